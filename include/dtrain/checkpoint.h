// dtrain's checkpoints: the state of a training run (model, optimizer, sampler position, step,
// torch's CPU random generator, and whatever else the program adds) saved atomically into numbered
// files of one folder, each guarded by a checksum, the newest K kept, optionally written by a
// background thread while training goes on.
//
//   dtrain::CheckpointOptions options;
//   options.dir = "ckpt";
//   options.async = true;                    // the loop waits only for a copy in memory
//   dtrain::Checkpointer checkpointer(options, pg);  // pg: loads read the folder on rank 0 only
//   dtrain::TrainingState state{net.get(), &optimizer, &sampler};  // net: a TORCH_MODULE holder
//   if (auto loaded = checkpointer.load_latest(state)) start_step = state.step;
//   for (...) {
//     ...; state.step = step;
//     if (step % 100 == 0 && pg->rank() == 0) checkpointer.save(state);
//   }
//
// Note [Checkpoint file]: <dir>/checkpoint-<step>.ckpt is a torch.save file that PyTorch opens
// with torch.load(path, weights_only=True): a dict of plain state dicts, each what Python's own
// object would give:
//   "model"        name -> tensor (named_parameters, then named_buffers): model.load_state_dict
//   "optimizer"    {"state", "param_groups"} as optimizer.state_dict() (SGD, Adam, AdamW, Adagrad,
//                  RMSprop; another optimizer's LibTorch archive is "optimizer_archive", bytes)
//   "sampler"      {"epoch", "samples_consumed"} (the samples of all ranks together)
//   "rng"          torch.get_rng_state()'s tensor;  "grad_scaler"  GradScaler.state_dict()
//   "step", "format" (2), "tensors" and "values" (TrainingState's extras)
// Entries the state had no part for are absent. Its integrity check is inside: the zip's comment
// holds a CRC-32 of every byte before it. Load reads the same from a file PyTorch wrote with
// torch.save (state dicts as they are; a missing "step" is the file name's), checking each
// record against the zip's own CRC-32s, and still reads the framed files of dtrain's format 1.
// A file is written as a hidden temporary, fsynced, renamed into place and the folder fsynced, so
// a crash leaves either the old set of files or the new one, never a half-written checkpoint under
// a checkpoint's name; the checksums catch the rest (a disk that tore a write, a file truncated or
// edited by hand): such a file is named in a warning and the one before it loaded.
//
// Loading state saved at another world size works as long as the state is replicated (the same on
// every rank, as in DDP): the sampler's saved position counts the samples of all ranks together and
// redistributes over the new ranks (see DistributedSampler::load_state).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain {

class DistributedSampler;
class ProcessGroup;
namespace amp {
class GradScaler;
}

struct CheckpointOptions {
  // The folder of the checkpoint files; created on the first save if missing.
  std::string dir;
  // How many of the newest complete checkpoints to keep (>= 1); older ones are deleted after each
  // successful save. Keep at least 2 so that a newest file found corrupt has a predecessor.
  int keep_last = 3;
  // save() copies the state in memory and returns; a background thread writes the file. A new save
  // (and load, wait and the destructor) first waits for the one in flight.
  bool async = false;
  // Files are <dir>/<prefix>-<step>.ckpt.
  std::string prefix = "checkpoint";
};

// What a checkpoint holds. The pointers are not owned; null ones are neither saved nor loaded.
// Every rank that loads must describe the same model and optimizer (parameter names and shapes) as
// the rank that saved.
struct TrainingState {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  DistributedSampler* sampler = nullptr;  // its position (epoch, samples consumed by all ranks)
  // Its scale and growth count (dtrain/amp.h; a disabled scaler saves nothing). A checkpoint saved
  // without one leaves the scaler as it is.
  amp::GradScaler* grad_scaler = nullptr;
  int64_t step = 0;                             // the caller's step count; names the file
  bool rng = true;                              // torch's default CPU generator (CUDA: not yet)
  std::map<std::string, at::Tensor> tensors{};  // the caller's extra tensors
  std::map<std::string, std::string> values{};  // the caller's small key/value extras
};

// What load_latest found.
struct LoadedCheckpoint {
  std::string path;  // the file the state came from
  int64_t step = 0;
  // Newer files that were skipped because they are torn or corrupt (each also named in a warning).
  std::vector<std::string> skipped;
};

// Saves and finds checkpoints in one folder. Usually only rank 0 of a data-parallel job saves (the
// state is replicated); every rank loads (from a shared folder, or through rank 0 with a group).
// Not thread-safe: call it from one thread (the training loop).
class Checkpointer {
 public:
  // `group`: the ranks that load together; with one, load_latest reads the folder on the group's
  // rank 0 only and broadcasts what it read (for nodes without a shared file system). Null: every
  // process reads the folder itself. save() never communicates. Throws UsageError if options.dir
  // is empty or keep_last < 1.
  explicit Checkpointer(CheckpointOptions options, std::shared_ptr<ProcessGroup> group = nullptr);
  // Waits for a save in flight; logs (never throws) if it failed.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Writes state as checkpoint state.step (replacing a file of the same step) and deletes all but
  // the newest keep_last. Synchronous: returns once the file and its folder entry are on disk.
  // Asynchronous: first waits for the previous save (rethrowing its error), then copies the tensors
  // and returns; the writing happens on a background thread. Returns the file's path. Throws
  // UsageError naming the file and the cause when it cannot be written (no space, no permission).
  std::string save(const TrainingState& state);

  // Blocks until the save in flight (if any) is on disk; rethrows its error.
  void wait();

  // Loads the newest checkpoint whose checksum holds into state (the model's and optimizer's
  // tensors in place, the sampler's position, step, the RNG, tensors and values), skipping and
  // warning about newer corrupt ones. Returns nullopt when the folder has no intact checkpoint.
  // With a group, only its rank 0 reads the folder and broadcasts the bytes; every rank of the
  // group must call it, and it blocks up to the group's timeout on rank 0's reading. Throws
  // UsageError naming the file when the checkpoint does not fit the state (a parameter missing or
  // of another shape, another optimizer).
  std::optional<LoadedCheckpoint> load_latest(TrainingState& state);

  // The checkpoint files of the folder, oldest first (intact or not: only loading checks).
  std::vector<std::string> list() const;

  const CheckpointOptions& options() const { return options_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  struct Impl;
  CheckpointOptions options_;
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
