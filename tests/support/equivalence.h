// The comparison every numerical-equivalence test uses: parallel training against single-process
// training.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <vector>

namespace dtrain::testing {

// The worst, over tensors, of max|got - want| / max|want|: a relative error that a single-step
// difference or a dropped gradient share pushes far above the float32 tolerance (1e-5) the tests
// allow.
inline double relative_error(const std::vector<torch::Tensor>& got,
                             const std::vector<torch::Tensor>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double scale = want[i].abs().max().item<double>() + 1e-12;
    worst = std::max(worst, (got[i] - want[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

inline double relative_error(torch::nn::Module& got, torch::nn::Module& want) {
  return relative_error(got.parameters(), want.parameters());
}

}  // namespace dtrain::testing
