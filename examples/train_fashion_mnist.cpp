// Training on Fashion-MNIST with each of dtrain's strategies: dtrain's main job and an example of a
// user's program.
//   dtrain run --nproc-per-node 2 -- build/bin/train_fashion_mnist --epochs 1            (DDP)
//   build/bin/train_fashion_mnist --strategy dp --devices 2 (DataParallel)
//   build/bin/train_fashion_mnist --strategy mp --devices 2 --micro-batches 4              (model
//   parallel) dtrain run --nproc-per-node 4 -- build/bin/train_fashion_mnist --strategy pipeline
//   --stages 2
//                                                                    (2 data-parallel pipelines of
//                                                                    2 stages)
//   dtrain run --nproc-per-node 2 -- build/bin/train_fashion_mnist --strategy zero --zero-stage 3
//                                                                    (ZeRO: sharded state; sharded
//                                                                    checkpoints, see below)
// Rank 0 shows progress and test accuracy per epoch; the last line of output is one JSON object.
// --batch-size (default 32) is per data-parallel rank, as in PyTorch: the main job's 2 ranks train
// on a global batch of 64, and any number of ranks trains (see Note [Batch size per data-parallel
// rank]).
//
// Checkpoints (--checkpoint-dir, through dtrain::Checkpointer): at the end of every epoch, every
// --checkpoint-every steps, and on SIGTERM. A run restarted by its launcher
// (TORCHELASTIC_RESTART_COUNT > 0) resumes by itself from the newest intact checkpoint; a first run
// never overwrites a folder that holds checkpoints unless told --resume. --strategy zero saves
// sharded checkpoints (dtrain::ShardedCheckpointer: every rank writes its shards), which resume at
// any world size and --zero-stage.
// Preemption: on SIGTERM (what `dtrain run` and torchrun send their workers when stopping them) the
// ranks finish the current step, agree on it, rank 0 saves a checkpoint, and every rank exits with
// code 143 (128 + SIGTERM: the job is not finished, so no script may take it for success).
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/dp.h"
#include "dtrain/pipeline.h"
#include "dtrain/sharded.h"
#include "dtrain/sharded_checkpoint.h"
#include "dtrain/spawn.h"

namespace {

using Clock = std::chrono::steady_clock;

const char* kUsage =
    "usage: train_fashion_mnist [--model mlp|cnn] [--strategy ddp|dp|mp|pipeline|zero]\n"
    "                           [--devices N (dp, mp)] [--zero-stage 1|2|3 (zero)]\n"
    "                           [--stages P (pipeline)] [--micro-batches M (mp, pipeline)]\n"
    "                           [--schedule gpipe|1f1b|interleaved] [--virtual-stages V "
    "(interleaved)]\n"
    "                           [--epochs N] [--batch-size N (per data-parallel rank)]\n"
    "                           [--lr X] [--seed N] [--data DIR] [--checkpoint-dir DIR] "
    "[--resume]\n"
    "                           [--checkpoint-every STEPS] [--keep-checkpoints K] "
    "[--async-checkpoints]\n"
    "                           [--max-steps N] [--log-every N] [--spawn N (start N DDP ranks itself)]\n"
    "                           [--device cpu|cuda|auto] [--amp bf16|fp16 (ddp, dp)]";

struct Flags {
  std::string model = "mlp";
  std::string strategy = "ddp";  // ddp: one process per rank (under `dtrain run`); dp: one process
  int64_t devices = 2;  // dp: replicas (CPU threads) in this process; mp: stages (CPU threads)
  int64_t stages = 2;   // pipeline: stages per pipeline; the job runs world / stages pipelines
  int64_t micro_batches = 4;      // mp, pipeline: micro-batches per step
  std::string schedule = "1f1b";  // mp, pipeline
  int64_t virtual_stages = 1;     // chunks per stage (interleaved schedule)
  int64_t epochs = 1;
  // Rows one data-parallel rank reads per step, as a PyTorch DataLoader's batch_size: the global
  // batch is batch_size x data-parallel ranks (Note [Batch size per data-parallel rank]).
  int64_t batch_size = 32;
  double lr = 0.02;
  int64_t seed = 0;
  std::string data = dtrain::default_fashion_mnist_dir();
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
  int64_t spawn = 0;      // start N ranks of this program itself (dtrain::spawn), no launcher needed
  // cpu, cuda (ddp: cuda:LOCAL_RANK; dp: --devices GPUs), auto: cuda when this process sees a GPU.
  std::string device = "auto";
  std::string amp;  // "", bf16 (autocast), fp16 (autocast + GradScaler; CUDA only)
};

[[noreturn]] void bad_flag(const std::string& flag, const std::string& value,
                           const std::string& accepted) {
  throw dtrain::UsageError("train_fashion_mnist: " + flag + " '" + value + "': expected " +
                           accepted);
}

int64_t parse_int(const std::string& flag, const std::string& value, int64_t min,
                  int64_t max = int64_t{1} << 40) {
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE || parsed < min || parsed > max) {
    bad_flag(flag, value, "an integer in " + std::to_string(min) + ".." + std::to_string(max));
  }
  return parsed;
}

const char* const kValueFlags[] = {"--model",          "--strategy",
                                   "--devices",        "--stages",
                                   "--micro-batches",  "--schedule",
                                   "--virtual-stages", "--epochs",
                                   "--batch-size",     "--lr",
                                   "--seed",           "--data",
                                   "--checkpoint-dir", "--checkpoint-every",
                                   "--max-steps",      "--keep-checkpoints", "--log-every",
                                   "--zero-stage", "--spawn", "--device", "--amp"};

Flags parse_flags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage << std::endl;
      std::exit(0);
    }
    if (flag == "--resume") {
      flags.resume = true;
      continue;
    }
    if (flag == "--async-checkpoints") {
      flags.async_checkpoints = true;
      continue;
    }
    if (std::find(std::begin(kValueFlags), std::end(kValueFlags), flag) == std::end(kValueFlags)) {
      throw dtrain::UsageError("train_fashion_mnist: unknown flag '" + flag + "'; see --help");
    }
    if (i + 1 >= argc)
      throw dtrain::UsageError("train_fashion_mnist: " + flag + ": missing its value; see --help");
    std::string value = argv[++i];
    if (flag == "--model") {
      if (value != "mlp" && value != "cnn") bad_flag(flag, value, "mlp or cnn");
      flags.model = value;
    } else if (flag == "--strategy") {
      if (value != "ddp" && value != "dp" && value != "mp" && value != "pipeline" &&
          value != "zero") {
        bad_flag(flag, value, "ddp, dp, mp, pipeline or zero");
      }
      flags.strategy = value;
    } else if (flag == "--devices") {
      flags.devices = parse_int(flag, value, 1, 1024);
    } else if (flag == "--stages") {
      flags.stages = parse_int(flag, value, 1, 1024);
    } else if (flag == "--micro-batches") {
      flags.micro_batches = parse_int(flag, value, 1, 1 << 20);
    } else if (flag == "--schedule") {
      if (value != "gpipe" && value != "1f1b" && value != "interleaved")
        bad_flag(flag, value, "gpipe, 1f1b or interleaved");
      flags.schedule = value;
    } else if (flag == "--virtual-stages") {
      flags.virtual_stages = parse_int(flag, value, 1, 64);
    } else if (flag == "--epochs") {
      flags.epochs = parse_int(flag, value, 1);
    } else if (flag == "--batch-size") {
      flags.batch_size = parse_int(flag, value, 1);
    } else if (flag == "--lr") {
      char* end = nullptr;
      flags.lr = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(flags.lr > 0) || !std::isfinite(flags.lr)) {
        bad_flag(flag, value, "a positive finite number");
      }
    } else if (flag == "--seed") {
      flags.seed = parse_int(flag, value, 0);
    } else if (flag == "--data") {
      flags.data = value;
    } else if (flag == "--checkpoint-dir") {
      flags.checkpoint_dir = value;
    } else if (flag == "--checkpoint-every") {
      flags.checkpoint_every = parse_int(flag, value, 0);
    } else if (flag == "--keep-checkpoints") {
      flags.keep_checkpoints = parse_int(flag, value, 1, 1 << 20);
    } else if (flag == "--max-steps") {
      flags.max_steps = parse_int(flag, value, 0);
    } else if (flag == "--log-every") {
      flags.log_every = parse_int(flag, value, 0);
    } else if (flag == "--zero-stage") {
      flags.zero_stage = parse_int(flag, value, 1, 3);
    } else if (flag == "--spawn") {
      flags.spawn = parse_int(flag, value, 1, 1024);
    } else if (flag == "--device") {
      if (value != "cpu" && value != "cuda" && value != "auto")
        bad_flag(flag, value, "cpu, cuda or auto");
      flags.device = value;
    } else if (flag == "--amp") {
      if (value != "bf16" && value != "fp16") bad_flag(flag, value, "bf16 or fp16");
      flags.amp = value;
    } else {
      bad_flag(flag, value, "a known flag. " + std::string(kUsage));
    }
  }
  if (flags.virtual_stages > 1 && flags.schedule != "interleaved") {
    throw dtrain::UsageError(
        "train_fashion_mnist: --virtual-stages " + std::to_string(flags.virtual_stages) +
        " needs --schedule interleaved (gpipe and 1f1b run one chunk per stage)");
  }
  if (flags.strategy == "pipeline" && !flags.checkpoint_dir.empty()) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --checkpoint-dir is not supported with --strategy pipeline yet "
        "(each stage holds its own optimizer state); use ddp, dp or mp for checkpointed runs");
  }
  if (flags.strategy == "zero" && flags.async_checkpoints) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --async-checkpoints is not supported with --strategy zero (every "
        "rank writes its own shards, synchronously); drop it");
  }
  if (flags.spawn > 0 && (flags.strategy == "dp" || flags.strategy == "mp")) {
    throw dtrain::UsageError("train_fashion_mnist: --spawn " + std::to_string(flags.spawn) + " with --strategy " +
                             flags.strategy + ": " + flags.strategy +
                             " runs in one process (use --devices N); --spawn starts ranks for ddp, zero or "
                             "pipeline");
  }
  if (!flags.amp.empty() && flags.strategy != "ddp" && flags.strategy != "dp") {
    throw dtrain::UsageError("train_fashion_mnist: --amp " + flags.amp + " with --strategy " +
                             flags.strategy + ": mixed precision is wired for ddp and dp only");
  }
  if (flags.resume && flags.checkpoint_dir.empty()) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --resume needs --checkpoint-dir DIR (where to resume from)");
  }
  return flags;
}

// The two models, in one Cloneable module so that DataParallel can make replicas of either.
//   mlp: 784-256-128-10 with ReLU.   cnn: two 5x5 conv+pool stages (16, 32 channels), then 10
//   outputs.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  explicit NetImpl(std::string kind) : kind(std::move(kind)) { reset(); }
  void reset() override {
    if (kind == "cnn") {
      conv1 = register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5).padding(2)));
      conv2 = register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5).padding(2)));
      fc1 = register_module("fc", torch::nn::Linear(32 * 7 * 7, 10));
    } else {
      fc1 = register_module("fc1", torch::nn::Linear(784, 256));
      fc2 = register_module("fc2", torch::nn::Linear(256, 128));
      fc3 = register_module("fc3", torch::nn::Linear(128, 10));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    if (kind == "cnn") {
      x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
      x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
      return fc1->forward(x.flatten(1));
    }
    x = torch::relu(fc1->forward(x.flatten(1)));
    x = torch::relu(fc2->forward(x));
    return fc3->forward(x);
  }
  std::string kind;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// The same two models as a torch::nn::Sequential, for the strategies that cut a model into stages.
// Layers are made in the same order as NetImpl's, so a seed gives both forms the same initial
// weights.
torch::nn::Sequential make_sequential(const std::string& kind) {
  namespace nn = torch::nn;
  if (kind == "cnn") {
    nn::Conv2d conv1(nn::Conv2dOptions(1, 16, 5).padding(2));
    nn::Conv2d conv2(nn::Conv2dOptions(16, 32, 5).padding(2));
    nn::Linear fc(32 * 7 * 7, 10);
    return nn::Sequential(conv1, nn::ReLU(), nn::MaxPool2d(2), conv2, nn::ReLU(), nn::MaxPool2d(2),
                          nn::Flatten(), fc);
  }
  nn::Linear fc1(784, 256), fc2(256, 128), fc3(128, 10);
  return nn::Sequential(nn::Flatten(), fc1, nn::ReLU(), fc2, nn::ReLU(), fc3);
}

// --device: where this process trains, decided before the process group starts so that a wrong flag
// is one line on every rank at once. ddp: cuda:LOCAL_RANK (modulo the GPUs this process sees: ranks
// that share a GPU need DTRAIN_CUDA_BACKEND=gloo); dp: --devices replicas dealt round-robin over
// the GPUs (two on one GPU overlap through their own streams); mp and pipeline stay on the CPU for
// now. auto: the GPUs when there are any and (ddp) one for each rank of this node, else the CPU.
struct Placement {
  c10::Device device{c10::kCPU};        // the module's (dp: the first replica's)
  std::vector<c10::Device> dp_devices;  // dp on GPUs: one per replica; empty: CPU threads
};

Placement place(const Flags& flags, const dtrain::LaunchInfo& launch) {
  const bool cuda = torch::cuda::is_available();
  const bool wired = flags.strategy == "ddp" || flags.strategy == "dp";
  if (flags.device == "cuda" && !cuda) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --device cuda: this process sees no CUDA device (LibTorch built "
        "without CUDA, no GPU, or CUDA_VISIBLE_DEVICES empty); use --device cpu or auto");
  }
  if (flags.device == "cuda" && !wired) {
    throw dtrain::UsageError("train_fashion_mnist: --device cuda with --strategy " +
                             flags.strategy + ": not wired yet (ddp and dp are); use --device cpu");
  }
  Placement placement;
  const int64_t gpus = cuda ? torch::cuda::device_count() : 0;
  // auto takes the GPUs only when every rank of this node gets its own (ranks sharing one would
  // need DTRAIN_CUDA_BACKEND=gloo: asked for with --device cuda, never chosen behind the user's
  // back).
  const bool fits = flags.strategy == "dp" || launch.local_world_size <= gpus;
  if (cuda && wired && (flags.device == "cuda" || (flags.device == "auto" && fits))) {
    if (flags.strategy == "dp") {
      for (int64_t i = 0; i < flags.devices; ++i) {
        placement.dp_devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i % gpus));
      }
      placement.device = placement.dp_devices[0];
    } else {
      placement.device =
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank % gpus));
    }
  }
  if (flags.amp == "fp16" && placement.device.is_cpu()) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --amp fp16 needs a CUDA device (float16 autocast with loss scaling) "
        "but this run trains on the CPU (--device auto picks it without a GPU for each rank of a "
        "node); use --amp bf16 there");
  }
  return placement;
}

// A batch's rows on their way to `device`. On a GPU they are gathered straight into pinned
// (page-locked) host memory, whose copy to the device is asynchronous and overlaps the GPU's work;
// `stay_on_host`: DataParallel scatters the pinned batch to its replicas itself.
torch::Tensor batch_rows(const torch::Tensor& data, const torch::Tensor& rows,
                         const c10::Device& device, bool stay_on_host) {
  if (device.is_cpu()) return data.index_select(0, rows);
  auto sizes = data.sizes().vec();
  sizes[0] = rows.numel();
  torch::Tensor pinned = torch::empty(sizes, data.options().pinned_memory(true));
  torch::index_select_out(pinned, data, 0, rows);
  return stay_on_host ? pinned : pinned.to(device, /*non_blocking=*/true);
}

// A resumed SGD's momentum must live with its parameters (the checkpoint's may load elsewhere).
void move_optimizer_state(torch::optim::SGD& optimizer, const c10::Device& device) {
  for (auto& entry : optimizer.state()) {
    auto& state = static_cast<torch::optim::SGDParamState&>(*entry.second);
    if (state.momentum_buffer().defined())
      state.momentum_buffer(state.momentum_buffer().to(device));
  }
}

// Progress on rank 0: a redrawn bar on a terminal, a plain line every 10% otherwise (logs, pipes).
class Progress {
 public:
  Progress(int64_t epoch, int64_t epochs, int64_t total_steps)
      : epoch_(epoch),
        epochs_(epochs),
        total_(total_steps),
        tty_(isatty(STDOUT_FILENO)),
        start_(Clock::now()) {}

  void update(int64_t step, int64_t samples, double loss) {
    double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    double rate = samples / std::max(elapsed, 1e-9);
    double eta = step > 0 ? elapsed / step * (total_ - step) : 0.0;
    int percent = static_cast<int>(100 * step / std::max<int64_t>(total_, 1));
    char line[200];
    if (tty_) {
      // Redraw at most ten times a second: a step can take well under a millisecond.
      auto now = Clock::now();
      if (step != total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      int filled = percent / 4;
      std::snprintf(line, sizeof line,
                    "\repoch %lld/%lld [%-25s] %3d%% %8.0f samples/s loss %.4f ETA %5.1fs",
                    static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_),
                    std::string(filled, '#').c_str(), percent, rate, loss, eta);
      std::cout << line << std::flush;
    } else if (percent >= next_percent_ || step == total_) {
      std::snprintf(line, sizeof line,
                    "epoch %lld/%lld %3d%% step %lld/%lld %.0f samples/s loss %.4f ETA %.1fs",
                    static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_), percent,
                    static_cast<long long>(step), static_cast<long long>(total_), rate, loss, eta);
      std::cout << line << std::endl;
      next_percent_ = percent / 10 * 10 + 10;
    }
  }
  void done() {
    if (tty_) std::cout << std::endl;
  }

 private:
  int64_t epoch_, epochs_, total_;
  bool tty_;
  Clock::time_point start_;
  Clock::time_point last_draw_{};
  int next_percent_ = 10;
};

// Accuracy on the test split, each rank evaluating a contiguous share and the counts summed.
double test_accuracy(torch::nn::Module& net,
                     const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const dtrain::MnistSplit& test, dtrain::ProcessGroup& pg) {
  torch::NoGradGuard no_grad;
  net.eval();
  int64_t n = test.labels.size(0);
  int64_t begin = n * pg.rank() / pg.size(), end = n * (pg.rank() + 1) / pg.size();
  int64_t correct = 0;
  for (int64_t i = begin; i < end; i += 1000) {
    int64_t count = std::min<int64_t>(1000, end - i);
    auto logits = forward(test.images.narrow(0, i, count));
    correct += logits.argmax(1).eq(test.labels.narrow(0, i, count)).sum().item<int64_t>();
  }
  net.train();
  at::Tensor counts = torch::tensor({correct, end - begin}, torch::kInt64);
  pg.all_reduce(counts);
  return static_cast<double>(counts[0].item<int64_t>()) / counts[1].item<int64_t>();
}

// Checkpoints go through dtrain::Checkpointer: rank 0 saves the replicated state (atomic,
// checksummed files, the newest --keep-checkpoints kept); every rank loads through rank 0's
// broadcast.
struct Position {
  int64_t epoch = 0;
  int64_t samples_consumed = 0;  // in this epoch, over all ranks
  int64_t steps = 0;             // optimizer steps taken in all
};

dtrain::CheckpointOptions checkpoint_options(const Flags& flags) {
  dtrain::CheckpointOptions options;
  options.dir = flags.checkpoint_dir;
  options.keep_last = static_cast<int>(flags.keep_checkpoints);
  options.async = flags.async_checkpoints;
  return options;
}

// TORCHELASTIC_RESTART_COUNT as `dtrain run` and torchrun set it: 0 in the first attempt.
int64_t restart_count() {
  const char* value = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  long long count = std::strtoll(value, &end, 10);
  if (*end != '\0' || count < 0) {
    throw dtrain::UsageError(std::string("train_fashion_mnist: TORCHELASTIC_RESTART_COUNT '") +
                             value + "': expected a non-negative integer (set by the launcher)");
  }
  return count;
}

// Checked on every rank before anything starts, so that all ranks fail the same way, at once, and
// existing checkpoints are never overwritten by a run that did not ask to continue from them. A
// restart by the launcher continues from them by itself: they are its own first attempt's.
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
                      ? dtrain::ShardedCheckpointer(checkpoint_options(flags), nullptr).list()
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

// Preemption. The handler only records the signal; the training loop polls it once per step.
std::atomic<int> stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void record_stop_signal(int signo) { stop_signal.store(signo); }

void install_stop_handler() {
  struct sigaction action {};
  action.sa_handler = record_stop_signal;
  sigemptyset(&action.sa_mask);
  // Restart interrupted system calls: a collective's socket read must not fail with EINTR.
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
}

// Note [Agreeing to stop]: SIGTERM reaches the ranks at different times (the launcher signals its
// workers one by one; a scheduler may signal one node before another), so each rank's own flag may
// change between any two steps. A rank that stopped on its own flag would leave the others waiting
// in the next step's gradient all-reduce until its timeout. So after every step the ranks take the
// maximum of their flags (one all-reduce of one integer, microseconds over shared memory): all see
// the same answer after the same step, and all stop there together.
bool agree_to_stop(dtrain::ProcessGroup& pg) {
  at::Tensor flag = torch::tensor({static_cast<int64_t>(stop_signal.load() != 0)});
  pg.all_reduce(flag, dtrain::ReduceOp::kMax);
  return flag.item<int64_t>() != 0;
}

// Test hook for the fault-injection tests: DTRAIN_TEST_KILL_AT_STEP=RANK:STEP[:SIGNAL] makes that
// rank send itself SIGNAL (default 9, SIGKILL) right after optimizer step STEP of the first attempt
// (TORCHELASTIC_RESTART_COUNT 0): a worker dying mid-epoch, or (15) preempted alone.
struct KillAt {
  int64_t rank = -1, step = -1;
  int signal = SIGKILL;
};

KillAt kill_at_step_from_env() {
  const char* value = std::getenv("DTRAIN_TEST_KILL_AT_STEP");
  if (value == nullptr || *value == '\0') return {};
  KillAt at;
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

// Before evaluating a pipeline, every rank takes each stage's trained layers from that stage (the
// stages of a pipeline hold disjoint layers of the same model), so that each rank can test the
// whole model.
void gather_stages(torch::nn::Sequential& layers, const dtrain::RankMesh& mesh,
                   int virtual_stages) {
  torch::NoGradGuard no_grad;
  const int stages = mesh.pipeline_size;
  auto chunks = dtrain::split_sequential(
      layers, dtrain::balance_by_parameters(layers, stages * virtual_stages));
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (auto& p : chunks[c]->parameters())
      mesh.pipeline_group->broadcast(p, static_cast<int>(c) % stages);
    for (auto& b : chunks[c]->buffers())
      mesh.pipeline_group->broadcast(b, static_cast<int>(c) % stages);
  }
}

// --strategy zero's checkpoints (dtrain::ShardedCheckpointer): every rank saves and loads its own
// shards; the sampler position, step and extras travel as in TrainingState, so the code around
// these two calls is the same for both kinds of checkpoint.
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

int run(int argc, char** argv) {
  Flags flags = parse_flags(argc, argv);
  const int64_t restarts = restart_count();
  const auto kill_at = kill_at_step_from_env();
  const Placement placement = place(flags, dtrain::launch_info_from_env());
  const c10::Device device = placement.device;
  check_checkpoint_dir(flags, dtrain::launch_info_from_env().rank, restarts > 0);
  auto pg = dtrain::init_process_group();
  const int world = pg->size(), rank = pg->rank();
  const bool leader = rank == 0;
  const bool one_process = flags.strategy == "dp" || flags.strategy == "mp";
  if (one_process && world != 1) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --strategy " + flags.strategy +
        " runs in one process (it drives --devices replicas or stages itself); start it "
        "without `dtrain run` or with --nproc-per-node 1");
  }
  if (flags.strategy == "pipeline" && world % flags.stages != 0) {
    throw dtrain::UsageError("train_fashion_mnist: --stages " + std::to_string(flags.stages) +
                             " does not divide the " + std::to_string(world) +
                             " processes; run a multiple of --stages processes (world = "
                             "data-parallel pipelines x stages)");
  }
  // Note [Batch size per data-parallel rank]
  // --batch-size is what one data-parallel rank reads per step, as a PyTorch DataLoader's
  // batch_size under torchrun: any world size trains, and the global batch is
  // local_batch x replicas.
  //   ddp, zero  every process is a replica and reads its own local_batch rows.
  //   pipeline   the world / stages pipelines are the replicas; the stages of one pipeline work
  //              on the same local_batch rows, cut into --micro-batches.
  //   mp         one process, one pipeline: the global batch is local_batch.
  //   dp         one process whose batch DataParallel scatters over its --devices replicas, as
  //              torch.nn.DataParallel does: the global batch is local_batch, in slices one row
  //              apart when --devices does not divide it. The gradient is still exactly that of
  //              the whole batch's mean loss: DataParallel weights each slice's mean loss by its
  //              share of the rows (src/dp/replica_set.cpp; tests/dp checks 13 rows on 1-4).
  // A checkpoint's position is in samples (DistributedSampler), so a run resumed at another world
  // size, and so with another global batch, still sees the rest of the epoch once.
  const int replicas =
      flags.strategy == "pipeline" ? world / static_cast<int>(flags.stages) : world;
  const int64_t local_batch = flags.batch_size;
  const int64_t global_batch = local_batch * replicas;
  torch::set_num_threads(
      1);  // one core per rank; `dtrain run` sets OMP_NUM_THREADS=1 for the same reason

  auto train = dtrain::load_fashion_mnist(flags.data, /*train=*/true);
  auto test = dtrain::load_fashion_mnist(flags.data, /*train=*/false);

  torch::manual_seed(flags.seed);
  // ddp and dp train NetImpl; mp and pipeline its Sequential form, cut into chunks.
  std::shared_ptr<NetImpl> net;
  torch::nn::Sequential layers{nullptr};
  std::shared_ptr<torch::nn::Module> model;  // what is checkpointed and evaluated
  std::function<torch::Tensor(const torch::Tensor&)> model_forward;
  if (flags.strategy == "mp" || flags.strategy == "pipeline") {
    layers = make_sequential(flags.model);
    model = layers.ptr();
    model_forward = [layers](const torch::Tensor& x) mutable { return layers->forward(x); };
  } else {
    net = std::make_shared<NetImpl>(flags.model);
    net->to(device);  // before the optimizer and the checkpoint see its parameters
    model = net;
    model_forward = [net, device](const torch::Tensor& x) {
      return net->forward(x.to(device)).to(torch::kCPU);
    };
  }

  dtrain::PipelineOptions pipeline_options;
  pipeline_options.micro_batches = static_cast<int>(flags.micro_batches);
  pipeline_options.schedule = dtrain::parse_schedule_kind(flags.schedule);
  pipeline_options.virtual_stages = static_cast<int>(flags.virtual_stages);
  std::unique_ptr<dtrain::Pipeline> mp;
  std::unique_ptr<dtrain::DistributedPipeline> pipeline;
  dtrain::RankMesh mesh;
  std::vector<torch::Tensor> trained = model->parameters();  // what this process's optimizer steps
  if (flags.strategy == "mp") {
    const int stages = static_cast<int>(flags.devices);
    auto chunks = dtrain::split_sequential(
        layers, dtrain::balance_by_parameters(layers, stages * pipeline_options.virtual_stages));
    mp = std::make_unique<dtrain::Pipeline>(chunks, std::vector<c10::Device>{}, pipeline_options,
                                            stages);
  } else if (flags.strategy == "pipeline") {
    mesh = dtrain::make_rank_mesh(*pg, static_cast<int>(flags.stages));
    const int chunks = static_cast<int>(flags.stages) * pipeline_options.virtual_stages;
    pipeline = std::make_unique<dtrain::DistributedPipeline>(
        dtrain::split_sequential(layers, dtrain::balance_by_parameters(layers, chunks)), mesh,
        pipeline_options);
    trained = pipeline->parameters();
  }
  std::unique_ptr<dtrain::ShardedDataParallel<NetImpl>> sdp;
  if (flags.strategy == "zero") {
    dtrain::ShardedDataParallelOptions options;
    options.stage = static_cast<int>(flags.zero_stage);
    sdp = std::make_unique<dtrain::ShardedDataParallel<NetImpl>>(net, pg, options);
    trained = sdp->parameters();
  }
  torch::optim::SGD optimizer(trained, torch::optim::SGDOptions(flags.lr).momentum(0.9));
  // --amp: autocast around each forward; fp16 also scales the loss (a disabled scaler passes
  // through). DDP's ranks agree on every skipped step through the group.
  dtrain::amp::GradScalerOptions scaler_options;
  scaler_options.enabled = flags.amp == "fp16";
  scaler_options.group = flags.strategy == "ddp" ? pg.get() : nullptr;
  dtrain::amp::GradScaler scaler(scaler_options);
  int64_t skipped_steps = 0;

  // The sampler deals the data over the data-parallel replicas (every stage of a pipeline reads the
  // same).
  const int data_rank = pipeline ? mesh.data_index : rank;
  dtrain::DistributedSamplerOptions sampler_options;
  sampler_options.seed = static_cast<uint64_t>(flags.seed);
  dtrain::DistributedSampler sampler(train.labels.size(0), replicas, data_rank, sampler_options);

  // epoch_samples[e]: training samples of epoch e whose gradients are in the model (padding repeats
  // included), kept in the checkpoint so that work rolled back by a restart is not counted.
  std::vector<int64_t> epoch_samples(flags.epochs, 0);
  Position at;
  std::unique_ptr<dtrain::Checkpointer> checkpointer;
  dtrain::TrainingState checkpoint_state{model.get(), &optimizer, &sampler};
  std::string resumed_from;
  const bool checkpointing = !flags.checkpoint_dir.empty();
  std::unique_ptr<dtrain::ShardedCheckpointer> sharded_checkpointer;  // zero: sharded checkpoints
  if (checkpointing && sdp) {
    sharded_checkpointer =
        std::make_unique<dtrain::ShardedCheckpointer>(checkpoint_options(flags), pg.get());
  } else if (checkpointing) {
    checkpointer = std::make_unique<dtrain::Checkpointer>(checkpoint_options(flags));
  }
  if (checkpointing && (flags.resume || restarts > 0)) {
    auto loaded = sharded_checkpointer ? load_sharded(*sharded_checkpointer, *sdp, checkpoint_state)
                                       : checkpointer->load_latest(checkpoint_state, pg.get());
    if (!loaded && flags.resume) {
      throw dtrain::UsageError("train_fashion_mnist: --resume: no intact checkpoint in " +
                               flags.checkpoint_dir +
                               " (the damaged ones are named above); drop --resume to start over");
    }
    if (loaded) {
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
      resumed_from = loaded->path;
      // A checkpoint saved without a scaler leaves the fresh one (load_from returns false).
      scaler.load_from(checkpoint_state);
      if (!device.is_cpu()) move_optimizer_state(optimizer, device);
    }
  }
  // Saves the state after at.steps steps, with the sampler where it stands (rank 0 only: the state
  // is replicated). Asynchronous with --async-checkpoints.
  auto save_checkpoint = [&] {
    if (!leader && !sdp) return std::string();
    checkpoint_state.step = at.steps;
    checkpoint_state.tensors["epoch_samples"] = torch::tensor(epoch_samples, torch::kInt64);
    checkpoint_state.values["model"] = flags.model;
    checkpoint_state.values["seed"] = std::to_string(flags.seed);
    scaler.save_to(checkpoint_state);
    if (sdp) return save_sharded(*sharded_checkpointer, *sdp, checkpoint_state);
    return checkpointer->save(checkpoint_state);
  };
  // Resumed on any world size: DDP broadcasts rank 0's (loaded) parameters; every rank loaded the
  // same optimizer state.
  std::unique_ptr<dtrain::DistributedDataParallel<NetImpl>> ddp;
  std::unique_ptr<dtrain::DataParallel<NetImpl>> dp;
  if (flags.strategy == "dp") {
    dtrain::DataParallelOptions options;
    options.num_replicas = static_cast<int>(flags.devices);
    options.devices = placement.dp_devices;
    dp = std::make_unique<dtrain::DataParallel<NetImpl>>(net, options);
  } else if (flags.strategy == "ddp") {
    ddp = std::make_unique<dtrain::DistributedDataParallel<NetImpl>>(net, pg);
  }
  auto mean_loss = [](const torch::Tensor& logits, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits, y);
  };

  sampler.load_state({at.epoch, at.samples_consumed});
  if (leader && !resumed_from.empty()) {
    std::cout << (restarts > 0 ? "restart " + std::to_string(restarts) + ": " : std::string())
              << "resumed from " << resumed_from << " at epoch " << at.epoch + 1 << ", "
              << at.samples_consumed << " samples into it, step " << at.steps << std::endl;
  }
  if (checkpointing) install_stop_handler();

  int64_t samples_processed = 0;  // this run, over all ranks
  double train_seconds = 0, accuracy = 0, last_loss = 0;
  bool stopped_early = false, preempted = false;
  for (int64_t epoch = at.epoch; epoch < flags.epochs && !stopped_early; ++epoch) {
    if (epoch != at.epoch) sampler.set_epoch(epoch);
    std::vector<int64_t> indices = sampler.indices();
    at::Tensor order =
        torch::from_blob(indices.data(), {static_cast<int64_t>(indices.size())}, torch::kInt64);
    int64_t steps = (static_cast<int64_t>(indices.size()) + local_batch - 1) / local_batch;
    Progress progress(epoch, flags.epochs, steps);
    auto start = Clock::now();
    for (int64_t step = 0; step < steps; ++step) {
      int64_t count =
          std::min<int64_t>(local_batch, static_cast<int64_t>(indices.size()) - step * local_batch);
      at::Tensor rows = order.narrow(0, step * local_batch, count);
      at::Tensor x = batch_rows(train.images, rows, device, /*stay_on_host=*/dp != nullptr);
      at::Tensor y = batch_rows(train.labels, rows, device, /*stay_on_host=*/dp != nullptr);
      optimizer.zero_grad();
      torch::Tensor loss;
      std::optional<dtrain::amp::Autocast> autocast;  // --amp: around the forward only
      if (!flags.amp.empty()) {
        autocast.emplace(device.type(), flags.amp == "fp16" ? torch::kHalf : torch::kBFloat16);
      }
      if (dp) {
        const double scale = scaler.get_scale();
        loss = dp->forward_backward(x, y,
                                    [&](const torch::Tensor& logits, const torch::Tensor& target) {
                                      return scaler.scale(mean_loss(logits, target));
                                    }) /
               scale;
        autocast.reset();
      } else if (mp) {
        loss = mp->forward_backward(x, y, mean_loss);
      } else if (pipeline) {
        loss = pipeline->forward_backward(x, y, mean_loss);
      } else {
        loss = mean_loss(sdp ? sdp->forward(x) : ddp->forward(x), y);
        autocast.reset();
        scaler.scale(loss).backward();
      }
      if (!scaler.step(optimizer)) ++skipped_steps;  // fp16: an inf/NaN gradient on any rank
      scaler.update();
      sampler.advance(count * replicas);
      samples_processed += count * replicas;
      epoch_samples[epoch] += count * replicas;
      ++at.steps;
      if (leader) {
        last_loss = loss.item<double>();
        progress.update(step + 1, (step + 1) * global_batch, last_loss);
        if (flags.log_every > 0 && at.steps % flags.log_every == 0) {
          std::cout << "step " << at.steps << " loss " << last_loss << std::endl;
        }
      }
      if (rank == kill_at.rank && at.steps == kill_at.step && restarts == 0) {
        std::raise(kill_at.signal);
      }
      if (checkpointing && agree_to_stop(*pg)) {
        preempted = stopped_early = true;
        break;
      }
      if (flags.checkpoint_every > 0 && at.steps % flags.checkpoint_every == 0 && checkpointing) {
        save_checkpoint();
      }
      if (flags.max_steps > 0 && at.steps >= flags.max_steps) {
        stopped_early = true;
        break;
      }
    }
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (leader) progress.done();
    if (preempted) break;
    if (pipeline) gather_stages(layers, mesh, pipeline_options.virtual_stages);
    if (sdp) sdp->gather_full_parameters();  // the full model, to evaluate
    accuracy = test_accuracy(*model, model_forward, test, *pg);
    if (sdp) sdp->release_full_parameters();
    if (leader) {
      char line[120];
      std::snprintf(line, sizeof line, "epoch %lld: test accuracy %.4f",
                    static_cast<long long>(epoch + 1), accuracy);
      std::cout << line << std::endl;
    }
    if (checkpointing) {
      // A finished epoch is saved as the start of the next one.
      if (!stopped_early) sampler.set_epoch(epoch + 1);
      save_checkpoint();
    }
  }
  if (preempted) {
    std::string path = save_checkpoint();
    if (checkpointer) checkpointer->wait();
    pg->barrier();  // every rank exits once the checkpoint is on disk
    if (leader) {
      std::cout << "stopped by SIGTERM after step " << at.steps << ": saved " << path
                << "; a restart by the launcher, or --resume, continues from it" << std::endl;
    }
    return 128 + SIGTERM;
  }
  if (checkpointer) checkpointer->wait();
  pg->barrier();  // rank 0's checkpoint is on disk before anyone reports success
  if (at.epoch >= flags.epochs && samples_processed == 0) {
    // Resumed from a checkpoint that already finished --epochs: nothing to train, but report the
    // model.
    if (leader) {
      std::cout << "nothing to train: the checkpoint has finished " << at.epoch
                << " epoch(s) and --epochs is " << flags.epochs << std::endl;
    }
    if (sdp) sdp->gather_full_parameters();
    accuracy = test_accuracy(*model, model_forward, test, *pg);
  }
  // JSON has no NaN or infinity: a diverged loss is reported as null.
  auto number = [](double x) { return std::isfinite(x) ? std::to_string(x) : std::string("null"); };
  if (leader) {
    std::ostringstream json;
    json.precision(6);
    json << "{\"test_accuracy\": " << accuracy << ", \"epochs\": " << flags.epochs
         << ", \"world_size\": " << world << ", \"strategy\": \"" << flags.strategy
         << "\", \"replicas\": " << (dp ? flags.devices : replicas) << ", \"model\": \""
         << flags.model << "\", \"global_batch\": " << global_batch
         << ", \"per_rank_batch\": " << local_batch << ", \"train_samples\": " << samples_processed
         << ", \"train_time_s\": " << train_seconds
         << ", \"samples_per_s\": " << (train_seconds > 0 ? samples_processed / train_seconds : 0.0)
         << ", \"final_loss\": " << number(last_loss) << ", \"steps\": " << at.steps
         << ", \"restarts\": " << restarts << ", \"epoch_samples\": [";
    for (size_t e = 0; e < epoch_samples.size(); ++e) json << (e ? ", " : "") << epoch_samples[e];
    json << "]";
    if (sdp) json << ", \"zero_stage\": " << sdp->stage();
    json << ", \"device\": \"" << device.str() << "\", \"amp\": \""
         << (flags.amp.empty() ? "none" : flags.amp) << "\"";
    if (scaler.is_enabled()) {
      json << ", \"amp_skipped_steps\": " << skipped_steps
           << ", \"amp_scale\": " << scaler.get_scale();
    }
    if (mp || pipeline) {
      json << ", \"stages\": " << (mp ? mp->stages() : pipeline->stages())
           << ", \"data_parallel\": " << replicas << ", \"micro_batches\": " << flags.micro_batches
           << ", \"schedule\": \"" << flags.schedule
           << "\", \"virtual_stages\": " << flags.virtual_stages;
    }
    json << "}";
    std::cout << json.str() << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    // --spawn N: the program starts its own N ranks (re-executed, each reaching this spawn() as a worker
    // and running run() there) instead of being started by `dtrain run`.
    if (int64_t ranks = parse_flags(argc, argv).spawn; ranks > 0) {
      dtrain::spawn(static_cast<int>(ranks), [&](int) {
        if (int code = run(argc, argv); code != 0) std::exit(code);
      });
      return 0;
    }
    return run(argc, argv);
  });
}
