// The 3-D data × pipeline × tensor rank mesh (see RankMesh in dtrain/comm.h).
#include <string>
#include <vector>

#include "common/format.h"
#include "dtrain/comm.h"

namespace dtrain {

RankMesh make_rank_mesh(const std::shared_ptr<ProcessGroup>& group_ptr, int pipeline_size,
                        int tensor_size) {
  if (!group_ptr) {
    throw UsageError(
        "make_rank_mesh: the process group is null; pass the group that "
        "init_process_group returned");
  }
  ProcessGroup& group = *group_ptr;
  const int n = group.size();
  // Each factor is checked against n before the product is formed, so the product cannot overflow.
  if (pipeline_size < 1 || tensor_size < 1 || pipeline_size > n || tensor_size > n ||
      n % (pipeline_size * tensor_size) != 0) {
    const std::string size = std::to_string(n);
    throw UsageError(detail::rank_text(group) + ": make_rank_mesh on group '" + group.name() +
                     "': pipeline_size=" + std::to_string(pipeline_size) +
                     " x tensor_size=" + std::to_string(tensor_size) +
                     " must be positive and divide the group size " + size +
                     " (data_size = group size / (pipeline_size x tensor_size)). Choose sizes "
                     "whose product divides " +
                     size + ".");
  }
  RankMesh mesh;
  mesh.pipeline_size = pipeline_size;
  mesh.tensor_size = tensor_size;
  mesh.data_size = n / (pipeline_size * tensor_size);
  mesh.tensor_index = group.rank() % tensor_size;
  mesh.pipeline_index = group.rank() / tensor_size % pipeline_size;
  mesh.data_index = group.rank() / (tensor_size * pipeline_size);
  auto rank_of = [&](int d, int p, int t) { return (d * pipeline_size + p) * tensor_size + t; };
  // Without tensor parallelism the groups keep the 2-D mesh's names (".data<stage>",
  // ".pipeline<replica>").
  auto shard_suffix = [&](int t) {
    return tensor_size == 1 ? std::string() : ".t" + std::to_string(t);
  };

  // Every rank creates every sub-group in the same order, so the names agree; non-members get
  // nullptr.
  for (int p = 0; p < pipeline_size; ++p) {
    for (int t = 0; t < tensor_size; ++t) {
      std::vector<int> ranks;
      for (int d = 0; d < mesh.data_size; ++d) ranks.push_back(rank_of(d, p, t));
      auto g = group.new_group(ranks, group.name() + ".data" + std::to_string(p) + shard_suffix(t));
      if (g) mesh.data_group = std::move(g);
    }
  }
  for (int d = 0; d < mesh.data_size; ++d) {
    for (int t = 0; t < tensor_size; ++t) {
      std::vector<int> ranks;
      for (int p = 0; p < pipeline_size; ++p) ranks.push_back(rank_of(d, p, t));
      auto g =
          group.new_group(ranks, group.name() + ".pipeline" + std::to_string(d) + shard_suffix(t));
      if (g) mesh.pipeline_group = std::move(g);
    }
  }
  for (int d = 0; d < mesh.data_size; ++d) {
    for (int p = 0; p < pipeline_size; ++p) {
      std::vector<int> ranks;
      for (int t = 0; t < tensor_size; ++t) ranks.push_back(rank_of(d, p, t));
      auto g = group.new_group(
          ranks, group.name() + ".tensor.d" + std::to_string(d) + ".p" + std::to_string(p));
      if (g) mesh.tensor_group = std::move(g);
    }
  }
  return mesh;
}

}  // namespace dtrain
