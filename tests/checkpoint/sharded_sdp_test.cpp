// Tier-1 end-to-end test of sharded checkpoints with dtrain::ShardedDataParallel: a run saved at N
// ranks and one stage, loaded at M != N ranks and another stage, continues as an uninterrupted
// single-process run of the same model on the same batches (each rank trains on its share of the
// batch; ShardedDataParallel averages the gradients).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "dtrain/comm.h"
#include "dtrain/sharded.h"
#include "dtrain/sharded_checkpoint.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

// 43 parameters (a prime), as in sharded_checkpoint_test.cpp: no world size divides them.
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 5), torch::nn::Tanh(), torch::nn::Linear(5, 3));
}

using Sdp = ShardedDataParallel<torch::nn::SequentialImpl>;

constexpr int kBatch = 12;  // divides over 1, 2, 3 and 4 ranks

struct Batches {
  std::vector<at::Tensor> x, y;
  explicit Batches(int steps) {
    torch::manual_seed(11);
    for (int i = 0; i < steps; ++i) {
      x.push_back(torch::randn({kBatch, 4}));
      y.push_back(torch::randn({kBatch, 3}));
    }
  }
};

std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// Runs body on `world` thread-ranks, each with a ShardedDataParallel of a copy of `initial`.
void run_sharded(int world, int stage, const torch::nn::Sequential& initial,
                 const std::function<void(int rank, ShardedDataParallel<torch::nn::SequentialImpl>&,
                                          torch::nn::Sequential& model)>& body) {
  const std::string method = testing::unique_store_name("sharded-ckpt");
  testing::run_ranks(world, [&](int rank) {
    InitOptions options;
    options.init_method = method;
    options.rank = rank;
    options.world_size = world;
    options.timeout = std::chrono::seconds(60);
    std::shared_ptr<ProcessGroup> group = init_process_group(options);
    torch::nn::Sequential model(
        std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone()));
    ShardedDataParallelOptions sdp_options;
    sdp_options.stage = stage;
    ShardedDataParallel<torch::nn::SequentialImpl> sdp(model.ptr(), group, sdp_options);
    body(rank, sdp, model);
  });
}

void sharded_steps(ShardedDataParallel<torch::nn::SequentialImpl>& sdp,
                   torch::optim::Optimizer& optimizer, const Batches& data, int first, int last) {
  const int world = sdp->group()->size(), rank = sdp->group()->rank();
  const int64_t share = kBatch / world;
  for (int step = first; step < last; ++step) {
    optimizer.zero_grad();
    auto x = data.x[step].narrow(0, rank * share, share);
    auto y = data.y[step].narrow(0, rank * share, share);
    (sdp->forward(x) - y).pow(2).mean().backward();
    optimizer.step();
  }
}

TEST(ShardedCheckpointWithShardedDataParallel,
     SavedAtNLoadedAtMAndAnotherStageContinuesAsUninterrupted) {
  const Batches data(6);
  torch::manual_seed(12);
  auto initial = make_model();
  // The uninterrupted reference: 6 steps of one process on the whole batches.
  torch::nn::Sequential reference(
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone()));
  auto reference_optimizer = make_adam(reference->parameters());
  for (int step = 0; step < 6; ++step) {
    reference_optimizer->zero_grad();
    (reference->forward(data.x[step]) - data.y[step]).pow(2).mean().backward();
    reference_optimizer->step();
  }
  struct Case {
    int n, save_stage, m, load_stage;
  };
  for (const Case& c : {Case{2, 1, 3, 3}, Case{3, 3, 2, 2}, Case{4, 2, 1, 1}}) {
    SCOPED_TRACE(std::to_string(c.n) + " ranks stage " + std::to_string(c.save_stage) + " -> " +
                 std::to_string(c.m) + " ranks stage " + std::to_string(c.load_stage));
    CheckpointOptions options;
    options.dir = testing::temp_dir("dtrain-sharded-sdp");
    run_sharded(c.n, c.save_stage, initial, [&](int, Sdp& sdp, torch::nn::Sequential&) {
      auto optimizer = make_adam(sdp->parameters());
      sharded_steps(sdp, *optimizer, data, 0, 3);
      ShardedTrainingState state{
          sdp->flat_shards(), sdp->stage(), optimizer.get(), nullptr, 3, false};
      ShardedCheckpointer(options, sdp->group()).save(state);
    });
    run_sharded(
        c.m, c.load_stage, make_model(), [&](int rank, Sdp& sdp, torch::nn::Sequential& model) {
          auto optimizer = make_adam(sdp->parameters());
          ShardedTrainingState state{
              sdp->flat_shards(), sdp->stage(), optimizer.get(), nullptr, 0, false};
          ASSERT_TRUE(ShardedCheckpointer(options, sdp->group()).load_latest(state).has_value());
          EXPECT_EQ(state.step, 3);
          sdp->shards_changed();
          sharded_steps(sdp, *optimizer, data, 3, 6);
          sdp->gather_full_parameters();
          if (rank != 0) return;
          auto actual = model->named_parameters();
          for (const auto& item : reference->named_parameters()) {
            const double error = (actual[item.key()] - item.value()).abs().max().item<double>();
            const double scale = item.value().abs().max().item<double>();
            EXPECT_LT(error, 1e-5 * scale) << item.key();
          }
        });
    fs::remove_all(options.dir);
  }
}

}  // namespace
}  // namespace dtrain
