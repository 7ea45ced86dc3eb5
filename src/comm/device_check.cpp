#include "comm/device_check.h"

#include <map>
#include <utility>

namespace dtrain::detail {

std::string describe_shared_device(const std::vector<RankDevice>& ranks) {
  std::map<std::pair<std::string, int>, std::vector<int>> users;
  for (const RankDevice& rank : ranks) users[{rank.host, rank.device}].push_back(rank.global_rank);
  for (const RankDevice& rank : ranks) {
    const std::vector<int>& sharing = users[{rank.host, rank.device}];
    if (sharing.size() < 2) continue;
    std::string names;
    for (size_t i = 0; i < sharing.size(); ++i) {
      names += (i == 0                    ? ""
                : i + 1 == sharing.size() ? " and "
                                          : ", ") +
               std::to_string(sharing[i]);
    }
    const std::string hostname = rank.host.substr(0, rank.host.find('/'));
    return "ranks " + names + " share cuda:" + std::to_string(rank.device) + " on host " +
           hostname +
           ", but NCCL needs a GPU of its own for each process. Give each rank its own device "
           "(cuda:LOCAL_RANK; "
           "start at most as many processes per node as it has GPUs), or set "
           "DTRAIN_CUDA_BACKEND=gloo to let "
           "ranks share a GPU through Gloo (slower; for tests)";
  }
  return "";
}

}  // namespace dtrain::detail
