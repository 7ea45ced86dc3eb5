// c10d's Gloo (and, in a CUDA build, NCCL) backend headers, for the one source file that talks to
// those backends: src/comm/process_group.cpp. Gloo's own headers come from Debian's libgloo-dev
// (pip wheels ship c10d's headers but not Gloo's), a snapshot older than the Gloo compiled into
// LibTorch; keeping them to one translation unit bounds what a layout difference could touch.
// dtrain holds Gloo objects only through c10d (the transport device is made inside LibTorch);
// tests/package/no_gloo_symbols_test.sh checks that libdtrain defines no Gloo code of its own, and
// the comm tests run every collective dtrain issues through this file
// (tests/comm/collectives_test.cpp, p2p_test.cpp, failures_test.cpp).
#pragma once

// c10d guards its backend headers with the macros its own build defines.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#if defined(DTRAIN_WITH_CUDA) && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef DTRAIN_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
