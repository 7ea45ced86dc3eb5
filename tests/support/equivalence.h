// The comparison every numerical-equivalence test uses: parallel training against single-process
// training.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dtrain::testing {

// The worst, over tensors, of max|got - want| / max|want|: a relative error that a single-step
// difference or a dropped gradient share pushes far above the float32 tolerance (1e-5) the tests
// allow. Infinite where the two lists differ in length or a tensor's shape, and where any error is
// not finite: a NaN in `got` must fail the test, not compare as 0 (std::max(0.0, NaN) is 0.0).
inline double relative_error(const std::vector<torch::Tensor>& got,
                             const std::vector<torch::Tensor>& want) {
  constexpr double kNever = std::numeric_limits<double>::infinity();
  if (got.size() != want.size()) return kNever;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i].sizes() != want[i].sizes()) return kNever;
    if (want[i].numel() == 0) continue;
    const double scale = want[i].abs().max().item<double>() + 1e-12;
    const double error = (got[i] - want[i]).abs().max().item<double>() / scale;
    if (!std::isfinite(error)) return kNever;
    worst = std::max(worst, error);
  }
  return worst;
}

inline double relative_error(torch::nn::Module& got, torch::nn::Module& want) {
  return relative_error(got.parameters(), want.parameters());
}

}  // namespace dtrain::testing
