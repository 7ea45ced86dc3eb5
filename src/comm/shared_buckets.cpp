// DDP's gradient buckets in shared memory; see Note [Gradient buckets in shared memory] in
// shared_buckets.h.
#include "comm/shared_buckets.h"

#include <ATen/ATen.h>

#include "comm/connect.h"
#include "comm/group_state.h"
#include "comm/shm_segment.h"
#include "comm/shm_transport.h"
#include "common/log.h"

namespace dtrain::detail {

std::unique_ptr<SharedBuckets> SharedBuckets::create(ProcessGroup& group, int64_t bytes_per_rank) {
  GroupState& state = *GroupInternals::state(group);
  if (!state.shm || bytes_per_rank <= 0) return nullptr;
  state.check_usable();
  const bool wanted = shared_buckets_enabled_by_env();
  const int64_t stride =
      (bytes_per_rank + 4095) / 4096 * 4096;  // each rank's region on its own pages
  const std::string key = "shared-buckets/" + std::to_string(state.shared_buckets_created++);
  SegmentOptions options;
  options.bytes = static_cast<size_t>(stride) * state.size;
  options.wanted = wanted;
  std::string problem;
  auto segment =
      map_group_segment(*state.store, key, state.rank, state.size, state.timeout, options, problem);
  if (!segment) {
    if (!problem.empty()) {
      DTRAIN_LOG(kWarn,
                 "shared memory unavailable for DDP's gradient buckets ("
                     << problem << ", " << stride * state.size
                     << " bytes); each all-reduce copies them through the transport instead");
    }
    return nullptr;
  }
  return std::unique_ptr<SharedBuckets>(new SharedBuckets(group, std::move(segment), stride));
}

SharedBuckets::SharedBuckets(ProcessGroup& group, std::shared_ptr<ShmSegment> segment,
                             int64_t bytes_per_rank)
    : group_(group), segment_(std::move(segment)), bytes_per_rank_(bytes_per_rank) {}

SharedBuckets::~SharedBuckets() = default;

at::Tensor SharedBuckets::tensor(int64_t offset, int64_t numel, at::ScalarType type) const {
  char* data = segment_->base() + bytes_per_rank_ * GroupInternals::state(group_)->rank + offset;
  std::shared_ptr<ShmSegment> keep = segment_;
  return at::from_blob(
      data, {numel}, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(type));
}

Work SharedBuckets::all_reduce_async(int64_t offset, int64_t numel, at::ScalarType type,
                                     double scale) {
  const std::shared_ptr<GroupState>& state = GroupInternals::state(group_);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(type));
  auto work = start_work(
      state, "all_reduce", true, -1, {}, static_cast<uint64_t>(bytes), [&](WorkState& w) {
        std::vector<char*> regions;
        for (int r = 0; r < state->size; ++r)
          regions.push_back(segment_->base() + bytes_per_rank_ * r + offset);
        w.in_flight = shm_collective_in_flight(state->shm->all_reduce_regions_async(
            std::move(regions), numel, type, scale, w.timeout, segment_));
      });
  return GroupInternals::work(std::move(work));
}

}  // namespace dtrain::detail
