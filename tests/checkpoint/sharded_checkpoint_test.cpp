// Tier-1 tests of sharded checkpoints (dtrain/sharded_checkpoint.h) on hand-built flat shards: a
// small ZeRO-1 written out here (full replicas, each rank steps its slice of every flat buffer, an
// all-reduce joins the slices) so that the format and the resharding are tested apart from
// ShardedDataParallel. Saved at N ranks and loaded at M != N (and with other units, as another
// stage has) training goes on exactly as an uninterrupted run; damaged, missing and mismatched rank
// files are skipped with a warning naming them; keep-last-K counts complete checkpoints only; full
// <-> sharded conversion keeps parameters and optimizer state.
#include "dtrain/sharded_checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "dtrain/checkpoint.h"
#include "dtrain/data.h"
#include "dtrain/errors.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using testing::temp_dir;

// 43 parameters (a prime): no world size of 2..4 divides a flat buffer of them.
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 5), torch::nn::Tanh(), torch::nn::Linear(5, 3));
}

// How the parameters are grouped into units: all in one (as stages 1-2 do for a small model) or
// one unit per layer (as stage 3 does), so that loading with the other layout is a stage change.
enum class Units { kOne, kPerLayer };

std::vector<std::vector<std::string>> unit_names(Units units) {
  if (units == Units::kOne) return {{"0.weight", "0.bias", "2.weight", "2.bias"}};
  return {{"0.weight", "0.bias"}, {"2.weight", "2.bias"}};
}

// A minimal ZeRO-1 rank: a full replica of the model, one flat shard per unit (the optimizer is
// built over these), gradients of a full batch (the same on every rank, as after DDP's all-reduce)
// cut into the shards, and an all-reduce that joins the updated shards into the replica.
struct ToyShardedRank {
  ToyShardedRank(const torch::nn::Sequential& initial, Units units, int rank, int world)
      : model(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone())),
        world(world) {
    torch::NoGradGuard no_grad;
    auto named = model->named_parameters();
    int index = 0;
    for (const auto& names : unit_names(units)) {
      FlatShard shard;
      shard.key = "unit" + std::to_string(index++);
      std::vector<at::Tensor> flat;
      for (const auto& name : names) {
        shard.params.push_back({name, named[name].sizes().vec(), shard.full_numel});
        shard.full_numel += named[name].numel();
        flat.push_back(named[name].reshape(-1));
      }
      const int64_t per_rank = (shard.full_numel + world - 1) / world;
      shard.offset = rank * per_rank;
      at::Tensor padded = torch::zeros({per_rank * world});
      padded.narrow(0, 0, shard.full_numel).copy_(torch::cat(flat));
      shard.shard = padded.narrow(0, shard.offset, per_rank).clone().requires_grad_();
      shards.push_back(shard);
    }
  }

  std::vector<at::Tensor> shard_tensors() const {
    std::vector<at::Tensor> tensors;
    for (const auto& s : shards) tensors.push_back(s.shard);
    return tensors;
  }

  // The replica's gradient, flattened per unit, sliced into the shards' gradients.
  void cut_gradients() {
    auto named = model->named_parameters();
    for (auto& s : shards) {
      at::Tensor padded = torch::zeros({s.shard.numel() * world});
      for (const auto& p : s.params)
        padded.narrow(0, p.offset, named[p.name].numel()).copy_(named[p.name].grad().reshape(-1));
      s.shard.mutable_grad() = padded.narrow(0, s.offset, s.shard.numel()).clone();
    }
  }

  // Every rank's shards into every rank's replica (what stages 1-2 all-gather after the step).
  void join_shards(const std::shared_ptr<ProcessGroup>& group) {
    torch::NoGradGuard no_grad;
    auto named = model->named_parameters();
    for (auto& s : shards) {
      at::Tensor flat = torch::zeros({s.shard.numel() * world});
      flat.narrow(0, s.offset, s.shard.numel()).copy_(s.shard);
      if (group && world > 1) group->all_reduce(flat);
      for (const auto& p : s.params)
        named[p.name].copy_(flat.narrow(0, p.offset, named[p.name].numel()).view(p.shape));
    }
  }

  torch::nn::Sequential model;
  int world;
  std::vector<FlatShard> shards;
};

// The batches every run trains on, made once so that all runs and ranks see the same.
struct Data {
  std::vector<at::Tensor> x, y;
  explicit Data(int steps) {
    torch::manual_seed(7);
    for (int i = 0; i < steps; ++i) {
      x.push_back(torch::randn({6, 4}));
      y.push_back(torch::randn({6, 3}));
    }
  }
};

at::Tensor loss_of(torch::nn::Sequential& model, const Data& data, int step) {
  return (model->forward(data.x[step]) - data.y[step]).pow(2).mean();
}

enum class Optim { kSgdMomentum, kAdam, kAdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind,
                                                        std::vector<at::Tensor> params) {
  switch (kind) {
    case Optim::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    case Optim::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
    case Optim::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params,
                                                   torch::optim::AdamWOptions(0.01).amsgrad(true));
  }
  return nullptr;
}

void toy_step(ToyShardedRank& toy, torch::optim::Optimizer& optimizer, const Data& data, int step,
              const std::shared_ptr<ProcessGroup>& group) {
  optimizer.zero_grad();
  toy.model->zero_grad();
  loss_of(toy.model, data, step).backward();
  toy.cut_gradients();
  optimizer.step();
  toy.join_shards(group);
}

// The uninterrupted reference: plain training of the full model for `steps` steps.
torch::nn::Sequential train_plain(const torch::nn::Sequential& initial, Optim kind,
                                  const Data& data, int steps) {
  torch::nn::Sequential model(
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone()));
  auto optimizer = make_optimizer(kind, model->parameters());
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    loss_of(model, data, step).backward();
    optimizer->step();
  }
  return model;
}

void expect_close(torch::nn::Module& actual, torch::nn::Module& expected) {
  auto a = actual.named_parameters(), e = expected.named_parameters();
  ASSERT_EQ(a.size(), e.size());
  for (const auto& item : e) {
    const double error = (a[item.key()] - item.value()).abs().max().item<double>();
    EXPECT_LT(error, 1e-6) << item.key();
  }
}

// Trains `first` steps at world size n with `save_units`, saves (step `first`), loads at world
// size m with `load_units`, trains to `first + second` steps; rank 0's replica is returned.
torch::nn::Sequential save_at_n_continue_at_m(const torch::nn::Sequential& initial, Optim kind,
                                              const Data& data, int n, Units save_units, int m,
                                              Units load_units, int first, int second,
                                              const std::string& dir) {
  CheckpointOptions options;
  options.dir = dir;
  testing::run_group(n, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    ToyShardedRank toy(initial, save_units, rank, n);
    auto optimizer = make_optimizer(kind, toy.shard_tensors());
    for (int step = 0; step < first; ++step) toy_step(toy, *optimizer, data, step, group);
    ShardedCheckpointer checkpointer(options, group);
    DistributedSampler sampler(100, n, rank);
    sampler.advance(first * 6);
    ShardedTrainingState state{toy.shards, 1, optimizer.get(), &sampler, first, /*rng=*/false};
    state.values["rank"] = std::to_string(rank);
    state.tensors["extra"] = torch::full({2}, static_cast<float>(rank));
    checkpointer.save(state);
  });
  torch::nn::Sequential result;
  testing::run_group(m, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    // Fresh shards of a model that differs from the saved one: everything must come from disk.
    auto other = make_model();
    ToyShardedRank toy(other, load_units, rank, m);
    auto optimizer = make_optimizer(kind, toy.shard_tensors());
    ShardedCheckpointer checkpointer(options, group);
    DistributedSampler sampler(100, m, rank);
    ShardedTrainingState state{toy.shards, 3, optimizer.get(), &sampler, 0, /*rng=*/false};
    auto loaded = checkpointer.load_latest(state);
    ASSERT_TRUE(loaded.has_value());
    EXPECT_EQ(loaded->step, first);
    EXPECT_TRUE(loaded->skipped.empty());
    EXPECT_EQ(state.step, first);
    EXPECT_EQ(sampler.state().samples_consumed, first * 6);
    // Extras come from the saving rank of the same number, rank 0's beyond the saved world.
    const int source = rank < n ? rank : 0;
    EXPECT_EQ(state.values["rank"], std::to_string(source));
    EXPECT_TRUE(torch::equal(state.tensors["extra"], torch::full({2}, static_cast<float>(source))));
    toy.join_shards(group);
    for (int step = first; step < first + second; ++step)
      toy_step(toy, *optimizer, data, step, group);
    if (rank == 0) result = toy.model;
  });
  return result;
}

TEST(ShardedCheckpoint, SavedAtNRanksLoadedAtMContinuesAsUninterrupted) {
  const Data data(6);
  torch::manual_seed(3);
  auto initial = make_model();
  struct Case {
    Optim optim;
    int n;
    Units save_units;
    int m;
    Units load_units;
  };
  for (const Case& c : {Case{Optim::kSgdMomentum, 2, Units::kOne, 3, Units::kOne},
                        Case{Optim::kSgdMomentum, 3, Units::kPerLayer, 2, Units::kOne},
                        Case{Optim::kAdam, 2, Units::kOne, 1, Units::kPerLayer},
                        Case{Optim::kAdam, 4, Units::kPerLayer, 3, Units::kPerLayer},
                        Case{Optim::kAdamW, 1, Units::kOne, 4, Units::kPerLayer}}) {
    SCOPED_TRACE("optimizer " + std::to_string(static_cast<int>(c.optim)) + ", " +
                 std::to_string(c.n) + " -> " + std::to_string(c.m) + " ranks");
    const std::string dir = temp_dir("dtrain-sharded-reshard");
    auto resumed = save_at_n_continue_at_m(initial, c.optim, data, c.n, c.save_units, c.m,
                                           c.load_units, 3, 3, dir);
    auto uninterrupted = train_plain(initial, c.optim, data, 6);
    expect_close(*resumed, *uninterrupted);
    // The test can fail: the model after 3 steps is far from the one after 6.
    auto halfway = train_plain(initial, c.optim, data, 3);
    EXPECT_GT((halfway[0]->as<torch::nn::Linear>()->weight -
               uninterrupted[0]->as<torch::nn::Linear>()->weight)
                  .abs()
                  .max()
                  .item<double>(),
              1e-4);
    fs::remove_all(dir);
  }
}

// Saves steps 10 and 20 at 2 ranks; `damage` spoils step 20; loading at 3 ranks must fall back to
// step 10, name what it skipped in `skipped` and in a warning.
void expect_fallback(const std::function<void(const std::string& folder)>& damage,
                     const std::string& skipped_name) {
  torch::manual_seed(5);
  auto initial = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-sharded-damage");
  testing::run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    ToyShardedRank toy(initial, Units::kOne, rank, 2);
    ShardedCheckpointer checkpointer(options, group);
    ShardedTrainingState state{toy.shards, 1, nullptr, nullptr, 10, false};
    checkpointer.save(state);
    for (auto& s : toy.shards) s.shard.detach().add_(1.0);
    state.step = 20;
    checkpointer.save(state);
  });
  const std::string newest = options.dir + "/checkpoint-20";
  damage(newest);
  ::testing::internal::CaptureStderr();
  testing::run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    ToyShardedRank toy(make_model(), Units::kOne, rank, 3);
    ShardedCheckpointer checkpointer(options, group);
    ShardedTrainingState state{toy.shards, 1, nullptr, nullptr, 0, false};
    auto loaded = checkpointer.load_latest(state);
    ASSERT_TRUE(loaded.has_value());
    EXPECT_EQ(loaded->step, 10);
    EXPECT_EQ(loaded->skipped, std::vector<std::string>{newest + "/" + skipped_name});
    toy.join_shards(group);
    if (rank == 0) expect_close(*toy.model, *initial);
  });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find(newest + "/" + skipped_name), std::string::npos) << log;
  EXPECT_NE(log.find("trying the one before it"), std::string::npos) << log;
  fs::remove_all(options.dir);
}

void flip_byte(const std::string& path) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  auto offset = static_cast<std::streamoff>(fs::file_size(path) / 2);
  file.seekg(offset);
  char byte = 0;
  file.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x10);
  file.seekp(offset);
  file.write(&byte, 1);
}

TEST(ShardedCheckpoint, CorruptRankFileIsSkippedWithAWarningNamingIt) {
  expect_fallback([](const std::string& folder) { flip_byte(folder + "/rank-1-of-2.ckpt"); },
                  "rank-1-of-2.ckpt");
}

TEST(ShardedCheckpoint, MissingRankFileIsSkippedWithAWarningNamingIt) {
  expect_fallback([](const std::string& folder) { fs::remove(folder + "/rank-0-of-2.ckpt"); },
                  "rank-0-of-2.ckpt");
}

TEST(ShardedCheckpoint, CheckpointWithoutMetadataIsIncompleteAndSkipped) {
  // A crash after the ranks wrote their files but before rank 0 committed the metadata.
  expect_fallback([](const std::string& folder) { fs::remove(folder + "/metadata.ckpt"); },
                  "metadata.ckpt");
}

TEST(ShardedCheckpoint, RankFileOfAnUnfinishedResaveIsSkipped) {
  // Step 20 saved again (a run resumed from step 10) crashed after rank 1 rewrote its file: both
  // files and the metadata are intact, but rank 1's belongs to the unfinished save.
  expect_fallback(
      [](const std::string& folder) {
        const std::string rank1 = folder + "/rank-1-of-2.ckpt", aside = folder + ".rank1";
        fs::copy_file(rank1, aside);
        CheckpointOptions options;
        options.dir = fs::path(folder).parent_path().string();
        testing::run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
          ToyShardedRank toy(make_model(), Units::kOne, rank, 2);
          ShardedTrainingState state{toy.shards, 1, nullptr, nullptr, 20, false};
          ShardedCheckpointer(options, group).save(state);
        });
        fs::rename(aside, rank1);  // the new rank 0 file and metadata, the old rank 1
      },
      "rank-1-of-2.ckpt");
}

TEST(ShardedCheckpoint, KeepsTheNewestKCompleteCheckpoints) {
  torch::manual_seed(6);
  auto initial = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-sharded-keep");
  options.keep_last = 2;
  auto save_steps = [&](std::vector<int64_t> steps, int world) {
    testing::run_group(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      ToyShardedRank toy(initial, Units::kOne, rank, world);
      ShardedCheckpointer checkpointer(options, group);
      for (int64_t step : steps) {
        ShardedTrainingState state{toy.shards, 1, nullptr, nullptr, step, false};
        checkpointer.save(state);
      }
    });
  };
  save_steps({1, 2}, 2);
  // Step 3 crashed before its metadata: incomplete, it must not count as one of the K.
  fs::remove(options.dir + "/checkpoint-2/metadata.ckpt");
  fs::create_directories(options.dir + "/checkpoint-3");
  fs::copy_file(options.dir + "/checkpoint-2/rank-0-of-2.ckpt",
                options.dir + "/checkpoint-3/rank-0-of-2.ckpt");
  save_steps({4}, 3);
  ShardedCheckpointer lister(options);
  EXPECT_EQ(lister.list(), (std::vector<std::string>{options.dir + "/checkpoint-1",
                                                     options.dir + "/checkpoint-4"}));
  // Step 4 again at another world size: the files of 3 ranks give way to those of 2.
  save_steps({4, 5}, 2);
  EXPECT_EQ(lister.list(), (std::vector<std::string>{options.dir + "/checkpoint-4",
                                                     options.dir + "/checkpoint-5"}));
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(options.dir + "/checkpoint-4"))
    files.push_back(entry.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files,
            (std::vector<std::string>{"metadata.ckpt", "rank-0-of-2.ckpt", "rank-1-of-2.ckpt"}));
  fs::remove_all(options.dir);
}

TEST(ShardedCheckpoint, FullAndShardedConvertBothWays) {
  const Data data(6);
  torch::manual_seed(8);
  auto initial = make_model();
  CheckpointOptions sharded_options, full_options;
  sharded_options.dir = temp_dir("dtrain-sharded-to-full");
  full_options.dir = temp_dir("dtrain-full-to-sharded");
  // 2 steps sharded at 2 ranks with Adam, saved sharded.
  testing::run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    ToyShardedRank toy(initial, Units::kPerLayer, rank, 2);
    auto optimizer = make_optimizer(Optim::kAdam, toy.shard_tensors());
    for (int step = 0; step < 2; ++step) toy_step(toy, *optimizer, data, step, group);
    ShardedTrainingState state{toy.shards, 3, optimizer.get(), nullptr, 2, false};
    state.values["note"] = "sharded";
    ShardedCheckpointer(sharded_options, group).save(state);
  });
  // Sharded -> full: a plain model and Adam on one device, saved as a replicated checkpoint.
  {
    auto plain = make_model();
    auto optimizer = make_optimizer(Optim::kAdam, plain->parameters());
    TrainingState full{plain.get(), optimizer.get()};
    full.rng = false;
    auto loaded = load_sharded_as_full(sharded_options, full);
    ASSERT_TRUE(loaded.has_value());
    EXPECT_EQ(full.step, 2);
    EXPECT_EQ(full.values["note"], "sharded");
    expect_close(*plain, *train_plain(initial, Optim::kAdam, data, 2));
    Checkpointer(full_options).save(full);
  }
  // Full -> sharded: the replicated checkpoint starts a sharded run at 3 ranks with one unit.
  testing::run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto plain = make_model();
    auto plain_optimizer = make_optimizer(Optim::kAdam, plain->parameters());
    TrainingState full{plain.get(), plain_optimizer.get()};
    full.rng = false;
    ASSERT_TRUE(Checkpointer(full_options).load_latest(full).has_value());
    ToyShardedRank toy(make_model(), Units::kOne, rank, 3);
    auto optimizer = make_optimizer(Optim::kAdam, toy.shard_tensors());
    ShardedTrainingState state{toy.shards, 1, optimizer.get()};
    copy_full_into_shards(full, state);
    EXPECT_EQ(state.step, 2);
    toy.join_shards(group);
    for (int step = 2; step < 6; ++step) toy_step(toy, *optimizer, data, step, group);
    if (rank == 0) expect_close(*toy.model, *train_plain(initial, Optim::kAdam, data, 6));
  });
  fs::remove_all(sharded_options.dir);
  fs::remove_all(full_options.dir);
}

TEST(ShardedCheckpoint, UnsupportedOptimizerIsAClearError) {
  auto initial = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-sharded-rmsprop");
  ToyShardedRank toy(initial, Units::kOne, 0, 1);
  torch::optim::RMSprop optimizer(toy.shard_tensors(), torch::optim::RMSpropOptions(0.01));
  ShardedTrainingState state{toy.shards, 1, &optimizer};
  ShardedCheckpointer checkpointer(options);
  try {
    checkpointer.save(state);
    FAIL() << "an RMSprop optimizer was saved";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("SGD, Adam and AdamW"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(checkpointer.list().empty());
  fs::remove_all(options.dir);
}

TEST(ShardedCheckpoint, CheckpointOfAnotherModelOrOptimizerIsAClearErrorAndChangesNothing) {
  auto initial = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-sharded-mismatch");
  {
    ToyShardedRank toy(initial, Units::kOne, 0, 1);
    auto optimizer = make_optimizer(Optim::kSgdMomentum, toy.shard_tensors());
    const Data data(1);
    toy_step(toy, *optimizer, data, 0, nullptr);
    DistributedSampler sampler(100, 1, 0);
    sampler.advance(60);
    ShardedTrainingState state{toy.shards, 1, optimizer.get(), &sampler, 1, /*rng=*/false};
    ShardedCheckpointer(options).save(state);
  }
  auto expect_error = [&](ToyShardedRank& toy, torch::optim::Optimizer* optimizer,
                          const std::string& expected, DistributedSampler* sampler = nullptr) {
    at::Tensor before = toy.shards[0].shard.detach().clone();
    ShardedTrainingState state{toy.shards, 1, optimizer, sampler, 0, /*rng=*/false};
    try {
      ShardedCheckpointer(options).load_latest(state);
      FAIL() << "loaded into a state that does not fit";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(before, toy.shards[0].shard));
    EXPECT_EQ(state.step, 0);
  };
  {
    ToyShardedRank toy(make_model(), Units::kOne, 0, 1);
    auto adam = make_optimizer(Optim::kAdam, toy.shard_tensors());
    expect_error(toy, adam.get(), "holds the state of a sgd optimizer but the optimizer is adam");
  }
  {
    torch::nn::Sequential wider(torch::nn::Linear(4, 6), torch::nn::Tanh(),
                                torch::nn::Linear(6, 3));
    ToyShardedRank toy(wider, Units::kOne, 0, 1);
    expect_error(toy, nullptr, "holds '0.weight' of shape [5, 4] but the model's is [6, 4]");
  }
  {
    // The sampler position is refused before the shards are filled, not after.
    ToyShardedRank toy(make_model(), Units::kOne, 0, 1);
    auto sgd = make_optimizer(Optim::kSgdMomentum, toy.shard_tensors());
    DistributedSampler smaller(50, 1, 0);
    expect_error(toy, sgd.get(), "its sampler position does not fit a dataset of 50 samples",
                 &smaller);
    EXPECT_EQ(smaller.state().samples_consumed, 0);
  }
  fs::remove_all(options.dir);
}

}  // namespace
}  // namespace dtrain
