// Tier-1 tests of dtrain::Checkpointer: every part of a TrainingState survives a round trip, a
// flipped byte or a truncation is caught and the previous checkpoint used, the newest K are kept,
// an asynchronous save writes what a synchronous one writes even while the model changes, a
// sampler position saved at one world size redistributes over another, and rank 0 can load for
// ranks without the folder.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "dtrain/checkpoint.h"
#include "dtrain/data.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

using testing::temp_dir;

// A model with parameters and a buffer (BatchNorm's running statistics).
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5),
                               torch::nn::ReLU(), torch::nn::Linear(5, 3));
}

void train_steps(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer, int steps) {
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    model->forward(torch::randn({8, 6})).pow(2).mean().backward();
    optimizer.step();
  }
}

void expect_same_tensors(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& item : ba) EXPECT_TRUE(torch::equal(item.value(), bb[item.key()])) << item.key();
}

TEST(Checkpointer, RoundTripRestoresEveryPart) {
  torch::manual_seed(1);
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train_steps(model, optimizer, 3);
  DistributedSampler sampler(100, 2, 0);
  sampler.set_epoch(4);
  sampler.advance(36);
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-roundtrip");
  Checkpointer checkpointer(options);
  TrainingState state{model.get(), &optimizer, &sampler};
  state.step = 3;
  state.tensors["epoch_samples"] = torch::tensor({60000, 123}, torch::kInt64);
  state.values["model"] = "mlp";
  std::string path = checkpointer.save(state);
  EXPECT_EQ(path, options.dir + "/checkpoint-3.ckpt");
  at::Tensor rng_after_save = torch::rand({4});  // what the restored generator must draw next

  torch::manual_seed(99);  // another initialization and generator state
  auto restored = make_model();
  torch::optim::SGD restored_optimizer(restored->parameters(),
                                       torch::optim::SGDOptions(0.1).momentum(0.9));
  DistributedSampler restored_sampler(100, 2, 0);
  TrainingState into{restored.get(), &restored_optimizer, &restored_sampler};
  auto loaded = Checkpointer(options).load_latest(into);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->path, path);
  EXPECT_EQ(loaded->step, 3);
  EXPECT_TRUE(loaded->skipped.empty());
  EXPECT_EQ(into.step, 3);
  expect_same_tensors(*model, *restored);
  EXPECT_EQ(restored_sampler.state().epoch, 4);
  EXPECT_EQ(restored_sampler.state().samples_consumed, 36);
  EXPECT_TRUE(torch::equal(torch::rand({4}), rng_after_save));
  ASSERT_EQ(into.tensors.count("epoch_samples"), 1u);
  EXPECT_TRUE(torch::equal(into.tensors["epoch_samples"], state.tensors["epoch_samples"]));
  EXPECT_EQ(into.values, state.values);

  // The optimizer's momentum came back too: one more identical step keeps the models identical
  // (without momentum the restored model would take a different step).
  torch::manual_seed(5);
  train_steps(model, optimizer, 1);
  torch::manual_seed(5);
  train_steps(restored, restored_optimizer, 1);
  expect_same_tensors(*model, *restored);
  fs::remove_all(options.dir);
}

TEST(Checkpointer, EmptyFolderHasNothingToLoad) {
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-empty");
  TrainingState state;
  EXPECT_FALSE(Checkpointer(options).load_latest(state).has_value());
}

// Saves steps 10 and 20 of a model, damages step 20 with `damage`, and expects step 10 back.
void expect_damage_detected(const std::function<void(const std::string& path)>& damage) {
  torch::manual_seed(2);
  auto model = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-damage");
  Checkpointer checkpointer(options);
  TrainingState state{model.get()};
  state.step = 10;
  checkpointer.save(state);
  auto at_step_10 = make_model();
  at_step_10->parameters()[0].data().copy_(model->parameters()[0]);
  for (auto& p : model->parameters()) p.data().add_(1.0);
  state.step = 20;
  std::string newest = checkpointer.save(state);
  damage(newest);

  auto restored = make_model();
  TrainingState into{restored.get()};
  auto loaded = checkpointer.load_latest(into);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 10);
  EXPECT_EQ(loaded->skipped, std::vector<std::string>{newest});
  EXPECT_TRUE(torch::equal(restored->parameters()[0], at_step_10->parameters()[0]));
  fs::remove_all(options.dir);
}

TEST(Checkpointer, FlippedByteFallsBackToThePreviousCheckpoint) {
  // A byte in the payload's middle, the last byte and a byte of the header's length field.
  for (int where : {0, 1, 2}) {
    SCOPED_TRACE(where);
    expect_damage_detected([where](const std::string& path) {
      std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
      auto size = static_cast<std::streamoff>(fs::file_size(path));
      std::streamoff offset = where == 0 ? size / 2 : where == 1 ? size - 1 : 9;
      file.seekg(offset);
      char byte = 0;
      file.read(&byte, 1);
      byte = static_cast<char>(byte ^ 0x10);
      file.seekp(offset);
      file.write(&byte, 1);
    });
  }
}

TEST(Checkpointer, TruncatedFileFallsBackToThePreviousCheckpoint) {
  for (double keep : {0.0, 0.01, 0.5, 0.999}) {
    SCOPED_TRACE(keep);
    expect_damage_detected([keep](const std::string& path) {
      fs::resize_file(path, static_cast<uintmax_t>(fs::file_size(path) * keep));
    });
  }
}

TEST(Checkpointer, KeepsTheNewestK) {
  auto model = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-keep");
  options.keep_last = 2;
  Checkpointer checkpointer(options);
  TrainingState state{model.get()};
  for (int64_t step : {5, 10, 15, 20, 100}) {
    state.step = step;
    checkpointer.save(state);
  }
  // A temporary of a writer that died mid-write goes at the next save; a live writer's stays.
  const std::string dead = options.dir + "/.checkpoint-7.ckpt.tmp-999999999";
  const std::string live = options.dir + "/.checkpoint-7.ckpt.tmp-" + std::to_string(::getppid());
  std::ofstream(dead) << "torn";
  std::ofstream(live) << "in progress";
  state.step = 100;
  checkpointer.save(state);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_EQ(checkpointer.list(), (std::vector<std::string>{options.dir + "/checkpoint-20.ckpt",
                                                           options.dir + "/checkpoint-100.ckpt"}));
  fs::remove_all(options.dir);
}

// After resuming past a damaged newest file, new saves are below it: the damaged file must not
// count against keep_last, or each new checkpoint would be deleted as soon as it is written.
TEST(Checkpointer, DamagedLaterFileDoesNotPushOutNewCheckpoints) {
  auto model = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-damaged-later");
  options.keep_last = 1;
  Checkpointer checkpointer(options);
  TrainingState state{model.get()};
  state.step = 40;
  checkpointer.save(state);
  std::ofstream(options.dir + "/checkpoint-50.ckpt") << "torn by a crash";
  state.step = 45;
  checkpointer.save(state);
  EXPECT_TRUE(fs::exists(options.dir + "/checkpoint-45.ckpt"));
  EXPECT_FALSE(fs::exists(options.dir + "/checkpoint-40.ckpt"));
  TrainingState loaded{model.get()};
  auto found = checkpointer.load_latest(loaded);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 45);
  EXPECT_EQ(found->skipped, (std::vector<std::string>{options.dir + "/checkpoint-50.ckpt"}));
  fs::remove_all(options.dir);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Checkpointer, AsynchronousSaveWritesWhatASynchronousSaveWrites) {
  torch::manual_seed(3);
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train_steps(model, optimizer, 2);
  DistributedSampler sampler(1000, 4, 1);
  sampler.advance(400);
  TrainingState state{model.get(), &optimizer, &sampler};
  state.step = 2;
  state.rng = false;  // the two saves happen at different generator states otherwise
  state.tensors["counts"] = torch::arange(10);

  CheckpointOptions sync_options;
  sync_options.dir = temp_dir("dtrain-ckpt-sync");
  std::string sync_path = Checkpointer(sync_options).save(state);

  CheckpointOptions async_options = sync_options;
  async_options.dir = temp_dir("dtrain-ckpt-async");
  async_options.async = true;
  std::string async_path;
  {
    Checkpointer checkpointer(async_options);
    async_path = checkpointer.save(state);
    // The training loop goes on at once: the save must have taken its copy already.
    train_steps(model, optimizer, 1);
    state.tensors["counts"].add_(1);
    checkpointer.wait();
  }
  EXPECT_EQ(file_bytes(sync_path), file_bytes(async_path));
  EXPECT_GT(fs::file_size(sync_path), 1000u);
  fs::remove_all(sync_options.dir);
  fs::remove_all(async_options.dir);
}

TEST(Checkpointer, DestructorWaitsForTheAsynchronousSave) {
  auto model = make_model();
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-exit");
  options.async = true;
  {
    Checkpointer checkpointer(options);
    TrainingState state{model.get()};
    for (int64_t step = 1; step <= 3; ++step) {  // each save waits for the one before
      state.step = step;
      checkpointer.save(state);
    }
  }
  auto restored = make_model();
  TrainingState into{restored.get()};
  auto loaded = Checkpointer(options).load_latest(into);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 3);
  EXPECT_TRUE(loaded->skipped.empty());
  expect_same_tensors(*model, *restored);
  fs::remove_all(options.dir);
}

TEST(Checkpointer, AsynchronousFailureIsRethrownByTheNextCall) {
  auto model = make_model();
  CheckpointOptions options;
  options.dir = "/dev/null/dtrain-ckpt";  // a folder under a file: cannot be created
  options.async = true;
  Checkpointer checkpointer(options);
  TrainingState state{model.get()};
  EXPECT_NO_THROW(checkpointer.save(state));
  try {
    checkpointer.wait();
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint /dev/null/dtrain-ckpt/checkpoint-0.ckpt: "),
              std::string::npos)
        << e.what();
  }
  checkpointer.wait();  // reported once
}

TEST(Checkpointer, SamplerPositionRedistributesAtAnotherWorldSize) {
  const int64_t dataset = 101;
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-world");
  {
    DistributedSampler saver(dataset, 2, 0);
    saver.set_epoch(1);
    saver.advance(2 * 17);  // 17 steps of one sample per rank
    TrainingState state;
    state.sampler = &saver;
    Checkpointer(options).save(state);
  }
  DistributedSampler whole(dataset, 1, 0);
  whole.set_epoch(1);
  std::vector<int64_t> order = whole.indices();
  std::multiset<int64_t> expected(order.begin() + 34, order.end());
  std::multiset<int64_t> seen;
  for (int world : {1, 3, 4}) {
    SCOPED_TRACE(world);
    seen.clear();
    for (int rank = 0; rank < world; ++rank) {
      DistributedSampler sampler(dataset, world, rank);
      TrainingState into;
      into.sampler = &sampler;
      ASSERT_TRUE(Checkpointer(options).load_latest(into).has_value());
      EXPECT_EQ(sampler.state().epoch, 1);
      EXPECT_EQ(sampler.state().samples_consumed, 34);
      auto indices = sampler.indices();
      seen.insert(indices.begin(), indices.end());
    }
    // Every remaining sample once; padding repeats at most world - 1 of them.
    for (int64_t index : expected) EXPECT_GE(seen.count(index), 1u) << index;
    EXPECT_LT(seen.size() - expected.size(), static_cast<size_t>(world));
  }
  fs::remove_all(options.dir);
}

TEST(Checkpointer, Rank0LoadsAndBroadcastsToRanksWithoutTheFolder) {
  torch::manual_seed(4);
  auto saved_model = make_model();
  torch::optim::SGD saved_optimizer(saved_model->parameters(),
                                    torch::optim::SGDOptions(0.1).momentum(0.9));
  train_steps(saved_model, saved_optimizer, 2);
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-bcast");
  {
    TrainingState state{saved_model.get(), &saved_optimizer};
    state.step = 8;
    state.values["note"] = "hello";
    Checkpointer(options).save(state);
  }
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE(world);
    testing::run_group(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      // Only rank 0 can see the folder, as on nodes without a shared file system.
      CheckpointOptions mine = options;
      if (rank != 0) mine.dir = temp_dir("dtrain-ckpt-nothing-here");
      auto model = make_model();
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      TrainingState into{model.get(), &optimizer};
      into.rng = false;  // one generator shared by the thread ranks
      auto loaded = Checkpointer(mine, group).load_latest(into);
      if (!loaded) throw std::runtime_error("rank " + std::to_string(rank) + ": nothing loaded");
      if (loaded->path != options.dir + "/checkpoint-8.ckpt" || into.step != 8 ||
          into.values["note"] != "hello") {
        throw std::runtime_error("rank " + std::to_string(rank) + ": loaded " + loaded->path);
      }
      for (size_t i = 0; i < model->parameters().size(); ++i) {
        if (!torch::equal(model->parameters()[i], saved_model->parameters()[i]))
          throw std::runtime_error("rank " + std::to_string(rank) + ": parameter differs");
      }

      // A folder without checkpoints: nothing on every rank, nobody left waiting.
      CheckpointOptions empty = options;
      empty.dir = temp_dir("dtrain-ckpt-empty-bcast");
      if (Checkpointer(empty, group).load_latest(into).has_value())
        throw std::runtime_error("rank " + std::to_string(rank) + ": loaded from nothing");
    });
  }
  fs::remove_all(options.dir);
}

TEST(Checkpointer, CheckpointOfAnotherModelIsOneLineNamingTheFile) {
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-other");
  auto model = make_model();
  TrainingState state{model.get()};
  state.step = 1;
  std::string path = Checkpointer(options).save(state);

  torch::nn::Sequential other(torch::nn::Linear(6, 4));
  auto before = other->parameters()[0].clone();
  TrainingState into{other.get()};
  try {
    Checkpointer(options).load_latest(into);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "checkpoint " + path +
                  ": holds '0.weight' of shape [5, 6] but the model's is [4, 6]; it was saved "
                  "from another model: load it into the model that saved it");
  }
  EXPECT_TRUE(torch::equal(before, other->parameters()[0]));  // left untouched

  EXPECT_THROW(Checkpointer(CheckpointOptions{}), UsageError);
  CheckpointOptions none_kept = options;
  none_kept.keep_last = 0;
  EXPECT_THROW(Checkpointer{none_kept}, UsageError);
  fs::remove_all(options.dir);
}

TEST(Checkpointer, CheckpointOfAnotherOptimizerIsOneLineAndChangesNothing) {
  CheckpointOptions options;
  options.dir = temp_dir("dtrain-ckpt-other-optimizer");
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train_steps(model, sgd, 2);
  TrainingState state{model.get(), &sgd};
  state.step = 2;
  std::string path = Checkpointer(options).save(state);

  auto restored = make_model();
  auto before = restored->parameters()[0].clone();
  torch::optim::Adam adam(restored->parameters());
  TrainingState into{restored.get(), &adam};
  try {
    Checkpointer(options).load_latest(into);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "checkpoint " + path +
                                         ": holds the state of SGD, not of this Adam; resume with "
                                         "the optimizer that saved it");
  }
  EXPECT_TRUE(torch::equal(before, restored->parameters()[0]));  // the model was left as it was
  EXPECT_TRUE(adam.state().empty());

  // The same SGD with a parameter group fewer: the counts are named.
  auto other = make_model();
  auto params = other->parameters();
  torch::optim::SGD partial(std::vector<at::Tensor>(params.begin(), params.begin() + 2),
                            torch::optim::SGDOptions(0.1).momentum(0.9));
  TrainingState into_partial{other.get(), &partial};
  try {
    Checkpointer(options).load_latest(into_partial);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("param_groups[0] holds 6 parameters, this SGD's 2"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(options.dir);
}

}  // namespace
}  // namespace dtrain
