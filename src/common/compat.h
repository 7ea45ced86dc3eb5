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

// Reduce-scatter into one flat output: `_reduce_scatter_base` in 1.13, `reduce_scatter_tensor_coalesced`
// and friends arrived later; both keep `_reduce_scatter_base`.
inline c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(Backend& backend, at::Tensor& output,
                                                          at::Tensor& input,
                                                          const c10d::ReduceScatterOptions& options) {
  return backend._reduce_scatter_base(output, input, options);
}

}  // namespace dtrain::compat
