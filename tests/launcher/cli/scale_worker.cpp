// A stand-in training program for the `dtrain scale` tests: plain C++, no LibTorch. Each rank
// writes one DTRAIN_PROFILE record per step (the fields of scale::StepRecord) whose times
// follow a known model instead of a clock, so the tests know every number the report must show:
//   compute   = compute_ms_per_sample * samples * (1 + contention * (WORLD_SIZE - 1))
//   comm      = 2(N-1) * ops * alpha + 2(N-1)/N * bytes / bandwidth     (a ring all-reduce)
//   exposed   = exposed_share * comm
//   step      = compute + exposed + optimizer; the record's "time" advances by step + gap
// It sleeps 1 ms of real time per step so a run lasts long enough to be stopped, and can fail on
// purpose at one world size, print its throughput like a non-dtrain program, or write no records.
//
// Flags (all optional): --global-batch G (split over the ranks: strong scaling) | --batch B (per
// rank: weak), --compute-ms-per-sample C, --contention P, --optimizer-ms O, --gap-ms X, --alpha-us
// A, --gbps BW (Gbit/s), --bytes N, --ops K, --vary-bytes (steps alternate 1x, 2x, 3x the bytes),
// --exposed-share F, --steps S (exit 0 after S steps; default: run until stopped), --fail-at-world
// W (rank W-1 exits with code 3 after 2 steps when WORLD_SIZE is W), --no-profile,
// --only-rank0-profile (the other ranks write no records),
// --print-samples (rank 0 prints "throughput: X samples/s" every step).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

double env_number(const char* name, double fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atof(value) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  double global_batch = 64, batch = 0, compute_ms = 0.1, contention = 0, optimizer_ms = 0.5,
         gap_ms = 0, alpha_us = 20, gbps = 8, bytes = 1e6, ops = 2, exposed_share = 1;
  long steps = -1;
  int fail_at_world = 0;
  bool vary_bytes = false, profile = true, print_samples = false, only_rank0 = false;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> double {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "scale_worker: %s: expected a value\n", flag.c_str());
        std::exit(2);
      }
      return std::atof(argv[++i]);
    };
    double* number = flag == "--global-batch"            ? &global_batch
                     : flag == "--batch"                 ? &batch
                     : flag == "--compute-ms-per-sample" ? &compute_ms
                     : flag == "--contention"            ? &contention
                     : flag == "--optimizer-ms"          ? &optimizer_ms
                     : flag == "--gap-ms"                ? &gap_ms
                     : flag == "--alpha-us"              ? &alpha_us
                     : flag == "--gbps"                  ? &gbps
                     : flag == "--bytes"                 ? &bytes
                     : flag == "--ops"                   ? &ops
                     : flag == "--exposed-share"         ? &exposed_share
                                                         : nullptr;
    if (number != nullptr) {
      *number = value();
    } else if (flag == "--steps") {
      steps = static_cast<long>(value());
    } else if (flag == "--fail-at-world") {
      fail_at_world = static_cast<int>(value());
    } else if (flag == "--vary-bytes") {
      vary_bytes = true;
    } else if (flag == "--no-profile") {
      profile = false;
    } else if (flag == "--only-rank0-profile") {
      only_rank0 = true;
    } else if (flag == "--print-samples") {
      print_samples = true;
    } else {
      std::fprintf(stderr, "scale_worker: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const int rank = static_cast<int>(env_number("RANK", 0));
  const int world = static_cast<int>(env_number("WORLD_SIZE", 1));
  const double samples = batch > 0 ? batch : global_batch / world;
  const char* path = std::getenv("DTRAIN_PROFILE");
  int fd = -1;
  if (profile && (rank == 0 || !only_rank0) && path != nullptr && *path != '\0') {
    fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
      std::fprintf(stderr, "scale_worker: rank %d: cannot open DTRAIN_PROFILE %s\n", rank, path);
      return 1;
    }
  }
  // The records' own clock (seconds), advanced by the model; a small origin keeps sub-microsecond
  // resolution in a double.
  double clock = 1e6;
  for (long step = 0; steps < 0 || step < steps; ++step) {
    if (fail_at_world == world && rank == world - 1 && step == 2) {
      std::fprintf(stderr, "scale_worker: rank %d: failing on purpose at world size %d\n", rank,
                   world);
      return 3;
    }
    const double n = world;
    const double step_bytes = world > 1 ? bytes * (vary_bytes ? 1 + step % 3 : 1) : 0;
    const double step_ops = world > 1 ? ops : 0;
    const double compute_s = compute_ms * 1e-3 * samples * (1 + contention * (n - 1));
    const double comm_s = world > 1 ? 2 * (n - 1) * ops * alpha_us * 1e-6 +
                                          2 * (n - 1) / n * step_bytes / (gbps * 1e9 / 8)
                                    : 0;
    const double exposed_s = exposed_share * comm_s;
    const double step_s = compute_s + exposed_s + optimizer_ms * 1e-3;
    clock += step_s + gap_ms * 1e-3;
    if (fd >= 0) {
      char record[512];
      int length = std::snprintf(
          record, sizeof record,
          "{\"rank\":%d,\"world_size\":%d,\"strategy\":\"ddp\",\"step\":%ld,\"step_s\":%.9f,"
          "\"forward_s\":%.9f,\"backward_s\":%.9f,\"exposed_comm_s\":%.9f,\"optimizer_s\":%.9f,"
          "\"comm_s\":%.9f,\"comm_bytes\":%.0f,\"comm_ops\":%.0f,\"samples\":%.0f,"
          "\"time\":%.9f}\n",
          rank, world, step, step_s, compute_s / 3, compute_s * 2 / 3, exposed_s,
          optimizer_ms * 1e-3, comm_s, step_bytes, step_ops, samples, clock);
      if (write(fd, record, static_cast<std::size_t>(length)) != length) return 1;
    }
    if (print_samples && rank == 0) {
      std::printf("step %ld: throughput: %.1f samples/s\n", step,
                  samples * world / (step_s + gap_ms * 1e-3));
      std::fflush(stdout);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return 0;
}
