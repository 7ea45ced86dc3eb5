// The one place where the LibTorch releases dtrain supports (2.11 to 2.15,
// cmake/dtrainFindTorch.cmake) differ for dtrain. LibTorch 1.13 (Debian's libtorch-dev) was retired
// with the move to C++20: see doc/building.md.
#pragma once

#include <c10/util/string_utils.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <type_traits>
#include <utility>

namespace dtrain::compat {

// LibTorch's optimizers key their per-parameter state by the parameter's TensorImpl: older releases
// by its address printed into a string, 2.15 by the pointer itself.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

// A template, so that the branch not taken is not compiled.
template <typename Key = OptimizerStateKey>
Key optimizer_state_key(const at::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    return c10::str(param.unsafeGetTensorImpl());
  } else {
    return param.unsafeGetTensorImpl();
  }
}

}  // namespace dtrain::compat

#include <torch/csrc/autograd/variable.h>

namespace dtrain::compat {

// What owns a parameter's gradient accumulator (the autograd Node whose hooks tell DDP and ZeRO
// that a gradient is ready): a std::shared_ptr in older releases, a c10::intrusive_ptr in 2.15.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace dtrain::compat
