// train_fashion_mnist: dtrain's main job, and the harness its tests and benchmarks run. It trains
// an MLP or a CNN on Fashion-MNIST with each of dtrain's strategies:
//
//   dtrain run --nproc-per-node 2 -- build/bin/train_fashion_mnist --epochs 1       DDP
//   build/bin/train_fashion_mnist --strategy dp --devices 2                          DataParallel
//   build/bin/train_fashion_mnist --strategy mp --devices 2 --micro-batches 4        model parallel
//   dtrain run --nproc-per-node 4 -- build/bin/train_fashion_mnist --strategy pipeline --stages 2
//                                                   2 data-parallel pipelines of 2 stages
//   dtrain run --nproc-per-node 2 -- build/bin/train_fashion_mnist --strategy zero --zero-stage 3
//                                                   ZeRO: sharded state, sharded checkpoints
//
// Rank 0 shows progress and test accuracy per epoch; the last line of output is one JSON object.
// --batch-size (default 32) is per data-parallel rank, as in PyTorch: the main job's 2 ranks train
// on a global batch of 64, and any number of ranks trains (Note [Batch size per data-parallel
// rank], strategies.cpp).
//
// Checkpoints (--checkpoint-dir, checkpoints.h): at the end of every epoch, every
// --checkpoint-every steps, and on SIGTERM. A run restarted by its launcher
// (TORCHELASTIC_RESTART_COUNT > 0) or requeued by Slurm (SLURM_RESTART_COUNT > 0) resumes by
// itself from the newest intact checkpoint; a first run never overwrites a folder that holds
// checkpoints unless told --resume. --strategy zero saves sharded checkpoints, which resume at any
// world size and --zero-stage.
//
// Preemption: on SIGTERM (what `dtrain run` and torchrun send their workers when stopping them, and
// Slurm its tasks when it cancels, requeues or preempts a job) the ranks finish the current step,
// agree on it, rank 0 saves a checkpoint, and every rank exits with code 143 (128 + SIGTERM: the
// job is not finished, so no script may take it for success).
//
// The files: flags (the command line), models (the two networks), strategies (the five ways to
// train them), checkpoints (saving, resuming, preemption, the fault-injection hook), train (the
// loop and the final JSON line).
#include <cstdlib>

#include "dtrain/errors.h"
#include "dtrain/spawn.h"
#include "flags.h"
#include "train.h"

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    const trainer::Flags flags = trainer::parse_flags(argc, argv);
    // --spawn N: the program starts its own N ranks (re-executed, each reaching this spawn() as a
    // worker and training there) instead of being started by `dtrain run`.
    if (flags.spawn > 0) {
      dtrain::spawn(static_cast<int>(flags.spawn), [&](int) {
        if (int code = trainer::train(flags); code != 0) std::exit(code);
      });
      return 0;
    }
    return trainer::train(flags);
  });
}
