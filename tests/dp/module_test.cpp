// DataParallel as a torch::nn::Module (dtrain/dp.h): its parameters are the module's own under the
// prefix "module.", as PyTorch's DataParallel names them; train() and eval() reach the module and
// its replicas; torch::save and torch::load go through it; it takes a std::shared_ptr, a
// TORCH_MODULE holder and a Sequential.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "dtrain/dp.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

// Cloneable: DataParallel makes its replicas with clone().
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 5));
    drop = register_module("drop", torch::nn::Dropout(0.5));
    fc2 = register_module("fc2", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Net);

DataParallelOptions three_replicas() {
  DataParallelOptions options;
  options.num_replicas = 3;
  return options;
}

TEST(DataParallelModule, ParametersAreTheModulesOwnUnderTheModulePrefix) {
  auto net = std::make_shared<NetImpl>();
  DataParallel dp(net, three_replicas());
  static_assert(std::is_same_v<decltype(dp), DataParallel<NetImpl>>);
  EXPECT_EQ(dp->module(), net);
  std::vector<std::string> names;
  for (const auto& item : dp->named_parameters()) names.push_back(item.key());
  EXPECT_EQ(names, (std::vector<std::string>{"module.fc1.weight", "module.fc1.bias",
                                             "module.fc2.weight", "module.fc2.bias"}));
  auto wrapped = dp->parameters(), own = net->parameters();
  ASSERT_EQ(wrapped.size(), own.size());  // the replicas' parameters are not the module's
  for (size_t i = 0; i < own.size(); ++i) EXPECT_TRUE(wrapped[i].is_same(own[i])) << i;
}

TEST(DataParallelModule, EvalReachesTheModuleAndItsReplicas) {
  Net net;
  DataParallel dp(net, three_replicas());
  static_assert(std::is_same_v<decltype(dp), DataParallel<NetImpl>>);
  EXPECT_EQ(dp->module(), net.ptr());
  dp->eval();
  EXPECT_FALSE(net->is_training());
  EXPECT_FALSE(net->drop->is_training());
  auto x = torch::randn({9, 6});
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(dp(x), net->forward(x))) << "a replica still runs dropout";
  }
  dp->train();
  EXPECT_TRUE(net->drop->is_training());
}

TEST(DataParallelModule, TakesASequentialAndTrainsThroughIt) {
  torch::nn::Sequential sequential(torch::nn::Linear(6, 4), torch::nn::ReLU(),
                                   torch::nn::Linear(4, 2));
  DataParallel dp(sequential, three_replicas());
  static_assert(std::is_same_v<decltype(dp), DataParallel<torch::nn::SequentialImpl>>);
  EXPECT_EQ(dp->named_parameters().keys().front(), "module.0.weight");
  torch::optim::SGD optimizer(dp->parameters(), 0.1);
  auto x = torch::randn({7, 6}), y = torch::randn({7, 2});
  auto loss = [](const torch::Tensor& out, const torch::Tensor& t) {
    return (out - t).pow(2).mean();
  };
  const double before = loss(sequential->forward(x), y).item<double>();
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    dp->forward_backward(x, y, loss);
    optimizer.step();
  }
  EXPECT_LT(loss(sequential->forward(x), y).item<double>(), before);
}

TEST(DataParallelModule, SaveAndLoadGoThroughTheWrapperUnderPyTorchsNames) {
  Net net;
  DataParallel dp(net, three_replicas());
  const std::string dir = testing::temp_dir("dtrain-dp-module");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/dp.pt";
  torch::save(dp, path);
  std::vector<torch::Tensor> saved;
  for (const auto& p : net->parameters()) saved.push_back(p.detach().clone());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.add_(1.0);
  }
  torch::load(dp, path);
  auto loaded = net->parameters();
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << i;
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  // "module.fc2.weight": an archive per module on the path.
  torch::serialize::InputArchive module, fc2;
  ASSERT_TRUE(archive.try_read("module", module));
  ASSERT_TRUE(module.try_read("fc2", fc2));
  torch::Tensor weight;
  ASSERT_TRUE(fc2.try_read("weight", weight));
  EXPECT_TRUE(torch::equal(weight, saved[2]));
  // The replicas pick the loaded parameters up at the next step.
  net->eval();
  auto x = torch::randn({5, 6});
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(dp(x), net->forward(x)));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
