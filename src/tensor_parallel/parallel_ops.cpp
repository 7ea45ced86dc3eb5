// The tensor-parallel autograd functions; see parallel_ops.h.
#include "tensor_parallel/parallel_ops.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common/format.h"
#include "dtrain/errors.h"
#include "dtrain/tensor_parallel.h"

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

// ---- Sequence parallelism (Note [Sequence parallelism] in dtrain/tensor_parallel.h) ----

// The sequence is dimension -2 of [.., seq, features]; a whole sequence must split evenly.
void check_sequence(const at::Tensor& tensor, const ProcessGroup& group, const char* op) {
  if (!tensor.defined() || tensor.dim() < 2) {
    throw UsageError(rank_text(group) + ": " + op + " on group '" + group.name() +
                     "': expected a tensor [.., seq, features], got " +
                     (tensor.defined() ? std::to_string(tensor.dim()) + " dimensions"
                                       : std::string("an undefined tensor")));
  }
  if (tensor.size(-2) % group.size() != 0) {
    throw UsageError(rank_text(group) + ": " + op + " on group '" + group.name() +
                     "': the sequence length " + std::to_string(tensor.size(-2)) +
                     " does not divide by the tensor-parallel degree " +
                     std::to_string(group.size()) +
                     "; sequence parallelism gives every rank an equal slice of the sequence, so "
                     "pick a sequence length that is a multiple of " +
                     std::to_string(group.size()));
  }
}

// Shared memory moves float, double, int32 and int64 (ShmTransport::supports); a reduced-precision
// CPU tensor would fall back to Gloo, whose reduce-scatter is an all-reduce of every rank's inputs.
// It travels as float32 instead: twice its bytes, through the faster transport, summed in float.
at::ScalarType wire_type(const at::Tensor& tensor, const ProcessGroup& group) {
  const at::ScalarType type = tensor.scalar_type();
  const bool reduced = type == at::kBFloat16 || type == at::kHalf;
  return reduced && tensor.device().is_cpu() && group.uses_shared_memory() ? at::kFloat : type;
}

// All-gather along the sequence: every rank's slice [.., s, f] -> [.., n s, f], rank order.
at::Tensor all_gather_sequence(const at::Tensor& slice, ProcessGroup& group) {
  const at::ScalarType type = slice.scalar_type();
  at::Tensor mine = slice.to(wire_type(slice, group)).contiguous();
  std::vector<at::Tensor> slices;
  for (int r = 0; r < group.size(); ++r)
    slices.push_back(at::empty_like(mine, at::MemoryFormat::Contiguous));
  group.all_gather(slices, mine);
  return at::cat(slices, -2).to(type);
}

// Reduce-scatter along the sequence: partial [.., n s, f] on every rank -> this rank's slice
// [.., s, f] of the sum. Started asynchronously so that the caller can overlap it; `result` is
// written once the Work has been waited for.
Work reduce_scatter_sequence_async(const at::Tensor& partial, ProcessGroup& group,
                                   at::Tensor& result) {
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& piece : partial.to(wire_type(partial, group)).chunk(group.size(), -2))
    pieces.push_back(piece.contiguous());
  result = at::empty_like(pieces[0], at::MemoryFormat::Contiguous);
  return group.reduce_scatter_async(result, pieces);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& partial, ProcessGroup& group) {
  at::Tensor result;
  reduce_scatter_sequence_async(partial, group, result).wait();
  return result.to(partial.scalar_type());
}

at::Tensor sequence_slice(const at::Tensor& full, const ProcessGroup& group) {
  const int64_t size = full.size(-2) / group.size();
  // A copy: a view of an input returned by a custom function may not be modified in place.
  return full.narrow(-2, group.rank() * size, size).contiguous();
}

class ScatterToSequenceParallel : public torch::autograd::Function<ScatterToSequenceParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& full,
                            const std::shared_ptr<ProcessGroup>& group) {
    save_group(ctx, group);
    return sequence_slice(full, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_sequence(grads[0], *saved_group(ctx).group), at::Tensor()};
  }
};

class GatherFromSequenceParallel : public torch::autograd::Function<GatherFromSequenceParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& slice,
                            const std::shared_ptr<ProcessGroup>& group) {
    save_group(ctx, group);
    return all_gather_sequence(slice, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {sequence_slice(grads[0], *saved_group(ctx).group), at::Tensor()};
  }
};

class ReduceScatterToSequenceParallel
    : public torch::autograd::Function<ReduceScatterToSequenceParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial,
                            const std::shared_ptr<ProcessGroup>& group) {
    save_group(ctx, group);
    return reduce_scatter_sequence(partial, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_sequence(grads[0], *saved_group(ctx).group), at::Tensor()};
  }
};

// y_i = all_gather(x) W_i^T, keeping only x (Note [Sequence parallelism]). Backward, for gradients
// dy_i: dx = reduce_scatter(sum_i dy_i W_i) and dW_i = dy_i^T all_gather(x), where the all-gather
// runs while dx's products are computed and the reduce-scatter while dW's are.
class SequenceParallelColumnLinear
    : public torch::autograd::Function<SequenceParallelColumnLinear> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& slice,
                               at::TensorList weights, const std::shared_ptr<ProcessGroup>& group) {
    save_group(ctx, group);
    variable_list saved{slice};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    at::Tensor full = all_gather_sequence(slice, *group);
    variable_list outputs;
    for (const at::Tensor& weight : weights) outputs.push_back(at::linear(full, weight));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ProcessGroup& group = *saved_group(ctx).group;
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& slice = saved[0];
    const size_t count = saved.size() - 1;
    bool weight_grads = false;
    for (size_t i = 0; i < count; ++i) weight_grads |= ctx->needs_input_grad(1 + i) != 0;

    // The gathered input, again (forward kept only the slice), in flight during dx's products.
    at::Tensor mine, full;
    std::vector<at::Tensor> gathered;
    Work gather;
    if (weight_grads) {
      mine = slice.to(wire_type(slice, group)).contiguous();
      for (int r = 0; r < group.size(); ++r)
        gathered.push_back(at::empty_like(mine, at::MemoryFormat::Contiguous));
      gather = group.all_gather_async(gathered, mine);
    }
    // The products run in the gradients' type (autocast's, if forward ran under it).
    at::Tensor grad_full;
    for (size_t i = 0; i < count; ++i) {
      if (!grads[i].defined()) continue;
      at::Tensor term = at::matmul(grads[i], saved[1 + i].to(grads[i].scalar_type()));
      grad_full = grad_full.defined() ? grad_full + term : term;
    }
    at::Tensor grad_slice;
    Work scatter;
    const bool input_grad = ctx->needs_input_grad(0) && grad_full.defined();
    if (input_grad) scatter = reduce_scatter_sequence_async(grad_full, group, grad_slice);

    variable_list result{at::Tensor()};
    if (weight_grads) {
      gather.wait();
      full = at::cat(gathered, -2);
      gathered.clear();
    }
    for (size_t i = 0; i < count; ++i) {
      const at::Tensor& weight = saved[1 + i];
      if (!ctx->needs_input_grad(1 + i) || !grads[i].defined()) {
        result.push_back(at::Tensor());
        continue;
      }
      const at::Tensor dy = grads[i].reshape({-1, grads[i].size(-1)});
      const at::Tensor x = full.reshape({-1, full.size(-1)}).to(dy.scalar_type());
      result.push_back(dy.t().mm(x).to(weight.scalar_type()));
    }
    if (input_grad) {
      scatter.wait();
      result[0] = grad_slice.to(slice.scalar_type());
    }
    result.push_back(at::Tensor());  // the group
    return result;
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

namespace dtrain {

at::Tensor scatter_to_sequence_parallel(const at::Tensor& full,
                                        const std::shared_ptr<ProcessGroup>& group) {
  detail::check_sequence(full, *group, "scatter_to_sequence_parallel");
  if (group->size() == 1) return full;
  return detail::ScatterToSequenceParallel::apply(full, group);
}

at::Tensor gather_from_sequence_parallel(const at::Tensor& slice,
                                         const std::shared_ptr<ProcessGroup>& group) {
  if (group->size() == 1) return slice;
  return detail::GatherFromSequenceParallel::apply(slice, group);
}

std::vector<at::Tensor> sequence_parallel_column_linear(
    const at::Tensor& slice, at::TensorList weights, const std::shared_ptr<ProcessGroup>& group) {
  if (group->size() == 1) {
    std::vector<at::Tensor> outputs;
    for (const at::Tensor& weight : weights) outputs.push_back(at::linear(slice, weight));
    return outputs;
  }
  return detail::SequenceParallelColumnLinear::apply(slice, weights, group);
}

at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& partial,
                                               const std::shared_ptr<ProcessGroup>& group) {
  detail::check_sequence(partial, *group, "reduce_scatter_to_sequence_parallel");
  if (group->size() == 1) return partial;
  return detail::ReduceScatterToSequenceParallel::apply(partial, group);
}

at::Tensor sequence_parallel_parameter(const at::Tensor& parameter,
                                       const std::shared_ptr<ProcessGroup>& group) {
  return detail::copy_to_tensor_parallel(parameter, group);
}

}  // namespace dtrain
