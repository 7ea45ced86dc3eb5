// Program for the dtrain::spawn tests: calls dtrain::spawn first thing in main, then does what argv
// says.
//   spawn_worker N ok DIR                  each rank writes DIR/rank<R> (its RANK, WORLD_SIZE,
//   MASTER_PORT) spawn_worker N fail R                  rank R throws "rank R gives up on purpose"
//   spawn_worker N crash R                 rank R dies of SIGSEGV
//   spawn_worker N hang DIR                every rank writes DIR/pid<R> and sleeps (for the orphan
//   test) spawn_worker N ddp K FILE processes|threads   K DDP steps; rank 0 writes its parameters
//   to FILE
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/spawn.h"

namespace {

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path + ".tmp");
  out << text;
  out.close();
  std::rename((path + ".tmp").c_str(), path.c_str());
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// A few DDP steps of a small MLP on data that depends only on the rank.
void train_ddp(int rank, int steps, const std::string& out) {
  auto pg = dtrain::init_process_group();
  // Thread ranks share the global generator: seeding and drawing the weights must not interleave,
  // or rank 0's starting point (which DDP broadcasts) would depend on the other thread's timing.
  static std::mutex generator_mutex;
  std::unique_lock<std::mutex> generator_lock(generator_mutex);
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(12, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  generator_lock.unlock();
  dtrain::DistributedDataParallel<torch::nn::SequentialImpl> ddp(net.ptr(), pg);
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  for (int s = 0; s < steps; ++s) {
    at::Tensor x = at::randn({5, 12}, gen);
    at::Tensor y = at::randint(0, 3, {5}, gen);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
    optimizer.step();
  }
  if (pg->rank() == 0) {
    std::ofstream file(out + ".tmp");
    file.precision(17);
    for (auto& p : net->parameters()) {
      at::Tensor flat = p.detach().reshape({-1});
      for (int64_t i = 0; i < flat.numel(); ++i) file << flat[i].item<double>() << "\n";
    }
    file.close();
    std::rename((out + ".tmp").c_str(), out.c_str());
  }
}

}  // namespace

volatile std::sig_atomic_t g_terminated = 0;

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    if (argc < 3) throw dtrain::UsageError("usage: spawn_worker N ok|fail|crash|hang|term|ddp ...");
    const int nprocs = std::atoi(argv[1]);
    const std::string what = argv[2];
    const std::string arg = argc > 3 ? argv[3] : "";
    dtrain::SpawnOptions options;
    if (what == "ddp" && argc > 5 && std::string(argv[5]) == "threads")
      options.mode = dtrain::SpawnMode::kThreads;
    options.stop_grace = std::chrono::seconds(2);
    dtrain::spawn(
        nprocs,
        [&](int rank) {
          if (what == "ok") {
            write_file(arg + "/rank" + std::to_string(rank), env("RANK") + " " + env("WORLD_SIZE") +
                                                                 " " + env("LOCAL_RANK") + " " +
                                                                 env("MASTER_PORT"));
          } else if (what == "fail" && rank == std::atoi(arg.c_str())) {
            throw std::runtime_error("rank " + std::to_string(rank) + " gives up on purpose");
          } else if (what == "crash" && rank == std::atoi(arg.c_str())) {
            ::raise(SIGSEGV);
          } else if (what == "hang") {
            write_file(arg + "/pid" + std::to_string(rank), std::to_string(::getpid()));
            std::this_thread::sleep_for(std::chrono::minutes(5));
          } else if (what == "term") {
            // Stands for a trainer that saves a checkpoint on SIGTERM before it exits.
            std::signal(SIGTERM, [](int) { g_terminated = 1; });
            write_file(arg + "/pid" + std::to_string(rank), std::to_string(::getpid()));
            for (int i = 0; i < 6000 && !g_terminated; ++i)
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            if (g_terminated) write_file(arg + "/saved" + std::to_string(rank), "checkpoint");
          } else if (what == "ddp") {
            train_ddp(rank, std::atoi(arg.c_str()), argv[4]);
          } else if (what == "fail" || what == "crash") {
            std::this_thread::sleep_for(
                std::chrono::seconds(300));  // stopped by spawn after the failure
          }
        },
        options);
    return 0;
  });
}
