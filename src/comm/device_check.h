// NCCL drives one GPU per process: two ranks of a group on the same GPU make NCCL fail at its first
// collective with "Duplicate GPU detected", which reads like a transport failure. dtrain's process
// group has each rank announce (host, device) before NCCL starts and turns a shared device into one
// clear line.
#pragma once

#include <string>
#include <vector>

namespace dtrain::detail {

// One rank's announcement: the machine it runs on (dtrain's host identity: hostname, then '/' and
// the boot id) and the CUDA device index its tensors live on.
struct RankDevice {
  int global_rank = 0;
  std::string host;
  int device = 0;
};

// Empty when every (host, device) pair is used by one rank; else a message naming the first pair
// used by several ranks ("ranks 0 and 1 share cuda:0 on host gpu7 ...") and what to do about it.
std::string describe_shared_device(const std::vector<RankDevice>& ranks);

}  // namespace dtrain::detail
