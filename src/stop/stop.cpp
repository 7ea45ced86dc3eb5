// The agreed stop on SIGTERM (include/dtrain/stop.h): a signal handler that sets a flag, and the
// all-reduce of the ranks' flags after every step.
#include "dtrain/stop.h"

#include <ATen/ops/scalar_tensor.h>

#include <atomic>
#include <csignal>

#include "stop/stop_flag.h"

namespace dtrain {
namespace {

static_assert(kStopExitCode == 128 + SIGTERM,
              "kStopExitCode must be what a shell reports for SIGTERM");

// Written from the signal handler: it must be lock-free to be async-signal-safe.
std::atomic<int> stop_flag{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void record_stop_signal(int) { stop_flag.store(1); }

}  // namespace

void install_stop_handler() {
  struct sigaction action {};
  action.sa_handler = record_stop_signal;
  sigemptyset(&action.sa_mask);
  // Restart interrupted system calls: a collective's socket read must not fail with EINTR.
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
}

void request_stop() { stop_flag.store(1); }

bool stop_requested() { return stop_flag.load() != 0; }

bool should_stop(const std::shared_ptr<ProcessGroup>& group, const CollectiveOptions& options) {
  if (!group) {
    throw UsageError(
        "should_stop: group is null; pass the group from dtrain::init_process_group() (every rank "
        "of it calls should_stop once per step).");
  }
  return detail::agree_to_stop(*group, stop_requested(), options);
}

namespace detail {

bool agree_to_stop(ProcessGroup& group, bool this_rank_stops, const CollectiveOptions& options) {
  at::Tensor flag = at::scalar_tensor(this_rank_stops ? 1 : 0, at::kLong).reshape({1});
  group.all_reduce(flag, ReduceOp::kMax, options);
  return flag.item<int64_t>() != 0;
}

void clear_stop_request() { stop_flag.store(0); }

}  // namespace detail
}  // namespace dtrain
