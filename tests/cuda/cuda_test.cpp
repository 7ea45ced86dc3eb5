// What only a GPU can show: NCCL collectives, DDP and DataParallel on CUDA against CPU training of
// the same model on the same data, and the clear line for two ranks on one GPU. Every test skips
// with the reason on a machine without CUDA (CI has none); a machine with one GPU runs them all,
// two ranks sharing it through DTRAIN_CUDA_BACKEND=gloo where NCCL would need a GPU each (or, where
// they train, one of them on the CPU: Cuda::training_device_of_rank says why).
//
// Tolerance: float32 on a GPU sums in another order than on the CPU (and cuBLAS may use TF32 unless
// told not to: the tests turn it off), so 1e-4 relative instead of the CPU tests' 1e-5; a dropped
// gradient share or a missed step is orders of magnitude above it.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include "dtrain/ddp.h"
#include "dtrain/dp.h"
#include "dtrain/errors.h"
#include "support/equivalence.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::relative_error;
using testing::run_group;

constexpr double kGpuTolerance = 1e-4;
constexpr int64_t kGlobalBatch = 16;
constexpr int kSteps = 3;

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available())
      GTEST_SKIP() << "no CUDA device here (or a LibTorch without CUDA)";
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
    torch::set_num_threads(1);
  }
  void TearDown() override { unsetenv("DTRAIN_CUDA_BACKEND"); }

  // Two ranks need two GPUs for NCCL; with one, they share it through Gloo (as PyTorch allows).
  static c10::Device device_of_rank(int rank) {
    if (torch::cuda::device_count() >= 2) return c10::Device(c10::kCUDA, rank);
    setenv("DTRAIN_CUDA_BACKEND", "gloo", 1);
    return c10::Device(c10::kCUDA, 0);
  }

  // Thread ranks that train need a GPU each: LibTorch's autograd engine runs the CUDA backward
  // work of a device on one thread per process, so two thread ranks on one GPU queue their
  // backward passes there one behind the other, and a collective inside the first (DDP's bucket
  // all-reduces) waits forever for the second (seen on an H200: both tests timed out). With one
  // GPU, rank 1 trains on the CPU and meets rank 0 through Gloo, which carries rank 0's CUDA
  // tensors through host copies (shared memory off: both ranks must take the Gloo path).
  static c10::Device training_device_of_rank(int rank) {
    if (torch::cuda::device_count() >= 2) return c10::Device(c10::kCUDA, rank);
    setenv("DTRAIN_CUDA_BACKEND", "gloo", 1);
    return rank == 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  }
};

torch::nn::Sequential make_mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 4));
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> make_data() {
  torch::manual_seed(11);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  for (int step = 0; step < kSteps; ++step) {
    data.emplace_back(torch::randn({kGlobalBatch, 10}), torch::randint(4, {kGlobalBatch}));
  }
  return data;
}

std::vector<torch::Tensor> cpu_parameters(torch::nn::Module& net) {
  std::vector<torch::Tensor> result;
  for (auto& p : net.parameters()) result.push_back(p.detach().to(torch::kCPU).clone());
  return result;
}

std::vector<torch::Tensor> train_on_cpu() {
  auto net = make_mlp();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (auto& [x, y] : make_data()) {
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer.step();
  }
  return cpu_parameters(*net);
}

TEST_F(Cuda, NcclAllReduceOfOneRank) {
  run_group(1, [](int, const std::shared_ptr<ProcessGroup>& group) {
    auto t = torch::arange(5, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat));
    group->all_reduce(t);
    EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(5, torch::kFloat)));
  });
}

TEST_F(Cuda, AllReduceOfTwoRanksSums) {
  std::vector<c10::Device> devices{device_of_rank(0), device_of_rank(1)};
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto t = torch::full({1000}, rank + 1.0, torch::TensorOptions().device(devices[rank]));
    group->all_reduce(t);
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({1000}, 3.0)));
  });
}

// What a pipeline's stages and ZeRO's shards move: point to point and reduce-scatter on CUDA
// tensors, over NCCL with two GPUs, or through Gloo's host copies with one (Gloo moves host memory
// only: a device pointer handed to it would be read as host memory).
TEST_F(Cuda, SendRecvAndReduceScatterOfTwoRanks) {
  std::vector<c10::Device> devices{device_of_rank(0), device_of_rank(1)};
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto on = torch::TensorOptions().device(devices[rank]).dtype(torch::kFloat);
    if (rank == 0) {
      group->send(torch::arange(6, on).view({2, 3}), 1, /*tag=*/7);
    } else {
      at::Tensor got = torch::zeros({2, 3}, on);
      group->recv(got, 0, /*tag=*/7);
      EXPECT_TRUE(got.is_cuda());
      EXPECT_TRUE(torch::equal(got.cpu(), torch::arange(6, torch::kFloat).view({2, 3})));
    }
    // Every rank gives [rank + 1, ...] for each slot; slot r's sum lands on rank r.
    std::vector<at::Tensor> inputs{torch::full({4}, rank + 1.0, on),
                                   torch::full({4}, 10.0 * (rank + 1), on)};
    at::Tensor output = torch::zeros({4}, on);
    group->reduce_scatter(output, inputs);
    EXPECT_TRUE(torch::equal(output.cpu(), torch::full({4}, rank == 0 ? 3.0 : 30.0)));
  });
}

TEST_F(Cuda, TwoRanksOnOneGpuAreOneClearLine) {
  try {
    run_group(2, [](int, const std::shared_ptr<ProcessGroup>& group) {
      auto t = torch::ones({4}, torch::TensorOptions().device(torch::kCUDA, 0));
      group->all_reduce(t);
    });
    FAIL() << "two ranks on cuda:0 with NCCL were not refused";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 0 and 1 share cuda:0 on host"), std::string::npos)
        << e.what();
  }
}

TEST_F(Cuda, DdpOnGpuEqualsCpuTraining) {
  const auto want = train_on_cpu();
  const auto data = make_data();
  std::vector<c10::Device> devices{training_device_of_rank(0), training_device_of_rank(1)};
  std::vector<std::vector<torch::Tensor>> got(2);
  auto initial = make_mlp();
  run_group(
      2,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
        net->to(devices[rank]);
        DistributedDataParallel ddp(net, group);
        torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        const int64_t half = kGlobalBatch / 2;
        for (auto& [x, y] : data) {
          optimizer.zero_grad();
          auto logits = ddp->forward(x.narrow(0, rank * half, half).to(devices[rank]));
          torch::nn::functional::cross_entropy(logits,
                                               y.narrow(0, rank * half, half).to(devices[rank]))
              .backward();
          optimizer.step();
        }
        got[rank] = cpu_parameters(*net);
      },
      std::chrono::seconds(60), /*shared_memory=*/false);
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_LT(relative_error(got[rank], want), kGpuTolerance) << rank;
}

TEST_F(Cuda, DataParallelOnGpuEqualsCpuTraining) {
  const auto want = train_on_cpu();
  auto net = make_mlp();
  const c10::Device first(c10::kCUDA, 0);
  const c10::Device second(c10::kCUDA, torch::cuda::device_count() >= 2 ? 1 : 0);
  net->to(first);
  DataParallelOptions options;
  options.devices = {first, second};
  DataParallel dp(net.ptr(), options);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (auto& [x, y] : make_data()) {
    optimizer.zero_grad();
    // Each replica's loss is the mean over its half; DataParallel averages the replicas' gradients.
    dp->forward_backward(x.to(first), y.to(first),
                         [](const torch::Tensor& out, const torch::Tensor& target) {
                           return torch::nn::functional::cross_entropy(out, target);
                         });
    optimizer.step();
  }
  EXPECT_LT(relative_error(cpu_parameters(*net), want), kGpuTolerance);
}

}  // namespace
}  // namespace dtrain
