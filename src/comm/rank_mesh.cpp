// The 2-D data × pipeline rank mesh (see RankMesh in dtrain/comm.h).
#include "dtrain/comm.h"

namespace dtrain {

RankMesh make_rank_mesh(ProcessGroup& group, int pipeline_size) {
  if (pipeline_size < 1 || group.size() % pipeline_size != 0) {
    throw UsageError("rank " + std::to_string(group.global_rank()) + ": make_rank_mesh: pipeline_size=" +
                     std::to_string(pipeline_size) + " must be a positive divisor of the group size " +
                     std::to_string(group.size()));
  }
  RankMesh mesh;
  mesh.pipeline_size = pipeline_size;
  mesh.data_size = group.size() / pipeline_size;
  mesh.data_index = group.rank() / pipeline_size;
  mesh.pipeline_index = group.rank() % pipeline_size;
  // Every rank creates every sub-group in the same order, so the names agree; non-members get nullptr.
  for (int stage = 0; stage < pipeline_size; ++stage) {
    std::vector<int> ranks;
    for (int d = 0; d < mesh.data_size; ++d) ranks.push_back(d * pipeline_size + stage);
    auto g = group.new_group(ranks, group.name() + ".data" + std::to_string(stage));
    if (g) mesh.data_group = std::move(g);
  }
  for (int d = 0; d < mesh.data_size; ++d) {
    std::vector<int> ranks;
    for (int stage = 0; stage < pipeline_size; ++stage) ranks.push_back(d * pipeline_size + stage);
    auto g = group.new_group(ranks, group.name() + ".pipeline" + std::to_string(d));
    if (g) mesh.pipeline_group = std::move(g);
  }
  return mesh;
}

}  // namespace dtrain
