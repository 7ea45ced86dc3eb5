// DDP step time, the same workload as PyTorch's Python peer (shared/peers/torch_ddp_mlp.py): an MLP
// 784-H-H-10, cross-entropy, SGD(lr=0.01), a fixed synthetic batch of B samples per rank, one intra-op
// thread per rank. Rank 0 prints one line: dtrain-ddp world=W params=P ms/step=T
//   dtrain run --nproc-per-node 2 -- build/bin/bench_ddp --hidden 1024 --batch 32 --steps 100
// Knobs for the wrapper's own costs: --no-ddp (plain training, world size 1 only), --no-overlap (all
// bucket all-reduces after backward), --bucket-mb X (bucket cap), --separate-grads (gradient_as_bucket_view
// off: gradients copied into the buckets and back).
// In one process instead: --dp N (DataParallel over N CPU replicas, a batch of N*B per step, B per replica;
// --dp-gather: outputs gathered for one loss instead of a loss per replica),
// --threads N (intra-op threads of a plain or DDP process).
// --local: every rank trains its own model without DDP, in step with the others (a barrier before and after
// the timed steps): a DDP step's computation without its communication, to see what running side by side
// costs. Under DTRAIN_PROFILE the optimizer step is marked (dtrain::ProfileOptimizerStep).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/dp.h"
#include "dtrain/profile.h"

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
  return dtrain::run_main([&] {
    int64_t hidden = 1024, batch = 32, steps = 100;
    double bucket_mb = 25;
    bool use_ddp = true, overlap = true, grad_views = true;
    int64_t dp_replicas = 0, threads = 1;
    bool dp_gather = false, local = false;
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
      } else if (flag == "--dp" && has_value) {
        dp_replicas = parse_int(flag, argv[++i]);
        use_ddp = false;
      } else if (flag == "--dp-gather") {
        dp_gather = true;
      } else if (flag == "--threads" && has_value) {
        threads = parse_int(flag, argv[++i]);
      } else if (flag == "--no-ddp") {
        use_ddp = false;
      } else if (flag == "--local") {
        use_ddp = false;
        local = true;
      } else if (flag == "--no-overlap") {
        overlap = false;
      } else if (flag == "--separate-grads") {
        grad_views = false;
      } else {
        throw dtrain::UsageError("bench_ddp: unknown argument '" + flag +
                                 "' (or missing value); accepted: --hidden N --batch N --steps N --bucket-mb X "
                                 "--no-ddp --local --no-overlap --separate-grads --dp N --dp-gather --threads N");
      }
    }
    torch::set_num_threads(static_cast<int>(threads));
    auto pg = dtrain::init_process_group();
    if (!use_ddp && !local && pg->size() != 1) {
      throw dtrain::UsageError("bench_ddp: --no-ddp and --dp measure one process and need world size 1, got " +
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
    std::unique_ptr<dtrain::DataParallel<torch::nn::SequentialImpl>> dp;
    if (dp_replicas > 0) {
      dtrain::DataParallelOptions dp_options;
      dp_options.num_replicas = static_cast<int>(dp_replicas);
      dp = std::make_unique<dtrain::DataParallel<torch::nn::SequentialImpl>>(model.ptr(), dp_options);
    }
    torch::optim::SGD optimizer(model->parameters(), 0.01);
    const int64_t rows = dp ? batch * dp_replicas : batch;  // B per replica, like B per rank
    at::Tensor x = torch::randn({rows, 784});
    at::Tensor y = torch::randint(0, 10, {rows});
    auto mean_loss = [](const at::Tensor& logits, const at::Tensor& target) {
      return torch::nn::functional::cross_entropy(logits, target);
    };

    auto step = [&] {
      optimizer.zero_grad();
      if (dp && dp_gather) {
        mean_loss(dp->forward(x), y).backward();
      } else if (dp) {
        dp->forward_backward(x, y, mean_loss);
      } else {
        mean_loss(ddp ? ddp->forward(x) : model->forward(x), y).backward();
      }
      dtrain::ProfileOptimizerStep timed;
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
      std::string mode = dp ? " (DataParallel, " + std::to_string(dp_replicas) + " replicas" +
                                  (dp_gather ? ", gathered outputs)" : ")")
                            : use_ddp ? "" : local ? " (each rank alone, no DDP)" : " (no wrapper)";
      if (!overlap) mode += " (no overlap)";
      if (threads > 1) mode += " (" + std::to_string(threads) + " intra-op threads)";
      std::printf("dtrain-ddp world=%d params=%lld ms/step=%.2f%s\n", pg->size(), static_cast<long long>(params), ms,
                  mode.c_str());
    }
    return 0;
  });
}
