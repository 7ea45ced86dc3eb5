// NCCL drives one GPU per process: two ranks of a group on the same GPU make NCCL fail at its first
// collective with "Duplicate GPU detected", which reads like a transport failure. dtrain's process
// group has each rank announce (host, device) before NCCL starts and turns a shared device into one
// clear line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::detail {

// One rank's announcement: the machine it runs on (dtrain's host identity: hostname, then '/' and
// the boot id; or NCCL_HOSTID, as NCCL takes it), the CUDA device index its tensors live on, and
// that GPU's PCI address (what NCCL compares; empty: the index is compared).
struct RankDevice {
  int global_rank = 0;
  std::string host;
  int device = 0;
  std::string gpu;
};

// Empty when every (host, GPU) pair is used by one rank; else a message naming the first pair used
// by several ranks ("ranks 0 and 1 share cuda:0 on host gpu7 ...") and what to do about it.
std::string describe_shared_device(const std::vector<RankDevice>& ranks);

// One rank's process and the GPU it trains on, gathered before DDP or ZeRO starts (the parameter
// check in common/gradient_sync.cpp).
struct RankProcess {
  int global_rank = 0;
  int64_t process = 0;  // own_process_id() of the rank's process
  int device = -1;      // the CUDA device of its parameters; -1: none
};

// This process among every process of every host: its host name, pid namespace and pid, hashed.
int64_t own_process_id();

// Empty unless two ranks are threads of one process training on one GPU; then a message naming
// them, the device and the ways out. LibTorch's autograd runs a device's backward work on one
// thread per process, so a collective inside one rank's backward (DDP's bucket all-reduces) would
// wait forever for the other rank's backward, queued behind it on that thread (seen on an H200).
std::string describe_threads_sharing_a_gpu(const std::vector<RankProcess>& ranks);

}  // namespace dtrain::detail
