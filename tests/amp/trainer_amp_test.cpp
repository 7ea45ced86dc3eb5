// Tier-2 tests of the trainer's --amp and --device flags (tools/trainer): bf16 autocast reaches the
// accuracy bar in one epoch under DDP, DataParallel trains under it, the final JSON line names the
// device and the precision, and flags this machine cannot honour are one line with exit code 2.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <regex>

#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::json_number;
using testing::run_command;

TEST(TrainerAmp, BFloat16DdpReachesTheAccuracyBarInOneEpoch) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " +
                            bin("train_fashion_mnist") + " --amp bf16 --device cpu");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_EQ(json_number(result.output, "train_samples"), 60000) << result.output;
  EXPECT_NE(result.output.find("\"device\":\"cpu\",\"amp\":\"bf16\""), std::string::npos)
      << result.output;
  // bfloat16 needs no loss scaling: no scaler, so nothing reported about one.
  EXPECT_EQ(result.output.find("amp_skipped_steps"), std::string::npos) << result.output;
}

TEST(TrainerAmp, BFloat16DataParallelTrains) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result = run_command(
      bin("train_fashion_mnist") +
      " --strategy dp --devices 3 --batch-size 60 --max-steps 100 --amp bf16 --device cpu");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(json_number(result.output, "train_samples"), 100 * 60) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.7) << result.output;  // 100 steps of 60
  EXPECT_NE(result.output.find("\"device\":\"cpu\",\"amp\":\"bf16\""), std::string::npos)
      << result.output;
}

TEST(TrainerAmp, TheJsonLineNamesTheDevice) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // auto: the CPU here unless this process sees a GPU.
  auto result =
      run_command(bin("train_fashion_mnist") + " --strategy dp --devices 2 --max-steps 5");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const std::string want =
      torch::cuda::is_available() ? "\"device\":\"cuda:0\"" : "\"device\":\"cpu\"";
  EXPECT_NE(result.output.find(want + ",\"amp\":\"none\""), std::string::npos) << result.output;
}

// Exit code 2 and exactly one line of output.
void expect_usage_error(const std::string& flags, const std::string& needle) {
  auto result = run_command(bin("train_fashion_mnist") + " " + flags, 60);
  EXPECT_EQ(result.exit_code, 2) << flags << "\n" << result.output;
  EXPECT_NE(result.output.find(needle), std::string::npos) << flags << "\n" << result.output;
  EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1) << result.output;
}

TEST(TrainerAmp, FlagsThisMachineCannotHonourAreOneLine) {
  expect_usage_error("--amp fp16 --device cpu", "--amp fp16 needs a CUDA device");
  expect_usage_error("--amp fp32", "--amp 'fp32': expected bf16 or fp16");
  expect_usage_error("--device tpu", "--device 'tpu': expected cpu, cuda or auto");
  expect_usage_error("--strategy mp --amp bf16", "mixed precision is wired for ddp and dp only");
  if (!torch::cuda::is_available()) {
    expect_usage_error("--device cuda", "--device cuda: this process sees no CUDA device");
    expect_usage_error("--amp fp16",
                       "--amp fp16 needs a CUDA device");  // auto fell back to the CPU
  }
}

// Tier 3: float16 with loss scaling, one GPU per rank.
TEST(TrainerAmp, Float16OnCudaReachesTheAccuracyBar) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // One rank: --batch-size 64 keeps the main job's global batch (the default is 32 per rank).
  auto result =
      run_command(bin("train_fashion_mnist") + " --device cuda --amp fp16 --batch-size 64", 300);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_NE(result.output.find("\"device\":\"cuda:0\",\"amp\":\"fp16\",\"amp_skipped_steps\":"),
            std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace dtrain
