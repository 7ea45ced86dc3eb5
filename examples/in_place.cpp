// Training that goes on when a process dies, with dtrain::ResilientDataParallel: DDP whose step is
// a function. When a rank dies, the others re-form their group and redo the step without it; the
// launcher restarts the dead one, which joins at a step boundary and receives the model, the
// optimizer and the sampler's position from a live peer. No restart of the others, no checkpoint.
// Run it with (one line):
//   build/bin/dtrain run --nproc-per-node 3 --recovery in-place --max-restarts 1
//       -- build/bin/in_place
// and kill one of the workers (kill -9) while it trains; or pass --demo-failure, and rank 1 kills
// itself after step 20 (once: not its replacement).
#include <torch/torch.h>

#include <csignal>
#include <iostream>
#include <string>

#include "dtrain/data.h"
#include "dtrain/errors.h"
#include "dtrain/recovery.h"

constexpr int64_t kSamples = 4096, kFeatures = 16, kClasses = 4;
constexpr int64_t kBatchPerRank = 32;
constexpr int64_t kEpochs = 5;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kFeatures, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, kClasses))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int train(bool demo_failure) {
  // The same seed everywhere: every process, a replacement too, builds the same data.
  torch::manual_seed(0);
  auto labels = torch::randint(kClasses, {kSamples});
  auto features = 0.5 * torch::randn({kClasses, kFeatures}).index_select(0, labels) +
                  torch::randn({kSamples, kFeatures});

  Net net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  // Built for a world of 1: the recovery deals it over whichever group is current.
  dtrain::DistributedSampler sampler(kSamples, 1, 0);
  // Joins the job (RANK, WORLD_SIZE, MASTER_ADDR, ... from `dtrain run`), or, for a replacement,
  // waits to be admitted and receives the state.
  dtrain::ResilientDataParallel rdp(net, optimizer, sampler);
  if (rdp.job_finished()) return 0;  // a replacement that came after the end: nothing to do
  const bool replacement = rdp.stats().steps > 0;

  int last_size = rdp.group()->size();
  for (int64_t epoch = sampler.epoch(); epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);  // keeps the position a replacement received
    torch::Tensor loss;
    // The body is one step; after a failure it runs again, on a smaller (or, after an admission, a
    // larger) group, with this rank's share of what is left of the epoch.
    while (rdp.step([&](auto& ddp) {
      auto batch = sampler.next(kBatchPerRank);
      if (!batch) return false;  // the epoch is over, on every rank at once
      auto rows = torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()));
      optimizer.zero_grad();
      loss = torch::nn::functional::cross_entropy(ddp(features.index_select(0, rows)),
                                                  labels.index_select(0, rows));
      loss.backward();  // gradients averaged over the current group
      optimizer.step();
      return true;
    })) {
      const auto& group = rdp.group();
      if (group->size() != last_size && group->rank() == 0) {
        std::cout << "step " << rdp.stats().steps << ": " << group->size() << " ranks now (were "
                  << last_size << ")" << std::endl;
      }
      last_size = group->size();
      if (demo_failure && !replacement && group->global_rank() == 1 && rdp.stats().steps == 20) {
        std::raise(SIGKILL);
      }
    }
    // (A replacement admitted at an epoch's very end trained no step of it here.)
    if (rdp.group()->rank() == 0 && loss.defined()) {
      std::cout << "epoch " << epoch + 1 << ": loss " << loss.item<double>() << std::endl;
    }
  }
  // The end, agreed among the live ranks like a step: a rank whose last step failed is healed and
  // ends with the others, a dead one is not waited for; late replacements are told the job is over.
  // No barrier of our own after it: one could not re-form.
  rdp.finish();
  const auto stats = rdp.stats();
  if (rdp.group()->rank() == 0) {
    std::cout << "done: " << stats.steps << " steps, " << stats.recoveries << " recovery(ies), "
              << stats.admitted << " replacement(s) admitted, " << rdp.group()->size()
              << " ranks at the end" << std::endl;
  }
  return 0;
}

int main(int argc, char** argv) {
  const bool demo_failure = argc > 1 && std::string(argv[1]) == "--demo-failure";
  return dtrain::run_main([&] { return train(demo_failure); });
}
