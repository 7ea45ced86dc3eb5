// DDP with ranks as threads of one process against ranks as processes, both started by
// dtrain::spawn: the same workload as bench_ddp (MLP 784-H-H-10, SGD, B samples per rank, one
// intra-op thread per rank). Prints one line: dtrain-spawn mode=threads|processes ranks=N ms/step=T
// startup_s=S total_s=W
//   build/bin/bench_spawn --mode threads --ranks 2 --hidden 1024 --batch 32 --steps 100
// startup_s: from spawn() to every rank's first step (process start, LibTorch load, rendezvous).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/spawn.h"
#include "flags.h"

namespace {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    int64_t hidden = 1024, batch = 32, steps = 100, ranks = 2;
    dtrain::SpawnOptions options;
    std::string mode = "processes";
    bench::Flags("bench_spawn",
                 "DDP ranks started by dtrain::spawn as threads or processes: start-up, step time")
        .text("--mode", mode, "what a rank is", {"threads", "processes"})
        .integer("--ranks", ranks, "ranks")
        .integer("--hidden", hidden, "hidden width")
        .integer("--batch", batch, "samples per rank per step")
        .integer("--steps", steps, "timed steps")
        .parse(argc, argv);
    if (mode == "threads") options.mode = dtrain::SpawnMode::kThreads;
    // The parent's start time reaches the process ranks through the environment (they re-run
    // main()).
    if (!std::getenv("BENCH_SPAWN_T0"))
      setenv("BENCH_SPAWN_T0", std::to_string(unix_seconds()).c_str(), 1);
    const double t0 = std::atof(std::getenv("BENCH_SPAWN_T0"));
    dtrain::spawn(
        static_cast<int>(ranks),
        [&](int) {
          torch::set_num_threads(1);
          auto pg = dtrain::init_process_group();
          torch::manual_seed(0);
          torch::nn::Sequential model(torch::nn::Linear(784, hidden), torch::nn::ReLU(),
                                      torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                      torch::nn::Linear(hidden, 10));
          dtrain::DistributedDataParallel<torch::nn::SequentialImpl> ddp(model.ptr(), pg);
          torch::optim::SGD optimizer(model->parameters(), 0.01);
          at::Tensor x = torch::randn({batch, 784});
          at::Tensor y = torch::randint(0, 10, {batch});
          auto step = [&] {
            optimizer.zero_grad();
            torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
            optimizer.step();
          };
          step();
          pg->barrier();
          const double startup = unix_seconds() - t0;
          for (int i = 0; i < 4; ++i) step();
          pg->barrier();
          auto start = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < steps; ++i) step();
          pg->barrier();
          double ms =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                  .count() /
              steps;
          if (pg->rank() == 0) {
            std::printf(
                "dtrain-spawn mode=%s ranks=%lld ms/step=%.2f startup_s=%.3f total_s=%.3f\n",
                mode.c_str(), static_cast<long long>(ranks), ms, startup, unix_seconds() - t0);
            std::fflush(stdout);
          }
        },
        options);
    return 0;
  });
}
