// DDP step time, the same workload as PyTorch's Python peer (shared/peers/torch_ddp_mlp.py): an MLP
// 784-H-H-10, cross-entropy, SGD(lr=0.01), a fixed synthetic batch of B samples per rank, one
// intra-op thread per rank. Rank 0 prints one line: dtrain-ddp world=W params=P ms/step=T
//   dtrain run --nproc-per-node 2 -- build/bin/bench_ddp --hidden 1024 --batch 32 --steps 100
// Knobs for the wrapper's own costs: --no-ddp (plain training, world size 1 only), --no-overlap
// (all bucket all-reduces after backward), --bucket-mb X (bucket cap), --separate-grads
// (gradient_as_bucket_view off: gradients copied into the buckets and back). In one process
// instead: --dp N (DataParallel over N CPU replicas, a batch of N*B per step, B per replica;
// --dp-gather: outputs gathered for one loss instead of a loss per replica), --threads N (intra-op
// threads of a plain or DDP process). --local: every rank trains its own model without DDP, in step
// with the others (a barrier before and after the timed steps): a DDP step's computation without
// its communication, to see what running side by side costs. Under DTRAIN_PROFILE the optimizer
// step is marked (dtrain::ProfileOptimizerStep). --device cuda: the same on cuda:LOCAL_RANK (modulo
// the GPUs; --dp: every replica on that GPU), the clock read after the GPU's queue has drained.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/dp.h"
#include "dtrain/profile.h"
#include "flags.h"

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    int64_t hidden = 1024, batch = 32, steps = 100;
    double bucket_mb = 25;
    int64_t dp_replicas = 0, threads = 1;
    bool dp_gather = false, local = false;
    bool no_ddp = false, no_overlap = false, separate_grads = false;
    std::string device_name = "cpu";
    bench::Flags("bench_ddp", "DDP step time on an MLP 784-H-H-10 (or the knobs below)")
        .integer("--hidden", hidden, "H")
        .integer("--batch", batch, "samples per rank per step")
        .integer("--steps", steps, "timed steps")
        .number("--bucket-mb", bucket_mb, "bucket cap, MiB")
        .on("--no-ddp", no_ddp, "plain training, world size 1 only")
        .on("--local", local,
            "every rank trains alone, in step with the others: DDP's computation alone")
        .on("--no-overlap", no_overlap, "all bucket all-reduces after backward")
        .on("--separate-grads", separate_grads, "gradient_as_bucket_view off")
        .integer("--dp", dp_replicas,
                 "DataParallel over N CPU replicas in one process, B samples each", 0)
        .on("--dp-gather", dp_gather, "with --dp: outputs gathered for one loss")
        .integer("--threads", threads, "intra-op threads")
        .text("--device", device_name, "cpu, or cuda: cuda:LOCAL_RANK modulo the GPUs",
              {"cpu", "cuda"})
        .parse(argc, argv);
    const bool use_ddp = !no_ddp && !local && dp_replicas == 0;
    const bool overlap = !no_overlap, grad_views = !separate_grads;
    torch::set_num_threads(static_cast<int>(threads));
    auto pg = dtrain::init_process_group();
    if (!use_ddp && !local && pg->size() != 1) {
      throw dtrain::UsageError(
          "bench_ddp: --no-ddp and --dp measure one process and need world size 1, got " +
          std::to_string(pg->size()));
    }
    if (device_name == "cuda" && !torch::cuda::is_available()) {
      throw dtrain::UsageError("bench_ddp: --device cuda: this process sees no CUDA device");
    }
    const c10::Device device =
        device_name == "cpu"
            ? c10::Device(c10::kCPU)
            : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(
                                          dtrain::launch_info_from_env().local_rank %
                                          static_cast<int>(torch::cuda::device_count())));
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(784, hidden), torch::nn::ReLU(),
                                torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                torch::nn::Linear(hidden, 10));
    model->to(device);
    dtrain::DistributedDataParallelOptions options;
    options.bucket_cap_bytes = static_cast<int64_t>(bucket_mb * (1 << 20));
    options.overlap = overlap;
    options.gradient_as_bucket_view = grad_views;
    dtrain::DistributedDataParallel<torch::nn::SequentialImpl> ddp{nullptr};
    if (use_ddp)
      ddp = dtrain::DistributedDataParallel<torch::nn::SequentialImpl>(model.ptr(), pg, options);
    dtrain::DataParallel<torch::nn::SequentialImpl> dp{nullptr};
    if (dp_replicas > 0) {
      dtrain::DataParallelOptions dp_options;
      dp_options.num_replicas = static_cast<int>(dp_replicas);
      if (device.is_cuda()) dp_options.devices.assign(dp_replicas, device);
      dp = dtrain::DataParallel<torch::nn::SequentialImpl>(model.ptr(), dp_options);
    }
    torch::optim::SGD optimizer(model->parameters(), 0.01);
    const int64_t rows = dp ? batch * dp_replicas : batch;  // B per replica, like B per rank
    at::Tensor x = torch::randn({rows, 784}).to(device);
    at::Tensor y = torch::randint(0, 10, {rows}).to(device);
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
    // The GPU's queue drains before the clock starts and before it stops.
    auto synchronize = [&] {
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
      pg->barrier();
    };
    for (int i = 0; i < 5; ++i) step();
    synchronize();
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) step();
    synchronize();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                    .count() /
                steps;
    if (pg->rank() == 0) {
      int64_t params = 0;
      for (auto& p : model->parameters()) params += p.numel();
      std::string mode = dp ? " (DataParallel, " + std::to_string(dp_replicas) + " replicas" +
                                  (dp_gather ? ", gathered outputs)" : ")")
                         : use_ddp ? ""
                         : local   ? " (each rank alone, no DDP)"
                                   : " (no wrapper)";
      if (!overlap) mode += " (no overlap)";
      if (threads > 1) mode += " (" + std::to_string(threads) + " intra-op threads)";
      if (device.is_cuda()) mode += " (" + device.str() + ")";
      std::printf("dtrain-ddp world=%d params=%lld ms/step=%.2f%s\n", pg->size(),
                  static_cast<long long>(params), ms, mode.c_str());
    }
    return 0;
  });
}
