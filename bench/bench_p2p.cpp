// Point-to-point latency and bandwidth between two ranks on one host: dtrain's shared-memory
// isend/irecv (Note [Shared-memory point to point]) beside c10d Gloo over TCP loopback, in one run.
//   dtrain run --nproc-per-node 2 -- build/bin/bench_p2p [--min-bytes N] [--max-bytes N]
//   [--max-iters N]
//                                                         [--transports shm,gloo]
// Rank 0 prints one JSON line per (bytes, transport):
//   latency_us     half a ping-pong round trip (rank 0 sends, rank 1 sends it back), as osu_latency
//   bandwidth_GBps bytes / time with kWindow messages in flight before an acknowledgement, as
//   osu_bw
// The Gloo side is a second group of the same two processes with shared memory off (InitOptions::
// shared_memory = false, what DTRAIN_SHM=0 does), meeting through a file store in /tmp.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/comm.h"
#include "flags.h"
#include "json_line.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWindow = 8;  // messages in flight per acknowledgement in the bandwidth test
constexpr double kBudgetS =
    0.2;  // aim for this much time per measurement: enough to average, quick overall

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Rank 0 decides how often to repeat (from its own timing); rank 1 learns it with the first
// message.
int64_t agree(dtrain::ProcessGroup& group, int64_t count) {
  at::Tensor value = torch::full({1}, count, torch::kInt64);
  if (group.rank() == 0) {
    group.send(value, 1, /*tag=*/1000);
  } else {
    group.recv(value, 0, /*tag=*/1000);
  }
  return value.item<int64_t>();
}

// `iterations` round trips of `buffer`; returns seconds per round trip on rank 0.
double ping_pong(dtrain::ProcessGroup& group, at::Tensor& buffer, int64_t iterations) {
  auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    if (group.rank() == 0) {
      group.send(buffer, 1, /*tag=*/1);
      group.recv(buffer, 1, /*tag=*/2);
    } else {
      group.recv(buffer, 0, /*tag=*/1);
      group.send(buffer, 0, /*tag=*/2);
    }
  }
  return seconds_since(start) / static_cast<double>(iterations);
}

// `iterations` windows of kWindow messages 0 -> 1, each window acknowledged; seconds per window.
double stream(dtrain::ProcessGroup& group, std::vector<at::Tensor>& buffers, int64_t iterations) {
  at::Tensor ack = torch::zeros({1}, torch::kUInt8);
  auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    std::vector<dtrain::Work> works;
    for (auto& buffer : buffers) {
      works.push_back(group.rank() == 0 ? group.isend(buffer, 1, /*tag=*/3)
                                        : group.irecv(buffer, 0, /*tag=*/3));
    }
    for (auto& work : works) work.wait();
    if (group.rank() == 0) {
      group.recv(ack, 1, /*tag=*/4);
    } else {
      group.send(ack, 0, /*tag=*/4);
    }
  }
  return seconds_since(start) / static_cast<double>(iterations);
}

struct Result {
  int64_t latency_iterations;
  double latency_s;
  int64_t bandwidth_iterations;
  double window_s;
};

Result measure(dtrain::ProcessGroup& group, int64_t bytes, int64_t max_iterations) {
  at::Tensor buffer = torch::ones({bytes}, torch::kUInt8);
  Result result{};
  // Warm-up (first use of the pair's ring or connection) and a first estimate for the repetitions.
  double estimate = ping_pong(group, buffer, 3);
  result.latency_iterations = agree(
      group, std::clamp<int64_t>(static_cast<int64_t>(kBudgetS / estimate), 5, max_iterations));
  result.latency_s = ping_pong(group, buffer, result.latency_iterations);
  std::vector<at::Tensor> buffers;
  for (int i = 0; i < kWindow; ++i) buffers.push_back(torch::ones({bytes}, torch::kUInt8));
  stream(group, buffers, 1);
  result.bandwidth_iterations = agree(
      group, std::clamp<int64_t>(static_cast<int64_t>(kBudgetS / (kWindow * result.latency_s / 2)),
                                 3, max_iterations));
  result.window_s = stream(group, buffers, result.bandwidth_iterations);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    int64_t min_bytes = 4, max_bytes = int64_t{64} << 20, max_iterations = 20000;
    std::string transports = "shm,gloo";
    bench::Flags("bench_p2p",
                 "point-to-point send/recv time and bandwidth by message size, 2 ranks")
        .integer("--min-bytes", min_bytes, "smallest message", 1)
        .integer("--max-bytes", max_bytes, "largest message", 1)
        .integer("--max-iters", max_iterations, "iterations per size at most", 5)
        .text("--transports", transports, "which transports to measure",
              {"shm,gloo", "shm", "gloo"})
        .parse(argc, argv);
    torch::set_num_threads(1);
    auto shm = dtrain::init_process_group();
    if (shm->size() != 2) {
      throw dtrain::UsageError(
          "bench_p2p: needs exactly 2 ranks (dtrain run --nproc-per-node 2), got " +
          std::to_string(shm->size()));
    }
    // The Gloo group: same ranks, shared memory off. Its store file is named after this run's
    // launcher (the parent of both ranks) and port, so concurrent runs do not meet each other.
    const char* port = std::getenv("MASTER_PORT");
    std::string store_file =
        "/tmp/dtrain-bench-p2p-" + std::to_string(::getppid()) + "-" + (port ? port : "0");
    dtrain::InitOptions gloo_options;
    gloo_options.init_method = "file://" + store_file;
    gloo_options.rank = shm->rank();
    gloo_options.world_size = 2;
    gloo_options.group_name = "gloo";
    gloo_options.shared_memory = false;
    auto gloo = dtrain::init_process_group(gloo_options);

    std::vector<std::pair<std::string, dtrain::ProcessGroup*>> groups;
    if (transports.find("shm") != std::string::npos) {
      if (!shm->uses_shared_memory()) {
        throw dtrain::UsageError(
            "bench_p2p: shared memory is off for this run (DTRAIN_SHM=0, or the ranks "
            "are on different hosts); run it without DTRAIN_SHM=0 on one host, or pass "
            "--transports gloo");
      }
      groups.emplace_back("shm", shm.get());
    }
    if (transports.find("gloo") != std::string::npos) groups.emplace_back("gloo", gloo.get());

    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      for (auto& [name, group] : groups) {
        Result r = measure(*group, bytes, max_iterations);
        if (shm->rank() == 0) {
          const double bandwidth = kWindow * static_cast<double>(bytes) / r.window_s / 1e9;
          bench::print_line({{"bench", "p2p"},
                             {"transport", name},
                             {"bytes", bytes},
                             {"latency_us", bench::rounded(r.latency_s / 2 * 1e6, 4)},
                             {"latency_iters", r.latency_iterations},
                             {"bandwidth_GBps", bench::rounded(bandwidth, 4)},
                             {"bandwidth_iters", r.bandwidth_iterations},
                             {"window", kWindow}});
        }
      }
    }
    shm->barrier();
    if (shm->rank() == 0) std::remove(store_file.c_str());
    return 0;
  });
}
