// Gradient buckets that live in shared memory, for DDP among ranks on one host.
//
// Note [Gradient buckets in shared memory]
// DDP's gradients take, per element and per step, a copy into the bucket, a copy into the
// transport's slot, the reduction, and a copy back: on a 2-core VM this memory traffic, not the
// arithmetic, made a 2-rank step 1.6x one process. When every rank of the group is on one host,
// each rank's buckets are instead carved out of one segment that all ranks map, so a peer reads
// them where they are:
//   1. backward writes each rank's gradients into its own region (with gradient_as_bucket_view
//      the gradients *are* the region, and nothing is copied at all);              then a barrier;
//   2. rank r sums share r over every rank's region, scales it (1/N for the average) and writes
//      the result into every region;                                               then a barrier
// after which every rank's region holds the averaged gradients. Each element is computed by one
// rank, so all ranks hold the same bits. The second barrier keeps a rank from writing its region
// (the next backward, zero_grad) while a peer still reads or writes it. The operations run on the
// group's shared-memory transport thread, in order with its other collectives, so they overlap with
// backward as any bucket all-reduce does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dtrain/comm.h"

namespace dtrain::detail {

class ShmSegment;

class SharedBuckets {
 public:
  // Collective over `group`: one region of `bytes_per_rank` for each rank, in a segment every rank
  // maps. nullptr on every rank when the group does not use shared memory, /dev/shm lacks the room
  // (a warning says so) or any rank has DTRAIN_SHM_BUCKETS=0, so the caller falls back to private
  // buckets.
  static std::unique_ptr<SharedBuckets> create(ProcessGroup& group, int64_t bytes_per_rank);
  ~SharedBuckets();

  // `numel` elements of `type` of this rank's region, from byte `offset` (a multiple of 64). The
  // tensor keeps the mapping alive, so gradients that point into it stay valid after DDP is gone.
  at::Tensor tensor(int64_t offset, int64_t numel, at::ScalarType type) const;
  // Collective: the same (offset, numel, type) on every rank; every element of that range becomes
  // scale * (the sum over ranks) in every rank's region. float and double only.
  Work all_reduce_async(int64_t offset, int64_t numel, at::ScalarType type, double scale);

 private:
  SharedBuckets(ProcessGroup& group, std::shared_ptr<ShmSegment> segment, int64_t bytes_per_rank);
  ProcessGroup& group_;
  std::shared_ptr<ShmSegment> segment_;
  int64_t bytes_per_rank_;
};

}  // namespace dtrain::detail
