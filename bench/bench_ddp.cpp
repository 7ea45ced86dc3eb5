// DDP step time, the same workload as PyTorch's Python peer (shared/peers/torch_ddp_mlp.py): an MLP
// 784-H-H-10, cross-entropy, SGD(lr=0.01), a fixed synthetic batch of B samples per rank, one intra-op
// thread per rank. Rank 0 prints one line: dtrain-ddp world=W params=P ms/step=T
//   dtrain run --nproc-per-node 2 -- build/bin/bench_ddp --hidden 1024 --batch 32 --steps 100
// Knobs for the wrapper's own costs: --no-ddp (plain training, world size 1 only), --no-overlap (all
// bucket all-reduces after backward), --bucket-mb X (bucket cap), --grad-views (gradient_as_bucket_view).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"

namespace {

int64_t parse_int(const std::string& flag, const char* text) {
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 1) {
    throw dtrain::UsageError("bench_ddp: " + flag + " '" + text + "': expected a positive integer");
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t hidden = 1024, batch = 32, steps = 100;
    double bucket_mb = 25;
    bool use_ddp = true, overlap = true, grad_views = false;
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      bool has_value = i + 1 < argc;
      if (flag == "--hidden" && has_value) {
        hidden = parse_int(flag, argv[++i]);
      } else if (flag == "--batch" && has_value) {
        batch = parse_int(flag, argv[++i]);
      } else if (flag == "--steps" && has_value) {
        steps = parse_int(flag, argv[++i]);
      } else if (flag == "--bucket-mb" && has_value) {
        bucket_mb = std::atof(argv[++i]);
        if (!(bucket_mb > 0)) throw dtrain::UsageError("bench_ddp: --bucket-mb: expected a positive number");
      } else if (flag == "--no-ddp") {
        use_ddp = false;
      } else if (flag == "--no-overlap") {
        overlap = false;
      } else if (flag == "--grad-views") {
        grad_views = true;
      } else {
        throw dtrain::UsageError("bench_ddp: unknown argument '" + flag +
                                 "' (or missing value); accepted: --hidden N --batch N --steps N --bucket-mb X "
                                 "--no-ddp --no-overlap --grad-views");
      }
    }
    torch::set_num_threads(1);
    auto pg = dtrain::init_process_group();
    if (!use_ddp && pg->size() != 1) {
      throw dtrain::UsageError("bench_ddp: --no-ddp measures plain training and needs world size 1, got " +
                               std::to_string(pg->size()));
    }
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(784, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, hidden),
                                torch::nn::ReLU(), torch::nn::Linear(hidden, 10));
    dtrain::DistributedDataParallelOptions options;
    options.bucket_cap_bytes = static_cast<int64_t>(bucket_mb * (1 << 20));
    options.overlap = overlap;
    options.gradient_as_bucket_view = grad_views;
    std::unique_ptr<dtrain::DistributedDataParallel<torch::nn::SequentialImpl>> ddp;
    if (use_ddp) ddp = std::make_unique<dtrain::DistributedDataParallel<torch::nn::SequentialImpl>>(model.ptr(), pg, options);
    torch::optim::SGD optimizer(model->parameters(), 0.01);
    at::Tensor x = torch::randn({batch, 784});
    at::Tensor y = torch::randint(0, 10, {batch});

    auto step = [&] {
      optimizer.zero_grad();
      at::Tensor logits = ddp ? ddp->forward(x) : model->forward(x);
      torch::nn::functional::cross_entropy(logits, y).backward();
      optimizer.step();
    };
    for (int i = 0; i < 5; ++i) step();
    pg->barrier();
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) step();
    pg->barrier();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
    if (pg->rank() == 0) {
      int64_t params = 0;
      for (auto& p : model->parameters()) params += p.numel();
      std::printf("dtrain-ddp world=%d params=%lld ms/step=%.2f%s%s\n", pg->size(), static_cast<long long>(params), ms,
                  use_ddp ? "" : " (no wrapper)", overlap ? "" : " (no overlap)");
    }
    return 0;
  } catch (const dtrain::UsageError& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
