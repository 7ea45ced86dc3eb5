// Training on Fashion-MNIST with each of dtrain's strategies: dtrain's main job and an example of a
// user's program.
//   dtrain run --nproc-per-node 2 -- build/bin/train_fashion_mnist --epochs 1            (DDP)
//   build/bin/train_fashion_mnist --strategy dp --devices 2 (DataParallel)
//   build/bin/train_fashion_mnist --strategy mp --devices 2 --micro-batches 4              (model
//   parallel) dtrain run --nproc-per-node 4 -- build/bin/train_fashion_mnist --strategy pipeline
//   --stages 2
//                                                                    (2 data-parallel pipelines of
//                                                                    2 stages)
// Rank 0 shows progress and test accuracy per epoch; the last line of output is one JSON object.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/dp.h"
#include "dtrain/pipeline.h"

namespace {

using Clock = std::chrono::steady_clock;

const char* kUsage =
    "usage: train_fashion_mnist [--model mlp|cnn] [--strategy ddp|dp|mp|pipeline] [--devices N "
    "(dp, mp)]\n"
    "                           [--stages P (pipeline)] [--micro-batches M (mp, pipeline)]\n"
    "                           [--schedule gpipe|1f1b|interleaved] [--virtual-stages V "
    "(interleaved)]\n"
    "                           [--epochs N] [--batch-size N (global)]\n"
    "                           [--lr X] [--seed N] [--data DIR] [--checkpoint-dir DIR] "
    "[--resume]\n"
    "                           [--checkpoint-every STEPS] [--max-steps N]";

struct Flags {
  std::string model = "mlp";
  std::string strategy = "ddp";  // ddp: one process per rank (under `dtrain run`); dp: one process
  int64_t devices = 2;  // dp: replicas (CPU threads) in this process; mp: stages (CPU threads)
  int64_t stages = 2;   // pipeline: stages per pipeline; the job runs world / stages pipelines
  int64_t micro_batches = 4;      // mp, pipeline: micro-batches per step
  std::string schedule = "1f1b";  // mp, pipeline
  int64_t virtual_stages = 1;     // chunks per stage (interleaved schedule)
  int64_t epochs = 1;
  int64_t batch_size = 64;  // global: split evenly over the ranks
  double lr = 0.02;
  int64_t seed = 0;
  std::string data = dtrain::kDefaultFashionMnistDir;
  std::string checkpoint_dir;    // empty: no checkpoints
  bool resume = false;           // continue from checkpoint_dir's checkpoint
  int64_t checkpoint_every = 0;  // also checkpoint every N steps (0: only at the end of each epoch)
  int64_t max_steps = 0;         // stop after N steps in all (0: no limit); for tests of resumption
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

const char* const kValueFlags[] = {
    "--model",    "--strategy",       "--devices",        "--stages",           "--micro-batches",
    "--schedule", "--virtual-stages", "--epochs",         "--batch-size",       "--lr",
    "--seed",     "--data",           "--checkpoint-dir", "--checkpoint-every", "--max-steps"};

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
      if (value != "ddp" && value != "dp" && value != "mp" && value != "pipeline") {
        bad_flag(flag, value, "ddp, dp, mp or pipeline");
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
    } else if (flag == "--max-steps") {
      flags.max_steps = parse_int(flag, value, 0);
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

// Checkpoints: written by rank 0 to a temporary file, then renamed over the old one, so the file on
// disk is always a complete checkpoint whatever is killed and when.
struct Position {
  int64_t epoch = 0;
  int64_t samples_consumed = 0;  // in this epoch, over all ranks
  int64_t steps = 0;             // optimizer steps taken in all
};

std::string checkpoint_path(const Flags& flags) { return flags.checkpoint_dir + "/checkpoint.pt"; }

// Checked on every rank before anything starts, so that all ranks fail the same way, at once, and
// an existing checkpoint is never overwritten by a run that did not ask to continue from it.
void check_checkpoint_dir(const Flags& flags, int rank) {
  if (flags.checkpoint_dir.empty()) return;
  namespace fs = std::filesystem;
  const std::string& dir = flags.checkpoint_dir;
  std::error_code error;
  if (flags.resume && !fs::exists(checkpoint_path(flags))) {
    throw dtrain::UsageError("train_fashion_mnist: --resume: no checkpoint at " +
                             checkpoint_path(flags) + "; run once with --checkpoint-dir " + dir +
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
  if (fs::exists(checkpoint_path(flags)) && !flags.resume) {
    throw dtrain::UsageError("train_fashion_mnist: --checkpoint-dir '" + dir +
                             "' already holds a checkpoint; "
                             "pass --resume to continue from it, or choose another folder");
  }
  if (fs::is_directory(checkpoint_path(flags))) {
    throw dtrain::UsageError("train_fashion_mnist: " + checkpoint_path(flags) +
                             " is a folder, not a checkpoint");
  }
}

void save_checkpoint(const Flags& flags, torch::nn::Module& net, torch::optim::Optimizer& optimizer,
                     const Position& at) {
  std::filesystem::create_directories(flags.checkpoint_dir);
  torch::serialize::OutputArchive archive;
  net.save(archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("epoch", torch::tensor(at.epoch));
  archive.write("samples_consumed", torch::tensor(at.samples_consumed));
  archive.write("steps", torch::tensor(at.steps));
  archive.write("model_kind", torch::tensor(flags.model == "cnn" ? 1 : 0));
  archive.write("seed", torch::tensor(flags.seed));  // the shuffle order the position refers to
  std::string final_path = checkpoint_path(flags);
  std::string temporary = final_path + ".tmp";
  archive.save_to(temporary);
  std::filesystem::rename(temporary, final_path);
}

Position load_checkpoint(const Flags& flags, torch::nn::Module& net,
                         torch::optim::Optimizer& optimizer) {
  std::string path = checkpoint_path(flags);
  if (!std::filesystem::exists(path)) {
    throw dtrain::UsageError("train_fashion_mnist: --resume: no checkpoint at " + path +
                             "; run once with --checkpoint-dir " + flags.checkpoint_dir +
                             " first, or drop --resume");
  }
  // Everything read from the file is checked before the model or optimizer is trusted with it.
  auto unreadable = [&](const std::string& why) {
    return dtrain::UsageError("train_fashion_mnist: --resume: " + path +
                              " is not a usable checkpoint (" + why + "); it was left as it is");
  };
  Position at;
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    torch::Tensor value;
    archive.read("model_kind", value);
    if (value.item<int64_t>() != (flags.model == "cnn" ? 1 : 0)) {
      throw dtrain::UsageError("train_fashion_mnist: --resume: " + path + " holds a " +
                               (value.item<int64_t>() ? "cnn" : "mlp") + " model but --model is " +
                               flags.model);
    }
    archive.read("seed", value);
    if (value.item<int64_t>() != flags.seed) {
      throw dtrain::UsageError("train_fashion_mnist: --resume: " + path +
                               " was trained with --seed " + std::to_string(value.item<int64_t>()) +
                               " but this run has --seed " + std::to_string(flags.seed) +
                               "; the saved position only means something in the "
                               "same shuffle order: pass --seed " +
                               std::to_string(value.item<int64_t>()));
    }
    archive.read("epoch", value);
    at.epoch = value.item<int64_t>();
    archive.read("samples_consumed", value);
    at.samples_consumed = value.item<int64_t>();
    archive.read("steps", value);
    at.steps = value.item<int64_t>();
    net.load(archive);
    torch::serialize::InputArchive optimizer_archive;
    archive.read("optimizer", optimizer_archive);
    optimizer.load(optimizer_archive);
  } catch (const dtrain::UsageError&) {
    throw;
  } catch (const c10::Error& e) {
    throw unreadable(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw unreadable(e.what());
  }
  return at;
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

int run(int argc, char** argv) {
  Flags flags = parse_flags(argc, argv);
  check_checkpoint_dir(flags, dtrain::launch_info_from_env().rank);
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
  // Data-parallel replicas: each takes its own share of the global batch. A pipeline's stages share
  // one.
  const int replicas =
      flags.strategy == "pipeline" ? world / static_cast<int>(flags.stages) : world;
  if (flags.batch_size % replicas != 0) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --batch-size " + std::to_string(flags.batch_size) +
        " does not split evenly over " + std::to_string(replicas) +
        " data-parallel replicas; use a multiple of " + std::to_string(replicas));
  }
  const int64_t local_batch = flags.batch_size / replicas;
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
    model = net;
    model_forward = [net](const torch::Tensor& x) { return net->forward(x); };
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
  torch::optim::SGD optimizer(trained, torch::optim::SGDOptions(flags.lr).momentum(0.9));
  Position at;
  if (flags.resume) at = load_checkpoint(flags, *model, optimizer);
  // Resumed on any world size: DDP broadcasts rank 0's (loaded) parameters; every rank loaded the
  // same optimizer state.
  std::unique_ptr<dtrain::DistributedDataParallel<NetImpl>> ddp;
  std::unique_ptr<dtrain::DataParallel<NetImpl>> dp;
  if (flags.strategy == "dp") {
    dtrain::DataParallelOptions options;
    options.num_replicas = static_cast<int>(flags.devices);
    dp = std::make_unique<dtrain::DataParallel<NetImpl>>(net, options);
  } else if (flags.strategy == "ddp") {
    ddp = std::make_unique<dtrain::DistributedDataParallel<NetImpl>>(net, pg);
  }
  auto mean_loss = [](const torch::Tensor& logits, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits, y);
  };

  // The sampler deals the data over the data-parallel replicas (every stage of a pipeline reads the
  // same).
  const int data_rank = pipeline ? mesh.data_index : rank;
  dtrain::DistributedSamplerOptions sampler_options;
  sampler_options.seed = static_cast<uint64_t>(flags.seed);
  dtrain::DistributedSampler sampler(train.labels.size(0), replicas, data_rank, sampler_options);
  sampler.load_state({at.epoch, at.samples_consumed});
  if (leader && flags.resume) {
    std::cout << "resumed from " << checkpoint_path(flags) << " at epoch " << at.epoch + 1 << ", "
              << at.samples_consumed << " samples into it, step " << at.steps << std::endl;
  }

  int64_t samples_processed = 0;  // this run, over all ranks
  double train_seconds = 0, accuracy = 0, last_loss = 0;
  bool stopped_early = false;
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
      at::Tensor x = train.images.index_select(0, rows), y = train.labels.index_select(0, rows);
      optimizer.zero_grad();
      torch::Tensor loss;
      if (dp) {
        loss = dp->forward_backward(x, y, mean_loss);
      } else if (mp) {
        loss = mp->forward_backward(x, y, mean_loss);
      } else if (pipeline) {
        loss = pipeline->forward_backward(x, y, mean_loss);
      } else {
        loss = mean_loss(ddp->forward(x), y);
        loss.backward();
      }
      optimizer.step();
      sampler.advance(count * replicas);
      samples_processed += count * replicas;
      ++at.steps;
      if (leader) {
        last_loss = loss.item<double>();
        progress.update(step + 1, (step + 1) * local_batch * replicas, last_loss);
      }
      if (flags.checkpoint_every > 0 && at.steps % flags.checkpoint_every == 0 && leader) {
        save_checkpoint(flags, *model, optimizer,
                        {epoch, sampler.state().samples_consumed, at.steps});
      }
      if (flags.max_steps > 0 && at.steps >= flags.max_steps) {
        stopped_early = true;
        break;
      }
    }
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (leader) progress.done();
    if (pipeline) gather_stages(layers, mesh, pipeline_options.virtual_stages);
    accuracy = test_accuracy(*model, model_forward, test, *pg);
    if (leader) {
      char line[120];
      std::snprintf(line, sizeof line, "epoch %lld: test accuracy %.4f",
                    static_cast<long long>(epoch + 1), accuracy);
      std::cout << line << std::endl;
    }
    if (!flags.checkpoint_dir.empty() && leader) {
      Position saved = stopped_early ? Position{epoch, sampler.state().samples_consumed, at.steps}
                                     : Position{epoch + 1, 0, at.steps};
      save_checkpoint(flags, *model, optimizer, saved);
    }
  }
  pg->barrier();  // rank 0's checkpoint is on disk before anyone reports success
  if (at.epoch >= flags.epochs && samples_processed == 0) {
    // Resumed from a checkpoint that already finished --epochs: nothing to train, but report the
    // model.
    if (leader) {
      std::cout << "nothing to train: the checkpoint has finished " << at.epoch
                << " epoch(s) and --epochs is " << flags.epochs << std::endl;
    }
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
         << flags.model << "\", \"global_batch\": " << flags.batch_size
         << ", \"train_samples\": " << samples_processed << ", \"train_time_s\": " << train_seconds
         << ", \"samples_per_s\": " << (train_seconds > 0 ? samples_processed / train_seconds : 0.0)
         << ", \"final_loss\": " << number(last_loss) << ", \"steps\": " << at.steps;
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
  return dtrain::run_main([&] { return run(argc, argv); });
}
