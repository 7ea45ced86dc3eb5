// The tensor-parallel autograd functions; see parallel_ops.h.
#include "tensor_parallel/parallel_ops.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace dtrain::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

FeatureShard shard_of(const ProcessGroup& group, int64_t features) {
  return feature_shard(features, group.size(), group.rank());
}

// The all-reduce writes into its tensor: it gets a fresh contiguous copy, so the caller's tensor
// (an autograd input or a gradient that others may share) stays as it was, and Gloo, which reads
// raw memory, sees a dense layout.
at::Tensor all_reduce_sum(const at::Tensor& tensor, ProcessGroup& group) {
  at::Tensor result = tensor.clone(at::MemoryFormat::Contiguous);
  group.all_reduce(result);
  return result;
}

// c10d's all-gather needs the same shape on every rank, but uneven shards differ by one feature:
// every rank pads its slice to the widest (rank 0's), and the gathered slices are cut back.
at::Tensor all_gather_last_dim(const at::Tensor& local, ProcessGroup& group, int64_t features) {
  const int64_t widest = feature_shard(features, group.size(), 0).size;
  at::Tensor padded = local.size(-1) == widest
                          ? local.contiguous()
                          : at::constant_pad_nd(local, {0, widest - local.size(-1)});
  std::vector<at::Tensor> slices;
  for (int r = 0; r < group.size(); ++r)
    slices.push_back(at::empty_like(padded, at::MemoryFormat::Contiguous));
  group.all_gather(slices, padded);
  for (int r = 0; r < group.size(); ++r) {
    slices[r] = slices[r].narrow(-1, 0, feature_shard(features, group.size(), r).size);
  }
  return at::cat(slices, -1);
}

// The group travels from forward to backward in the context's saved data, which holds IValues only:
// a capsule keeps the group alive until backward has run, even if the layer is gone by then.
struct GroupCapsule : torch::CustomClassHolder {
  GroupCapsule(std::shared_ptr<ProcessGroup> g, int64_t f) : group(std::move(g)), features(f) {}
  std::shared_ptr<ProcessGroup> group;
  int64_t features;  // the full size of the split dimension (gather/scatter only)
};

void save_group(AutogradContext* ctx, const std::shared_ptr<ProcessGroup>& group,
                int64_t features = 0) {
  ctx->saved_data["group"] =
      c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group, features));
}

const GroupCapsule& saved_group(AutogradContext* ctx) {
  // The capsule is owned by saved_data, which outlives this backward call.
  return *static_cast<GroupCapsule*>(ctx->saved_data["group"].toCapsule().get());
}

// backward() returns one gradient per forward() argument; the group arguments get none (undefined).

class CopyToTensorParallel : public torch::autograd::Function<CopyToTensorParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::shared_ptr<ProcessGroup>& group) {
    save_group(ctx, group);
    return input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce_sum(grads[0], *saved_group(ctx).group), at::Tensor()};
  }
};

class ReduceFromTensorParallel : public torch::autograd::Function<ReduceFromTensorParallel> {
 public:
  static at::Tensor forward(AutogradContext*, const at::Tensor& partial,
                            const std::shared_ptr<ProcessGroup>& group) {
    return all_reduce_sum(partial, *group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

class GatherFromTensorParallel : public torch::autograd::Function<GatherFromTensorParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local,
                            const std::shared_ptr<ProcessGroup>& group, int64_t features) {
    save_group(ctx, group, features);
    return all_gather_last_dim(local, *group, features);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const GroupCapsule& saved = saved_group(ctx);
    FeatureShard shard = shard_of(*saved.group, saved.features);
    return {grads[0].narrow(-1, shard.begin, shard.size), at::Tensor(), at::Tensor()};
  }
};

class ScatterToTensorParallel : public torch::autograd::Function<ScatterToTensorParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& full,
                            const std::shared_ptr<ProcessGroup>& group, int64_t features) {
    save_group(ctx, group, features);
    FeatureShard shard = shard_of(*group, features);
    // A copy: a view of an input returned by a custom function may not be modified in place.
    return full.narrow(-1, shard.begin, shard.size).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const GroupCapsule& saved = saved_group(ctx);
    return {all_gather_last_dim(grads[0], *saved.group, saved.features), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

FeatureShard feature_shard(int64_t features, int ranks, int rank) {
  int64_t base = features / ranks, extra = features % ranks;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

at::Tensor copy_to_tensor_parallel(const at::Tensor& input,
                                   const std::shared_ptr<ProcessGroup>& group) {
  if (group->size() == 1) return input;
  return CopyToTensorParallel::apply(input, group);
}

at::Tensor reduce_from_tensor_parallel(const at::Tensor& partial,
                                       const std::shared_ptr<ProcessGroup>& group) {
  if (group->size() == 1) return partial;
  return ReduceFromTensorParallel::apply(partial, group);
}

at::Tensor gather_from_tensor_parallel(const at::Tensor& local,
                                       const std::shared_ptr<ProcessGroup>& group,
                                       int64_t features) {
  if (group->size() == 1) return local;
  return GatherFromTensorParallel::apply(local, group, features);
}

at::Tensor scatter_to_tensor_parallel(const at::Tensor& full,
                                      const std::shared_ptr<ProcessGroup>& group,
                                      int64_t features) {
  if (group->size() == 1) return full;
  return ScatterToTensorParallel::apply(full, group, features);
}

}  // namespace dtrain::detail
