// dtrain::amp::GradScaler against PyTorch's GradScaler semantics (torch/cuda/amp/grad_scaler.py and
// its _amp_update_scale_ kernel; Debian's torch 1.13 cannot run its GradScaler without CUDA, so the
// expected sequences below are worked out by hand from those rules): growth after growth_interval
// clean steps, backoff and a skipped optimizer step on inf or NaN, no growth past float32, unscale_
// before clipping and its misuse, the ranks of a group agreeing to skip when only one of them sees
// an inf, and the state's round trip through a checkpoint.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "support/equivalence.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using amp::GradScaler;
using amp::GradScalerOptions;

// One parameter w (4 elements, all 1) and loss = sum(w * c) * poison, so that dloss/dw = c *
// poison: poison 1 gives the clean gradient c, inf or NaN a poisoned one.
struct Tiny {
  torch::Tensor w = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD optimizer{{w}, torch::optim::SGDOptions(1.0)};
  torch::Tensor c = torch::tensor({0.5f, -1.0f, 2.0f, 0.25f});

  torch::Tensor loss(float poison) { return (w * c).sum() * poison; }
};

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(GradScaler, GrowthBackoffAndSkipFollowPyTorchsRule) {
  GradScalerOptions options;
  options.init_scale = 1024;
  options.growth_interval = 3;
  GradScaler scaler(options);
  Tiny tiny;
  // Per step: the poison, then what PyTorch's rule gives after update(): whether optimizer.step()
  // ran, the scale and the growth tracker. Three clean steps in a row grow the scale x2 and reset
  // the count; inf or NaN halves it, resets the count, and skips the step.
  struct Expected {
    float poison;
    bool stepped;
    double scale;
    int64_t tracker;
  };
  const Expected sequence[] = {
      {1, true, 1024, 1},     {1, true, 1024, 2}, {1, true, 2048, 0},    {1, true, 2048, 1},
      {kInf, false, 1024, 0}, {1, true, 1024, 1}, {kNaN, false, 512, 0}, {-kInf, false, 256, 0},
      {1, true, 256, 1},      {1, true, 256, 2},  {1, true, 512, 0},     {1, true, 512, 1},
  };
  int64_t clean_steps = 0;
  for (size_t i = 0; i < std::size(sequence); ++i) {
    const Expected& want = sequence[i];
    SCOPED_TRACE("step " + std::to_string(i));
    torch::Tensor before = tiny.w.detach().clone();
    tiny.optimizer.zero_grad();
    torch::Tensor scaled = scaler.scale(tiny.loss(want.poison));
    if (want.poison == 1) {
      // scale(loss) multiplies by the current scale, so the gradient is c * scale before unscaling.
      EXPECT_FLOAT_EQ(scaled.item<float>(), tiny.loss(1).item<float>() * scaler.get_scale());
    }
    scaled.backward();
    EXPECT_EQ(scaler.step(tiny.optimizer), want.stepped);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), want.scale);
    EXPECT_EQ(scaler.growth_tracker(), want.tracker);
    if (want.stepped) {
      ++clean_steps;
      // SGD(lr 1) with the unscaled gradient c: exact, since the scales are powers of two.
      EXPECT_TRUE(torch::equal(tiny.w.detach(), before - tiny.c));
    } else {
      EXPECT_TRUE(torch::equal(tiny.w.detach(), before)) << "a skipped step must leave w untouched";
    }
  }
  EXPECT_TRUE(torch::equal(tiny.w.detach(), torch::ones({4}) - clean_steps * tiny.c));
}

TEST(GradScaler, DefaultsArePyTorchs) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  auto state = scaler.state_dict();
  EXPECT_EQ(state.growth_factor, 2.0);
  EXPECT_EQ(state.backoff_factor, 0.5);
  EXPECT_EQ(state.growth_interval, 2000);
  // 1999 clean steps keep the scale, the 2000th doubles it.
  Tiny tiny;
  for (int i = 0; i < 2000; ++i) {
    tiny.optimizer.zero_grad();
    scaler.scale(tiny.loss(1)).backward();
    scaler.step(tiny.optimizer);
    scaler.update();
    if (i == 1998) EXPECT_EQ(scaler.get_scale(), 65536.0);
  }
  EXPECT_EQ(scaler.get_scale(), 131072.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, NeverGrowsPastFloat32) {
  GradScalerOptions options;
  options.init_scale = std::ldexp(1.0, 127);  // the largest power of two in float32
  options.growth_interval = 1;
  GradScaler scaler(options);
  torch::Tensor w = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD optimizer({w}, 0.1);
  for (int i = 0; i < 2; ++i) {
    optimizer.zero_grad();
    w.mutable_grad() = torch::ones({1});  // small, finite: a clean step
    scaler.step(optimizer);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), std::ldexp(1.0, 127))
        << "2^128 is inf in float32: PyTorch keeps 2^127";
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, UnscaleBeforeClippingClipsTheTrueGradient) {
  GradScalerOptions options;
  options.init_scale = 4096;
  GradScaler scaler(options);
  Tiny tiny;
  scaler.scale(tiny.loss(1)).backward();
  EXPECT_TRUE(torch::equal(tiny.w.grad(), tiny.c * 4096));
  scaler.unscale_(tiny.optimizer);
  EXPECT_TRUE(torch::equal(tiny.w.grad(), tiny.c));
  double norm = tiny.c.norm().item<double>();
  torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{tiny.w}, norm / 2);
  torch::Tensor clipped = tiny.w.grad().clone();
  EXPECT_NEAR(clipped.norm().item<double>(), norm / 2, 1e-5);
  EXPECT_TRUE(scaler.step(tiny.optimizer));  // does not unscale a second time
  EXPECT_TRUE(torch::allclose(tiny.w.detach(), torch::ones({4}) - clipped));
  scaler.update();
}

TEST(GradScaler, MisuseIsAUsageError) {
  GradScaler scaler;
  Tiny tiny;
  EXPECT_THROW(scaler.update(), UsageError) << "update() with nothing recorded";
  scaler.scale(tiny.loss(1)).backward();
  scaler.unscale_(tiny.optimizer);
  try {
    scaler.unscale_(tiny.optimizer);
    FAIL() << "a second unscale_ would divide the gradients twice";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("unscale_() was already called"), std::string::npos)
        << e.what();
  }
  scaler.step(tiny.optimizer);
  EXPECT_THROW(scaler.step(tiny.optimizer), UsageError);
  EXPECT_THROW(scaler.unscale_(tiny.optimizer), UsageError);
  scaler.update();
  // A fresh step after update() is fine again.
  tiny.optimizer.zero_grad();
  scaler.scale(tiny.loss(1)).backward();
  scaler.unscale_(tiny.optimizer);
  scaler.step(tiny.optimizer);
  scaler.update();

  // float16 gradients are refused, as in PyTorch.
  torch::Tensor half = torch::ones({2}, torch::dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD half_optimizer({half}, 0.1);
  half.mutable_grad() = torch::ones({2}, torch::kHalf);
  EXPECT_THROW(scaler.unscale_(half_optimizer), UsageError);

  GradScalerOptions bad;
  bad.growth_factor = 1.0;
  EXPECT_THROW(GradScaler{bad}, UsageError);
  bad = {};
  bad.backoff_factor = 1.5;
  EXPECT_THROW(GradScaler{bad}, UsageError);
  bad = {};
  bad.growth_interval = 0;
  EXPECT_THROW(GradScaler{bad}, UsageError);
}

TEST(GradScaler, DisabledPassesEverythingThrough) {
  GradScalerOptions options;
  options.enabled = false;
  GradScaler scaler(options);
  Tiny tiny;
  torch::Tensor loss = tiny.loss(1);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  EXPECT_TRUE(scaler.step(tiny.optimizer));
  scaler.update();
  EXPECT_TRUE(torch::equal(tiny.w.detach(), torch::ones({4}) - tiny.c));
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(GradScaler, BFloat16GradientsAndSeveralOptimizersShareOneVerdict) {
  // bfloat16 gradients are unscaled in place (only float16 is refused); an inf in one optimizer's
  // gradients skips that optimizer, and update() backs off once for the step.
  GradScalerOptions options;
  options.init_scale = 8;
  GradScaler scaler(options);
  torch::Tensor a = torch::ones({3}, torch::dtype(torch::kBFloat16).requires_grad(true));
  torch::Tensor b = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt_a({a}, 1.0), opt_b({b}, 1.0);
  a.mutable_grad() = torch::full({3}, 8.0, torch::kBFloat16);
  b.mutable_grad() = torch::tensor({8.0f, kInf, 8.0f});
  EXPECT_TRUE(scaler.step(opt_a));
  EXPECT_TRUE(torch::equal(a.detach(), torch::zeros({3}, torch::kBFloat16)));
  EXPECT_FALSE(scaler.step(opt_b));
  EXPECT_TRUE(torch::equal(b.detach(), torch::ones({3})));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 4.0);
}

// Note: with DDP an inf in one rank's gradient usually reaches every rank through the gradient
// all-reduce anyway; the flag matters where it does not: parameters held by one rank only (pipeline
// stages, tensor shards), gradients compressed or clipped per rank, a rank whose unscale overflowed
// on its own. Here each rank holds its own parameter and only rank 1's gradient is inf.
void train_ranks_with_one_inf(int world, bool with_group, std::vector<torch::Tensor>& final_w,
                              std::vector<double>& final_scale) {
  final_w.assign(world, {});
  final_scale.assign(world, 0);
  testing::run_group(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    GradScalerOptions options;
    options.init_scale = 256;
    options.growth_interval = 2;
    GradScaler scaler(options, with_group ? group : nullptr);
    Tiny tiny;
    for (int step = 0; step < 4; ++step) {
      tiny.optimizer.zero_grad();
      float poison = (step == 1 && rank == 1) ? kInf : 1.0f;
      scaler.scale(tiny.loss(poison)).backward();
      scaler.step(tiny.optimizer);
      scaler.update();
    }
    final_w[rank] = tiny.w.detach().clone();
    final_scale[rank] = scaler.get_scale();
  });
}

TEST(GradScaler, EveryRankSkipsWhenOneRankSeesAnInf) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<torch::Tensor> w;
    std::vector<double> scale;
    train_ranks_with_one_inf(world, /*with_group=*/true, w, scale);
    Tiny reference;
    for (int rank = 0; rank < world; ++rank) {
      // Steps 0, 2, 3 ran, step 1 was skipped everywhere: 256 -> (clean) 256 -> (inf) 128 -> 128 ->
      // 256.
      EXPECT_TRUE(torch::equal(w[rank], torch::ones({4}) - 3 * reference.c)) << "rank " << rank;
      EXPECT_EQ(scale[rank], 256.0) << "rank " << rank;
    }
  }
  // Without the group the ranks part ways: the agreement above is what keeps replicas identical.
  std::vector<torch::Tensor> w;
  std::vector<double> scale;
  train_ranks_with_one_inf(2, /*with_group=*/false, w, scale);
  EXPECT_FALSE(torch::equal(w[0], w[1]));
  EXPECT_NE(scale[0], scale[1]);
}

TEST(GradScaler, DdpRanksStepAndSkipInLockstep) {
  // The scaler's all-reduce shares the group with DDP's gradient buckets: one poisoned step on rank
  // 1 is skipped on both ranks, the replicas stay identical, and nothing hangs or mismatches.
  constexpr int kWorld = 2, kSteps = 4;
  torch::manual_seed(11);
  torch::nn::Sequential initial(torch::nn::Linear(6, 8), torch::nn::ReLU(),
                                torch::nn::Linear(8, 3));
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < kSteps * kWorld; ++i) {
    xs.push_back(torch::randn({5, 6}));
    ys.push_back(torch::randint(3, {5}));
  }
  std::vector<std::vector<torch::Tensor>> params(kWorld);
  std::vector<int> stepped(kWorld, 0);
  std::vector<double> scales(kWorld, 0);
  testing::run_group(kWorld, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
    DistributedDataParallel ddp(net, group);
    torch::optim::SGD optimizer(net->parameters(), 0.1);
    GradScaler scaler(GradScalerOptions{}, group);
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(
          ddp->forward(xs[step * kWorld + rank]), ys[step * kWorld + rank]);
      if (step == 2 && rank == 1) loss = loss * kNaN;
      scaler.scale(loss).backward();
      stepped[rank] += scaler.step(optimizer) ? 1 : 0;
      scaler.update();
    }
    params[rank] = net->parameters();
    scales[rank] = scaler.get_scale();
  });
  EXPECT_EQ(stepped[0], kSteps - 1);
  EXPECT_EQ(stepped[1], kSteps - 1);
  EXPECT_EQ(scales[0], 32768.0);
  EXPECT_EQ(scales[1], 32768.0);
  for (size_t i = 0; i < params[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(params[0][i], params[1][i])) << "parameter " << i;
  }
  // And what they stepped is one process's plain SGD over both ranks' rows (equal slices, so the
  // mean of the two means is the mean), step 2 left out: ranks that agreed on a gradient unscaled
  // twice, or not at all, would still agree with each other.
  auto single = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
  torch::optim::SGD reference(single->parameters(), 0.1);
  for (int step : {0, 1, 3}) {
    reference.zero_grad();
    torch::nn::functional::cross_entropy(
        single->forward(torch::cat({xs[step * kWorld], xs[step * kWorld + 1]})),
        torch::cat({ys[step * kWorld], ys[step * kWorld + 1]}))
        .backward();
    reference.step();
  }
  EXPECT_LT(testing::relative_error(params[0], single->parameters()), 1e-5);
  // The test can fail: the poisoned step taken too would be far off.
  auto stepped_all = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(single->clone());
  torch::optim::SGD extra(stepped_all->parameters(), 0.1);
  extra.zero_grad();
  torch::nn::functional::cross_entropy(stepped_all->forward(torch::cat({xs[4], xs[5]})),
                                       torch::cat({ys[4], ys[5]}))
      .backward();
  extra.step();
  EXPECT_GT(testing::relative_error(params[0], stepped_all->parameters()), 1e-3);
}

TEST(GradScaler, StateRoundTripsThroughACheckpoint) {
  GradScalerOptions options;
  options.init_scale = 3.0e4;  // not a power of two: the text must carry it exactly
  options.growth_factor = 3.0;
  options.backoff_factor = 0.25;
  options.growth_interval = 5;
  GradScaler scaler(options);
  Tiny tiny;
  for (float poison : {1.0f, kInf, 1.0f, 1.0f}) {
    tiny.optimizer.zero_grad();
    scaler.scale(tiny.loss(poison)).backward();
    scaler.step(tiny.optimizer);
    scaler.update();
  }
  ASSERT_EQ(scaler.growth_tracker(), 2);
  ASSERT_EQ(scaler.get_scale(), static_cast<double>(static_cast<float>(3.0e4 * 0.25)));

  CheckpointOptions checkpoint_options;
  checkpoint_options.dir = testing::temp_dir("dtrain-amp-ckpt");
  {
    Checkpointer checkpointer(checkpoint_options);
    TrainingState state;
    state.step = 4;
    state.grad_scaler = &scaler;
    checkpointer.save(state);
  }
  GradScaler restored;  // PyTorch's defaults, all replaced by the checkpoint's
  TrainingState loaded;
  loaded.grad_scaler = &restored;
  ASSERT_TRUE(Checkpointer(checkpoint_options).load_latest(loaded));
  auto want = scaler.state_dict(), got = restored.state_dict();
  EXPECT_EQ(got.scale, want.scale);
  EXPECT_EQ(got.growth_factor, 3.0);
  EXPECT_EQ(got.backoff_factor, 0.25);
  EXPECT_EQ(got.growth_interval, 5);
  EXPECT_EQ(got.growth_tracker, 2);
  // And both continue alike: three more clean steps reach the interval and grow x3.
  for (GradScaler* s : {&scaler, &restored}) {
    for (int i = 0; i < 3; ++i) {
      tiny.optimizer.zero_grad();
      s->scale(tiny.loss(1)).backward();
      s->step(tiny.optimizer);
      s->update();
    }
  }
  EXPECT_EQ(restored.get_scale(), scaler.get_scale());
  EXPECT_EQ(restored.get_scale(),
            static_cast<double>(
                static_cast<float>(static_cast<double>(static_cast<float>(3.0e4 * 0.25)) * 3.0)));

  // A checkpoint saved without a scaler leaves it as it is; a partial or garbled one is a
  // UsageError naming the entry, and leaves the scaler as it was.
  auto save_values = [&](std::map<std::string, std::string> values, int64_t step) {
    TrainingState state;
    state.step = step;
    state.values = std::move(values);
    Checkpointer(checkpoint_options).save(state);
  };
  const double before = restored.get_scale();
  save_values({}, 5);
  ASSERT_TRUE(Checkpointer(checkpoint_options).load_latest(loaded));
  EXPECT_EQ(restored.get_scale(), before);
  save_values({{"grad_scaler.scale", "8"}}, 6);
  try {
    Checkpointer(checkpoint_options).load_latest(loaded);
    FAIL() << "a partial state must not load";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'grad_scaler.growth_factor'"), std::string::npos)
        << e.what();
  }
  std::map<std::string, std::string> values = {{"grad_scaler.scale", "lots"},
                                               {"grad_scaler.growth_factor", "2"},
                                               {"grad_scaler.backoff_factor", "0.5"},
                                               {"grad_scaler.growth_interval", "10"},
                                               {"grad_scaler.growth_tracker", "0"}};
  save_values(values, 7);
  EXPECT_THROW(Checkpointer(checkpoint_options).load_latest(loaded), UsageError);
  EXPECT_EQ(restored.get_scale(), before);
  std::filesystem::remove_all(checkpoint_options.dir);
}

}  // namespace
}  // namespace dtrain
