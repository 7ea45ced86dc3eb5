// A worker for the multi-process pipeline tests, run under `dtrain run` with one stage per process.
//   pipeline_worker vanish STAGE TIMEOUT_S
// STAGE exits (status 0) in the middle of the third step's schedule; the other stages must name it
// long before the timeout.
#include <torch/torch.h>
#include <unistd.h>

#include <iostream>

#include "dtrain/pipeline.h"

namespace {

// Passes its input through; on its n-th forward it ends the process without a word to anyone.
struct VanishImpl : torch::nn::Module {
  explicit VanishImpl(int n) : remaining(n) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (remaining > 0 && --remaining == 0) _exit(0);
    return x;
  }
  int remaining;
};
TORCH_MODULE(Vanish);

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    if (argc != 4 || std::string(argv[1]) != "vanish") {
      throw dtrain::UsageError("usage: pipeline_worker vanish STAGE TIMEOUT_S");
    }
    dtrain::InitOptions init;
    init.timeout = std::chrono::milliseconds(static_cast<int>(std::stod(argv[3]) * 1000));
    auto pg = dtrain::init_process_group(init);
    const int stages = pg->size(), vanishing = std::stoi(argv[2]);
    auto mesh = dtrain::make_rank_mesh(pg, stages);
    torch::manual_seed(1);
    std::vector<torch::nn::Sequential> chunks;
    for (int s = 0; s < stages; ++s) {
      torch::nn::Sequential chunk(torch::nn::Linear(8, 8), torch::nn::Tanh());
      // One pre-flight dry run, then 4 micro-batches a step: the 11th forward is step 3's second
      // micro-batch.
      if (s == vanishing && pg->rank() == vanishing) chunk->push_back(Vanish(11));
      chunks.push_back(chunk);
    }
    dtrain::PipelineOptions options;
    options.micro_batches = 4;
    dtrain::DistributedPipeline pipe(chunks, mesh, options);
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
      return (out - y).pow(2).mean();
    };
    for (int step = 0; step < 5; ++step) {
      auto x = torch::randn({8, 8}), y = torch::randn({8, 8});
      pipe.forward_backward(x, y, loss_fn);
    }
    std::cout << "stage " << pipe.stage() << " finished" << std::endl;
    return 0;
  });
}
