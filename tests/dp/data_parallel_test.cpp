// DataParallel against single-process training of the same model on the same data: after k
// optimizer steps the module's parameters must equal the single process's (relative error < 1e-5 in
// float32), for 1..4 CPU replicas with uneven slices, in both modes; plus the buffer rule and
// errors raised inside a replica.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/dp.h"
#include "support/equivalence.h"

namespace dtrain {
namespace {

using testing::relative_error;

constexpr int64_t kBatch = 13;  // prime: uneven slices for every replica count > 1
constexpr int kSteps = 3;

torch::nn::Sequential make_mlp() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 24), torch::nn::Tanh(),
                               torch::nn::Linear(24, 5));
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> make_batches() {
  torch::manual_seed(100);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int s = 0; s < kSteps; ++s)
    batches.emplace_back(torch::randn({kBatch, 12}), torch::randint(5, {kBatch}));
  return batches;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool adam,
                                                        std::vector<torch::Tensor> params) {
  if (adam) return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

torch::Tensor mean_loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

enum class Mode { kLossPerReplica, kGatheredOutputs };

void expect_equivalent(int replicas, bool adam, Mode mode) {
  auto batches = make_batches();
  auto single = make_mlp();
  auto single_opt = make_optimizer(adam, single->parameters());
  for (auto& [x, y] : batches) {
    single_opt->zero_grad();
    mean_loss(single->forward(x), y).backward();
    single_opt->step();
  }

  auto net = make_mlp();
  DataParallelOptions options;
  options.num_replicas = replicas;
  DataParallel dp(net.ptr(), options);
  auto opt = make_optimizer(adam, net->parameters());
  for (auto& [x, y] : batches) {
    opt->zero_grad();
    if (mode == Mode::kLossPerReplica) {
      dp->forward_backward(x, y, mean_loss);
    } else {
      mean_loss(dp->forward(x), y).backward();
    }
    opt->step();
  }
  EXPECT_LT(relative_error(*net, *single), 1e-5) << replicas << " replicas";
}

class DataParallelEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(DataParallelEquivalence, SgdLossPerReplica) {
  expect_equivalent(GetParam(), false, Mode::kLossPerReplica);
}
TEST_P(DataParallelEquivalence, AdamLossPerReplica) {
  expect_equivalent(GetParam(), true, Mode::kLossPerReplica);
}
TEST_P(DataParallelEquivalence, SgdGatheredOutputs) {
  expect_equivalent(GetParam(), false, Mode::kGatheredOutputs);
}
TEST_P(DataParallelEquivalence, AdamGatheredOutputs) {
  expect_equivalent(GetParam(), true, Mode::kGatheredOutputs);
}

INSTANTIATE_TEST_SUITE_P(Replicas, DataParallelEquivalence, ::testing::Values(1, 2, 3, 4));

TEST(DataParallel, ReturnsTheWholeBatchLoss) {
  auto batches = make_batches();
  auto net = make_mlp();
  DataParallelOptions options;
  options.num_replicas = 3;
  DataParallel dp(net.ptr(), options);
  double got = dp->forward_backward(batches[0].first, batches[0].second, mean_loss).item<double>();
  double want = mean_loss(net->forward(batches[0].first), batches[0].second).item<double>();
  EXPECT_NEAR(got, want, 1e-6);
}

TEST(DataParallel, BuffersFollowTheModuleAndItsSlice) {
  torch::manual_seed(1);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
  DataParallelOptions options;
  options.num_replicas = 3;
  DataParallel dp(net.ptr(), options);
  torch::Tensor x = torch::randn({9, 4}), y = torch::randn({9, 4});
  dp->forward_backward(x, y, [](const torch::Tensor& out, const torch::Tensor& t) {
    return (out - t).pow(2).mean();
  });
  reference->forward(x.narrow(0, 0, 3));  // replica 0's slice: rows 0..2
  auto bn = net[1]->as<torch::nn::BatchNorm1dImpl>();
  auto bn_ref = (*reference)[1]->as<torch::nn::BatchNorm1dImpl>();
  EXPECT_TRUE(torch::allclose(bn->running_mean, bn_ref->running_mean));
  EXPECT_TRUE(torch::allclose(bn->running_var, bn_ref->running_var));
}

TEST(DataParallel, ReplicasFollowEvalModeAndFrozenParameters) {
  torch::manual_seed(3);
  auto net = torch::nn::Sequential(torch::nn::Linear(6, 6), torch::nn::Dropout(0.5),
                                   torch::nn::Linear(6, 2));
  DataParallelOptions options;
  options.num_replicas = 3;
  DataParallel dp(net.ptr(), options);
  torch::Tensor x = torch::randn({9, 6});
  net->eval();
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(dp->forward(x), net->forward(x))) << "a replica still runs dropout";
  }
  net->train();
  net[0]->as<torch::nn::LinearImpl>()->weight.requires_grad_(false);
  dp->forward_backward(
      x, torch::randn({9, 2}),
      [](const torch::Tensor& out, const torch::Tensor& t) { return (out - t).pow(2).mean(); });
  EXPECT_FALSE(net[0]->as<torch::nn::LinearImpl>()->weight.grad().defined())
      << "a frozen parameter got a gradient";
  EXPECT_TRUE(net[2]->as<torch::nn::LinearImpl>()->weight.grad().defined());
}

TEST(DataParallel, TwoForwardsThenOneBackwardAndRetainedGraphs) {
  // A siamese step (two gathered forwards, one loss) and a second backward through a retained graph
  // must give the single process's gradients.
  auto single = make_mlp();
  auto net = make_mlp();
  DataParallelOptions options;
  options.num_replicas = 3;
  DataParallel dp(net.ptr(), options);
  torch::manual_seed(4);
  torch::Tensor a = torch::randn({7, 12}), b = torch::randn({7, 12});
  auto loss_of = [](const torch::Tensor& fa, const torch::Tensor& fb) {
    return (fa - fb).pow(2).mean();
  };

  auto single_loss = loss_of(single->forward(a), single->forward(b));
  single_loss.backward({}, /*retain_graph=*/true);
  single_loss.backward();
  auto dp_loss = loss_of(dp->forward(a), dp->forward(b));
  dp_loss.backward({}, /*retain_graph=*/true);
  dp_loss.backward();
  auto got = net->parameters(), want = single->parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-6)) << "parameter " << i;
  }
}

struct FailsOnThreeRows : torch::nn::Cloneable<FailsOnThreeRows> {
  FailsOnThreeRows() { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(2, 1)); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (x.size(0) == 3) throw std::runtime_error("this replica's slice has 3 rows");
    return linear->forward(x);
  }
  torch::nn::Linear linear{nullptr};
};

TEST(DataParallel, AnExceptionInAReplicaNamesItAndLeavesTheRestUsable) {
  auto net = std::make_shared<FailsOnThreeRows>();
  DataParallelOptions options;
  options.num_replicas = 3;
  DataParallel dp(net, options);
  auto loss = [](const torch::Tensor& out, const torch::Tensor& t) {
    return (out - t).pow(2).mean();
  };
  try {
    dp->forward_backward(torch::randn({11, 2}), torch::randn({11, 1}), loss);  // slices 4, 4, 3
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("DataParallel replica 2 (cpu): this replica's slice has 3 rows"),
        std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(
      dp->forward_backward(torch::randn({12, 2}), torch::randn({12, 1}), loss));  // 4, 4, 4
}

struct NotCloneable : torch::nn::Module {
  NotCloneable() { linear = register_module("linear", torch::nn::Linear(2, 1)); }
  torch::Tensor forward(const torch::Tensor& x) { return linear->forward(x); }
  torch::nn::Linear linear{nullptr};
};

TEST(DataParallel, ModulesThatCannotCloneAreUsageErrors) {
  DataParallelOptions options;
  options.num_replicas = 2;
  try {
    DataParallel dp(std::make_shared<NotCloneable>(), options);
    FAIL() << "no exception";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("torch::nn::Cloneable<YourModule>"), std::string::npos)
        << e.what();
  }
  options.num_replicas = 0;
  EXPECT_THROW(DataParallel(make_mlp().ptr(), options), UsageError);
}

TEST(DataParallel, DevicesThisProcessLacksAreUsageErrors) {
  // Checked before anything is cloned: a CUDA device in a CPU-only LibTorch, or a GPU index past
  // the visible ones, is one line naming the device (not a clone failure).
  DataParallelOptions options;
  const int64_t gpus = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  options.devices = {c10::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(gpus))};
  try {
    DataParallel dp(make_mlp().ptr(), options);
    FAIL() << "no exception";
  } catch (const UsageError& e) {
    EXPECT_NE(
        std::string(e.what()).find("DataParallel: device cuda:" + std::to_string(gpus) + ": "),
        std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dtrain
