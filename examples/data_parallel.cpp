// Data parallelism inside one process with dtrain::DataParallel: two replicas of the model, each on
// its own thread, each computing forward, loss and backward on half of every batch; their gradients
// are summed into the original model, which the optimizer steps. No launcher needed:
//   build/bin/data_parallel
#include <torch/torch.h>

#include <iostream>

#include "dtrain/dp.h"
#include "dtrain/errors.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kClasses = 4;
constexpr int64_t kBatch = 64;  // the whole batch: DataParallel gives each replica 32 rows
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

// Cloneable, because DataParallel makes its replicas with clone(): the layers are registered in
// reset(), which clone() calls to build a fresh module before copying the parameters in.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(kFeatures, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

int train() {
  torch::manual_seed(0);
  Blobs blobs;
  Net net;
  dtrain::DataParallelOptions options;
  options.num_replicas = 2;  // CPU threads; options.devices = {cuda:0, cuda:1} for GPUs
  dtrain::DataParallel dp(net, options);
  // The replicas are refreshed from the module before every step: optimize the module's parameters.
  torch::optim::SGD optimizer(dp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      blobs.map(torch::data::transforms::Stack<>()), kBatch);
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(logits, target);  // the mean over a replica's rows
  };

  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    double loss_sum = 0;
    int64_t steps = 0;
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      // Each replica runs its own backward on its own thread (faster on CPU than dp(x) followed by
      // one backward on this thread); the returned loss is the whole batch's mean.
      loss_sum += dp->forward_backward(batch.data, batch.target, loss_fn).item<double>();
      optimizer.step();
      ++steps;
    }
    std::cout << "epoch " << epoch + 1 << ": loss " << loss_sum / steps << "\n";
  }

  torch::NoGradGuard no_grad;
  dp->eval();
  auto logits = dp(blobs.features);  // inference is split over the replicas too
  auto loss = torch::nn::functional::cross_entropy(logits, blobs.labels).item<double>();
  auto accuracy = logits.argmax(1).eq(blobs.labels).to(torch::kDouble).mean().item<double>();
  std::cout << "accuracy " << accuracy << "\n";
  std::cout << "final loss " << loss << std::endl;
  return 0;
}

int main() { return dtrain::run_main(train); }
