// The model the tensor-parallel tests train: Linear -> ReLU -> Linear, unsplit (the reference) and
// split over a group (ColumnParallelLinear -> ReLU -> RowParallelLinear), built under the same seed
// so that the split model's shards are pieces of the reference's weights.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <vector>

#include "dtrain/tensor_parallel.h"

namespace dtrain::testing {

constexpr int64_t kInputs = 12;
constexpr int64_t kHidden = 10;  // uneven shards over 3 ranks (4, 3, 3) and 4 ranks (3, 3, 2, 2)
constexpr int64_t kOutputs = 5;  // not split: RowParallelLinear splits its 10 inputs
constexpr uint64_t kSeed = 7;

// Seeding and drawing from LibTorch's global generator is not safe from several threads at once,
// and a rank's layers must see the generator exactly as the reference did: rank threads build under
// this lock.
inline std::mutex& seed_mutex() {
  static std::mutex mutex;
  return mutex;
}

inline torch::nn::Sequential make_reference_mlp() {
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(kSeed);
  return torch::nn::Sequential(torch::nn::Linear(kInputs, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kOutputs));
}

// How the two split layers meet: the pairing of the Note (the hidden activation stays split), or a
// gathered hidden activation that the row-parallel layer splits again (an all-gather each way).
enum class Wiring { kSplitHidden, kGatheredHidden };

inline torch::nn::Sequential make_parallel_mlp(const std::shared_ptr<ProcessGroup>& group,
                                               Wiring wiring = Wiring::kSplitHidden) {
  ColumnParallelLinearOptions column;
  column.gather_output = wiring == Wiring::kGatheredHidden;
  RowParallelLinearOptions row;
  row.input_is_parallel = wiring == Wiring::kSplitHidden;
  std::lock_guard<std::mutex> lock(seed_mutex());
  torch::manual_seed(kSeed);
  return torch::nn::Sequential(ColumnParallelLinear(kInputs, kHidden, group, column),
                               torch::nn::ReLU(), RowParallelLinear(kHidden, kOutputs, group, row));
}

// The reference's parameters cut as `parallel` holds them: the first layer's rows, the second's
// columns and its whole bias. Compared with parallel->parameters() in the same order.
inline std::vector<torch::Tensor> expected_shards(torch::nn::Sequential& reference,
                                                  torch::nn::Sequential& parallel) {
  auto column = parallel->ptr<ColumnParallelLinearImpl>(0);
  auto row = parallel->ptr<RowParallelLinearImpl>(2);
  auto want = reference->parameters();
  return {want[0].narrow(0, column->local_begin(), column->local_size()),
          want[1].narrow(0, column->local_begin(), column->local_size()),
          want[2].narrow(1, row->local_begin(), row->local_size()), want[3]};
}

inline std::vector<torch::Tensor> detached(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> copies;
  for (const auto& t : tensors) copies.push_back(t.detach().clone());
  return copies;
}

}  // namespace dtrain::testing
