// dtrain::amp::Autocast on the CPU (bfloat16): matmuls inside the scope really run in bfloat16 and
// the scope restores what it found; float16 on the CPU is one UsageError; an MLP trains under it
// (with and without a GradScaler); DataParallel's replica threads run under the caller's scope.
// CUDA cases (float16 with a GradScaler, DataParallel on GPUs) skip themselves without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>

#include "dtrain/amp.h"
#include "dtrain/dp.h"

namespace dtrain {
namespace {

using amp::Autocast;

TEST(Autocast, MatmulsRunInBFloat16InsideTheScopeOnly) {
  torch::nn::Linear linear(8, 4);
  torch::Tensor x = torch::randn({3, 8});
  EXPECT_EQ(linear->forward(x).scalar_type(), torch::kFloat);
  {
    Autocast autocast(torch::kCPU, torch::kBFloat16);
    torch::Tensor y = linear->forward(x);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << "linear must be lowered to bfloat16";
    EXPECT_EQ(torch::matmul(x, x.t()).scalar_type(), torch::kBFloat16);
    {
      Autocast nested(torch::kCPU, torch::kBFloat16);
      EXPECT_EQ(linear->forward(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(linear->forward(x).scalar_type(), torch::kBFloat16)
        << "leaving a nested scope keeps the outer";
    // Parameters stay float32: autocast casts copies.
    EXPECT_EQ(linear->weight.scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(linear->forward(x).scalar_type(), torch::kFloat)
      << "leaving the outermost scope ends autocast";
}

TEST(Autocast, Float16OnTheCpuIsOneUsageError) {
  try {
    Autocast autocast(torch::kCPU, torch::kHalf);
    FAIL() << "float16 CPU autocast must be refused";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("float16 on the CPU"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Autocast(torch::kCPU, torch::kDouble), UsageError);
  // A refused scope leaves nothing enabled behind.
  torch::nn::Linear linear(2, 2);
  EXPECT_EQ(linear->forward(torch::randn({1, 2})).scalar_type(), torch::kFloat);
  if (!torch::cuda::is_available()) {
    EXPECT_THROW(Autocast(torch::kCUDA, torch::kHalf), UsageError);
  }
}

// Two well separated Gaussian blobs in 16 dimensions, 4 classes.
std::pair<torch::Tensor, torch::Tensor> blobs(int64_t n) {
  torch::manual_seed(3);
  torch::Tensor centers = torch::randn({4, 16}) * 3;
  torch::Tensor y = torch::randint(4, {n});
  return {centers.index_select(0, y) + torch::randn({n, 16}), y};
}

struct Mlp : torch::nn::Cloneable<Mlp> {
  Mlp() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Trains under bfloat16 autocast; returns the first and last losses.
std::pair<double, double> train_bf16(bool with_scaler) {
  auto [x, y] = blobs(512);
  torch::manual_seed(0);
  auto net = std::make_shared<Mlp>();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::GradScalerOptions options;
  options.enabled = with_scaler;
  options.growth_interval = 10;
  amp::GradScaler scaler(options);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    torch::Tensor rows = torch::arange(step * 64 % 512, step * 64 % 512 + 64);
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      Autocast autocast(torch::kCPU, torch::kBFloat16);
      torch::Tensor logits = net->forward(x.index_select(0, rows));
      EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
      loss = torch::nn::functional::cross_entropy(logits, y.index_select(0, rows));
    }
    scaler.scale(loss).backward();
    EXPECT_EQ(net->fc1->weight.grad().scalar_type(), torch::kFloat)
        << "gradients of float32 parameters";
    EXPECT_TRUE(scaler.step(optimizer)) << "bfloat16 has float32's range: no step may overflow";
    scaler.update();
    (step == 0 ? first : last) = loss.item<double>();
  }
  for (auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  return {first, last};
}

TEST(Autocast, BFloat16TrainingOnTheCpuLowersTheLoss) {
  for (bool with_scaler : {false, true}) {
    SCOPED_TRACE(with_scaler ? "with a GradScaler" : "without a GradScaler");
    auto [first, last] = train_bf16(with_scaler);
    EXPECT_GT(first, 1.0);          // about ln 4 = 1.39 at the start
    EXPECT_LT(last, 0.25 * first);  // the blobs are separable: bfloat16 rounding must not stop that
  }
}

TEST(Autocast, DataParallelReplicasRunUnderTheCallersScope) {
  auto [x, y] = blobs(30);
  torch::manual_seed(0);
  auto net = std::make_shared<Mlp>();
  DataParallelOptions options;
  options.num_replicas = 3;
  DataParallel<Mlp> dp(net, options);
  std::atomic<int> bf16_outputs{0}, float_outputs{0};
  auto loss_fn = [&](const torch::Tensor& out, const torch::Tensor& target) {
    (out.scalar_type() == torch::kBFloat16 ? bf16_outputs : float_outputs)++;
    return torch::nn::functional::cross_entropy(out, target);
  };
  {
    Autocast autocast(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(dp->forward(x).scalar_type(), torch::kBFloat16);
    dp->forward_backward(x, y, loss_fn);
  }
  EXPECT_EQ(bf16_outputs.load(), 3) << "every replica thread must run under the caller's autocast";
  EXPECT_EQ(float_outputs.load(), 0);
  for (auto& p : net->parameters()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  // Outside the scope the replicas are back in float32 (the workers' threads do not keep it).
  dp->forward_backward(x, y, loss_fn);
  EXPECT_EQ(float_outputs.load(), 3);
  EXPECT_EQ(dp->forward(x).scalar_type(), torch::kFloat);
}

// Tier 3: needs a GPU.
TEST(AutocastCuda, Float16WithAGradScalerTrains) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto [x, y] = blobs(512);
  torch::Device device(torch::kCUDA, 0);
  x = x.to(device);
  y = y.to(device);
  torch::manual_seed(0);
  auto net = std::make_shared<Mlp>();
  net->to(device);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::GradScaler scaler;  // 2^16: the first steps may overflow and back off
  double first = 0, last = 0;
  int stepped = 0;
  for (int step = 0; step < 80; ++step) {
    torch::Tensor rows = torch::arange(step * 64 % 512, step * 64 % 512 + 64,
                                       torch::TensorOptions(device).dtype(torch::kLong));
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      Autocast autocast(torch::kCUDA, torch::kHalf);
      torch::Tensor logits = net->forward(x.index_select(0, rows));
      EXPECT_EQ(logits.scalar_type(), torch::kHalf);
      loss = torch::nn::functional::cross_entropy(logits, y.index_select(0, rows));
    }
    scaler.scale(loss).backward();
    stepped += scaler.step(optimizer) ? 1 : 0;
    scaler.update();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_GT(stepped, 60);
  EXPECT_LT(last, 0.25 * first);
}

TEST(DataParallelCuda, TwoReplicasMatchTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // Two replicas on the first GPU (or on two GPUs when there are two) against one CPU process.
  const int64_t gpus = torch::cuda::device_count();
  std::vector<c10::Device> devices = {c10::Device(torch::kCUDA, 0),
                                      c10::Device(torch::kCUDA, gpus > 1 ? 1 : 0)};
  auto [x, y] = blobs(96);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  torch::manual_seed(0);
  auto reference = std::make_shared<Mlp>();
  torch::manual_seed(0);
  auto net = std::make_shared<Mlp>();
  net->to(devices[0]);
  torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(net->parameters(), 0.1);
  DataParallelOptions options;
  options.devices = devices;
  DataParallel<Mlp> dp(net, options);
  torch::Tensor pinned_x = x.pin_memory(), pinned_y = y.pin_memory();
  for (int step = 0; step < 5; ++step) {
    ref_opt.zero_grad();
    loss_fn(reference->forward(x), y).backward();
    ref_opt.step();
    opt.zero_grad();
    if (step % 2 == 0) {
      dp->forward_backward(pinned_x, pinned_y, loss_fn);
    } else {
      loss_fn(dp->forward(pinned_x), y.to(devices[0])).backward();
    }
    opt.step();
  }
  auto got = net->parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    // GPU reductions sum in another order: float32 to about 1e-5 relative, far below a lost share.
    EXPECT_TRUE(torch::allclose(got[i].cpu(), want[i], 1e-4, 1e-5)) << "parameter " << i;
  }
}

}  // namespace
}  // namespace dtrain
