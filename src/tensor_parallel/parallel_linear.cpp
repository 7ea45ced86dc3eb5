// ColumnParallelLinear and RowParallelLinear (dtrain/tensor_parallel.h): shard bookkeeping, seeded
// initialization, input checks; the communication is in parallel_ops.cpp.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "common/format.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/parallel_ops.h"

namespace dtrain {

namespace {

std::string layer_label(const char* kind, int64_t in_features, int64_t out_features) {
  return std::string(kind) + "(in_features=" + std::to_string(in_features) +
         ", out_features=" + std::to_string(out_features) + ")";
}

std::string shape_of(const at::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

// Both layers' constructor checks; `split_features` is the dimension the layer splits.
void check_construction(const char* kind, int64_t in_features, int64_t out_features,
                        const std::shared_ptr<ProcessGroup>& group, const char* split_name,
                        int64_t split_features) {
  std::string layer = layer_label(kind, in_features, out_features);
  if (!group) {
    throw UsageError(
        layer +
        ": the process group is null; pass the tensor-parallel group this rank belongs "
        "to (e.g. make_rank_mesh(group, pipeline_size, tensor_size).tensor_group)");
  }
  if (in_features < 1 || out_features < 1) {
    throw UsageError(detail::rank_text(*group) + ": " + layer +
                     ": in_features and out_features must be at least 1");
  }
  if (split_features < group->size()) {
    throw UsageError(detail::rank_text(*group) + ": " + layer + ": " + split_name + "=" +
                     std::to_string(split_features) + " cannot be split over the " +
                     std::to_string(group->size()) + " ranks of group '" + group->name() +
                     "': every rank needs at least one feature. Use a smaller "
                     "tensor-parallel group, or an unsplit torch::nn::Linear for this layer.");
  }
}

// The input's last dimension must be `expected`; the message says what was expected and the fix.
void check_input(const char* kind, int64_t in_features, int64_t out_features,
                 const ProcessGroup& group, const at::Tensor& input, int64_t expected,
                 const std::string& expected_what, const std::string& fix) {
  if (input.defined() && input.dim() >= 1 && input.size(-1) == expected) return;
  std::string actual = !input.defined()   ? "an undefined tensor"
                       : input.dim() == 0 ? "a 0-dimensional tensor"
                                          : "shape " + shape_of(input) + ", last dimension " +
                                                std::to_string(input.size(-1));
  throw UsageError(detail::rank_text(group) + ": " + layer_label(kind, in_features, out_features) +
                   " forward on tensor rank " + std::to_string(group.rank()) + "/" +
                   std::to_string(group.size()) + " of group '" + group.name() +
                   "': the input has " + actual + ", expected last dimension " +
                   std::to_string(expected) + " (" + expected_what + "). " + fix);
}

}  // namespace

// ---- ColumnParallelLinear ----

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   std::shared_ptr<ProcessGroup> group,
                                                   ColumnParallelLinearOptions options)
    : ColumnParallelLinearImpl(in_features, out_features, std::move(group), options, NoInit{}) {
  reset_parameters();
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   std::shared_ptr<ProcessGroup> group,
                                                   ColumnParallelLinearOptions options, NoInit)
    : in_features_(in_features),
      out_features_(out_features),
      group_(std::move(group)),
      options_(options) {
  check_construction("ColumnParallelLinear", in_features_, out_features_, group_, "out_features",
                     out_features_);
  detail::FeatureShard shard = detail::feature_shard(out_features_, group_->size(), group_->rank());
  local_begin_ = shard.begin;
  local_size_ = shard.size;
  allocate();
}

void ColumnParallelLinearImpl::allocate() {
  weight = register_parameter("weight", at::empty({local_size_, in_features_}));
  bias = options_.bias ? register_parameter("bias", at::empty({local_size_})) : at::Tensor();
}

void ColumnParallelLinearImpl::reset() {
  allocate();
  reset_parameters();
}

void ColumnParallelLinearImpl::reset_parameters() {
  // The whole layer, drawn exactly as an unsplit Linear draws it, then this rank's rows: every
  // rank's shard is then a piece of the same reference layer (see "Initialization" in the header).
  torch::NoGradGuard no_grad;
  torch::nn::Linear full(torch::nn::LinearOptions(in_features_, out_features_).bias(options_.bias));
  weight.copy_(full->weight.narrow(0, local_begin_, local_size_));
  if (options_.bias) bias.copy_(full->bias.narrow(0, local_begin_, local_size_));
}

namespace {

// The input check of a column-parallel layer's forward, alone or in column_parallel_forward.
void check_column_input(const ColumnParallelLinearImpl& layer, const at::Tensor& input) {
  check_input(
      "ColumnParallelLinear", layer.in_features(), layer.out_features(), *layer.group(), input,
      layer.in_features(), "in_features",
      "Every rank of the group must get the whole input (the same on every rank); a slice of the "
      "features is the input of a RowParallelLinear.");
}

// The layers' outputs on one input, which enters the tensor-parallel region once: one
// copy_to_tensor_parallel (whose backward all-reduces the sum of the layers' input gradients,
// which autograd adds before it runs), or under sequence parallelism one all-gather for all the
// weights. The layers share group, in_features and sequence_parallel (checked by the callers).
std::vector<at::Tensor> column_outputs(const at::Tensor& input,
                                       const std::vector<const ColumnParallelLinearImpl*>& layers) {
  const ColumnParallelLinearImpl& first = *layers.front();
  const std::shared_ptr<ProcessGroup>& group = first.group();
  std::vector<at::Tensor> outputs;
  if (first.options().sequence_parallel) {
    // The all-gather's backward reduce-scatters the input's gradient: no all-reduce here.
    std::vector<at::Tensor> weights;
    for (const ColumnParallelLinearImpl* layer : layers) weights.push_back(layer->weight);
    outputs = sequence_parallel_column_linear(input, weights, group);
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i]->bias.defined()) outputs[i] = outputs[i] + layers[i]->bias;
    }
  } else {
    const at::Tensor entered = detail::copy_to_tensor_parallel(input, group);
    for (const ColumnParallelLinearImpl* layer : layers) {
      outputs.push_back(at::linear(
          entered, layer->weight,
          layer->bias.defined() ? c10::optional<at::Tensor>(layer->bias) : c10::nullopt));
    }
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i]->options().gather_output) {
      outputs[i] =
          detail::gather_from_tensor_parallel(outputs[i], group, layers[i]->out_features());
    }
  }
  return outputs;
}

}  // namespace

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  check_column_input(*this, input);
  return column_outputs(input, {this})[0];
}

std::vector<at::Tensor> column_parallel_forward(const at::Tensor& input,
                                                const std::vector<ColumnParallelLinear>& layers) {
  if (layers.empty()) {
    throw UsageError(
        "column_parallel_forward: no layers; pass the ColumnParallelLinear layers that read the "
        "input");
  }
  std::vector<const ColumnParallelLinearImpl*> impls;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].is_empty()) {
      throw UsageError("column_parallel_forward: layer " + std::to_string(i) +
                       " is an empty (null) ColumnParallelLinear; pass built layers");
    }
    impls.push_back(layers[i].get());
  }
  const ColumnParallelLinearImpl& first = *impls.front();
  for (size_t i = 1; i < impls.size(); ++i) {
    const ColumnParallelLinearImpl& layer = *impls[i];
    if (layer.group() == first.group() && layer.in_features() == first.in_features() &&
        layer.options().sequence_parallel == first.options().sequence_parallel) {
      continue;
    }
    auto describe = [](const ColumnParallelLinearImpl& l) {
      return layer_label("ColumnParallelLinear", l.in_features(), l.out_features()) +
             " on group '" + l.group()->name() + "'" +
             (l.options().sequence_parallel ? " with sequence_parallel" : "");
    };
    throw UsageError(detail::rank_text(*first.group()) + ": column_parallel_forward: layer " +
                     std::to_string(i) + ", " + describe(layer) + ", does not match layer 0, " +
                     describe(first) +
                     ": layers that share one input must share its process group (the same "
                     "object), in_features and sequence_parallel; call the forward of a layer "
                     "that differs on its own.");
  }
  check_column_input(first, input);
  return column_outputs(input, impls);
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "dtrain::ColumnParallelLinear(in_features=" << in_features_
         << ", out_features=" << out_features_ << ", rows=[" << local_begin_ << ", "
         << local_begin_ + local_size_ << ")"
         << ", bias=" << (options_.bias ? "true" : "false")
         << ", gather_output=" << (options_.gather_output ? "true" : "false")
         << (options_.sequence_parallel ? ", sequence_parallel=true" : "") << ")";
}

ColumnParallelLinear column_parallel_from(const torch::nn::Linear& linear,
                                          std::shared_ptr<ProcessGroup> group,
                                          ColumnParallelLinearOptions options) {
  if (linear.is_empty())
    throw UsageError("column_parallel_from: the torch::nn::Linear is empty (null)");
  const at::Tensor& w = linear->weight;
  options.bias = linear->bias.defined();
  std::shared_ptr<ColumnParallelLinearImpl> layer(new ColumnParallelLinearImpl(
      w.size(1), w.size(0), std::move(group), options, ColumnParallelLinearImpl::NoInit{}));
  torch::NoGradGuard no_grad;
  // set_data, not copy_: the shard takes the layer's device and dtype, as the header promises.
  layer->weight.set_data(w.narrow(0, layer->local_begin(), layer->local_size()).clone());
  if (options.bias)
    layer->bias.set_data(linear->bias.narrow(0, layer->local_begin(), layer->local_size()).clone());
  return ColumnParallelLinear(std::move(layer));
}

// ---- RowParallelLinear ----

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             std::shared_ptr<ProcessGroup> group,
                                             RowParallelLinearOptions options)
    : RowParallelLinearImpl(in_features, out_features, std::move(group), options, NoInit{}) {
  reset_parameters();
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             std::shared_ptr<ProcessGroup> group,
                                             RowParallelLinearOptions options, NoInit)
    : in_features_(in_features),
      out_features_(out_features),
      group_(std::move(group)),
      options_(options) {
  check_construction("RowParallelLinear", in_features_, out_features_, group_, "in_features",
                     in_features_);
  detail::FeatureShard shard = detail::feature_shard(in_features_, group_->size(), group_->rank());
  local_begin_ = shard.begin;
  local_size_ = shard.size;
  allocate();
}

void RowParallelLinearImpl::allocate() {
  weight = register_parameter("weight", at::empty({out_features_, local_size_}));
  bias = options_.bias ? register_parameter("bias", at::empty({out_features_})) : at::Tensor();
}

void RowParallelLinearImpl::reset() {
  allocate();
  reset_parameters();
}

void RowParallelLinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::Linear full(torch::nn::LinearOptions(in_features_, out_features_).bias(options_.bias));
  weight.copy_(full->weight.narrow(1, local_begin_, local_size_));
  if (options_.bias) bias.copy_(full->bias);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  at::Tensor local = input;
  if (options_.input_is_parallel) {
    check_input("RowParallelLinear", in_features_, out_features_, *group_, input, local_size_,
                "this rank's slice of in_features=" + std::to_string(in_features_) + ": features " +
                    std::to_string(local_begin_) + ".." +
                    std::to_string(local_begin_ + local_size_ - 1) + ", as input_is_parallel=true",
                "Feed the output of a ColumnParallelLinear without gather_output over the same "
                "group, or set input_is_parallel=false to pass the full input.");
  } else {
    check_input("RowParallelLinear", in_features_, out_features_, *group_, input, in_features_,
                "in_features, as input_is_parallel=false",
                "Pass the whole input on every rank, or set input_is_parallel=true to pass this "
                "rank's slice.");
    local = detail::scatter_to_tensor_parallel(input, group_, in_features_);
  }
  // This rank's input features' share of every output, summed over the ranks; then the bias, once.
  // Under sequence parallelism the sum arrives as this rank's slice of the sequence, so the bias
  // sees only those positions and its gradient is all-reduced (sequence_parallel_parameter).
  if (options_.sequence_parallel) {
    at::Tensor output = reduce_scatter_to_sequence_parallel(at::linear(local, weight), group_);
    return bias.defined() ? output + sequence_parallel_parameter(bias, group_) : output;
  }
  at::Tensor output = detail::reduce_from_tensor_parallel(at::linear(local, weight), group_);
  return bias.defined() ? output + bias : output;
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "dtrain::RowParallelLinear(in_features=" << in_features_
         << ", out_features=" << out_features_ << ", columns=[" << local_begin_ << ", "
         << local_begin_ + local_size_ << ")"
         << ", bias=" << (options_.bias ? "true" : "false")
         << ", input_is_parallel=" << (options_.input_is_parallel ? "true" : "false")
         << (options_.sequence_parallel ? ", sequence_parallel=true" : "") << ")";
}

RowParallelLinear row_parallel_from(const torch::nn::Linear& linear,
                                    std::shared_ptr<ProcessGroup> group,
                                    RowParallelLinearOptions options) {
  if (linear.is_empty())
    throw UsageError("row_parallel_from: the torch::nn::Linear is empty (null)");
  const at::Tensor& w = linear->weight;
  options.bias = linear->bias.defined();
  std::shared_ptr<RowParallelLinearImpl> layer(new RowParallelLinearImpl(
      w.size(1), w.size(0), std::move(group), options, RowParallelLinearImpl::NoInit{}));
  torch::NoGradGuard no_grad;
  layer->weight.set_data(w.narrow(1, layer->local_begin(), layer->local_size()).clone());
  if (options.bias) layer->bias.set_data(linear->bias.clone());
  return RowParallelLinear(std::move(layer));
}

}  // namespace dtrain
