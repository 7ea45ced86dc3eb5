// Checkpoint save, blocking vs asynchronous: how long the training loop is held by
// dtrain::Checkpointer::save, for the trainer's MLP and CNN (with SGD momentum, so the optimizer
// state is as large as the model). Between saves the loop trains --steps-between real steps on
// batches of 64, so an asynchronous write overlaps with training as it would in a job.
//   bench_checkpoint [--model mlp|cnn|both] [--saves 20] [--steps-between 100] [--dir DIR]
// One JSON line per model and mode: the held time's median and 90th percentile, and for the
// asynchronous mode the background write's time (measured through wait() after a save, separately).
//   bench_checkpoint --sharded 1,2,4 [--model mlp|wide|both] [--saves 10]
// instead compares a blocking replicated save (one writer, the whole state) with a sharded save
// (dtrain::ShardedCheckpointer: N ranks, here threads of this process, each writing 1/N of the flat
// parameters and their momentum, all at once); "wide" is a 784-2048-2048-10 MLP (5.8M parameters).
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/sharded_checkpoint.h"
#include "flags.h"
#include "json_line.h"

namespace {

using Clock = std::chrono::steady_clock;

// The trainer's two models (tools/trainer/models.h), as Sequentials.
torch::nn::Sequential make_model(const std::string& kind) {
  namespace nn = torch::nn;
  if (kind == "cnn") {
    return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 16, 5).padding(2)), nn::ReLU(),
                          nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(16, 32, 5).padding(2)),
                          nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(32 * 7 * 7, 10));
  }
  if (kind == "wide") {
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 2048), nn::ReLU(), nn::Linear(2048, 2048),
                          nn::ReLU(), nn::Linear(2048, 10));
  }
  return nn::Sequential(nn::Flatten(), nn::Linear(784, 256), nn::ReLU(), nn::Linear(256, 128),
                        nn::ReLU(), nn::Linear(128, 10));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double p90(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, v.size() * 9 / 10)];
}

void bench_saves(const std::string& kind, bool async, int saves, int steps_between,
                 const std::string& dir) {
  torch::manual_seed(0);
  auto model = make_model(kind);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(0, 10, {64});
  auto train_step = [&] {
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    optimizer.step();
  };
  train_step();  // momentum buffers exist from here on

  std::filesystem::remove_all(dir);
  dtrain::CheckpointOptions options;
  options.dir = dir;
  options.async = async;
  options.keep_last = 2;
  dtrain::Checkpointer checkpointer(options);
  dtrain::TrainingState state{model.get(), &optimizer};

  std::vector<double> held_ms, step_ms, write_ms;
  for (int i = 0; i < saves; ++i) {
    state.step = i;
    auto start = Clock::now();
    checkpointer.save(state);
    held_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    auto train_start = Clock::now();
    for (int s = 0; s < steps_between; ++s) train_step();
    step_ms.push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - train_start).count() /
        steps_between);
  }
  checkpointer.wait();
  if (async) {
    // The background write alone: save then wait at once, with no training in between.
    for (int i = 0; i < std::max(5, saves / 4); ++i) {
      state.step = saves + i;
      auto start = Clock::now();
      checkpointer.save(state);
      checkpointer.wait();
      write_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
  }
  int64_t bytes = static_cast<int64_t>(std::filesystem::file_size(checkpointer.list().back()));
  bench::JsonLine line = {{"model", kind},
                          {"mode", async ? "async" : "blocking"},
                          {"file_bytes", bytes},
                          {"saves", saves},
                          {"held_ms_median", bench::rounded(median(held_ms), 3)},
                          {"held_ms_p90", bench::rounded(p90(held_ms), 3)},
                          {"train_step_ms_median", bench::rounded(median(step_ms), 3)}};
  if (async) line["save_and_wait_ms_median"] = bench::rounded(median(write_ms), 3);
  bench::print_line(line);
  std::filesystem::remove_all(dir);
}

// Replicated (one blocking Checkpointer::save of model + SGD momentum) against sharded at each of
// `world_sizes` (every rank saves its slice of one flat buffer of all parameters and its momentum
// buffer; the time is rank 0's ShardedCheckpointer::save, which returns once all files and the
// metadata are on disk).
void bench_sharded(const std::string& kind, const std::vector<int>& world_sizes, int saves,
                   const std::string& dir) {
  torch::manual_seed(0);
  auto model = make_model(kind);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  for (auto& p : model->parameters()) p.mutable_grad() = torch::randn_like(p);
  optimizer.step();  // momentum buffers exist from here on
  std::vector<double> replicated_ms;
  {
    std::filesystem::remove_all(dir);
    dtrain::CheckpointOptions options;
    options.dir = dir;
    options.keep_last = 2;
    dtrain::Checkpointer checkpointer(options);
    dtrain::TrainingState state{model.get(), &optimizer};
    for (int i = 0; i < saves; ++i) {
      state.step = i;
      auto start = Clock::now();
      checkpointer.save(state);
      replicated_ms.push_back(
          std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
  }
  std::vector<at::Tensor> flat_params;
  for (auto& p : model->parameters()) flat_params.push_back(p.detach().reshape(-1));
  const at::Tensor flat = torch::cat(flat_params);
  const int64_t full_numel = flat.numel();
  bench::JsonLine line = {{"model", kind},
                          {"parameters", full_numel},
                          {"replicated_save_ms_median", bench::rounded(median(replicated_ms), 3)}};
  for (int world : world_sizes) {
    std::filesystem::remove_all(dir);
    std::vector<double> sharded_ms;
    const std::string store = "memory://bench-sharded-" + kind + "-" + std::to_string(world);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < world; ++rank) {
      ranks.emplace_back([&, rank] {
        dtrain::InitOptions init;
        init.init_method = store;
        init.rank = rank;
        init.world_size = world;
        auto group = dtrain::init_process_group(init);
        const int64_t per_rank = (full_numel + world - 1) / world;
        dtrain::FlatShard shard;
        shard.key = "unit0";
        shard.offset = rank * per_rank;
        shard.full_numel = full_numel;
        int64_t offset = 0;
        for (const auto& item : model->named_parameters()) {
          shard.params.push_back({item.key(), item.value().sizes().vec(), offset});
          offset += item.value().numel();
        }
        const int64_t mine = std::max<int64_t>(0, std::min(per_rank, full_numel - shard.offset));
        shard.shard = torch::zeros({per_rank});
        shard.shard.narrow(0, 0, mine).copy_(flat.narrow(0, shard.offset, mine));
        shard.shard.requires_grad_();
        torch::optim::SGD shard_optimizer({shard.shard},
                                          torch::optim::SGDOptions(0.01).momentum(0.9));
        shard.shard.mutable_grad() = torch::randn_like(shard.shard);
        shard_optimizer.step();
        dtrain::CheckpointOptions options;
        options.dir = dir;
        options.keep_last = 2;
        dtrain::ShardedCheckpointer checkpointer(options, group);
        dtrain::ShardedTrainingState state{{shard}, 1, &shard_optimizer};
        for (int i = 0; i < saves; ++i) {
          state.step = i;
          group->barrier();
          auto start = Clock::now();
          checkpointer.save(state);
          if (rank == 0) {
            sharded_ms.push_back(
                std::chrono::duration<double, std::milli>(Clock::now() - start).count());
          }
        }
      });
    }
    for (auto& t : ranks) t.join();
    line["sharded_" + std::to_string(world) + "_save_ms_median"] =
        bench::rounded(median(sharded_ms), 3);
  }
  bench::print_line(line);
  std::filesystem::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    std::string model = "both";
    int saves = 20, steps_between = 100;
    std::vector<int> sharded_world_sizes;  // --sharded: compare replicated with sharded saves
    std::string dir =
        (std::filesystem::temp_directory_path() / ("dtrain-bench-ckpt-" + std::to_string(getpid())))
            .string();
    bench::Flags("bench_checkpoint",
                 "how long a checkpoint save holds the training loop, blocking vs asynchronous")
        .text("--model", model, "which model (wide: with --sharded)",
              {"mlp", "cnn", "wide", "both"})
        .integer("--saves", saves, "saves per mode")
        .integer("--steps-between", steps_between, "training steps between saves")
        .text("--dir", dir, "where the checkpoints go")
        .integers("--sharded", sharded_world_sizes,
                  "instead, replicated vs sharded saves at these world sizes")
        .parse(argc, argv);
    torch::set_num_threads(1);  // as one rank of the trainer
    if (!sharded_world_sizes.empty()) {
      for (const std::string kind : {"mlp", "wide"}) {
        if (model != "both" && model != kind) continue;
        bench_sharded(kind, sharded_world_sizes, saves, dir);
      }
      return 0;
    }
    for (const std::string kind : {"mlp", "cnn"}) {
      if (model != "both" && model != kind) continue;
      bench_saves(kind, /*async=*/false, saves, steps_between, dir);
      bench_saves(kind, /*async=*/true, saves, steps_between, dir);
    }
    return 0;
  });
}
