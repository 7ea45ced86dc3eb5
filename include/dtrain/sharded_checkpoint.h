// Sharded checkpoints: every rank of a sharded (ZeRO / FSDP-style) run writes its own shards of
// the flat parameter buffers and of their optimizer state, in parallel, plus one metadata record
// for the whole checkpoint; loading reshards, so a checkpoint saved at N ranks (and any stage)
// loads at M ranks (and any stage), into a plain module on one device, or from one.
//
//   dtrain::ShardedCheckpointer checkpointer(options, pg);        // options as Checkpointer's
//   dtrain::ShardedTrainingState state{sdp->flat_shards(), sdp->stage(), &optimizer, &sampler};
//   if (checkpointer.load_latest(state)) { sdp->shards_changed(); start_step = state.step; }
//   for (...) {  // every rank saves its own shards
//     ...; state.step = step;
//     if (step % 100 == 0) checkpointer.save(state);
//   }
//
// Note [Sharded checkpoint]: checkpoint <step> is the folder <dir>/<prefix>-<step>/ holding
//   rank-<r>-of-<N>.ckpt   one per saving rank r of N: its shard of every flat buffer, the
//                          optimizer state of those shards, and its sampler position, step, RNG
//                          and extras;
//   metadata.ckpt          JSON: world size, stage, step, the save's id, every unit's parameters
//                          (name, shape, offset in the flat buffer), dtype and each rank's range;
// each framed, checksummed and written atomically as a replicated checkpoint file is (Note
// [Checkpoint file] in dtrain/checkpoint.h). The ranks write their files at the same time; once all
// have, rank 0 writes the metadata: it is the commit record. A checkpoint is complete when the
// metadata and all N rank files are there, intact, and carry the metadata's save id. So a crash
// between ranks' writes leaves a folder without metadata (skipped, pruned later) or, when a step
// was saved again, new rank files beside the old metadata (their ids differ: skipped), never a mix
// that loads. The ranks read the files they need themselves: the folder must be shared by all
// ranks (one host, or a shared file system).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/checkpoint.h"
#include "dtrain/sharded.h"

namespace dtrain {

// What a sharded checkpoint holds for one rank. The pointers are not owned; null ones are neither
// saved nor loaded.
struct ShardedTrainingState {
  // This rank's flat shards (ShardedDataParallel::flat_shards()). Loading overwrites each shard
  // tensor in place; then call ShardedDataParallel::shards_changed().
  std::vector<FlatShard> shards;
  // The ZeRO stage, recorded in the metadata (a checkpoint loads at any stage).
  int stage = 0;
  // Built over the shard tensors: SGD (momentum_buffer), Adam or AdamW (step, exp_avg, exp_avg_sq,
  // max_exp_avg_sq). Another optimizer type is a UsageError. Only the state is saved, not the
  // hyperparameters (the program builds the optimizer with them).
  torch::optim::Optimizer* optimizer = nullptr;
  DistributedSampler* sampler = nullptr;      // its position (the same on every rank)
  int64_t step = 0;                           // names the checkpoint
  bool rng = true;                            // torch's default CPU generator, per rank
  std::map<std::string, at::Tensor> tensors;  // the caller's extras, per rank
  std::map<std::string, std::string> values;
};

// Saves and finds sharded checkpoints in one folder (Note [Sharded checkpoint]).
class ShardedCheckpointer {
 public:
  // group: the ranks that hold the shards (null: one process holding every shard). Throws
  // UsageError if options.dir is empty, keep_last < 1, or options.async is set (sharded saves are
  // synchronous: each rank writes only 1/N of the state, in parallel).
  explicit ShardedCheckpointer(CheckpointOptions options,
                               std::shared_ptr<ProcessGroup> group = nullptr);

  // Collective: every rank calls it with its own state and the same step. Each rank writes its
  // file, the ranks agree that all succeeded, rank 0 writes the metadata and deletes all but the
  // newest keep_last complete checkpoints; returns (on every rank) the checkpoint's folder once it
  // is complete on disk. Throws UsageError on every rank, naming the rank and file that could not
  // be written; the previous checkpoints stay loadable. Blocks up to the group's timeout on the
  // others.
  std::string save(const ShardedTrainingState& state);

  // Collective: loads the newest complete checkpoint into state, resharding from the world size and
  // units it was saved with to state's: each rank reads the ranges of every parameter that its
  // shards now hold from whichever rank files hold them. A damaged or missing rank file or metadata
  // makes its checkpoint skipped with a warning naming the file; the one before it is tried.
  // Returns nullopt when there is no complete checkpoint. The RNG and extras come from the saving
  // rank of the same number (rank 0's for ranks beyond the saved world). Throws UsageError when the
  // checkpoint does not fit (a parameter missing or of another shape, another optimizer type).
  std::optional<LoadedCheckpoint> load_latest(ShardedTrainingState& state);

  // The checkpoint folders of options.dir, oldest first (complete or not: only loading checks).
  std::vector<std::string> list() const;

  const CheckpointOptions& options() const { return options_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  CheckpointOptions options_;
  std::shared_ptr<ProcessGroup> group_;
};

// Sharded -> full: loads the newest complete sharded checkpoint of options.dir into a plain module
// (every parameter by its name; buffers are not part of sharded checkpoints) and, if given, a
// plain SGD/Adam/AdamW optimizer over the module's parameters, plus sampler position, step, RNG and
// extras of rank 0; one process, no group. Then Checkpointer::save(full) writes it as a replicated
// checkpoint. Returns nullopt when there is no complete checkpoint; throws UsageError as
// load_latest.
std::optional<LoadedCheckpoint> load_sharded_as_full(const CheckpointOptions& options,
                                                     TrainingState& full);

// Full -> sharded: copies the full state (a plain module, its optimizer's state, sampler position,
// step, extras; e.g. from Checkpointer::load_latest) into this rank's shards and their optimizer
// state, so that a replicated checkpoint can start a sharded run. Every rank calls it with the same
// full state; no communication. Throws UsageError when a shard's parameter is missing from the
// module or has another shape, or the optimizers are of different types.
void copy_full_into_shards(const TrainingState& full, ShardedTrainingState& sharded);

}  // namespace dtrain
