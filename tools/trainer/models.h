// The trainer's two models (--model), in the two forms its strategies need:
//   mlp: 784-256-128-10 with ReLU.
//   cnn: two 5x5 conv+pool stages (16, 32 channels), then 10 outputs.
#pragma once

#include <torch/torch.h>

#include <string>

namespace trainer {

// Either model in one Cloneable module, so that DataParallel can make replicas of either.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  explicit NetImpl(std::string kind) : kind(std::move(kind)) { reset(); }
  void reset() override {
    if (kind == "cnn") {
      conv1 = register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5).padding(2)));
      conv2 = register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5).padding(2)));
      fc1 = register_module("fc", torch::nn::Linear(32 * 7 * 7, 10));
    } else {
      fc1 = register_module("fc1", torch::nn::Linear(784, 256));
      fc2 = register_module("fc2", torch::nn::Linear(256, 128));
      fc3 = register_module("fc3", torch::nn::Linear(128, 10));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    if (kind == "cnn") {
      x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
      x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
      return fc1->forward(x.flatten(1));
    }
    x = torch::relu(fc1->forward(x.flatten(1)));
    x = torch::relu(fc2->forward(x));
    return fc3->forward(x);
  }
  std::string kind;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// The same two models as a torch::nn::Sequential, for the strategies that cut a model into stages.
// Layers are made in the same order as NetImpl's, so a seed gives both forms the same initial
// weights.
inline torch::nn::Sequential make_sequential(const std::string& kind) {
  namespace nn = torch::nn;
  if (kind == "cnn") {
    nn::Conv2d conv1(nn::Conv2dOptions(1, 16, 5).padding(2));
    nn::Conv2d conv2(nn::Conv2dOptions(16, 32, 5).padding(2));
    nn::Linear fc(32 * 7 * 7, 10);
    return nn::Sequential(conv1, nn::ReLU(), nn::MaxPool2d(2), conv2, nn::ReLU(), nn::MaxPool2d(2),
                          nn::Flatten(), fc);
  }
  nn::Linear fc1(784, 256), fc2(256, 128), fc3(128, 10);
  return nn::Sequential(nn::Flatten(), fc1, nn::ReLU(), fc2, nn::ReLU(), fc3);
}

}  // namespace trainer
