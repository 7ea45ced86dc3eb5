// Sharded data parallelism (ZeRO stage 3, as PyTorch's FSDP) with dtrain::ShardedDataParallel: like
// DDP each rank trains on its own share of the data, but each rank keeps only 1/world of the
// parameters, gradients and Adam state, and gathers a layer's full weights just while it computes.
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/zero
#include <torch/torch.h>

#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/errors.h"
#include "dtrain/sharded.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kClasses = 4;
constexpr int64_t kBatchPerRank = 32;
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

int train() {
  auto pg = dtrain::init_process_group();
  torch::manual_seed(0);  // the same data set on every rank
  Blobs blobs;
  // Stage 3 gathers the parameters layer by layer, so it wants the model as a Sequential.
  torch::nn::Sequential net(torch::nn::Linear(kFeatures, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, kClasses));
  dtrain::ShardedDataParallelOptions options;
  // 1 shards only the optimizer state, 2 the gradients too; both keep the full parameters on
  // every rank (less communication, more memory). 3 shards the parameters as well.
  options.stage = 3;
  dtrain::ShardedDataParallel sdp(net, pg, options);
  // The optimizer gets this rank's shards, not net->parameters(): that is where the memory saving
  // comes from (Adam keeps two more tensors the size of what it optimizes).
  torch::optim::Adam optimizer(sdp->parameters(), torch::optim::AdamOptions(1e-2));

  auto dataset = blobs.map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(kSamples, pg);
  auto loader = torch::data::make_data_loader(dataset, sampler,
                                              torch::data::DataLoaderOptions(kBatchPerRank));

  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);
    torch::Tensor loss_sum = torch::zeros({}, torch::kDouble);
    int64_t steps = 0;
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(sdp(batch.data), batch.target);
      loss.backward();   // each rank ends with its shard of the averaged gradient
      optimizer.step();  // and updates its shard only; the next forward gathers the new weights
      loss_sum += loss.detach();
      ++steps;
    }
    torch::Tensor epoch_loss = loss_sum / steps;
    pg->all_reduce(epoch_loss, dtrain::ReduceOp::kAvg);
    if (pg->rank() == 0) {
      std::cout << "epoch " << epoch + 1 << ": loss " << epoch_loss.item<double>() << "\n";
    }
  }

  // Outside forward and backward the full parameters do not exist: gather them (every rank takes
  // part), evaluate the whole model on rank 0, and free them again.
  sdp->gather_full_parameters();
  if (pg->rank() == 0) {
    torch::NoGradGuard no_grad;
    auto logits = net->forward(blobs.features);
    auto loss = torch::nn::functional::cross_entropy(logits, blobs.labels).item<double>();
    auto accuracy = logits.argmax(1).eq(blobs.labels).to(torch::kDouble).mean().item<double>();
    std::cout << "rank 0: accuracy " << accuracy << "\n";
    std::cout << "rank 0: final loss " << loss << std::endl;
  }
  sdp->release_full_parameters();
  return 0;
}

int main() { return dtrain::run_main(train); }
