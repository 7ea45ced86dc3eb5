// A chunk's backward in two passes, for the zero-bubble schedule: B computes only the gradient of
// the chunk's input, W later only the parameters' gradients, together exactly one backward.
//
// Note [Split backward]
// ZB-H1 needs B, the input gradient the stage upstream waits for, at once, and W, the weight
// gradients, later, in what would be idle time. Running autograd twice (B restricted to the input,
// then W restricted to the parameters) would compute the chain of input gradients through the
// chunk again in W: a second whole backward. The paper's WeightGradStore instead keeps, per
// linear layer, the layer's input x and output gradient g from B, and W computes g^T·x. That needs
// the model to be built from layers that know about the store; dtrain does the same on any
// autograd graph instead, cutting the one graph the forward built:
//
// - Before B, walk the graph from the chunk's output and mark the nodes from which the chunk's
//   input can be reached ("input nodes"). Every other node only leads to parameters (or other
//   leaves). An input node with an edge to a parameter-only node is a "split node": a Linear's
//   AddmmBackward (edges to x's path, to the bias and to W^T), a norm's MulBackward with its
//   weight, an embedding or a custom function that takes a parameter.
// - B is autograd restricted to the input (torch::autograd::grad with inputs = {input}, keeping
//   the graph): the engine runs only input nodes and asks each split node for the outputs on the
//   input's path only (its task_should_compute_output), so a Linear computes g·W and not g^T·x. A
//   pre-hook on each split node keeps the gradient flowing into it: g, the store's grad_output.
// - After B the edges between input nodes are cut and the saved tensors of input nodes that are
//   not split nodes are freed: what stays is the split nodes with what they saved (a Linear's x)
//   and the parameter-only nodes below them.
// - W runs the engine from the split nodes, seeded with the kept gradients, accumulating into the
//   leaves. Their cut edges are invalid, so a Linear's node computes only g^T·x and the bias sum;
//   the parameters' AccumulateGrad nodes run then, which is when their gradient hooks fire: a
//   data-parallel reducer (DDP's buckets) or any other AccumulateGrad hook learns that a gradient
//   is ready in W, not in B.
//
// B then W compute what one backward computes, each product once: input nodes ran in B with all
// their incoming gradient (every node upstream of an input node is itself one), and every other
// node runs in W with all of its own. Only the order in which an engine input buffer sums two
// contributions to one node may differ. Every parameter's gradient is W, norm weights and biases
// included; a chunk whose input needs no gradient (the first, fed with data) has an empty B and
// runs its whole backward as W. Memory from B to W: per micro-batch, what the split nodes saved
// (the linears' inputs, as the paper's store) and the gradients at them (the linears' output
// gradients). Works for any layers whose backward honours task_should_compute_output, as
// LibTorch's own do; a custom autograd function that ignores it still gives the right gradients,
// it only computes unneeded ones too.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <vector>

namespace dtrain::detail {

// What W of one micro-batch through one chunk needs once its B has run: the engine's roots (the
// split nodes of Note [Split backward], or the output's node when B had nothing to do) and the
// gradients that flow into them. Holds the part of the graph that W runs. Empty before B and after
// W.
struct WeightGradStore {
  std::vector<torch::autograd::Edge> roots;
  std::vector<at::Tensor> grads;
  bool empty() const { return roots.empty(); }
};

// B: the gradient of `output` (seeded with `grad_output`; undefined means ones, for a scalar loss)
// with respect to `input`, computing no parameter gradient. Returns zeros shaped like `input` when
// the output does not depend on it, an undefined tensor when `input` needs no gradient. Fills
// `store` for backward_weight. Blocks until done (the autograd engine).
at::Tensor backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                          const at::Tensor& input, WeightGradStore& store);

// W: accumulates the parameters' gradients of the micro-batch whose B filled `store` into their
// .grad (running their AccumulateGrad hooks), and empties it. Does nothing for an empty store.
void backward_weight(WeightGradStore& store);

}  // namespace dtrain::detail
