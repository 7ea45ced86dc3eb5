// A program in the ordinary LibTorch shape (tests/workers/libtorch_program.cpp: a TORCH_MODULE
// holder, make_data_loader over a torch::data dataset with dtrain's sampler, a per-rank batch)
// trained on 2 ranks under `dtrain run` against the same training in one process without dtrain,
// on the global batch: the parameters after 12 optimizer steps must agree.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "support/equivalence.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::relative_error;
using testing::run_command;

// float32 through a different summation order for 12 steps; one sample more or less in one step,
// or another batch size, moves the parameters by 1e-3 or more (checked below).
constexpr double kTolerance = 1e-5;

std::vector<torch::Tensor> load_parameters(const std::string& path) {
  std::vector<torch::Tensor> parameters;
  torch::load(parameters, path);
  return parameters;
}

TEST(LibTorchProgram, TwoRanksThroughDtrainEqualOneProcessWithoutIt) {
  const std::string dir = testing::temp_dir("dtrain-libtorch-program");
  std::filesystem::create_directories(dir);
  const std::string program = bin("libtorch_program");

  auto single = run_command(program + " single 2 " + dir + "/single.pt");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  auto ddp = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + program + " ddp " + dir +
                         "/ddp.pt");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(ddp.output.find("rank " + std::to_string(rank) + " trained 12 steps"),
              std::string::npos)
        << ddp.output;
  }
  const auto want = load_parameters(dir + "/single.pt");
  const auto got = load_parameters(dir + "/ddp.pt");
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LT(relative_error(got, want), kTolerance);

  // The tolerance can fail: one process on a batch of 8 (the per-rank batch taken for a global
  // one) trains differently.
  auto per_rank_batch = run_command(program + " single 1 " + dir + "/single-8.pt");
  ASSERT_EQ(per_rank_batch.exit_code, 0) << per_rank_batch.output;
  EXPECT_GT(relative_error(load_parameters(dir + "/single-8.pt"), want), 1e-3);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
