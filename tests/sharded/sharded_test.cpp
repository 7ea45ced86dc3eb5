// ShardedDataParallel (ZeRO stages 1-3) against one process: each rank trains on its slice of the
// global batch, the ranks other than 0 from other parameters (the broadcast must replace them);
// after k optimizer steps the sharded run's full parameters must equal one process's trained on the
// whole batch (relative error < 1e-5, float32) for every stage, world sizes 1..4 and parameter
// counts that do not divide by the world size; also with a frozen layer (which the ranks other
// than 0 hold differently too) and with gather_full_parameters() between backward and step. Plus:
// stage 3 really frees gathered parameters, and the usage errors.
#include "dtrain/sharded.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <set>

#include "support/equivalence.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::relative_error;
using testing::run_group;

constexpr int64_t kInputs = 6;
constexpr int64_t kOutputs = 3;
constexpr int64_t kGlobalBatch =
    12;  // divides by 1..4: equal local batches, so mean losses average exactly
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;

// 49 + 40 + 18 = 107 parameters (a prime): no unit and no model divides evenly by 2, 3 or 4
// everywhere, so the last ranks' shards carry padding.
torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(kInputs, 7), torch::nn::ReLU(),
                               torch::nn::Linear(7, 5), torch::nn::Tanh(),
                               torch::nn::Linear(5, kOutputs));
}

// Rank 0's starting parameters, made once on the calling thread (the ranks' threads share one RNG).
std::vector<torch::Tensor> initial_parameters() {
  torch::manual_seed(11);
  auto net = make_mlp();
  std::vector<torch::Tensor> values;
  for (auto& p : net->parameters()) values.push_back(p.detach().clone());
  return values;
}

torch::nn::Sequential make_mlp_from(const std::vector<torch::Tensor>& values) {
  auto net = make_mlp();
  torch::NoGradGuard no_grad;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
  return net;
}

struct Batch {
  torch::Tensor x, y;
};

// Deterministic, RNG-free data: this rank's rows of the global batch of `step`.
Batch local_batch(int step, int world, int rank) {
  auto rows = torch::arange(kGlobalBatch, torch::kFloat32).unsqueeze(1);
  auto x = torch::sin(rows * 0.37 + torch::arange(kInputs, torch::kFloat32) * 1.3 + step);
  auto y = torch::cos(rows * 0.21 + torch::arange(kOutputs, torch::kFloat32) * 0.7 - step);
  int64_t per = kGlobalBatch / world;
  return {x.narrow(0, rank * per, per), y.narrow(0, rank * per, per)};
}

enum class Optim { kSgdMomentum, kAdam, kAdamW, kSgd };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind,
                                                        std::vector<torch::Tensor> params) {
  switch (kind) {
    case Optim::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    case Optim::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
    case Optim::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    case Optim::kSgd:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  }
  return nullptr;
}

std::string describe(int stage, int world, Optim kind) {
  const char* names[] = {"SGD+momentum", "Adam", "AdamW", "SGD"};
  return "stage " + std::to_string(stage) + ", " + std::to_string(world) + " ranks, " +
         names[static_cast<int>(kind)];
}

struct RunConfig {
  int stage = 1;
  int world = 1;
  Optim optim = Optim::kAdam;
  bool shared_memory = true;
  int micro_batches = 1;             // >1: gradient accumulation, all but the last under no_sync()
  bool freeze_first_weight = false;  // the first Linear's weight does not require gradients
  bool gather_before_step = false;   // gather_full_parameters() between backward and step
  bool plain_module = false;         // wrap a module that is not a Sequential (stage 3: one unit)
  ShardedDataParallelOptions options;
};

void freeze_first_weight(const torch::nn::Sequential& net) {
  net->ptr<torch::nn::LinearImpl>(0)->weight.requires_grad_(false);
}

// A module that only holds the MLP: not a Sequential, so stage 3 gathers it whole around forward().
struct PlainImpl : torch::nn::Module {
  explicit PlainImpl(torch::nn::Sequential inner) : net(register_module("net", inner)) {}
  torch::Tensor forward(torch::Tensor x) { return net->forward(x); }
  torch::nn::Sequential net;
};

// One process trained on the whole global batch, micro-batch by micro-batch: what every rank's
// parameters must equal (the ranks' slices are equal, so the mean of their mean losses is this
// process's mean loss).
std::vector<torch::Tensor> train_single(const RunConfig& setup,
                                        const std::vector<torch::Tensor>& start) {
  auto net = make_mlp_from(start);
  if (setup.freeze_first_weight) freeze_first_weight(net);
  auto opt = make_optimizer(setup.optim, net->parameters());  // skips the frozen weight: no grad
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    for (int micro = 0; micro < setup.micro_batches; ++micro) {
      Batch b = local_batch(step * setup.micro_batches + micro, 1, 0);
      torch::mse_loss(net->forward(b.x), b.y).backward();
    }
    opt->step();
  }
  return net->parameters();
}

// Trains ShardedDataParallel on every rank, each on its slice of the global batch; returns the
// worst relative error over ranks between its full parameters (gathered after the last step) and
// one process's. Ranks other than 0 start from other parameters, which the wrapper's broadcast of
// rank 0's must replace.
double sharded_vs_single(RunConfig setup, const std::vector<torch::Tensor>& start) {
  setup.options.stage = setup.stage;
  const std::vector<torch::Tensor> want = train_single(setup, start);
  std::vector<double> errors(setup.world, 0);
  run_group(
      setup.world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto net = make_mlp_from(start);
        {
          torch::NoGradGuard no_grad;
          for (auto& p : net->parameters()) p.add_(0.5 * rank);  // the frozen weight too
        }
        if (setup.freeze_first_weight) freeze_first_weight(net);
        auto train = [&](auto& sdp) {
          auto opt = make_optimizer(setup.optim, sdp->parameters());
          for (int step = 0; step < kSteps; ++step) {
            opt->zero_grad();
            for (int micro = 0; micro < setup.micro_batches; ++micro) {
              Batch b = local_batch(step * setup.micro_batches + micro, setup.world, rank);
              std::optional<ShardedDataParallelBase::NoSyncGuard> guard;
              if (micro + 1 < setup.micro_batches) guard.emplace(*sdp);
              torch::mse_loss(sdp->forward(b.x), b.y).backward();
            }
            if (setup.gather_before_step) sdp->gather_full_parameters();
            opt->step();
          }
          sdp->gather_full_parameters();
          errors[rank] = relative_error(net->parameters(), want);
          sdp->release_full_parameters();
        };
        if (setup.plain_module) {
          ShardedDataParallel<PlainImpl> sdp(std::make_shared<PlainImpl>(net), group,
                                             setup.options);
          train(sdp);
        } else {
          ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), group, setup.options);
          train(sdp);
        }
      },
      std::chrono::seconds(30), setup.shared_memory);
  return *std::max_element(errors.begin(), errors.end());
}

TEST(ShardedDataParallel, EveryStageMatchesOneProcessOnOneToFourRanks) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    for (int world : {1, 2, 3, 4}) {
      for (Optim optim : {Optim::kSgdMomentum, Optim::kAdam}) {
        RunConfig setup;
        setup.stage = stage;
        setup.world = world;
        setup.optim = optim;
        EXPECT_LT(sharded_vs_single(setup, start), kTolerance) << describe(stage, world, optim);
      }
    }
  }
}

// A relative error this small must mean something: the same runs one step apart differ by far more,
// so an off-by-one in a shard offset (which moves parameters onto their neighbours' gradients)
// cannot pass.
TEST(ShardedDataParallel, ToleranceSeparatesOneStepOfDifference) {
  const auto start = initial_parameters();
  auto net = make_mlp_from(start);
  auto other = make_mlp_from(start);
  auto opt = make_optimizer(Optim::kAdam, other->parameters());
  Batch b = local_batch(0, 1, 0);
  torch::mse_loss(other->forward(b.x), b.y).backward();
  opt->step();
  EXPECT_GT(relative_error(net->parameters(), other->parameters()), 100 * kTolerance);
}

TEST(ShardedDataParallel, AdamWAndPlainSgdOverTheShards) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    for (Optim optim : {Optim::kAdamW, Optim::kSgd}) {
      RunConfig setup;
      setup.stage = stage;
      setup.world = 3;
      setup.optim = optim;
      EXPECT_LT(sharded_vs_single(setup, start), kTolerance) << describe(stage, 3, optim);
    }
  }
}

TEST(ShardedDataParallel, GradientAccumulationWithNoSync) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    RunConfig setup;
    setup.stage = stage;
    setup.world = 2;
    setup.optim = Optim::kSgdMomentum;
    setup.micro_batches = 3;
    EXPECT_LT(sharded_vs_single(setup, start), kTolerance)
        << describe(stage, 2, setup.optim) << ", no_sync";
  }
}

TEST(ShardedDataParallel, GlooTransportAndSmallBucketsAndUnitsWithoutPrefetch) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    RunConfig setup;
    setup.stage = stage;
    setup.world = 3;
    setup.shared_memory = false;
    setup.options.bucket_cap_bytes =
        100;  // stages 1-2: one unit per parameter tensor, several reductions
    setup.options.prefetch = false;
    EXPECT_LT(sharded_vs_single(setup, start), kTolerance)
        << describe(stage, 3, setup.optim) << ", Gloo";
  }
  RunConfig
      merged;  // stage 3 with the whole model in one unit (min_unit_params above the model's size)
  merged.stage = 3;
  merged.world = 4;
  merged.options.min_unit_params = 1000;
  EXPECT_LT(sharded_vs_single(merged, start), kTolerance) << "stage 3, one unit";
}

// Frozen parameters are no unit's, but every rank must start from rank 0's: here rank r's frozen
// weight is rank 0's + 0.5 r, which, were it kept, gives each rank another model (and other
// gradients to average), and differs from one process's weight itself.
TEST(ShardedDataParallel, FrozenParametersStartFromRankZeroAtEveryStage) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    for (int world : {2, 3}) {
      for (bool plain : {false, true}) {
        RunConfig setup;
        setup.stage = stage;
        setup.world = world;
        setup.freeze_first_weight = true;
        setup.plain_module = plain;
        EXPECT_LT(sharded_vs_single(setup, start), kTolerance)
            << describe(stage, world, setup.optim) << ", frozen first weight"
            << (plain ? ", not a Sequential" : "");
      }
    }
  }
}

// gather_full_parameters() between backward and step gathers the shards from before the step: the
// next forward must still see the stepped ones (stages 1-2: every rank's slice, not only its own;
// stage 3: not the units that call left gathered), and so must the gather after the last step.
TEST(ShardedDataParallel, GatherBetweenBackwardAndStepLeavesNoStaleParameters) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    for (int world : {2, 3}) {
      for (bool plain : {false, true}) {
        RunConfig setup;
        setup.stage = stage;
        setup.world = world;
        setup.gather_before_step = true;
        setup.plain_module = plain;
        EXPECT_LT(sharded_vs_single(setup, start), kTolerance)
            << describe(stage, world, setup.optim) << ", gather before step"
            << (plain ? ", not a Sequential" : "");
      }
    }
  }
}

// The layout the sharded checkpoints rely on: shards tile each unit's flat buffer in rank order,
// and writing into them then calling shards_changed() changes the module.
TEST(ShardedDataParallel, FlatShardsTileTheFlatBuffersAndShardsChangedReachesTheModule) {
  const auto start = initial_parameters();
  for (int stage : {1, 2, 3}) {
    run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      auto net = make_mlp_from(start);
      ShardedDataParallelOptions options;
      options.stage = stage;
      ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), group, options);
      auto named = net->named_parameters();
      const std::vector<std::string> names = named.keys();
      std::set<std::string> seen;
      int64_t total = 0;
      for (const auto& shard : sdp->flat_shards()) {
        int64_t size = shard.shard.numel();
        EXPECT_EQ(size, (shard.full_numel + 2) / 3) << shard.key;
        EXPECT_EQ(shard.offset, rank * size);
        total += shard.full_numel;
        // This rank's slice of the flat buffer, rebuilt from the starting parameters by the
        // extents.
        auto flat = torch::zeros({3 * size});
        for (const auto& extent : shard.params) {
          seen.insert(extent.name);
          auto value = start[std::find(names.begin(), names.end(), extent.name) - names.begin()];
          EXPECT_EQ(value.sizes().vec(), extent.shape) << extent.name;
          flat.narrow(0, extent.offset, value.numel()).copy_(value.reshape({-1}));
        }
        EXPECT_TRUE(torch::equal(shard.shard.detach(), flat.narrow(0, shard.offset, size)))
            << shard.key;
        torch::NoGradGuard no_grad;
        shard.shard.fill_(static_cast<float>(rank + 1));
      }
      EXPECT_EQ(total, 107);
      EXPECT_EQ(seen.size(), named.size());
      sdp->shards_changed();
      sdp->gather_full_parameters();
      // The last parameter in flat order ends in the last rank's shard... every value is some
      // rank's + 1.
      for (auto& p : net->parameters()) {
        EXPECT_TRUE(((p == 1) | (p == 2) | (p == 3)).all().item<bool>()) << "stage " << stage;
      }
      sdp->release_full_parameters();
    });
  }
}

// Stages 1-2: the forward also gathers after an in-place write into the shards that no reduction
// and no shards_changed() announced (a second optimizer step, a write before shards_changed() was
// called): the shards' version counters moved.
TEST(ShardedDataParallel, ForwardGathersShardsWrittenInPlace) {
  const auto start = initial_parameters();
  for (int stage : {1, 2}) {
    run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      auto net = make_mlp_from(start);
      ShardedDataParallelOptions options;
      options.stage = stage;
      ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), group, options);
      torch::NoGradGuard no_grad;
      sdp->forward(torch::ones({2, kInputs}));
      for (auto& shard : sdp->parameters()) shard.fill_(static_cast<float>(rank + 1));
      sdp->forward(torch::ones({2, kInputs}));
      for (auto& p : net->parameters()) {
        EXPECT_TRUE(((p == 1) | (p == 2)).all().item<bool>()) << "stage " << stage;
      }
    });
  }
}

// Stage 3 frees what it gathered: the storage behind a unit's parameters (and behind views of them
// that autograd keeps for backward) holds 0 bytes outside the unit's forward and backward.
struct ProbeImpl : torch::nn::Module {
  std::vector<torch::Tensor> watched;  // parameters of the Linear layers, in order
  std::vector<size_t> bytes_seen;      // their storage bytes while this probe ran
  torch::Tensor view_of_first;         // a view of the first layer's weight, as autograd saves one
  torch::Tensor forward(torch::Tensor x) {
    bytes_seen.clear();
    for (auto& w : watched) bytes_seen.push_back(w.storage().nbytes());
    view_of_first = watched[0].t();
    return x;
  }
};
TORCH_MODULE(Probe);

TEST(ShardedDataParallel, StageThreeFreesGatheredParameters) {
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    torch::nn::Linear first(64, 64), second(64, 64), third(64, 4);
    Probe probe;
    torch::nn::Sequential net(first, probe, second, torch::nn::ReLU(), third);
    ShardedDataParallelOptions options;
    options.stage = 3;
    ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), group, options);
    probe->watched = {first->weight, second->weight, third->weight};
    auto total_bytes = [&] {  // a unit's parameters share one storage: count each storage once
      std::set<const void*> storages;
      size_t bytes = 0;
      for (auto& p : net->parameters()) {
        if (storages.insert(p.storage().unsafeGetStorageImpl()).second)
          bytes += p.storage().nbytes();
      }
      return bytes;
    };
    EXPECT_EQ(total_bytes(), 0u) << "after construction";
    auto opt = make_optimizer(Optim::kAdam, sdp->parameters());
    for (int step = 0; step < 2; ++step) {
      auto x = torch::ones({4, 64});
      auto loss = sdp->forward(x).square().mean();
      // During the first unit's forward: its parameters are gathered; the third unit's are not
      // (only the next unit, the second, is prefetched).
      ASSERT_EQ(probe->bytes_seen.size(), 3u);
      EXPECT_GE(probe->bytes_seen[0], 64u * 64u * 4u);
      EXPECT_EQ(probe->bytes_seen[2], 0u);
      EXPECT_EQ(total_bytes(), 0u) << "after forward";
      EXPECT_EQ(probe->view_of_first.storage().nbytes(), 0u)
          << "a saved view still holds the memory";
      loss.backward();
      EXPECT_EQ(total_bytes(), 0u) << "after backward";
      opt->step();
      opt->zero_grad();
    }
    // The shards: about a half of the model each, 64*64*2 + 64*4 + 64*2 + 4 = 8580 parameters.
    int64_t shard_numel = 0;
    for (auto& s : sdp->parameters()) shard_numel += s.numel();
    EXPECT_LE(shard_numel, 8580 / 2 + 3);
    sdp->gather_full_parameters();
    EXPECT_EQ(total_bytes(),
              4u * 8580);  // units of 4160, 4160 and 260 parameters: no padding at 2 ranks
    sdp->release_full_parameters();
    EXPECT_EQ(total_bytes(), 0u);
  });
}

// ---- usage errors ----

template <typename Body>
std::string usage_error_of(int world, Body body) {
  std::vector<std::string> messages(world);
  run_group(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    try {
      body(group);
    } catch (const UsageError& e) {
      messages[rank] = e.what();
    }
  });
  return messages[0];
}

TEST(ShardedDataParallelErrors, ParameterSharedBetweenTwoUnits) {
  std::string message = usage_error_of(2, [](std::shared_ptr<ProcessGroup> pg) {
    torch::nn::Linear shared(4, 4);
    torch::nn::Sequential net(shared, torch::nn::ReLU(), shared);
    ShardedDataParallelOptions options;
    options.stage = 3;
    ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), pg, options);
  });
  EXPECT_NE(message.find("rank 0/2"), std::string::npos) << message;
  EXPECT_NE(message.find("'0.weight' is used by child 0"), std::string::npos) << message;
  EXPECT_NE(message.find("and by child 2"), std::string::npos) << message;
}

TEST(ShardedDataParallelErrors, UnitWithoutParameters) {
  std::string message = usage_error_of(2, [](std::shared_ptr<ProcessGroup> pg) {
    torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
    ShardedDataParallelOptions options;
    options.stage = 3;
    options.wrap_policy = WrapPolicy::kEveryChild;
    ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), pg, options);
  });
  EXPECT_NE(message.find("rank 0/2"), std::string::npos) << message;
  EXPECT_NE(message.find("child 1 ('torch::nn::ReLUImpl') would have no parameters"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("WrapPolicy::kMinParams"), std::string::npos) << message;
}

TEST(ShardedDataParallelErrors, OptimizerOverTheFullParameters) {
  for (int stage : {1, 2, 3}) {
    for (Optim optim : {Optim::kSgd, Optim::kAdam}) {
      std::string message = usage_error_of(2, [&](std::shared_ptr<ProcessGroup> pg) {
        auto net = make_mlp();
        ShardedDataParallelOptions options;
        options.stage = stage;
        ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), pg, options);
        auto wrong = make_optimizer(optim, net->parameters());
        for (int step = 0; step < 2; ++step) {
          wrong->zero_grad();
          torch::mse_loss(sdp->forward(torch::ones({2, kInputs})), torch::zeros({2, kOutputs}))
              .backward();
          wrong->step();
        }
      });
      SCOPED_TRACE(describe(stage, 2, optim));
      EXPECT_NE(message.find("rank 0/2"), std::string::npos) << message;
      EXPECT_NE(message.find("optimizer was built over module->parameters()"), std::string::npos)
          << message;
    }
  }
}

// The same check as DDP's (common/gradient_sync.h): the first differing parameter, what each side
// has, on every rank.
TEST(ShardedDataParallelErrors, DifferentModelsAreNamed) {
  std::vector<std::string> messages(2);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    torch::nn::Sequential net(torch::nn::Linear(kInputs, rank == 1 ? 8 : 7), torch::nn::ReLU());
    try {
      ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), group);
    } catch (const UsageError& e) {
      messages[rank] = e.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& message = messages[rank];
    EXPECT_NE(message.find("rank " + std::to_string(rank) +
                           "/2: ShardedDataParallel: parameter #0 "
                           "differs between ranks: ranks {1} do not match rank 0"),
              std::string::npos)
        << message;
    EXPECT_NE(
        message.find("rank 0 has '0.weight' [7, 6] Float, rank 1 has '0.weight' [8, 6] Float."),
        std::string::npos)
        << message;
  }
}

TEST(ShardedDataParallelErrors, StageOutOfRange) {
  std::string message = usage_error_of(1, [](std::shared_ptr<ProcessGroup> pg) {
    auto net = make_mlp();
    ShardedDataParallelOptions options;
    options.stage = 4;
    ShardedDataParallel<torch::nn::SequentialImpl> sdp(net.ptr(), pg, options);
  });
  EXPECT_NE(message.find("stage 4 does not exist"), std::string::npos) << message;
}

}  // namespace
}  // namespace dtrain
