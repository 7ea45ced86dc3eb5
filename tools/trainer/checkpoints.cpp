// The trainer's checkpoints, restarts, preemption and fault-injection hook; see checkpoints.h.
#include "checkpoints.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "dtrain/errors.h"

namespace trainer {
namespace {

// --strategy zero's checkpoints (dtrain::ShardedCheckpointer): every rank saves and loads its own
// shards; the sampler position, step and extras travel as in TrainingState, so the code around
// these calls is the same for both kinds of checkpoint.
dtrain::ShardedTrainingState sharded_state(const dtrain::ShardedDataParallelBase& sdp,
                                           const dtrain::TrainingState& state) {
  return {sdp.flat_shards(), sdp.stage(), state.optimizer, state.sampler,
          state.step,        state.rng,   state.tensors,   state.values};
}

std::optional<dtrain::LoadedCheckpoint> load_sharded(dtrain::ShardedCheckpointer& checkpointer,
                                                     dtrain::ShardedDataParallelBase& sdp,
                                                     dtrain::TrainingState& state) {
  auto sharded = sharded_state(sdp, state);
  auto loaded = checkpointer.load_latest(sharded);
  if (loaded) {
    sdp.shards_changed();
    state.step = sharded.step;
    state.tensors = sharded.tensors;
    state.values = sharded.values;
  }
  return loaded;
}

std::string save_sharded(dtrain::ShardedCheckpointer& checkpointer,
                         const dtrain::ShardedDataParallelBase& sdp,
                         const dtrain::TrainingState& state) {
  return checkpointer.save(sharded_state(sdp, state));
}

// A resumed SGD's momentum must live with its parameters (the checkpoint's may load elsewhere).
void move_optimizer_state(torch::optim::SGD& optimizer, const c10::Device& device) {
  for (auto& entry : optimizer.state()) {
    auto& state = static_cast<torch::optim::SGDParamState&>(*entry.second);
    if (state.momentum_buffer().defined())
      state.momentum_buffer(state.momentum_buffer().to(device));
  }
}

dtrain::CheckpointOptions checkpoint_options(const Flags& flags) {
  dtrain::CheckpointOptions options;
  options.dir = flags.checkpoint_dir;
  options.keep_last = static_cast<int>(flags.keep_checkpoints);
  options.async = flags.async_checkpoints;
  return options;
}

}  // namespace

int64_t restart_count() { return dtrain::launch_info_from_env().restarts; }

void check_checkpoint_dir(const Flags& flags, int rank, bool restarted) {
  if (flags.checkpoint_dir.empty()) return;
  namespace fs = std::filesystem;
  const std::string& dir = flags.checkpoint_dir;
  std::error_code error;
  if (fs::exists(dir) && !fs::is_directory(dir)) {
    throw dtrain::UsageError("train_fashion_mnist: --checkpoint-dir '" + dir +
                             "' is a file, not a folder; pass a folder");
  }
  // What the folder holds is rank 0's to judge: it reads the checkpoint and broadcasts it, so on
  // nodes without a shared file system the other ranks' folders are empty, and rightly so.
  auto existing = flags.strategy == "zero"
                      ? dtrain::ShardedCheckpointer(checkpoint_options(flags)).list()
                      : dtrain::Checkpointer(checkpoint_options(flags)).list();
  if (flags.resume && existing.empty() && rank == 0) {
    throw dtrain::UsageError("train_fashion_mnist: --resume: no checkpoint in " + dir +
                             "; run once with --checkpoint-dir " + dir +
                             " first, or drop --resume");
  }
  fs::create_directories(dir, error);
  if (error || !fs::is_directory(dir)) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --checkpoint-dir '" + dir + "': cannot be used as a folder (" +
        (error ? error.message() : "it is a file") + "); pass a writable folder");
  }
  std::string probe =
      dir + "/.write-test-" + std::to_string(rank) + "-" + std::to_string(::getpid());
  if (FILE* f = std::fopen(probe.c_str(), "w")) {
    std::fclose(f);
    fs::remove(probe, error);
  } else {
    throw dtrain::UsageError("train_fashion_mnist: --checkpoint-dir '" + dir +
                             "': cannot write there (" + std::strerror(errno) + ")");
  }
  if (!existing.empty() && !flags.resume && !restarted && rank == 0) {
    throw dtrain::UsageError("train_fashion_mnist: --checkpoint-dir '" + dir +
                             "' already holds a checkpoint (" + existing.back() +
                             "); pass --resume to continue from it, or choose another folder");
  }
}

Checkpoints::Checkpoints(const Flags& flags, const std::shared_ptr<dtrain::ProcessGroup>& pg,
                         torch::nn::Module* model, dtrain::ShardedDataParallelBase* sdp,
                         torch::optim::SGD& optimizer, dtrain::DistributedSampler& sampler,
                         dtrain::amp::GradScaler& scaler)
    : flags(flags),
      pg(pg),
      sdp(sdp),
      optimizer(optimizer),
      sampler(sampler),
      scaler(scaler),
      checkpointing(!flags.checkpoint_dir.empty()) {
  checkpoint_state.model = model;
  checkpoint_state.optimizer = &optimizer;
  checkpoint_state.sampler = &sampler;
  checkpoint_state.grad_scaler = &scaler;  // a checkpoint saved without one leaves it fresh
  if (checkpointing && sdp) {
    sharded_checkpointer =
        std::make_unique<dtrain::ShardedCheckpointer>(checkpoint_options(flags), pg);
  } else if (checkpointing) {
    checkpointer = std::make_unique<dtrain::Checkpointer>(checkpoint_options(flags), pg);
  }
}

std::string Checkpoints::resume(int64_t restarts, Position& at, std::vector<int64_t>& epoch_samples,
                                const c10::Device& device) {
  if (!checkpointing || !(flags.resume || restarts > 0)) return {};
  auto loaded = sharded_checkpointer ? load_sharded(*sharded_checkpointer, *sdp, checkpoint_state)
                                     : checkpointer->load_latest(checkpoint_state);
  if (!loaded && flags.resume) {
    throw dtrain::UsageError("train_fashion_mnist: --resume: no intact checkpoint in " +
                             flags.checkpoint_dir +
                             " (the damaged ones are named above); drop --resume to start over");
  }
  if (!loaded) return {};
  auto& values = checkpoint_state.values;
  if (values["model"] != flags.model) {
    throw dtrain::UsageError("train_fashion_mnist: --resume: " + loaded->path + " holds a " +
                             values["model"] + " model but --model is " + flags.model);
  }
  if (values["seed"] != std::to_string(flags.seed)) {
    throw dtrain::UsageError("train_fashion_mnist: --resume: " + loaded->path +
                             " was trained with --seed " + values["seed"] +
                             " but this run has --seed " + std::to_string(flags.seed) +
                             "; the saved position only means something in the "
                             "same shuffle order: pass --seed " +
                             values["seed"]);
  }
  at = {sampler.state().epoch, sampler.state().samples_consumed, checkpoint_state.step};
  at::Tensor saved_counts = checkpoint_state.tensors["epoch_samples"];
  for (int64_t e = 0; e < saved_counts.numel(); ++e) {
    if (e >= static_cast<int64_t>(epoch_samples.size())) epoch_samples.push_back(0);
    epoch_samples[e] = saved_counts[e].item<int64_t>();
  }
  if (!device.is_cpu()) move_optimizer_state(optimizer, device);
  return loaded->path;
}

std::string Checkpoints::save(const Position& at, const std::vector<int64_t>& epoch_samples,
                              const dtrain::ProcessGroup& group) {
  if (!checkpointing || (group.rank() != 0 && !sdp)) return std::string();
  checkpoint_state.step = at.steps;
  checkpoint_state.tensors["epoch_samples"] = torch::tensor(epoch_samples, torch::kInt64);
  checkpoint_state.values["model"] = flags.model;
  checkpoint_state.values["seed"] = std::to_string(flags.seed);
  if (sdp) return save_sharded(*sharded_checkpointer, *sdp, checkpoint_state);
  return checkpointer->save(checkpoint_state);
}

void Checkpoints::forget_group() {
  if (checkpointer)
    checkpointer = std::make_unique<dtrain::Checkpointer>(checkpoint_options(flags));
  pg.reset();
}

void Checkpoints::wait() {
  if (checkpointer) checkpointer->wait();
}

KillAt kill_at_step_from_env() {
  const char* value = std::getenv("DTRAIN_TEST_KILL_AT_STEP");
  if (value == nullptr || *value == '\0') return {};
  long long signal = SIGKILL;
  int used = 0;
  long long rank = -1, step = -1;
  int fields = std::sscanf(value, "%lld:%lld%n:%lld%n", &rank, &step, &used, &signal, &used);
  if (fields < 2 || value[used] != '\0' || rank < 0 || step < 1 || signal < 1 || signal > 64) {
    throw dtrain::UsageError(std::string("train_fashion_mnist: DTRAIN_TEST_KILL_AT_STEP '") +
                             value +
                             "': expected RANK:STEP[:SIGNAL], e.g. 1:120 (a test hook; unset it)");
  }
  return {rank, step, static_cast<int>(signal)};
}

}  // namespace trainer
