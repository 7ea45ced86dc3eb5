// All-reduce bandwidth through dtrain's process group, per message size: shared memory when every
// rank is on one host, c10d Gloo otherwise (DTRAIN_SHM=0 forces Gloo, for comparison).
//   dtrain run --nproc-per-node 3 -- build/bin/bench_allreduce \
//       [--min-bytes N] [--max-bytes N] [--max-iters N]
// Rank 0 prints one row per size: time per all-reduce (the slowest rank's), algorithm bandwidth
// (bytes / time) and bus bandwidth (algbw * 2(n-1)/n, the bytes each rank's links carry in a ring,
// as nccl-tests reports it), beside this machine's memcpy bandwidth for the same size.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "dtrain/comm.h"
#include "flags.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Enough repetitions that each size runs ~0.1-0.3 s on loopback, few enough that 64 MiB stays
// quick.
int iterations_for(int64_t bytes, int64_t max_iterations) {
  int64_t n = (int64_t{64} << 20) / std::max<int64_t>(bytes, 1);
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(n, 5), max_iterations));
}

double memcpy_gbps(int64_t bytes, int iterations) {
  std::vector<char> from(bytes, 1), to(bytes);
  std::memcpy(to.data(), from.data(), bytes);  // fault the pages in
  auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    std::memcpy(to.data(), from.data(), bytes);
    from[i % bytes] = to[(i + 1) % bytes];  // keep the copy from being optimized away
  }
  return bytes * static_cast<double>(iterations) / seconds_since(start) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    int64_t min_bytes = 4, max_bytes = int64_t{64} << 20, max_iterations = 1000;
    bench::Flags("bench_allreduce",
                 "all-reduce time and bandwidth by message size, doubling from --min-bytes")
        .integer("--min-bytes", min_bytes, "smallest message", 4)
        .integer("--max-bytes", max_bytes, "largest message", 4)
        .integer("--max-iters", max_iterations, "iterations per size at most", 5)
        .parse(argc, argv);
    torch::set_num_threads(1);
    auto pg = dtrain::init_process_group();
    const int n = pg->size();
    if (pg->rank() == 0) {
      std::printf(
          "# all_reduce (sum, float32), %d ranks, algorithm: %s\n", n,
          pg->uses_shared_memory()
              ? (n == 2
                     ? "dtrain shared memory, one step: every rank combines both slots (all ranks "
                       "on one host)"
                     : "dtrain shared-memory reduce-scatter + all-gather (all ranks on one host)")
              : "Gloo ring all-reduce via c10d ProcessGroupGloo (2 threads)");
      std::printf("%12s %8s %12s %12s %12s %14s\n", "bytes", "iters", "time_us", "algbw_GB/s",
                  "busbw_GB/s", "memcpy_GB/s");
    }
    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      at::Tensor buffer = torch::ones({bytes / 4});
      int iterations = iterations_for(bytes, max_iterations);
      for (int i = 0; i < 3; ++i) pg->all_reduce(buffer);  // warm-up: connections, caches
      pg->barrier();
      auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) pg->all_reduce(buffer);
      at::Tensor elapsed = torch::full({1}, seconds_since(start) / iterations, torch::kFloat64);
      pg->all_reduce(elapsed,
                     dtrain::ReduceOp::kMax);  // a collective is as slow as its slowest rank
      double seconds = elapsed.item<double>();
      double memcpy = 0;
      if (pg->rank() == 0) memcpy = memcpy_gbps(bytes, iterations);
      pg->barrier();  // keep rank 0's memcpy out of the next size's timing
      if (pg->rank() == 0) {
        double algbw = bytes / seconds / 1e9;
        double busbw = n > 1 ? algbw * 2.0 * (n - 1) / n : 0.0;
        std::printf("%12lld %8d %12.1f %12.3f %12.3f %14.2f\n", static_cast<long long>(bytes),
                    iterations, seconds * 1e6, algbw, busbw, memcpy);
        std::fflush(stdout);
      }
    }
    return 0;
  });
}
