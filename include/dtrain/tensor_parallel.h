// Megatron-style tensor parallelism: linear layers whose weight is split over the ranks of a
// process group, so a layer too large for one device (or too slow on one) is computed by several at
// once. Each rank holds one shard of each such layer and sees the same input batch; the layers are
// ordinary torch::nn modules and fit in a torch::nn::Sequential, a pipeline stage, or a
// DistributedDataParallel over the data group.
//
//   auto mesh = dtrain::make_rank_mesh(pg, /*pipeline_size=*/1, /*tensor_size=*/2);
//   torch::manual_seed(0);  // the same seed on every rank
//   torch::nn::Sequential mlp(
//       dtrain::ColumnParallelLinear(1024, 4096, mesh.tensor_group),  // out: this rank's features
//       torch::nn::GELU(),                                            // elementwise: on the slice
//       dtrain::RowParallelLinear(4096, 1024, mesh.tensor_group));    // out: full, on every rank
//   dtrain::DistributedDataParallel ddp(mlp, mesh.data_group);  // optional: data x tensor
//
// Shards: a layer of F features split over n ranks gives rank r the features [begin, begin + size)
// with size = F / n, plus one for the first F % n ranks (local_begin(), local_size()). Every rank
// must hold at least one feature, so F >= n.
//
// Initialization: a layer built from sizes draws, under a given torch::manual_seed, exactly what an
// unsplit torch::nn::Linear(in, out) would draw, and keeps its shard. So a model built under the
// same seed on every rank holds, in total, the unsplit model's weights, and the unsplit model is a
// reference to test against. The full layer exists on each rank for a moment during construction
// (on the CPU, in the default dtype); build large layers from an existing, sharded checkpoint
// instead when that is too much. To split a layer that already exists (trained, or loaded), use
// column_parallel_from / row_parallel_from.
//
// Collectives: the layers communicate only through their group (all_reduce, all_gather, and
// reduce_scatter under sequence parallelism), on the device of the tensors they get: shared memory
// or Gloo for CPU tensors (ProcessGroup::uses_shared_memory), NCCL for CUDA tensors in a CUDA
// build.
// Every rank of the group must run the same layers in the same order with inputs of the same shape,
// as for any collective; a rank that skips a layer leaves the others waiting until the group's
// timeout. The backward's collectives run on the thread that runs backward (LibTorch's autograd
// engine: the caller's thread for CPU tensors, the device's engine thread for CUDA tensors); none
// run at construction.
//
// Note [Tensor-parallel MLP: one all-reduce each way]
// Y = act(X A) B with A split by columns (A = [A_1 .. A_n]) and B by rows (B = [B_1; ..; B_n]) is
// Y = sum_r act(X A_r) B_r: rank r computes its columns of the hidden layer, H_r = act(X A_r),
// needing only the replicated X and its own A_r, because an elementwise activation of a column
// slice is the column slice of the activation (a non-elementwise function, e.g. softmax or layer
// norm over the hidden features, is not, and needs gather_output). Rank r then multiplies its slice
// H_r by its rows B_r, a partial sum of Y with Y's full shape, and one all-reduce (sum) gives Y on
// every rank. Backward mirrors it: dY is replicated, so each rank gets dH_r = dY B_r^T and the
// gradients of A_r and B_r locally, without communication (the row-parallel all-reduce's backward
// is the identity); only dX = sum_r (dH_r * act'(X A_r)) A_r^T is a sum over ranks, the one
// all-reduce of the column-parallel layer's backward (its forward is the identity). So a Column ->
// elementwise -> Row pair costs exactly one all-reduce of Y's size forward and one of X's size
// backward, and none when X needs no gradient (the model's first layer). gather_output and
// input_is_parallel = false break this pairing and cost an all-gather each (forward, resp.
// backward); they are for layers that stand alone. Several column-parallel layers reading one X
// (attention's q, k and v; SwiGLU's two) keep the one backward all-reduce only if X enters the
// region once for all of them: column_parallel_forward (each layer's own forward would all-reduce
// its share of dX separately).
//
// Note [Sequence parallelism]
// Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation
// in Large Transformer Models"), an option on top of the pairing above. Between a row-parallel
// layer and the next column-parallel one a transformer runs layer norms, residual adds and other
// work that is elementwise along the sequence; plain tensor parallelism repeats that work, and
// keeps its activations, whole on every rank of the group. Under sequence parallelism each of the
// T ranks holds 1/T of the sequence there instead: a tensor [.., seq, features] becomes this rank's
// slice [.., seq / T, features] (dimension -2 is the sequence; rank r holds positions
// [r seq/T, (r+1) seq/T)). The all-reduce at each end of the pair splits in its two halves:
//
//   entering the column-parallel layers: all-gather the slices along the sequence (forward);
//     backward reduce-scatters the input's gradient, which the all-reduce of
//     copy_to_tensor_parallel summed before (sequence_parallel_column_linear)
//   leaving the row-parallel layer: reduce-scatter the partial products along the sequence
//     (forward); backward all-gathers the output's gradient (reduce_scatter_to_sequence_parallel)
//
// An all-reduce is a reduce-scatter followed by an all-gather, so the traffic is the same as
// tensor parallelism's and the activations between the pairs shrink T-fold. The column-parallel
// layers keep only the slice for their weight gradients and all-gather it again in backward (the
// paper's section 4.2.3), so the gathered input is not kept either. Parameters that act on a slice
// (a norm's weight, a row-parallel layer's bias) get a gradient from 1/T of the positions on each
// rank: they go through sequence_parallel_parameter, whose backward all-reduces their gradient over
// the group, so that each rank holds the whole sequence's gradient, as under tensor parallelism.
// Transports: the all-gathers and reduce-scatters are ProcessGroup::all_gather and
// ProcessGroup::reduce_scatter, real ones: among ranks on one host (uses_shared_memory()) CPU
// tensors go through shared memory, each rank moving and summing only its share (bfloat16 and
// float16 CPU tensors travel as float32 there, the transport's type); on CUDA tensors NCCL's
// all-gather and reduce-scatter. Only CPU tensors between hosts (or with DTRAIN_SHM=0) go through
// Gloo: its all-gather, and a reduce-scatter made of its all-to-all, each moving a ring's share
// (ProcessGroup::reduce_scatter_async). The sequence length must divide
// by T: a sequence that does not is one UsageError naming the length and the degree.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <vector>

#include "dtrain/comm.h"

namespace dtrain {

struct ColumnParallelLinearOptions {
  // Learn an additive bias; it is split with the output features, like the weight's rows.
  bool bias = true;
  // All-gather the output slices, so every rank gets the full [.., out_features] output (costs an
  // all-gather forward; backward takes this rank's slice of the gradient without communication).
  // Leave it off when a RowParallelLinear with input_is_parallel follows (see the Note above).
  bool gather_output = false;
  // Sequence parallelism (Note [Sequence parallelism]): the input is this rank's slice
  // [.., seq / n, in_features] of the sequence; the layer all-gathers the sequence and its output
  // is [.., seq, local_size()]. Backward reduce-scatters the input's gradient and all-gathers the
  // input again for the weight's gradient. Several layers on one input (query, key and value) share
  // one all-gather through column_parallel_forward.
  bool sequence_parallel = false;
};

struct RowParallelLinearOptions {
  // Learn an additive bias. It is not split: every rank holds all of it and adds it once, after the
  // all-reduce (adding a split bias before the sum would add it n times).
  bool bias = true;
  // The input is already this rank's slice [.., local_size()] of the in features, e.g. the output
  // of a ColumnParallelLinear without gather_output over the same group. false: the input is the
  // full [.., in_features] on every rank and each rank takes its slice (backward then all-gathers
  // the input's gradient).
  bool input_is_parallel = true;
  // Sequence parallelism (Note [Sequence parallelism]): reduce-scatter the partial products along
  // the sequence instead of all-reducing them, so the output is this rank's slice
  // [.., seq / n, out_features] of the sum (backward all-gathers its gradient). The bias is added
  // to the slice through sequence_parallel_parameter.
  bool sequence_parallel = false;
};

class ColumnParallelLinear;  // module holders, defined by TORCH_MODULE below
class RowParallelLinear;

// Split an existing layer (trained, or loaded from a checkpoint): this rank keeps a copy of its
// shard, on the layer's device and in its dtype. Every rank must pass the same layer (nothing
// checks it: a layer initialized under different seeds gives a model that matches no unsplit one).
// The bias follows the layer: options.bias is ignored. No communication. Throws UsageError for an
// empty layer or group, or fewer features than ranks along the split dimension.
ColumnParallelLinear column_parallel_from(const torch::nn::Linear& linear,
                                          std::shared_ptr<ProcessGroup> group,
                                          ColumnParallelLinearOptions options = {});
RowParallelLinear row_parallel_from(const torch::nn::Linear& linear,
                                    std::shared_ptr<ProcessGroup> group,
                                    RowParallelLinearOptions options = {});

// y = x W^T + b with W [out_features, in_features] split by rows (the output features) over
// `group`: the input x [.., in_features] is the same on every rank, the output is this rank's slice
// [.., local_size()] (or the full output with gather_output). Backward all-reduces (sums) the
// input's gradient over the group.
class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl> {
 public:
  // Initialized as torch::nn::Linear(in_features, out_features) would be under the current seed;
  // this rank keeps its rows. No communication. Throws UsageError for a null group, a size below 1,
  // or fewer output features than ranks.
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                           std::shared_ptr<ProcessGroup> group,
                           ColumnParallelLinearOptions options = {});

  // Registers fresh parameters and initializes them (clone() calls it; as for torch::nn::Linear,
  // calling it again on a live layer fails: use reset_parameters()).
  void reset() override;
  // Re-draws the full layer's initial weights under the current seed and keeps this rank's shard.
  void reset_parameters();

  // input [.., in_features] -> [.., local_size()], or [.., out_features] with gather_output. Throws
  // UsageError naming the rank and the layer when the input's last dimension is not in_features.
  at::Tensor forward(const at::Tensor& input);

  void pretty_print(std::ostream& stream) const override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  // This rank's output features (weight rows): [local_begin(), local_begin() + local_size()).
  int64_t local_begin() const { return local_begin_; }
  int64_t local_size() const { return local_size_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const ColumnParallelLinearOptions& options() const { return options_; }

  at::Tensor weight;  // [local_size(), in_features]: rows local_begin() .. of the full weight
  at::Tensor bias;    // [local_size()], undefined without options.bias

 private:
  friend ColumnParallelLinear column_parallel_from(const torch::nn::Linear&,
                                                   std::shared_ptr<ProcessGroup>,
                                                   ColumnParallelLinearOptions);
  struct NoInit {};
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                           std::shared_ptr<ProcessGroup> group, ColumnParallelLinearOptions options,
                           NoInit);
  void allocate();

  int64_t in_features_;
  int64_t out_features_;
  std::shared_ptr<ProcessGroup> group_;
  ColumnParallelLinearOptions options_;
  int64_t local_begin_ = 0;
  int64_t local_size_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

// Several column-parallel layers on one input, entering the tensor-parallel region once: a
// transformer's query, key and value projections, SwiGLU's gate and up projections. Each
// ColumnParallelLinear::forward enters the region on its own, and its backward all-reduces its
// share of the input's gradient, so k layers called one by one on the same x cost k all-reduces
// in backward. The input's gradient is the sum of the k shares, and an all-reduce is a sum: here
// autograd adds the shares first and one all-reduce serves all k (under sequence parallelism, one
// all-gather forward and one reduce-scatter plus one all-gather backward, as
// sequence_parallel_column_linear), which restores one all-reduce each way per sub-layer (Note
// [Tensor-parallel MLP: one all-reduce each way]). Returns what each layer's forward would, in
// order (its bias added, its gather_output applied); the results equal the layers' own forwards up
// to the order of floating-point additions in the input's gradient. Collective over the layers'
// group, as their forwards are. Throws UsageError for no layers, an empty holder, layers that do
// not share one group (the same object), in_features and sequence_parallel (naming the first
// layer that differs), or an input whose last dimension is not in_features.
std::vector<at::Tensor> column_parallel_forward(const at::Tensor& input,
                                                const std::vector<ColumnParallelLinear>& layers);

// y = x W^T + b with W [out_features, in_features] split by columns (the input features) over
// `group`: each rank multiplies its slice of x by its columns of W, and an all-reduce (sum) of
// these partial products gives the full output [.., out_features] on every rank. Backward needs no
// communication for the output's gradient.
class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl> {
 public:
  // Initialized as torch::nn::Linear(in_features, out_features) would be under the current seed;
  // this rank keeps its columns and the whole bias. No communication. Throws UsageError for a null
  // group, a size below 1, or fewer input features than ranks.
  RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                        std::shared_ptr<ProcessGroup> group, RowParallelLinearOptions options = {});

  void reset() override;    // as ColumnParallelLinearImpl::reset
  void reset_parameters();  // as ColumnParallelLinearImpl::reset_parameters (keeps the whole bias)

  // input [.., local_size()] (input_is_parallel) or [.., in_features] -> [.., out_features], the
  // same on every rank. Throws UsageError naming the rank and the layer when the input's last
  // dimension is wrong.
  at::Tensor forward(const at::Tensor& input);

  void pretty_print(std::ostream& stream) const override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  // This rank's input features (weight columns): [local_begin(), local_begin() + local_size()).
  int64_t local_begin() const { return local_begin_; }
  int64_t local_size() const { return local_size_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const RowParallelLinearOptions& options() const { return options_; }

  at::Tensor weight;  // [out_features, local_size()]: columns local_begin() .. of the full weight
  at::Tensor bias;    // [out_features], all of it on every rank; undefined without options.bias

 private:
  friend RowParallelLinear row_parallel_from(const torch::nn::Linear&,
                                             std::shared_ptr<ProcessGroup>,
                                             RowParallelLinearOptions);
  struct NoInit {};
  RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                        std::shared_ptr<ProcessGroup> group, RowParallelLinearOptions options,
                        NoInit);
  void allocate();

  int64_t in_features_;
  int64_t out_features_;
  std::shared_ptr<ProcessGroup> group_;
  RowParallelLinearOptions options_;
  int64_t local_begin_ = 0;
  int64_t local_size_ = 0;
};
TORCH_MODULE(RowParallelLinear);

// ---- Sequence parallelism (Note [Sequence parallelism]) ----
// The autograd functions the sequence-parallel regions are built from. Each is collective over
// `group` (every rank calls it, in the same order, with tensors of the same shape), blocks until
// this rank's part of the collective is done (up to the group's timeout), and is the identity
// without communication for a group of one rank. The sequence is dimension -2 of
// [.., seq, features]; a whole sequence whose length does not divide by group->size() is a
// UsageError naming the rank, the length and the degree.

// Enter the region from a tensor that is the same on every rank (an embedding's output): full
// [.., seq, features] -> this rank's slice [.., seq / n, features], without communication. Backward
// all-gathers the gradient, so the producer (replicated on every rank) gets the whole of it.
at::Tensor scatter_to_sequence_parallel(const at::Tensor& full,
                                        const std::shared_ptr<ProcessGroup>& group);

// Leave the region to work that is replicated on every rank (the final norm's output going to a
// whole LM head): slice -> [.., seq, features] by an all-gather. Backward takes this rank's slice
// of the gradient without communication: every rank computed the same gradient downstream.
at::Tensor gather_from_sequence_parallel(const at::Tensor& slice,
                                         const std::shared_ptr<ProcessGroup>& group);

// Enter the tensor-parallel region: one all-gather of the slice [.., seq / n, in] and, for each
// weight W_i [out_i, in] (column-parallel shards), y_i = gathered W_i^T [.., seq, out_i]. Only the
// slice is kept for backward, which all-gathers it again for the weights' gradients and
// reduce-scatters the input's gradient sum_i dy_i W_i (overlapping the two collectives with the
// products). Under autocast the products run in the autocast type, as at::linear's would.
std::vector<at::Tensor> sequence_parallel_column_linear(const at::Tensor& slice,
                                                        at::TensorList weights,
                                                        const std::shared_ptr<ProcessGroup>& group);

// Leave the tensor-parallel region: partial products [.., seq, features] (a row-parallel layer's
// before its all-reduce) -> this rank's slice [.., seq / n, features] of their sum over the group,
// by a reduce-scatter. Backward all-gathers the gradient.
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& partial,
                                               const std::shared_ptr<ProcessGroup>& group);

// A parameter that acts on this rank's slice only (a norm's weight, a row-parallel bias): returns
// it unchanged; backward all-reduces (sums) its gradient over the group, so that every rank's
// gradient is the whole sequence's, before it reaches the parameter (and DDP's hooks, or ZeRO's).
at::Tensor sequence_parallel_parameter(const at::Tensor& parameter,
                                       const std::shared_ptr<ProcessGroup>& group);

}  // namespace dtrain
