// Tensor parallelism: the MLP's hidden layer is split over two processes. The first layer's output
// features and the second layer's input features are halved, so each rank computes half the hidden
// activations and one all-reduce per forward adds the halves' contributions up. With four processes
// DDP also runs two such pairs side by side on different data (data x tensor parallelism):
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/tensor_parallel
#include <torch/torch.h>

#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/tensor_parallel.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kHidden = 256, kClasses = 4;
constexpr int kTensor = 2;  // ranks that split each layer; must divide the world size
constexpr int64_t kBatchPerReplica = 32;
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
  // Neighbouring ranks form a tensor group (they talk in every layer and want the fastest link);
  // the ranks holding the same half in different pairs form a data group.
  auto mesh = dtrain::make_rank_mesh(pg, /*pipeline_size=*/1, /*tensor_size=*/kTensor);

  // The same seed on every rank: each parallel layer draws the whole layer's initial weights and
  // keeps its half, so the halves fit together into one model.
  torch::manual_seed(0);
  Blobs blobs;
  torch::nn::Sequential net(
      dtrain::ColumnParallelLinear(kFeatures, kHidden, mesh.tensor_group),  // out: my half
      torch::nn::ReLU(),  // elementwise, so it works on a half as on the whole
      dtrain::RowParallelLinear(kHidden, kClasses, mesh.tensor_group));  // out: whole, summed
  auto hidden = net->ptr<dtrain::ColumnParallelLinearImpl>(0);
  std::cout << "rank " << pg->rank() << ": hidden features [" << hidden->local_begin() << ", "
            << hidden->local_begin() + hidden->local_size() << ") of " << kHidden << std::endl;
  // Gradients are averaged over the data group only (a group of one with two processes).
  dtrain::DistributedDataParallel ddp(net, mesh.data_group);
  torch::optim::SGD optimizer(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  // Both ranks of a tensor group must see the same batch: deal the data over the data group.
  auto dataset = blobs.map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(kSamples, mesh.data_group);
  auto loader = torch::data::make_data_loader(dataset, sampler,
                                              torch::data::DataLoaderOptions(kBatchPerReplica));

  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp(batch.data), batch.target).backward();
      optimizer.step();
    }
  }

  // Every rank of the tensor group runs the evaluation too: the layers communicate in forward, and
  // a rank that skipped it would leave its partner waiting.
  torch::NoGradGuard no_grad;
  auto logits = net->forward(blobs.features);
  auto loss = torch::nn::functional::cross_entropy(logits, blobs.labels).item<double>();
  auto accuracy = logits.argmax(1).eq(blobs.labels).to(torch::kDouble).mean().item<double>();
  if (pg->rank() == 0) {
    std::cout << "rank 0: accuracy " << accuracy << "\n";
    std::cout << "rank 0: final loss " << loss << std::endl;
  }
  return 0;
}

int main() { return dtrain::run_main(train); }
