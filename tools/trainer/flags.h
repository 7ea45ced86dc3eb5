// The trainer's flags: what each one means, its default, and parse_flags, which reads them from the
// command line and checks that they go together.
#pragma once

#include <cstdint>
#include <string>

namespace trainer {

struct Flags {
  std::string model = "mlp";  // mlp or cnn (models.h)
  // ddp: one process per rank (under `dtrain run`); dp: replicas in one process; mp: stages in one
  // process; pipeline: data-parallel pipelines of --stages processes; zero: sharded DDP.
  std::string strategy = "ddp";
  int64_t devices = 2;  // dp: replicas (CPU threads) in this process; mp: stages (CPU threads)
  int64_t stages = 2;   // pipeline: stages per pipeline; the job runs world / stages pipelines
  int64_t micro_batches = 4;      // mp, pipeline: micro-batches per step
  std::string schedule = "1f1b";  // mp, pipeline: gpipe, 1f1b, interleaved or zbh1
  int64_t virtual_stages = 1;     // chunks per stage (interleaved schedule)
  int64_t epochs = 1;
  // Rows one data-parallel rank reads per step, as a PyTorch DataLoader's batch_size: the global
  // batch is batch_size x data-parallel ranks (Note [Batch size per data-parallel rank]).
  int64_t batch_size = 32;
  // Gradient accumulation: a step reads grad_accum x batch_size rows per rank and runs them in
  // grad_accum passes whose gradients add up, reduced over the ranks only in the last pass.
  int64_t grad_accum = 1;
  double lr = 0.02;
  int64_t seed = 0;
  // Fashion-MNIST's folder; empty: datasets::default_fashion_mnist_dir()
  // ($DTRAIN_FASHION_MNIST_DIR, else Debian's).
  std::string data;
  std::string checkpoint_dir;    // empty: no checkpoints
  bool resume = false;           // continue from checkpoint_dir's checkpoint
  int64_t checkpoint_every = 0;  // also checkpoint every N steps (0: only at the end of each epoch)
  int64_t keep_checkpoints = 3;  // the newest K checkpoints stay on disk
  bool async_checkpoints =
      false;              // write checkpoints on a background thread while training goes on
  int64_t max_steps = 0;  // stop after N steps in all (0: no limit); for tests of resumption
  // rank 0 prints "step S loss L" after every N-th step (0: never): a per-step marker for
  // benchmarks of restarts (the progress bar moves every 10% of an epoch)
  int64_t log_every = 0;
  // zero: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters
  int64_t zero_stage = 1;
  int64_t spawn = 0;  // start N ranks of this program itself (dtrain::spawn), no launcher needed
  // cpu, cuda (ddp: cuda:LOCAL_RANK; dp: --devices GPUs), auto: cuda when this process sees a GPU.
  std::string device = "auto";
  std::string amp;  // "", bf16 (autocast), fp16 (autocast + GradScaler; CUDA only)
  // ddp on one GPU, one rank, no --amp: the whole step captured in a CUDA graph and replayed
  // (dtrain/cuda_graph.h): one launch a step instead of dozens.
  bool cuda_graph = false;
};

// Reads the flags from argv. --help prints them and exits 0; an unknown flag, a missing or bad
// value, or flags that do not go together throw dtrain::UsageError, one line naming the flag, the
// value and what is accepted (exit code 2 under dtrain::run_main).
Flags parse_flags(int argc, char** argv);

}  // namespace trainer
