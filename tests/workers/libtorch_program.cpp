// A training program in the ordinary LibTorch shape (as pytorch/examples' cpp/mnist): a
// TORCH_MODULE holder, a torch::data dataset, torch::data::make_data_loader with a per-rank batch,
// an epoch loop that calls set_epoch at its top. dtrain adds the process group, DDP, its sampler
// and the agreed stop on SIGTERM, and nothing else: no glue. The tests run it under `dtrain run`
// and compare it with the same training in one process without dtrain (tests/data,
// tests/stop).
//   libtorch_program ddp OUT [--resume DIR] [--sigterm-at RANK:STEP DIR]
//       trains kEpochs epochs on every rank; rank 0 writes the parameters to OUT. --sigterm-at:
//       RANK sends itself SIGTERM after optimizer step STEP; the ranks agree to stop after that
//       step, rank 0 saves model, optimizer and sampler into DIR, and every rank exits with 143.
//       --resume: continues from what a stop saved in DIR.
//   libtorch_program single WORLD OUT
//       the reference without dtrain: one process, a batch of WORLD * kBatchPerRank, the epoch
//       order that dtrain's sampler draws (randperm seeded with the epoch).
#include <torch/torch.h>

#include <csignal>
#include <iostream>
#include <string>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/stop.h"

constexpr int64_t kSamples = 96;
constexpr int64_t kFeatures = 10;
constexpr int64_t kClasses = 4;
constexpr int64_t kBatchPerRank = 8;
constexpr int64_t kEpochs = 2;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kFeatures, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, kClasses))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

// Points around kClasses centres; the same on every rank and in every run.
class Blobs : public torch::data::datasets::Dataset<Blobs> {
 public:
  Blobs() {
    torch::manual_seed(0);
    labels_ = torch::randint(kClasses, {kSamples});
    features_ = torch::randn({kClasses, kFeatures}).index_select(0, labels_) +
                0.5 * torch::randn({kSamples, kFeatures});
  }
  torch::data::Example<> get(size_t index) override { return {features_[index], labels_[index]}; }
  std::optional<size_t> size() const override { return kSamples; }
  const torch::Tensor& features() const { return features_; }
  const torch::Tensor& labels() const { return labels_; }

 private:
  torch::Tensor features_, labels_;
};

torch::optim::SGD make_optimizer(Net& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

int train_ddp(int argc, char** argv) {
  const std::string out = argv[2];
  std::string resume_dir, stop_dir;
  int sigterm_rank = -1;
  int64_t sigterm_step = -1;
  for (int i = 3; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--resume") resume_dir = argv[++i];
    if (std::string(argv[i]) == "--sigterm-at" && i + 2 < argc) {
      const std::string at = argv[++i];
      sigterm_rank = std::stoi(at.substr(0, at.find(':')));
      sigterm_step = std::stoll(at.substr(at.find(':') + 1));
      stop_dir = argv[++i];
    }
  }

  auto pg = dtrain::init_process_group();
  torch::manual_seed(1);
  Net net;
  auto optimizer = make_optimizer(net);
  auto dataset = Blobs().map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(dataset.size().value(), pg);
  if (!resume_dir.empty()) {
    torch::load(net, resume_dir + "/model.pt");
    torch::load(optimizer, resume_dir + "/optimizer.pt");
    torch::load(sampler, resume_dir + "/sampler.pt");
  }
  dtrain::DistributedDataParallel ddp(net, pg);  // the holder, as LibTorch programs hold modules
  auto loader = torch::data::make_data_loader(dataset, sampler,
                                              torch::data::DataLoaderOptions(kBatchPerRank));
  dtrain::install_stop_handler();

  int64_t step = 0;
  for (int64_t epoch = sampler.epoch(); epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp(batch.data), batch.target).backward();
      optimizer.step();
      ++step;
      if (pg->rank() == sigterm_rank && step == sigterm_step) std::raise(SIGTERM);
      if (dtrain::should_stop(pg)) {
        if (pg->rank() == 0) {
          torch::save(net, stop_dir + "/model.pt");
          torch::save(optimizer, stop_dir + "/optimizer.pt");
          torch::save(sampler, stop_dir + "/sampler.pt");
        }
        pg->barrier();
        std::cout << "rank " << pg->rank() << " stopped after step " << step << std::endl;
        return dtrain::kStopExitCode;
      }
    }
  }
  if (pg->rank() == 0) torch::save(net->parameters(), out);
  std::cout << "rank " << pg->rank() << " trained " << step << " steps" << std::endl;
  return 0;
}

int train_single(int argc, char** argv) {
  const int64_t batch = std::stoll(argv[2]) * kBatchPerRank;
  const std::string out = argv[3];
  torch::manual_seed(1);
  Net net;
  auto optimizer = make_optimizer(net);
  Blobs data;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    torch::Tensor order = torch::randperm(kSamples, at::detail::createCPUGenerator(epoch));
    for (int64_t begin = 0; begin < kSamples; begin += batch) {
      torch::Tensor rows = order.slice(0, begin, std::min(begin + batch, kSamples));
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(data.features().index_select(0, rows)),
                                           data.labels().index_select(0, rows))
          .backward();
      optimizer.step();
    }
  }
  torch::save(net->parameters(), out);
  return 0;
}

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    const std::string mode = argc > 2 ? argv[1] : "";
    if (mode == "ddp") return train_ddp(argc, argv);
    if (mode == "single" && argc > 3) return train_single(argc, argv);
    std::cerr << "usage: libtorch_program ddp OUT [--resume DIR] [--sigterm-at RANK:STEP DIR] | "
                 "single WORLD OUT"
              << std::endl;
    return 2;
  });
}
