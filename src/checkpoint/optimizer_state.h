// A LibTorch optimizer's state in the form of Python's optimizer.state_dict(), both ways: what
// Python's Optimizer.load_state_dict takes from a dtrain checkpoint, and what dtrain takes from
// one Python saved.
#pragma once

#include <ATen/core/ivalue.h>

#include <optional>
#include <string>

namespace torch::optim {
class Optimizer;
}

namespace dtrain::detail {

// {"state": {index: {name: tensor, ...}}, "param_groups": [{"lr": ..., ..., "params": [index,
// ...]}]}, the parameters numbered through the groups in order as Python numbers them, tensors on
// the CPU; copies when `copy`, else the optimizer's own tensors. SGD, Adam, AdamW, Adagrad and
// RMSprop; nullopt for another optimizer (LBFGS, the caller's own).
std::optional<c10::IValue> python_optimizer_state(const torch::optim::Optimizer& optimizer,
                                                  bool copy);

// "SGD", "Adam", "AdamW", "Adagrad" or "RMSprop" (Python's class names); empty for another
// optimizer.
std::string python_optimizer_class(const torch::optim::Optimizer& optimizer);

// Loads such a dict (from python_optimizer_state, or Python's torch.save of
// optimizer.state_dict()) into `optimizer`: each group's hyperparameters and each parameter's
// state. Throws std::runtime_error saying what does not fit (another optimizer type, group or
// parameter counts, a state tensor's shape, a Python option LibTorch lacks such as
// maximize=True) before it changes anything.
void load_python_optimizer_state(const c10::IValue& saved, torch::optim::Optimizer& optimizer);

}  // namespace dtrain::detail
