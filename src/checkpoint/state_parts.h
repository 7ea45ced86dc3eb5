// Pieces of a training state that the replicated and the sharded checkpoints save the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtrain::detail {

// The model as a flat state dict: parameters then (defined) buffers, with their dotted names.
std::vector<std::pair<std::string, at::Tensor>> model_tensors(torch::nn::Module& model);

// torch's default CPU generator: its state (a copy), and setting it back.
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);
// Throws c10::Error (as set_cpu_rng_state would) unless state is one, without setting it.
void check_cpu_rng_state(const at::Tensor& state);

}  // namespace dtrain::detail
