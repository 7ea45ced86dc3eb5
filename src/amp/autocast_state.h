// Autocast's per-thread state, captured on one thread and set on another: DataParallel's replica
// threads run their forwards under the autocast scope of the thread that called DataParallel
// (PyTorch's DataParallel does the same in its parallel_apply threads).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace dtrain::amp::detail {

struct AutocastState {
  bool cpu_enabled = false;
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;
  bool cuda_enabled = false;
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;
  bool any_enabled() const { return cpu_enabled || cuda_enabled; }
};

// This thread's autocast state.
AutocastState current_autocast_state();

// Sets `state` on this thread for the guard's lifetime (a no-op when nothing is enabled in it and
// nothing is enabled on this thread), then restores the thread's own state and, leaving the
// outermost autocast scope of the thread, empties its cache of casted weights.
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(const AutocastState& state);
  ~AutocastStateGuard();
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  bool active_ = false;
  AutocastState previous_;
};

}  // namespace dtrain::amp::detail
