// The trainer's checkpoints (--checkpoint-dir) and the faults they recover from: the folder's
// checks, loading and saving, the launcher's restart count, the agreed stop on SIGTERM, and the
// fault-injection hook of the tests.
//
// Checkpoints go through dtrain::Checkpointer: rank 0 saves the replicated state (atomic,
// checksummed files, the newest --keep-checkpoints kept); every rank loads through rank 0's
// broadcast. --strategy zero saves through dtrain::ShardedCheckpointer: every rank writes and reads
// its own shards, which resume at any world size and --zero-stage.
#pragma once

#include <torch/torch.h>

#include <csignal>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/sharded.h"
#include "dtrain/sharded_checkpoint.h"
#include "flags.h"

namespace trainer {

// Where training stands: what a checkpoint records and a resumed run starts from.
struct Position {
  int64_t epoch = 0;
  int64_t samples_consumed = 0;  // in this epoch, over all ranks
  int64_t steps = 0;             // optimizer steps taken in all
};

// How many times this run was started again, 0 in the first attempt: the larger of
// TORCHELASTIC_RESTART_COUNT (`dtrain run` and torchrun restarting their workers) and
// SLURM_RESTART_COUNT (Slurm requeueing the job: `scontrol requeue`, preemption with
// PreemptMode=REQUEUE, a node failure): dtrain::LaunchInfo::restarts. Above 0, the run resumes from
// its checkpoint by itself.
int64_t restart_count();

// Checked on every rank before anything starts, so that all ranks fail the same way, at once, and
// existing checkpoints are never overwritten by a run that did not ask to continue from them. A
// restart by the launcher continues from them by itself: they are its own first attempt's.
void check_checkpoint_dir(const Flags& flags, int rank, bool restarted);

// The checkpoints of one run, with the parts of the training state they hold: the model (a
// ShardedDataParallel's shards with --strategy zero), the optimizer, the sampler's position, the
// loss scaler, the step and how many samples of each epoch are in the model.
struct Checkpoints {
  // sdp: --strategy zero's wrapper (sharded checkpoints), else null.
  Checkpoints(const Flags& flags, const std::shared_ptr<dtrain::ProcessGroup>& pg,
              torch::nn::Module* model, dtrain::ShardedDataParallelBase* sdp,
              torch::optim::SGD& optimizer, dtrain::DistributedSampler& sampler,
              dtrain::amp::GradScaler& scaler);

  // With --resume, or in a restart by the launcher: loads the newest intact checkpoint (moving the
  // optimizer's state to `device`), sets `at` and `epoch_samples` to what it holds and returns its
  // path. Empty when there is nothing to load; a --resume that finds nothing, or a checkpoint of
  // another --model or --seed, is a UsageError.
  std::string resume(int64_t restarts, Position& at, std::vector<int64_t>& epoch_samples,
                     const c10::Device& device);
  // Saves the state after at.steps steps, with the sampler where it stands: on `group`'s rank 0
  // only (the state is replicated; every rank its shards with --strategy zero). `group`: the ranks
  // that train together now, pg, or in place the current generation's. Asynchronous with
  // --async-checkpoints. Returns the checkpoint's path; empty on a rank that saves nothing.
  std::string save(const Position& at, const std::vector<int64_t>& epoch_samples,
                   const dtrain::ProcessGroup& group);
  // In-place recovery: after resume(), keeps no group (saving never communicates), so that the
  // first generation's group can be released when it fails (Note [In-place recovery]).
  void forget_group();
  // Blocks until an asynchronous save is on disk.
  void wait();

  const Flags& flags;
  std::shared_ptr<dtrain::ProcessGroup> pg;
  dtrain::ShardedDataParallelBase* sdp;
  torch::optim::SGD& optimizer;
  dtrain::DistributedSampler& sampler;
  dtrain::amp::GradScaler& scaler;
  const bool checkpointing;  // --checkpoint-dir given: without it nothing is loaded or saved
  dtrain::TrainingState checkpoint_state;
  std::unique_ptr<dtrain::Checkpointer> checkpointer;
  std::unique_ptr<dtrain::ShardedCheckpointer> sharded_checkpointer;  // zero: sharded checkpoints
};

// Test hook for the fault-injection tests: DTRAIN_TEST_KILL_AT_STEP=RANK:STEP[:SIGNAL] makes that
// rank send itself SIGNAL (default 9, SIGKILL) right after optimizer step STEP of the first attempt
// (restart_count() 0): a worker dying mid-epoch, or (15) preempted alone.
struct KillAt {
  int64_t rank = -1, step = -1;
  int signal = SIGKILL;
};
KillAt kill_at_step_from_env();

}  // namespace trainer
