// Model parallelism with micro-batches in one process, with dtrain::Pipeline: a Sequential model is
// cut into two chunks, one per stage (a thread here; a GPU each with devices), and every batch is
// cut into four micro-batches so that both stages work at once instead of waiting on each other.
// No launcher needed:
//   build/bin/pipeline
#include <torch/torch.h>

#include <iostream>

#include "dtrain/errors.h"
#include "dtrain/pipeline.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kClasses = 4;
constexpr int64_t kBatch = 64;  // 4 micro-batches of 16 rows
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
  torch::manual_seed(0);
  Blobs blobs;
  // A pipeline needs the model as a sequence of layers, to know where it may cut.
  torch::nn::Sequential net(torch::nn::Linear(kFeatures, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, kClasses));
  // Cut where both halves hold about as many parameters, so neither stage waits long on the other.
  auto chunks = dtrain::split_sequential(net, dtrain::balance_by_parameters(net, 2));
  dtrain::PipelineOptions options;
  options.micro_batches = 4;  // more micro-batches: less idle time at the start and end of a step
  dtrain::Pipeline pipe(chunks, /*devices=*/{}, options);  // no devices: one CPU thread per stage
  // The chunks share the model's layers, so the model's optimizer trains the pipeline.
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      blobs.map(torch::data::transforms::Stack<>()), kBatch);
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(logits, target);  // a micro-batch's mean
  };

  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    double loss_sum = 0;
    int64_t steps = 0;
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      // Runs every micro-batch's forward and backward through both stages and leaves the gradient
      // of the whole batch's mean loss in the parameters; returns that loss.
      loss_sum += pipe.forward_backward(batch.data, batch.target, loss_fn).item<double>();
      optimizer.step();
      ++steps;
    }
    std::cout << "epoch " << epoch + 1 << ": loss " << loss_sum / steps << "\n";
  }

  auto logits = pipe.forward(blobs.features);  // pipelined inference, without gradients
  auto loss = torch::nn::functional::cross_entropy(logits, blobs.labels).item<double>();
  auto accuracy = logits.argmax(1).eq(blobs.labels).to(torch::kDouble).mean().item<double>();
  std::cout << "accuracy " << accuracy << "\n";
  std::cout << "final loss " << loss << std::endl;
  return 0;
}

int main() { return dtrain::run_main(train); }
