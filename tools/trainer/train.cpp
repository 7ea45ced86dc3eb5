// The trainer's run (see train.h): the set-up, the checkpoints it resumes from and saves, the
// training loop and the final report.
#include "train.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>

#include "checkpoints.h"
#include "datasets/fashion_mnist.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/errors.h"
#include "dtrain/sharded_checkpoint.h"
#include "dtrain/stop.h"
#include "strategies.h"

namespace trainer {

// A measurement as the final line reports it: six significant digits (more would be noise).
double six_digits(double x) {
  if (!std::isfinite(x)) return x;
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", x);
  return std::strtod(text, nullptr);
}

namespace {

using Clock = std::chrono::steady_clock;

// Progress on rank 0: a redrawn bar on a terminal, a plain line every 10% otherwise (logs, pipes).
class Progress {
 public:
  Progress(int64_t epoch, int64_t epochs, int64_t total_steps)
      : epoch_(epoch),
        epochs_(epochs),
        total_(total_steps),
        tty_(isatty(STDOUT_FILENO)),
        start_(Clock::now()) {}

  // loss() is called only when a line is drawn: reading a loss off a GPU waits for the step to
  // finish, and a wait every step would keep the host from queueing the next one meanwhile.
  template <typename LossFn>
  void update(int64_t step, int64_t samples, LossFn&& loss_fn) {
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
                    std::string(filled, '#').c_str(), percent, rate, loss_fn(), eta);
      std::cout << line << std::flush;
    } else if (percent >= next_percent_ || step == total_) {
      std::snprintf(line, sizeof line,
                    "epoch %lld/%lld %3d%% step %lld/%lld %.0f samples/s loss %.4f ETA %.1fs",
                    static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_), percent,
                    static_cast<long long>(step), static_cast<long long>(total_), rate, loss_fn(),
                    eta);
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

}  // namespace

int train(const Flags& flags) {
  const std::string recovery = std::getenv("DTRAIN_RECOVERY") ? std::getenv("DTRAIN_RECOVERY") : "";
  if (recovery != "" && recovery != "restart" && recovery != "in-place") {
    throw dtrain::UsageError("train_fashion_mnist: DTRAIN_RECOVERY is '" + recovery +
                             "'; accepted: restart or in-place (as `dtrain run --recovery` sets "
                             "it), or unset");
  }
  if (recovery == "in-place") {
    const std::string reason = in_place_unsupported_reason(flags);
    if (reason.empty()) return train_in_place(flags);
    if (dtrain::launch_info_from_env().rank == 0) {
      std::cout << "in-place recovery: not for " << reason
                << "; a failure restarts the job from its last checkpoint" << std::endl;
    }
  }
  const int64_t restarts = restart_count();
  const auto kill_at = kill_at_step_from_env();
  const Placement placement = place(flags, dtrain::launch_info_from_env());
  const c10::Device device = placement.device;
  check_checkpoint_dir(flags, dtrain::launch_info_from_env().rank, restarts > 0);
  auto pg = dtrain::init_process_group();
  const int world = pg->size(), rank = pg->rank();
  const bool leader = rank == 0;
  // Note [Batch size per data-parallel rank] (strategies.cpp)
  const int replicas = data_parallel_replicas(flags, world);
  const int64_t local_batch = flags.batch_size;
  const int64_t global_batch = local_batch * replicas;
  // One core per rank; `dtrain run` sets OMP_NUM_THREADS=1 for the same reason.
  torch::set_num_threads(1);

  const std::string data = flags.data.empty() ? datasets::default_fashion_mnist_dir() : flags.data;
  auto train_set = datasets::load_fashion_mnist(data, /*train=*/true);
  auto test_set = datasets::load_fashion_mnist(data, /*train=*/false);

  torch::manual_seed(flags.seed);
  Strategy strategy(flags, device, pg);
  torch::optim::SGD optimizer(strategy.trained, torch::optim::SGDOptions(flags.lr).momentum(0.9));
  // --amp: autocast around each forward; fp16 also scales the loss (a disabled scaler passes
  // through). DDP's ranks agree on every skipped step through the group.
  dtrain::amp::GradScalerOptions scaler_options;
  scaler_options.enabled = flags.amp == "fp16";
  dtrain::amp::GradScaler scaler(scaler_options, flags.strategy == "ddp" ? pg : nullptr);
  int64_t skipped_steps = 0;

  // The sampler deals the data over the data-parallel replicas (every stage of a pipeline reads the
  // same).
  dtrain::DistributedSamplerOptions sampler_options;
  sampler_options.seed = static_cast<uint64_t>(flags.seed);
  dtrain::DistributedSampler sampler(train_set.labels.size(0), replicas, strategy.data_rank(),
                                     sampler_options);

  // epoch_samples[e]: training samples of epoch e whose gradients are in the model (padding repeats
  // included), kept in the checkpoint so that work rolled back by a restart is not counted.
  std::vector<int64_t> epoch_samples(flags.epochs, 0);
  Position at;
  Checkpoints checkpoints(flags, pg, strategy.model.get(),
                          strategy.sdp ? strategy.sdp.get() : nullptr, optimizer, sampler, scaler);
  const std::string resumed_from = checkpoints.resume(restarts, at, epoch_samples, device);
  const bool checkpointing = checkpoints.checkpointing;
  // Resumed on any world size: DDP broadcasts rank 0's (loaded) parameters; every rank loaded the
  // same optimizer state.
  strategy.wrap(placement);

  sampler.load_state({at.epoch, at.samples_consumed});
  if (leader && !resumed_from.empty()) {
    std::cout << (restarts > 0 ? "restart " + std::to_string(restarts) + ": " : std::string())
              << "resumed from " << resumed_from << " at epoch " << at.epoch + 1 << ", "
              << at.samples_consumed << " samples into it, step " << at.steps << std::endl;
  }
  if (checkpointing) dtrain::install_stop_handler();  // preemption: dtrain/stop.h

  int64_t samples_processed = 0;  // this run, over all ranks
  double train_seconds = 0, accuracy = 0, last_loss = 0;
  at::Tensor last_loss_tensor;  // read only when shown (Progress::update) and at the end
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
      const bool on_host = !strategy.dp.is_empty();  // DataParallel scatters the batch itself
      at::Tensor x = batch_rows(train_set.images, rows, device, /*stay_on_host=*/on_host);
      at::Tensor y = batch_rows(train_set.labels, rows, device, /*stay_on_host=*/on_host);
      optimizer.zero_grad();
      torch::Tensor loss = strategy.forward_backward(x, y, scaler);
      if (!scaler.step(optimizer)) ++skipped_steps;  // fp16: an inf/NaN gradient on any rank
      scaler.update();
      sampler.advance(count * replicas);
      samples_processed += count * replicas;
      epoch_samples[epoch] += count * replicas;
      ++at.steps;
      if (leader) {
        last_loss_tensor = loss.detach();
        auto read_loss = [&] { return last_loss = last_loss_tensor.item<double>(); };
        progress.update(step + 1, (step + 1) * global_batch, read_loss);
        if (flags.log_every > 0 && at.steps % flags.log_every == 0) {
          std::cout << "step " << at.steps << " loss " << read_loss() << std::endl;
        }
      }
      if (rank == kill_at.rank && at.steps == kill_at.step && restarts == 0) {
        std::raise(kill_at.signal);
      }
      if (checkpointing && dtrain::should_stop(pg)) {
        preempted = stopped_early = true;
        break;
      }
      if (flags.checkpoint_every > 0 && at.steps % flags.checkpoint_every == 0 && checkpointing) {
        checkpoints.save(at, epoch_samples);
      }
      if (flags.max_steps > 0 && at.steps >= flags.max_steps) {
        stopped_early = true;
        break;
      }
    }
    if (last_loss_tensor.defined()) last_loss = last_loss_tensor.item<double>();
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (leader) progress.done();
    if (preempted) break;
    accuracy = strategy.test_accuracy(test_set);
    if (leader) {
      char line[120];
      std::snprintf(line, sizeof line, "epoch %lld: test accuracy %.4f",
                    static_cast<long long>(epoch + 1), accuracy);
      std::cout << line << std::endl;
    }
    if (checkpointing) {
      // A finished epoch is saved as the start of the next one.
      if (!stopped_early) sampler.set_epoch(epoch + 1);
      checkpoints.save(at, epoch_samples);
    }
  }
  if (preempted) {
    std::string path = checkpoints.save(at, epoch_samples);
    checkpoints.wait();
    pg->barrier();  // every rank exits once the checkpoint is on disk
    if (leader) {
      std::cout << "stopped by SIGTERM after step " << at.steps << ": saved " << path
                << "; a restart by the launcher, or --resume, continues from it" << std::endl;
    }
    return dtrain::kStopExitCode;
  }
  checkpoints.wait();
  pg->barrier();  // rank 0's checkpoint is on disk before anyone reports success
  if (at.epoch >= flags.epochs && samples_processed == 0) {
    // Resumed from a checkpoint that already finished --epochs: nothing to train, but report the
    // model.
    if (leader) {
      std::cout << "nothing to train: the checkpoint has finished " << at.epoch
                << " epoch(s) and --epochs is " << flags.epochs << std::endl;
    }
    accuracy = strategy.test_accuracy(test_set);
  }
  if (leader) {
    // The final JSON line, its keys in this order. nlohmann::json writes a diverged (non-finite)
    // loss as null: JSON has no NaN or infinity.
    nlohmann::ordered_json result = {
        {"test_accuracy", six_digits(accuracy)},
        {"epochs", flags.epochs},
        {"world_size", world},
        {"strategy", flags.strategy},
        {"replicas", strategy.dp ? flags.devices : replicas},
        {"model", flags.model},
        {"global_batch", global_batch},
        {"per_rank_batch", local_batch},
        {"train_samples", samples_processed},
        {"train_time_s", six_digits(train_seconds)},
        {"samples_per_s", six_digits(train_seconds > 0 ? samples_processed / train_seconds : 0.0)},
        {"final_loss", six_digits(last_loss)},
        {"steps", at.steps},
        {"restarts", restarts},
        {"epoch_samples", epoch_samples}};
    if (strategy.sdp) result["zero_stage"] = strategy.sdp->stage();
    result["device"] = device.str();
    result["amp"] = flags.amp.empty() ? "none" : flags.amp;
    if (scaler.is_enabled()) {
      result["amp_skipped_steps"] = skipped_steps;
      result["amp_scale"] = scaler.get_scale();
    }
    if (strategy.mp || strategy.pipeline) {
      result["stages"] = strategy.mp ? strategy.mp->stages() : strategy.pipeline->stages();
      result["data_parallel"] = replicas;
      result["micro_batches"] = flags.micro_batches;
      result["schedule"] = flags.schedule;
      result["virtual_stages"] = flags.virtual_stages;
    }
    std::cout << result.dump() << std::endl;
  }
  return 0;
}

}  // namespace trainer
