// Fault-tolerant DDP training: the program saves a checkpoint every few steps and resumes from the
// newest one when it starts, so the launcher can restart it after a failure or run it on another
// number of nodes. SIGTERM (what `dtrain run`, Slurm and Kubernetes send to stop a job) makes every
// rank finish the same step, save, and exit with 143 (stopped, not finished): the same command run
// again resumes there. A worker that dies is restarted by the launcher (up to --max-restarts), and
// the job resumes from the newest checkpoint:
//   build/bin/dtrain run --nproc-per-node 2 --max-restarts 3 -- build/bin/elastic ckpt
// Across 1 or 2 nodes, the same command on each (one line; the job shrinks and grows with them):
//   build/bin/dtrain run --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d
//       --rdzv-endpoint host0:29400 -- build/bin/elastic ckpt
#include <torch/torch.h>

#include <iostream>
#include <string>

#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/stop.h"

constexpr int64_t kSamples = 2048, kFeatures = 16, kClasses = 4;
constexpr int64_t kBatchPerRank = 32;
constexpr int64_t kEpochs = 2;
constexpr int64_t kSaveEvery = 20;  // steps; a failure loses at most this much work

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

int train(int argc, char** argv) {
  auto pg = dtrain::init_process_group();  // after a restart: the new set of ranks
  const bool leader = pg->rank() == 0;
  torch::manual_seed(0);
  Blobs blobs;
  Net net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto dataset = blobs.map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(kSamples, pg);

  // What a checkpoint holds: the model, the optimizer's momentum, how far into which epoch the
  // sampler was (counted over all ranks, so it resumes at another world size too), and the step.
  dtrain::CheckpointOptions checkpoint_options;
  checkpoint_options.dir = argc > 1 ? argv[1] : "ckpt";
  dtrain::Checkpointer checkpointer(checkpoint_options, pg);  // rank 0 reads, and sends to all
  dtrain::TrainingState state;
  state.model = net.get();
  state.optimizer = &optimizer;
  state.sampler = &sampler;
  auto loaded = checkpointer.load_latest(state);  // every rank calls it; nullopt on a first run
  if (loaded && leader) std::cout << "resumed from " << loaded->path << "\n";
  // Wrap after loading: DDP starts every rank from rank 0's parameters.
  dtrain::DistributedDataParallel ddp(net, pg);
  auto loader = torch::data::make_data_loader(dataset, sampler,
                                              torch::data::DataLoaderOptions(kBatchPerRank));

  dtrain::install_stop_handler();  // from now on SIGTERM only sets a flag, checked after each step
  for (int64_t epoch = sampler.epoch(); epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);  // after a resume: keeps the loaded position in this epoch
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp(batch.data), batch.target).backward();
      optimizer.step();
      ++state.step;
      // All ranks agree (one tiny all-reduce), so they all stop after the same step.
      if (dtrain::should_stop(pg)) {
        if (leader) checkpointer.save(state);
        pg->barrier();  // nobody exits before the checkpoint is on disk
        return dtrain::kStopExitCode;
      }
      // The ranks hold identical state, so one copy suffices.
      if (leader && state.step % kSaveEvery == 0) checkpointer.save(state);
    }
  }
  // Saving the finished state too makes a rerun of the same command a no-op instead of a replay.
  if (leader) checkpointer.save(state);

  if (leader) {
    torch::NoGradGuard no_grad;
    auto logits = net->forward(blobs.features);
    auto loss = torch::nn::functional::cross_entropy(logits, blobs.labels).item<double>();
    std::cout << "rank 0: trained to step " << state.step << "\n";
    std::cout << "rank 0: final loss " << loss << std::endl;
  }
  return 0;
}

int main(int argc, char** argv) {
  return dtrain::run_main([&] { return train(argc, argv); });
}
