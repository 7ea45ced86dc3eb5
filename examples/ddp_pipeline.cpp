// Data x pipeline parallelism with dtrain::DistributedPipeline: the model is cut into two stages,
// one process each, and with more processes there are several such pipelines, each training on its
// own share of the data while DDP averages each stage's gradients over the pipelines. Four
// processes make 2 pipelines x 2 stages; two make one pipeline:
//   build/bin/dtrain run --nproc-per-node 4 -- build/bin/ddp_pipeline
#include <torch/torch.h>

#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/errors.h"
#include "dtrain/pipeline.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kClasses = 4;
constexpr int kStages = 2;                 // processes per pipeline; must divide the world size
constexpr int64_t kBatchPerPipeline = 32;  // 4 micro-batches of 8 rows
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
  // Ranks 2p and 2p+1 form pipeline p (mesh.pipeline_group); the ranks holding the same stage in
  // every pipeline form its data group (mesh.data_group), where gradients are averaged.
  dtrain::RankMesh mesh = dtrain::make_rank_mesh(pg, kStages);

  // Every rank builds the whole model under the same seed and keeps its own stage's layers.
  torch::manual_seed(0);
  Blobs blobs;
  torch::nn::Sequential net(torch::nn::Linear(kFeatures, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, kClasses));
  auto chunks = dtrain::split_sequential(net, dtrain::balance_by_parameters(net, kStages));
  dtrain::PipelineOptions options;
  options.micro_batches = 4;
  dtrain::DistributedPipeline pipe(chunks, mesh, options);
  torch::optim::SGD optimizer(pipe.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  // The data is dealt over the pipelines, not the processes: both stages of a pipeline must read
  // the same batch (the first stage uses its inputs, the last its labels), so the sampler is built
  // over the data group, where this rank's position is its pipeline's index.
  auto dataset = blobs.map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(kSamples, mesh.data_group);
  auto loader = torch::data::make_data_loader(dataset, sampler,
                                              torch::data::DataLoaderOptions(kBatchPerPipeline));
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(logits, target);  // a micro-batch's mean
  };

  double epoch_loss = 0;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);
    torch::Tensor loss_sum = torch::zeros({}, torch::kDouble);
    int64_t steps = 0;
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      // Blocks on the neighbouring stage; the loss of this pipeline's batch comes back on both.
      loss_sum += pipe.forward_backward(batch.data, batch.target, loss_fn);
      optimizer.step();
      ++steps;
    }
    // Average over the pipelines (every rank takes part, each in its own stage's data group).
    torch::Tensor mean = loss_sum / steps;
    mesh.data_group->all_reduce(mean, dtrain::ReduceOp::kAvg);
    epoch_loss = mean.item<double>();
    if (pg->rank() == 0) std::cout << "epoch " << epoch + 1 << ": loss " << epoch_loss << "\n";
  }
  if (pg->rank() == 0) {
    std::cout << "rank 0: " << mesh.data_size << " pipelines x " << kStages << " stages\n";
    std::cout << "rank 0: final loss " << epoch_loss << std::endl;
  }
  return 0;
}

int main() { return dtrain::run_main(train); }
