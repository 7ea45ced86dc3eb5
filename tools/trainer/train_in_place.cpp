// The trainer under in-place recovery (DTRAIN_RECOVERY=in-place, `dtrain run --recovery
// in-place`): DDP through dtrain::ResilientDataParallel, so a rank's death costs the survivors a
// re-formed group and one step redone, not a restart (dtrain/recovery.h). Only --strategy ddp
// without checkpoints or --amp takes this path (see in_place_unsupported_reason); train.cpp runs
// every other job.
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <iostream>
#include <nlohmann/json.hpp>

#include "checkpoints.h"
#include "datasets/fashion_mnist.h"
#include "dtrain/recovery.h"
#include "models.h"
#include "strategies.h"
#include "train.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

// The whole test split on one rank: no collective, so an evaluation never meets a failure.
double accuracy_on(NetImpl& net, const datasets::MnistSplit& test, const c10::Device& device) {
  const int64_t n = test.labels.size(0);
  const int64_t correct = correct_predictions(
      net, [&](const torch::Tensor& x) { return net.forward(x.to(device)).to(torch::kCPU); }, test,
      0, n);
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace

std::string in_place_unsupported_reason(const Flags& flags) {
  if (flags.strategy != "ddp") return "--strategy " + flags.strategy + " (in place: ddp only)";
  if (!flags.checkpoint_dir.empty()) return "--checkpoint-dir (not yet written in place)";
  if (!flags.amp.empty()) return "--amp (its scaler's agreement is not yet recovered)";
  if (flags.spawn > 0) return "--spawn (its workers are not restarted alone)";
  return "";
}

int train_in_place(const Flags& flags) {
  const auto launch = dtrain::launch_info_from_env();
  const Placement placement = place(flags, launch);
  const c10::Device device = placement.device;
  const auto kill_at = kill_at_step_from_env();
  torch::set_num_threads(1);
  const std::string data = flags.data.empty() ? datasets::default_fashion_mnist_dir() : flags.data;
  auto train_set = datasets::load_fashion_mnist(data, /*train=*/true);
  auto test_set = datasets::load_fashion_mnist(data, /*train=*/false);

  torch::manual_seed(flags.seed);
  auto net = std::make_shared<NetImpl>(flags.model);
  net->to(device);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(flags.lr).momentum(0.9));
  dtrain::DistributedSamplerOptions sampler_options;
  sampler_options.seed = static_cast<uint64_t>(flags.seed);
  dtrain::DistributedSampler sampler(train_set.labels.size(0), 1, 0, sampler_options);
  dtrain::ResilientDataParallel rdp(net, optimizer, sampler);
  if (rdp.job_finished()) return 0;  // a replacement that came after the end: nothing to do
  const bool newcomer = rdp.stats().admitted > 0 || rdp.stats().steps > 0;

  // epoch_samples[e]: samples of epoch e whose gradients are in the model (committed steps only).
  std::vector<int64_t> epoch_samples(flags.epochs, 0);
  int64_t samples_processed = 0;
  double train_seconds = 0, accuracy = 0, last_loss = 0;
  bool stopped = false;
  for (int64_t epoch = sampler.epoch(); epoch < flags.epochs && !stopped; ++epoch) {
    sampler.set_epoch(epoch);
    const auto start = Clock::now();
    int64_t step_samples = 0;
    torch::Tensor loss;
    while (rdp.step([&](auto& ddp) {
      auto batch = sampler.next(static_cast<size_t>(flags.batch_size));
      if (!batch) return false;
      auto rows = torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()));
      auto x = batch_rows(train_set.images, rows, device, /*stay_on_host=*/false);
      auto y = batch_rows(train_set.labels, rows, device, /*stay_on_host=*/false);
      optimizer.zero_grad();
      loss = torch::nn::functional::cross_entropy(ddp(x), y);
      loss.backward();
      optimizer.step();
      step_samples = static_cast<int64_t>(batch->size()) * rdp.group()->size();
      return true;
    })) {
      const auto stats = rdp.stats();
      epoch_samples[epoch] += step_samples;
      samples_processed += step_samples;
      if (rdp.group()->rank() == 0) {
        last_loss = loss.item<double>();
        if (flags.log_every > 0 && stats.steps % flags.log_every == 0) {
          std::cout << "step " << stats.steps << " loss " << last_loss << " world "
                    << rdp.group()->size() << std::endl;
        }
      }
      if (launch.rank == kill_at.rank && stats.steps == kill_at.step && !newcomer) {
        std::raise(kill_at.signal);
      }
      if (flags.max_steps > 0 && stats.steps >= flags.max_steps) {
        stopped = true;
        break;
      }
    }
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (rdp.group()->rank() == 0) {
      accuracy = accuracy_on(*net, test_set, device);
      char line[120];
      std::snprintf(line, sizeof line, "epoch %lld: test accuracy %.4f",
                    static_cast<long long>(epoch + 1), accuracy);
      std::cout << line << std::endl;
    }
  }
  rdp.finish();
  auto group = rdp.group();
  group->barrier();
  const auto stats = rdp.stats();
  if (group->rank() == 0) {
    // The keys of train.cpp's line (a newcomer's counts start where it joined: samples are the
    // job's only on a rank that lived through it, which rank 0 always does), plus the recovery's.
    nlohmann::ordered_json result = {
        {"test_accuracy", six_digits(accuracy)},
        {"epochs", flags.epochs},
        {"world_size", group->size()},
        {"strategy", flags.strategy},
        {"replicas", group->size()},
        {"model", flags.model},
        {"per_rank_batch", flags.batch_size},
        {"train_samples", samples_processed},
        {"train_time_s", six_digits(train_seconds)},
        {"samples_per_s", six_digits(train_seconds > 0 ? samples_processed / train_seconds : 0.0)},
        {"final_loss", six_digits(last_loss)},
        {"steps", stats.steps},
        {"restarts", 0},
        {"recovery", "in-place"},
        {"recoveries", stats.recoveries},
        {"steps_redone", stats.steps_redone},
        {"admitted", stats.admitted},
        {"epoch_samples", epoch_samples},
        {"device", device.str()}};
    std::cout << result.dump() << std::endl;
  }
  group->barrier();  // where rank 0 hosts the store, nobody may still need it when it exits
  return 0;
}

}  // namespace trainer
