#include "comm/device_check.h"

#include <unistd.h>

#include <map>
#include <utility>

#include "common/process_identity.h"
#include "common/stable_hash.h"

namespace dtrain::detail {

std::string describe_shared_device(const std::vector<RankDevice>& ranks) {
  auto gpu_of = [](const RankDevice& rank) {
    return std::make_pair(rank.host,
                          rank.gpu.empty() ? "cuda:" + std::to_string(rank.device) : rank.gpu);
  };
  std::map<std::pair<std::string, std::string>, std::vector<int>> users;
  for (const RankDevice& rank : ranks) users[gpu_of(rank)].push_back(rank.global_rank);
  for (const RankDevice& rank : ranks) {
    const std::vector<int>& sharing = users[gpu_of(rank)];
    if (sharing.size() < 2) continue;
    std::string names;
    for (size_t i = 0; i < sharing.size(); ++i) {
      names += (i == 0                    ? ""
                : i + 1 == sharing.size() ? " and "
                                          : ", ") +
               std::to_string(sharing[i]);
    }
    const std::string hostname = rank.host.substr(0, rank.host.find('/'));
    return "ranks " + names + " share cuda:" + std::to_string(rank.device) +
           (rank.gpu.empty() ? "" : " (PCI " + rank.gpu + ")") + " on host " + hostname +
           ", but NCCL needs a GPU of its own for each process. Give each rank its own device "
           "(cuda:LOCAL_RANK; "
           "start at most as many processes per node as it has GPUs), or set "
           "DTRAIN_CUDA_BACKEND=gloo to let "
           "ranks share a GPU through Gloo (slower; for tests)";
  }
  return "";
}

int64_t own_process_id() {
  const std::string identity =
      own_hostname() + "/" + std::to_string(own_pid_namespace()) + "/" + std::to_string(getpid());
  return stable_hash(identity);
}

std::string describe_threads_sharing_a_gpu(const std::vector<RankProcess>& ranks) {
  std::map<std::pair<int64_t, int>, std::vector<int>> users;  // (process, device) -> ranks
  for (const RankProcess& rank : ranks) {
    if (rank.device >= 0) users[{rank.process, rank.device}].push_back(rank.global_rank);
  }
  for (const auto& [where, sharing] : users) {
    if (sharing.size() < 2) continue;
    return "ranks " + std::to_string(sharing[0]) + " and " + std::to_string(sharing[1]) +
           " are threads of one process training on cuda:" + std::to_string(where.second) +
           ", but LibTorch's autograd runs a device's backward work on one thread per process, "
           "so a collective inside one rank's backward would wait forever for the other's. Give "
           "each thread rank a GPU of its own, or run one process per rank (dtrain run; ranks "
           "sharing a GPU then need DTRAIN_CUDA_BACKEND=gloo)";
  }
  return "";
}

}  // namespace dtrain::detail
