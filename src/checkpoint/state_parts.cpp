// Pieces of a training state shared by the replicated and the sharded checkpoints (state_parts.h).
#include "checkpoint/state_parts.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <mutex>

namespace dtrain::detail {

std::vector<std::pair<std::string, at::Tensor>> model_tensors(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    tensors.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) tensors.emplace_back(item.key(), item.value());
  }
  return tensors;
}

// TODO(cuda): in a CUDA build also the CUDA generators' states (one per device).
at::Tensor cpu_rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();  // already a copy
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

void check_cpu_rng_state(const at::Tensor& state) {
  // The same checks as set_state's on the default generator, on a generator of its own.
  at::detail::createCPUGenerator().set_state(state);
}

}  // namespace dtrain::detail
