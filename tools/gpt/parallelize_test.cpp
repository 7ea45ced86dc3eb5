// The layouts of parallelize.h against one process: data x tensor x pipeline meshes of 2, 4 and 8
// thread-ranks, ZeRO (alone and over a tensor or pipeline layout's data dimension), recomputed
// blocks, gradient accumulation, the clipped global norm and a hidden width that does not divide by
// the tensor ranks each end k SGD steps with the parameters of one process trained on the whole
// batch (every whole tensor and every tensor shard within a relative 1e-5, float32), and the
// degrees that do not fit the world are one error naming them.
#include "gpt/parallelize.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "dtrain/errors.h"
#include "support/thread_ranks.h"

namespace gpt {
namespace {

GptConfig tiny() {
  GptConfig config;
  config.seq_len = 16;
  config.layers = 2;
  config.width = 32;
  config.heads = 4;
  config.kv_heads = 2;
  return config;
}

constexpr int64_t kSteps = 3, kRowsPerReplica = 4;
constexpr double kLr = 0.1;

// One process on the whole batch of each step, clipped as torch.nn.utils.clip_grad_norm_ clips
// (max_norm 0: not clipped); returns the parameters by name and each step's norm.
struct Reference {
  std::map<std::string, at::Tensor> parameters;
  std::vector<double> norms;
};
Reference train_one_process(const GptConfig& config, const at::Tensor& data, double max_norm) {
  torch::manual_seed(3);
  Gpt model(config);
  torch::optim::SGD optimizer(model->parameters(), kLr);
  Reference result;
  for (int64_t s = 0; s < kSteps; ++s) {
    optimizer.zero_grad();
    next_token_loss(model(data[s].narrow(1, 0, config.seq_len)),
                    data[s].narrow(1, 1, config.seq_len))
        .backward();
    double squares = 0;
    for (const auto& p : model->parameters())
      squares += p.grad().to(at::kDouble).square().sum().item<double>();
    const double norm = std::sqrt(squares);
    result.norms.push_back(norm);
    if (max_norm > 0 && max_norm / (norm + 1e-6) < 1) {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.grad().mul_(max_norm / (norm + 1e-6));
    }
    optimizer.step();
  }
  for (const auto& item : model->named_parameters())
    result.parameters[item.key()] = item.value().detach().clone();
  return result;
}

// `world` thread-ranks in `options`' layout, each replica on its rows of every step's batch (in
// `accumulate` passes of as many rows each, their gradients accumulated), k SGD steps clipped at
// max_norm (0: not): every parameter a rank holds (a tensor shard: its rows or columns of the
// whole one) equals the reference's, and so does every step's norm.
void expect_layout_equals_one_process(const LayoutOptions& options, int world, double max_norm = 0,
                                      const GptConfig& config = tiny(), int accumulate = 1) {
  const int dp = check_degrees(options, world);
  torch::manual_seed(7);
  at::Tensor data = torch::randint(256, {kSteps, dp * kRowsPerReplica, config.seq_len + 1});
  const Reference reference = train_one_process(config, data, max_norm);

  std::mutex seed_mutex;  // the thread-ranks share one generator: one draws the model at a time
  // The names each (data, tensor) position's ranks hold, over its pipeline stages.
  std::mutex held_mutex;
  std::map<std::pair<int, int>, std::vector<std::string>> held;
  dtrain::testing::run_group(world, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    dtrain::RankMesh mesh = make_mesh(options, pg);
    Gpt model{nullptr};
    {
      std::lock_guard<std::mutex> lock(seed_mutex);
      torch::manual_seed(3);
      model = make_model(config, options, mesh);
    }
    Parallel layout(model, options, mesh, pg, c10::Device(c10::kCPU));
    torch::optim::SGD optimizer(layout.parameters(), kLr);
    const std::string who = "rank " + std::to_string(rank) + "/" + std::to_string(world);
    for (int64_t s = 0; s < kSteps; ++s) {
      at::Tensor mine = data[s].narrow(0, mesh.data_index * kRowsPerReplica, kRowsPerReplica);
      optimizer.zero_grad();
      const int64_t rows = kRowsPerReplica / accumulate;
      for (int pass = 0; pass < accumulate; ++pass) {
        at::Tensor part = mine.narrow(0, pass * rows, rows);
        layout.forward_backward(part.narrow(1, 0, config.seq_len),
                                part.narrow(1, 1, config.seq_len), 1.0 / accumulate,
                                /*sync=*/pass + 1 == accumulate);
      }
      if (max_norm > 0) {
        const double norm = layout.clip_grad_norm(max_norm);
        EXPECT_LT(std::abs(norm - reference.norms[s]) / reference.norms[s], 1e-5)
            << who << ", step " << s << ": norm " << norm << ", one process's "
            << reference.norms[s];
      }
      optimizer.step();
    }
    layout.gather_full_parameters();  // ZeRO: the parameters this rank trains, to compare
    const std::vector<std::pair<std::string, at::Tensor>> trained = layout.named_parameters();
    // A stage holds its blocks only; the stages together hold every parameter (checked below).
    ASSERT_FALSE(trained.empty()) << who;
    {
      std::lock_guard<std::mutex> lock(held_mutex);
      auto& names = held[{mesh.data_index, mesh.tensor_index}];
      for (const auto& item : trained) names.push_back(item.first);
    }
    for (const auto& [name, mine] : trained) {
      at::Tensor want = reference.parameters.at(name);
      if (!mine.sizes().equals(want.sizes())) {
        // A shard: rows (column-parallel) or columns (row-parallel); of a size that does not
        // divide, the first size % T tensor ranks hold one more (as ColumnParallelLinear cuts).
        const int64_t dim = mine.size(0) != want.size(0) ? 0 : 1, t = mesh.tensor_index;
        const int64_t base = want.size(dim) / options.tp, extra = want.size(dim) % options.tp;
        want = want.narrow(dim, t * base + std::min(t, extra), mine.size(dim));
      }
      const double error =
          (mine - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
      EXPECT_LT(error, 1e-5) << who << ", " << name;
    }
  });
  // Every parameter once per (data, tensor) position: a stage that dropped a block, or two that
  // both hold one, would pass the comparison above.
  std::vector<std::string> every;
  for (const auto& item : reference.parameters) every.push_back(item.first);
  std::sort(every.begin(), every.end());
  EXPECT_EQ(held.size(), static_cast<size_t>(dp * options.tp));
  for (auto& [position, names] : held) {
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, every) << "data " << position.first << ", tensor " << position.second;
  }
}

LayoutOptions layout(int dp, int tp, int pp, int zero = 0, bool recompute = false,
                     dtrain::ScheduleKind schedule = dtrain::ScheduleKind::k1F1B) {
  LayoutOptions options;
  options.dp = dp;
  options.tp = tp;
  options.pp = pp;
  options.zero = zero;
  options.recompute = recompute;
  options.micro_batches = 2;
  options.schedule = schedule;
  return options;
}

// Clipping at 0.5 binds on every step here (the norms are ~1-3).
constexpr double kClip = 0.5;

TEST(GptLayout, DataTensorPipelineMeshesEqualOneProcess) {
  for (auto [dp, tp, pp] : {std::tuple{2, 1, 2}, std::tuple{2, 2, 1}, std::tuple{1, 2, 2}}) {
    SCOPED_TRACE("dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " +
                 std::to_string(pp));
    expect_layout_equals_one_process(layout(dp, tp, pp), dp * tp * pp);
  }
}

// Recomputed blocks give the gradients of stored ones: in DDP, ZeRO-3 (which gathers a block
// again before its backward redoes the forward), tensor parallelism (whose all-reduces run again)
// and a pipeline.
TEST(GptLayout, RecomputedBlocksEqualOneProcessInEveryLayout) {
  for (auto [dp, tp, pp, zero] : {std::tuple{2, 1, 1, 0}, std::tuple{2, 1, 1, 3},
                                  std::tuple{1, 2, 1, 0}, std::tuple{1, 1, 2, 0}}) {
    SCOPED_TRACE("dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " +
                 std::to_string(pp) + ", zero " + std::to_string(zero));
    expect_layout_equals_one_process(layout(dp, tp, pp, zero, /*recompute=*/true), dp * tp * pp);
  }
}

// The global norm counts every element once (Note [Global gradient norm]): a whole tensor that
// every tensor rank holds once, ZeRO's shards and the stages summed, DDP's replicas once. Counting
// one twice changes the norm, so the scale, so the parameters.
TEST(GptLayout, ClippingByTheGlobalNormEqualsOneProcessInEveryLayout) {
  for (auto [dp, tp, pp, zero] :
       {std::tuple{2, 1, 1, 0}, std::tuple{2, 1, 1, 2}, std::tuple{2, 1, 1, 3},
        std::tuple{1, 2, 1, 0}, std::tuple{1, 1, 2, 0}, std::tuple{1, 2, 2, 0}}) {
    SCOPED_TRACE("dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " +
                 std::to_string(pp) + ", zero " + std::to_string(zero));
    expect_layout_equals_one_process(layout(dp, tp, pp, zero), dp * tp * pp, kClip);
  }
  // Everything at once on 4 ranks: a tensor x pipeline mesh with recomputed blocks, clipped.
  expect_layout_equals_one_process(layout(1, 2, 2, 0, /*recompute=*/true), 4, kClip);
}

// ZeRO over the data dimension of a tensor layout: each tensor rank's shards sharded over its
// data group. Clipped, so that the global norm must count a block's whole norms once over the
// tensor ranks although a ZeRO shard holds them beside the split projections; stage 2 with
// sequence parallelism, recomputed blocks and a hidden width that does not divide by the tensor
// ranks (91: 46 and 45 features), and the same uneven width in a DDP x tensor x pipeline mesh.
TEST(GptLayout, ZeroOverATensorLayoutsDataDimensionEqualsOneProcess) {
  for (int zero : {1, 3}) {
    SCOPED_TRACE("dp 2 x tp 2, zero " + std::to_string(zero));
    expect_layout_equals_one_process(layout(2, 2, 1, zero), 4, kClip);
  }
  GptConfig uneven = tiny();
  uneven.mlp_width = 91;
  {
    SCOPED_TRACE("dp 2 x tp 2, zero 2, sequence parallel, recomputed, hidden width 91");
    LayoutOptions options = layout(2, 2, 1, 2, /*recompute=*/true);
    options.sp = true;
    expect_layout_equals_one_process(options, 4, kClip, uneven);
  }
  SCOPED_TRACE("dp 1 x tp 2 x pp 2, hidden width 91");
  expect_layout_equals_one_process(layout(1, 2, 2), 4, 0, uneven);
}

// ZeRO over a pipeline's data dimension (Note [ZeRO in a pipeline]): each stage's units sharded
// over its replicas, the micro-batches' gradients accumulated and reduced in the chunk's last
// backward. Every stage, clipped (each stage's shards add to the global norm); stage 3 under the
// zero-bubble schedule, whose gradients arrive in the deferred W passes, and under the
// interleaved one (two sharded chunks per rank); and a data x tensor x pipeline mesh of 8 ranks.
TEST(GptLayout, ZeroOverAPipelinesDataDimensionEqualsOneProcess) {
  for (int zero : {1, 2, 3}) {
    SCOPED_TRACE("dp 2 x pp 2, zero " + std::to_string(zero));
    expect_layout_equals_one_process(layout(2, 1, 2, zero), 4, kClip);
  }
  {
    SCOPED_TRACE("dp 2 x pp 2, zero 3, zbh1, recomputed blocks");
    expect_layout_equals_one_process(
        layout(2, 1, 2, 3, /*recompute=*/true, dtrain::ScheduleKind::kZeroBubbleH1), 4, kClip);
  }
  {
    SCOPED_TRACE("dp 2 x pp 2, zero 2, interleaved");
    GptConfig four_blocks = tiny();
    four_blocks.layers = 4;
    expect_layout_equals_one_process(
        layout(2, 1, 2, 2, false, dtrain::ScheduleKind::kInterleaved1F1B), 4, kClip, four_blocks);
  }
  SCOPED_TRACE("dp 2 x tp 2 x pp 2, zero 3");
  expect_layout_equals_one_process(layout(2, 2, 2, 3), 8, kClip);
}

// Gradient accumulation: a replica's rows in 2 passes of half as many, each a half of the loss,
// only the second one reducing (DDP's, ZeRO's and the pipeline's no_sync), clipped after both. A
// pass whose loss is not scaled, or a last pass that does not reduce what the first left, ends
// elsewhere. (Reducing after every pass would give the same numbers, the sum of averages being
// the average of sums, and only cost time: what the test cannot see.)
TEST(GptLayout, GradientAccumulationEqualsOneProcessInEveryLayout) {
  for (auto [dp, tp, pp, zero] :
       {std::tuple{2, 1, 1, 0}, std::tuple{2, 1, 1, 1}, std::tuple{2, 1, 1, 3},
        std::tuple{1, 2, 1, 0}, std::tuple{2, 1, 2, 0}, std::tuple{2, 1, 2, 2}}) {
    SCOPED_TRACE("dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " +
                 std::to_string(pp) + ", zero " + std::to_string(zero) + ", 2 passes a step");
    expect_layout_equals_one_process(layout(dp, tp, pp, zero), dp * tp * pp, kClip, tiny(),
                                     /*accumulate=*/2);
  }
}

TEST(GptLayout, DegreesThatDoNotFitTheWorldAreNamed) {
  auto message = [](const LayoutOptions& options, int world) {
    try {
      check_degrees(options, world);
    } catch (const dtrain::UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(check_degrees(layout(0, 2, 2), 8), 2);  // --dp left out: the quotient
  EXPECT_NE(message(layout(0, 2, 2), 6)
                .find("--tp 2 x --pp 2 = 4 does not divide the world "
                      "size 6"),
            std::string::npos)
      << message(layout(0, 2, 2), 6);
  EXPECT_NE(message(layout(3, 2, 1), 4)
                .find("--dp 3 x --tp 2 x --pp 1 = 6 ranks, but the world "
                      "size is 4"),
            std::string::npos)
      << message(layout(3, 2, 1), 4);
  EXPECT_EQ(check_degrees(layout(2, 2, 1, 3), 4), 2);  // ZeRO with --tp
  EXPECT_EQ(check_degrees(layout(2, 1, 2, 3), 4), 2);  // and with --pp
}

}  // namespace
}  // namespace gpt
