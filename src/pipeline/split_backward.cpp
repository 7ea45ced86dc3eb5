// B and W of a split backward; see Note [Split backward] in split_backward.h.
#include "pipeline/split_backward.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <unordered_map>
#include <utility>

namespace dtrain::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using NodePtr = decltype(Edge::function);  // std::shared_ptr or c10::intrusive_ptr by release

// The gradients flowing into a node, as the engine hands them to it the first time it runs it.
struct Captured {
  bool done = false;
  torch::autograd::variable_list grads;
};

class CaptureGrads : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureGrads(std::shared_ptr<Captured> into) : into_(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!into_->done) {  // W runs the node again, with the same gradients
      into_->grads = grads;
      into_->done = true;
    }
    return grads;
  }

 private:
  std::shared_ptr<Captured> into_;
};

// The graph below `root`, each node once, children before parents (an iterative depth-first walk:
// a deep chunk must not overflow the stack).
std::vector<NodePtr> post_order(const NodePtr& root) {
  std::vector<NodePtr> order;
  std::unordered_map<Node*, bool> entered;
  std::vector<std::pair<NodePtr, size_t>> stack{{root, 0}};
  entered[root.get()] = true;
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      const Edge& edge = node->next_edge(next++);
      if (edge.is_valid() && !entered[edge.function.get()]) {
        entered[edge.function.get()] = true;
        stack.emplace_back(edge.function, 0);
      }
      continue;
    }
    order.push_back(node);
    stack.pop_back();
  }
  return order;
}

}  // namespace

at::Tensor backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                          const at::Tensor& input, WeightGradStore& store) {
  store = WeightGradStore();
  at::Tensor seed = grad_output.defined() ? grad_output : at::ones_like(output);
  Edge root = torch::autograd::impl::gradient_edge(output);
  if (!root.is_valid()) {
    // The output needs no gradient: let autograd say so, as a plain backward would.
    torch::autograd::backward({output}, {seed});
    return at::Tensor();
  }
  NodePtr input_node;
  if (input.defined() && input.requires_grad())
    input_node = torch::autograd::impl::gradient_edge(input).function;

  // Input nodes: those from which the input's own node can be reached.
  std::vector<NodePtr> nodes = post_order(root.function);
  std::unordered_map<Node*, bool> reaches_input;
  for (const NodePtr& node : nodes) {
    bool reaches = input_node && node.get() == input_node.get();
    for (const Edge& edge : node->next_edges())
      reaches = reaches || (edge.is_valid() && reaches_input[edge.function.get()]);
    reaches_input[node.get()] = reaches;
  }
  if (!input_node || !reaches_input[root.function.get()]) {
    // Nothing to compute for the input: the whole backward is W.
    store.roots.push_back(root);
    store.grads.push_back(seed);
    return input_node ? at::zeros_like(input) : at::Tensor();
  }

  // Split nodes get a hook that keeps the gradient flowing into them during B.
  struct Split {
    NodePtr node;
    std::shared_ptr<Captured> captured;
  };
  std::vector<Split> splits;
  std::vector<NodePtr> input_nodes;
  for (const NodePtr& node : nodes) {
    if (!reaches_input[node.get()]) continue;
    input_nodes.push_back(node);
    bool split = false;
    for (const Edge& edge : node->next_edges())
      split = split || (edge.is_valid() && !reaches_input[edge.function.get()]);
    if (!split) continue;
    splits.push_back({node, std::make_shared<Captured>()});
    node->add_pre_hook(std::make_unique<CaptureGrads>(splits.back().captured));
  }

  // B: the engine runs only input nodes, and asks each for its outputs on the input's path only.
  at::Tensor grad_input = torch::autograd::grad({output}, {input}, {seed},
                                                /*retain_graph=*/true, /*create_graph=*/false,
                                                /*allow_unused=*/true)[0];
  if (!grad_input.defined()) grad_input = at::zeros_like(input);

  // What W does not need goes now: the edges between input nodes (so that W cannot run the input
  // path again, and split nodes compute only their parameters' outputs) and what non-split input
  // nodes saved.
  for (const NodePtr& node : input_nodes) {
    bool split = false;
    for (size_t i = 0; i < node->num_outputs(); ++i) {
      const Edge& edge = node->next_edge(i);
      if (!edge.is_valid()) continue;
      if (reaches_input[edge.function.get()]) {
        // Not set_next_edge(), which refuses to touch a node that has parents: dropping an edge
        // only leaves the node's topological number larger than needed, which stays valid.
        node->next_edges()[i] = Edge();
      } else {
        split = true;
      }
    }
    // (The input's own node is a leaf's accumulator: nothing saved, nothing to free.)
    if (!split && node.get() != input_node.get()) node->release_variables();
  }
  for (const Split& s : splits) {
    const auto& grads = s.captured->grads;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;  // nothing flowed into this input of the node
      store.roots.emplace_back(s.node, static_cast<uint32_t>(i));
      store.grads.push_back(grads[i]);
    }
  }
  return grad_input;
}

void backward_weight(WeightGradStore& store) {
  if (store.empty()) return;
  // No outputs: the engine runs everything the roots reach, which after B's cut is the
  // parameter-only part of the graph, and accumulates into its leaves.
  torch::autograd::Engine::get_default_engine().execute(store.roots, store.grads,
                                                        /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true, /*outputs=*/{});
  store = WeightGradStore();
}

}  // namespace dtrain::detail
