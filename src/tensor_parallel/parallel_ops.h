// The four autograd functions tensor-parallel layers are built from (Megatron-LM's "mappings"),
// each a collective one way and its adjoint the other; see Note [Tensor-parallel MLP: one
// all-reduce each way] in dtrain/tensor_parallel.h for why these pairs:
//
//   function                     forward              backward
//   copy_to_tensor_parallel      identity             all-reduce (sum)
//   reduce_from_tensor_parallel  all-reduce (sum)     identity
//   gather_from_tensor_parallel  all-gather           this rank's slice
//   scatter_to_tensor_parallel   this rank's slice    all-gather
//
// Gathers and slices run along the last dimension (the features), with uneven shards as
// feature_shard() assigns them. With a group of one rank each is the identity, without
// communication.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "dtrain/comm.h"

namespace dtrain::detail {

// Which features of `features` split over `ranks` rank `rank` holds: the first features % ranks
// ranks get one more than the others (the same rule as DataParallel's batch split).
struct FeatureShard {
  int64_t begin = 0;
  int64_t size = 0;
};
FeatureShard feature_shard(int64_t features, int ranks, int rank);

at::Tensor copy_to_tensor_parallel(const at::Tensor& input,
                                   const std::shared_ptr<ProcessGroup>& group);
at::Tensor reduce_from_tensor_parallel(const at::Tensor& partial,
                                       const std::shared_ptr<ProcessGroup>& group);
// local: this rank's slice [.., feature_shard(features, n, rank).size]; returns [.., features].
at::Tensor gather_from_tensor_parallel(const at::Tensor& local,
                                       const std::shared_ptr<ProcessGroup>& group,
                                       int64_t features);
// full: [.., features]; returns this rank's slice [.., feature_shard(features, n, rank).size].
at::Tensor scatter_to_tensor_parallel(const at::Tensor& full,
                                      const std::shared_ptr<ProcessGroup>& group, int64_t features);

}  // namespace dtrain::detail
