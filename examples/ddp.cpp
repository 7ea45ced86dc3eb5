// Data parallelism with dtrain::DistributedDataParallel: every process holds a full copy of a small
// MLP, reads its own share of each epoch through DistributedSampler, and DDP averages the gradients
// so the copies stay identical. Run it with:
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/ddp
#include <torch/torch.h>

#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kClasses = 4;
constexpr int64_t kBatchPerRank = 32;  // as in PyTorch: the global batch is 32 x world size
constexpr int64_t kEpochs = 2;

// Points scattered around one random centre per class; the clouds overlap, so no model gets
// them all right.
struct Blobs : torch::data::datasets::Dataset<Blobs> {
  Blobs() {
    labels = torch::randint(kClasses, {kSamples});
    features = 0.5 * torch::randn({kClasses, kFeatures}).index_select(0, labels) +
               torch::randn({kSamples, kFeatures});
  }
  torch::data::Example<> get(size_t i) override { return {features[i], labels[i]}; }
  std::optional<size_t> size() const override { return kSamples; }
  torch::Tensor features, labels;
};

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kFeatures, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, kClasses))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int train() {
  // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from `dtrain run`.
  auto pg = dtrain::init_process_group();
  const bool leader = pg->rank() == 0;

  // The same seed everywhere gives every rank the same data set. (The model's initial weights need
  // no such care: DDP's constructor copies rank 0's to every rank.)
  torch::manual_seed(0);
  Blobs blobs;
  Net net;
  dtrain::DistributedDataParallel ddp(net, pg);
  torch::optim::SGD optimizer(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  // Each rank sees a different 1/world of every epoch; the loader's batch size is per rank.
  auto dataset = blobs.map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(kSamples, pg);
  auto loader = torch::data::make_data_loader(dataset, sampler,
                                              torch::data::DataLoaderOptions(kBatchPerRank));

  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);  // a new shuffle each epoch, the same one on every rank
    torch::Tensor loss_sum = torch::zeros({}, torch::kDouble);
    int64_t steps = 0;
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp(batch.data), batch.target);
      loss.backward();  // returns with the gradients averaged over the ranks
      optimizer.step();
      loss_sum += loss.detach();
      ++steps;
    }
    // Each rank only saw its share: average the epoch's loss over the ranks for the report.
    torch::Tensor epoch_loss = loss_sum / steps;
    pg->all_reduce(epoch_loss, dtrain::ReduceOp::kAvg);
    if (leader)
      std::cout << "epoch " << epoch + 1 << ": loss " << epoch_loss.item<double>() << "\n";
  }

  // The replicas are identical, so rank 0 can judge the model alone, with the module itself
  // (outside DDP: no gradients to average here).
  if (leader) {
    torch::NoGradGuard no_grad;
    net->eval();
    auto logits = net->forward(blobs.features);
    auto loss = torch::nn::functional::cross_entropy(logits, blobs.labels).item<double>();
    auto accuracy = logits.argmax(1).eq(blobs.labels).to(torch::kDouble).mean().item<double>();
    std::cout << "rank 0: accuracy " << accuracy << "\n";
    std::cout << "rank 0: final loss " << loss << std::endl;
  }
  return 0;
}

int main() { return dtrain::run_main(train); }
