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
