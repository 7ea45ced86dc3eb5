// dtrain::spawn: run a training function as N ranks on this machine, the C++ counterpart of
// torch.multiprocessing.spawn.
//
//   int main(int argc, char** argv) {
//     dtrain::spawn(2, [&](int rank) {           // first thing in main: "How a worker finds fn"
//       auto pg = dtrain::init_process_group();  // the torchrun environment is set
//       ...train...
//     });
//   }
//
// Processes (the default): each rank is a fresh process of this program, re-executed through
// /proc/self/exe with the same arguments (not forked from a process whose LibTorch thread pools
// already run), with the environment `dtrain run` sets on one node (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR, MASTER_PORT (a free port), TORCHELASTIC_*, ...),
// each in its own process group with stdin from /dev/null, writing to this program's stdout and
// stderr: the workers of `dtrain run` are started, watched and stopped by the same code. spawn()
// blocks until every worker has exited. On the first failure (a non-zero exit status, a signal, an
// exception out of fn) it stops the others (SIGTERM, then SIGKILL after `stop_grace`) and throws
// SpawnError naming the rank and its exit status, signal or exception message. Workers die with the
// parent (PR_SET_PDEATHSIG, plus a check that the parent is still the one that started them), so
// killing the parent leaves no orphans. SIGINT, SIGTERM or SIGHUP reaching the parent while spawn()
// waits (a scheduler preempting the job) stop the workers as `dtrain run` does: SIGTERM, so they
// can save a checkpoint, SIGKILL after `stop_grace`; then the signal takes its usual course in the
// parent (by default it ends there; if the program has its own handler, spawn() throws SpawnError
// with rank -1 once it returns). A signal the program ignores stays ignored, in the workers too.
//
// How a worker finds fn: the worker runs main() again from the top and reaches the same spawn()
// call; an environment marker (DTRAIN_SPAWN_NPROCS) tells that call it is a worker, LOCAL_RANK
// which one (R), so instead of spawning it calls fn(R) and exits the process (status 0, or 1 after
// an exception, 2 after a UsageError) instead of returning. So: call spawn() once per program run,
// early in main(), before anything with side effects (files written, output printed) that the
// workers must not repeat, and decide `nprocs` the same way in the parent and the workers (from
// argv, not from the clock).
//
// Threads (SpawnMode::kThreads): the ranks are threads of this process; init_process_group() called
// on a rank's thread (with the default init_method "env://") joins an in-process store
// ("memory://"), and collectives go through the same shared-memory transport. No process start-up,
// no copy of the program per rank; each thread is free to drive its own device
// (torch::Device(torch::kCUDA, rank)). fn runs with one intra-op thread per rank unless it sets
// another. Caveat: a rank that throws cannot stop the others; they fail at their next collective
// with that rank, after the group's timeout (DTRAIN_TIMEOUT_S).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "dtrain/errors.h"

namespace dtrain {

enum class SpawnMode { kProcesses, kThreads };

struct SpawnOptions {
  SpawnMode mode = SpawnMode::kProcesses;
  // Processes only: where rank 0 hosts the store. Port 0: a free port picked by the parent.
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // Processes only: after the first failure (or a signal to the parent), how long the workers get
  // between SIGTERM and SIGKILL.
  std::chrono::milliseconds stop_grace = std::chrono::seconds(5);
};

// A rank failed. what() names it, e.g. "dtrain::spawn: rank 1/4 (pid 4242) exited with status 1:
// <the exception's message>" or "... was killed by signal 11 (Segmentation fault)".
class SpawnError : public Error {
 public:
  SpawnError(const std::string& what, int rank, int exit_status, int signal)
      : Error(what), rank(rank), exit_status(exit_status), signal(signal) {}
  int rank;         // the rank that failed first (-1: a signal to the parent stopped them all)
  int exit_status;  // its exit status (-1: killed by a signal, or a thread rank)
  int signal;       // the signal that killed it, or that the parent received (0: none)
};

// Runs fn(rank) for rank = 0..nprocs-1 as described above. Throws UsageError for nprocs < 1 (or, in
// a worker, an nprocs that differs from the parent's), SpawnError for a failed rank.
void spawn(int nprocs, const std::function<void(int rank)>& fn, const SpawnOptions& options = {});

}  // namespace dtrain
