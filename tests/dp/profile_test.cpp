// DTRAIN_PROFILE's per-step records for DataParallel: fields present and sane, the parameter copies
// and the gradient reduction counted as (exposed, in-process) communication, and the breakdown adds
// up.
#include "dtrain/profile.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/dp.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

TEST(DataParallelProfile, OneRecordPerStepThatAddsUp) {
  std::string path = testing::temp_dir("dp-profile") + ".jsonl";
  setenv("DTRAIN_PROFILE", path.c_str(), 1);
  const int steps = 5;
  {
    torch::manual_seed(2);
    torch::nn::Sequential net(torch::nn::Linear(20, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 4));
    DataParallelOptions options;
    options.num_replicas = 2;
    DataParallel<torch::nn::SequentialImpl> dp(net.ptr(), options);
    torch::optim::SGD optimizer(net->parameters(), 0.01);
    at::Tensor x = torch::randn({10, 20}), y = torch::randint(0, 4, {10});
    auto loss = [](const at::Tensor& out, const at::Tensor& target) {
      return torch::nn::functional::cross_entropy(out, target);
    };
    for (int s = 0; s < steps; ++s) {
      optimizer.zero_grad();
      dp->forward_backward(x, y, loss);
      ProfileOptimizerStep timed;
      optimizer.step();
    }
  }
  unsetenv("DTRAIN_PROFILE");
  std::ifstream in(path);
  std::string line;
  int count = 0;
  const int64_t parameter_bytes = (20 * 64 + 64 + 64 * 4 + 4) * 4;
  while (std::getline(in, line)) {
    auto r = nlohmann::json::parse(line);
    SCOPED_TRACE(line);
    EXPECT_EQ(r["strategy"], "dp");
    EXPECT_EQ(r["replicas"], 2);
    EXPECT_EQ(r["step"], count);
    EXPECT_EQ(r["samples"], 10);
    EXPECT_EQ(r["comm_ops"], 2);  // the copy into replica 1, the reduction
    EXPECT_EQ(r["comm_bytes"].get<int64_t>(), 2 * parameter_bytes);
    double step = r["step_s"], forward = r["forward_s"], backward = r["backward_s"];
    double exposed = r["exposed_comm_s"], optimizer = r["optimizer_s"];
    EXPECT_GT(forward, 0);
    EXPECT_GT(backward, 0);
    EXPECT_GT(exposed, 0);
    EXPECT_GT(optimizer, 0);
    // The phases and the rest (between backward and the optimizer, after it) partition the step;
    // how large each is depends on the machine, so only the accounting is checked here.
    double other = r["other_s"];
    EXPECT_GE(other, 0);
    EXPECT_NEAR(forward + backward + exposed + optimizer + other, step, 1e-8);
    ++count;
  }
  EXPECT_EQ(count, steps);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace dtrain
