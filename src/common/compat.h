// The one place where LibTorch versions differ for dtrain: Debian's 1.13 (CI) and 2.x (CUDA machines).
//   - 1.13: c10d's ProcessGroupGloo/ProcessGroupNCCL derive from c10d::ProcessGroup.
//   - 2.x:  they derive from c10d::Backend (ProcessGroup became a dispatcher over backends).
// dtrain talks to the concrete backend objects directly, whose collective methods kept their signatures.
#pragma once

#include <torch/csrc/api/include/torch/version.h>

// c10d guards its backend headers with the macros its own build defines.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#if defined(DTRAIN_WITH_CUDA) && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

}  // namespace dtrain::compat

// Autocast: 2.4 replaced the per-device functions (set_enabled for CUDA, set_cpu_enabled,
// get_autocast_gpu_dtype, ...) by ones that take the device type, and later releases dropped the old
// names. dtrain uses autocast on CPU and CUDA only.
#include <ATen/autocast_mode.h>

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
  at::autocast::set_autocast_enabled(type, enabled);
}
inline c10::ScalarType autocast_dtype(c10::DeviceType type) { return at::autocast::get_autocast_dtype(type); }
inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
  at::autocast::set_autocast_dtype(type, dtype);
}
#else
inline bool autocast_enabled(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
}
inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                       : at::autocast::get_autocast_cpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
}
#endif

}  // namespace dtrain::compat
