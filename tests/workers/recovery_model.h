// The in-place recovery tests' model, data and optimizer, shared by the worker
// (tests/workers/recovery_worker.cpp) and the one-process replay it is compared against
// (tests/recovery/recovery_test.cpp): both must build exactly the same.
#pragma once

#include <torch/torch.h>

namespace recovery_model {

constexpr int64_t kSamples = 480;
constexpr int64_t kInputs = 12;
constexpr int64_t kClasses = 5;
constexpr int64_t kBatch = 8;  // per rank
constexpr int64_t kEpochs = 4;

struct Data {
  torch::Tensor x, y;
};

inline Data make_data() {
  torch::manual_seed(3);
  Data data;
  data.x = torch::randn({kSamples, kInputs});
  data.y = torch::randint(kClasses, {kSamples});
  return data;
}

inline torch::nn::Sequential make_net() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(kInputs, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, kClasses));
}

inline torch::optim::SGD make_optimizer(torch::nn::Sequential& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

}  // namespace recovery_model
