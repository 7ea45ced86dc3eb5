// dtrain::CudaGraphStep (dtrain/cuda_graph.h): a captured step trains exactly as the same step run
// eagerly, through the warm-up, the capture, the replays and a short batch between them; the
// trainer's --cuda-graph ends where its eager run ends; what cannot be captured is one line. The
// GPU tests skip without one (CI has none); the refusals run everywhere.
//
// Tolerance: a replay launches the kernels the eager step launched, on the same data, so the two
// agree to the last bit in practice; 1e-6 relative leaves room for a cuBLAS algorithm chosen
// differently under capture. A lost gradient, a step not taken or taken twice (a replay that
// accumulates into the previous step's gradients) is orders of magnitude above it.
#include "dtrain/cuda_graph.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/errors.h"
#include "support/equivalence.h"
#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

using testing::relative_error;

torch::nn::Sequential small_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 4));
}

TEST(CudaGraph, OnlySgdIsCaptured) {
  auto net = small_mlp();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  try {
    CudaGraphStep graphed([](const std::vector<at::Tensor>& in) { return in[0]; }, adam);
    FAIL() << "Adam was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("only torch::optim::SGD can be captured"),
              std::string::npos)
        << e.what();
  }
}

TEST(CudaGraph, WithoutAGpuItIsOneLine) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU";
  auto net = small_mlp();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  try {
    CudaGraphStep graphed([](const std::vector<at::Tensor>& in) { return in[0]; }, sgd);
    FAIL() << "a CudaGraphStep was made without a GPU";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("sees no CUDA device") != std::string::npos ||
                what.find("without CUDA") != std::string::npos)
        << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

class CudaGraphOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
    at::globalContext().setAllowTF32CuBLAS(false);
  }
};

// 12 steps of SGD with momentum and weight decay, batches of 8 rows except a 5-row batch at step 8:
// eagerly, and through CudaGraphStep (3 eager warm-up steps, the capture at step 4, 7 replays, the
// short batch eagerly in between). Every step's loss and the final parameters agree.
TEST_F(CudaGraphOnGpu, GraphedStepsEqualEagerSteps) {
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(7);
  auto eager_net = small_mlp();
  eager_net->to(gpu);
  torch::nn::Sequential graphed_net(
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(eager_net->clone()));
  auto options = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3);
  torch::optim::SGD eager_sgd(eager_net->parameters(), options);
  torch::optim::SGD graphed_sgd(graphed_net->parameters(), options);

  const int kSteps = 12, kShortStep = 8;
  std::vector<at::Tensor> xs, ys;
  for (int i = 0; i < kSteps; ++i) {
    const int64_t rows = i == kShortStep ? 5 : 8;
    xs.push_back(torch::randn({rows, 20}).pin_memory());  // host inputs, as a loader gives them
    ys.push_back(torch::randint(0, 4, {rows}, torch::kLong).pin_memory());
  }
  auto loss_of = [](torch::nn::Sequential& net, const at::Tensor& x, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(net->forward(x), y);
  };
  CudaGraphStep graphed(
      [&](const std::vector<at::Tensor>& in) {
        at::Tensor loss = loss_of(graphed_net, in[0], in[1]);
        loss.backward();
        graphed_sgd.step();
        return loss;
      },
      graphed_sgd);

  for (int i = 0; i < kSteps; ++i) {
    eager_sgd.zero_grad();
    at::Tensor want = loss_of(eager_net, xs[i].to(gpu), ys[i].to(gpu));
    want.backward();
    eager_sgd.step();
    at::Tensor got = graphed({xs[i], ys[i]});
    EXPECT_LE(relative_error({got.cpu()}, {want.detach().cpu()}), 1e-6) << "step " << i + 1;
  }
  EXPECT_TRUE(graphed.captured());
  EXPECT_EQ(graphed.eager_steps(), 4);  // the warm-up and the short batch
  EXPECT_EQ(graphed.replayed_steps(), 8);
  EXPECT_LE(relative_error(*graphed_net, *eager_net), 1e-6);
}

// A step that waits on the host (.item()) cannot be captured: one line, and the stream and the
// allocator stay usable (an eager step after it works).
TEST_F(CudaGraphOnGpu, AStepThatWaitsOnTheHostIsOneLine) {
  const torch::Device gpu(torch::kCUDA, 0);
  auto net = small_mlp();
  net->to(gpu);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  CudaGraphStepOptions options;
  options.warmup_steps = 1;
  CudaGraphStep graphed(
      [&](const std::vector<at::Tensor>& in) {
        at::Tensor loss = net->forward(in[0]).pow(2).mean();
        loss.backward();
        if (loss.item<double>() < 0) return loss;  // a wait on the host
        sgd.step();
        return loss;
      },
      sgd, options);
  at::Tensor x = torch::randn({8, 20});
  graphed({x});  // the warm-up, eager: fine
  try {
    graphed({x});
    FAIL() << "a step with .item() was captured";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("could not be captured in a CUDA graph"),
              std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  at::Tensor after = net->forward(x.to(gpu)).sum();
  after.backward();
  EXPECT_TRUE(std::isfinite(after.item<double>()));
}

// The trainer's --cuda-graph: 300 steps of the main job's MLP end at the eager run's loss, the
// steps after the warm-up replayed.
TEST_F(CudaGraphOnGpu, TheTrainersGraphedRunEndsWhereItsEagerRunEnds) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string run = testing::bin("train_fashion_mnist") + " --device cuda --max-steps 300";
  auto eager = testing::run_command(run, 300);
  ASSERT_EQ(eager.exit_code, 0) << eager.output;
  auto graphed = testing::run_command(run + " --cuda-graph", 300);
  ASSERT_EQ(graphed.exit_code, 0) << graphed.output;
  const double want = testing::json_number(eager.output, "final_loss");
  const double got = testing::json_number(graphed.output, "final_loss");
  EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << eager.output << graphed.output;
  EXPECT_EQ(testing::json_number(graphed.output, "cuda_graph_replays"), 297) << graphed.output;
  EXPECT_EQ(testing::json_number(graphed.output, "test_accuracy"),
            testing::json_number(eager.output, "test_accuracy"));
}

TEST(CudaGraph, TheTrainerRefusesWhatItCannotCapture) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result = testing::run_command(
      testing::bin("train_fashion_mnist") + " --device cpu --max-steps 1 --cuda-graph", 60);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("--cuda-graph captures the step of --strategy ddp on one rank on a "
                               "GPU without --amp or --grad-accum; this run has the CPU as its "
                               "device"),
            std::string::npos)
      << result.output;
  EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1) << result.output;
}

}  // namespace
}  // namespace dtrain
