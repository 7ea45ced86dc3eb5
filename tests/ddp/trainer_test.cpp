// Tier-2 tests of the Fashion-MNIST trainer (examples/train_fashion_mnist): a run stopped mid-epoch
// and resumed at another world size processes every remaining training sample exactly once, and bad
// flags or data get one clear line and exit code 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::run_command;
using testing::json_int;
using testing::json_number;

std::string temp_dir(const std::string& stem) {
  auto dir = std::filesystem::temp_directory_path() / (stem + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(Trainer, ResumedAtAnotherWorldSizeSeesTheRestOfTheEpochOnce) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  std::string dir = temp_dir("dtrain-trainer");
  // 40 steps of 60 samples on 2 ranks, then the rest of the epoch on 3 ranks.
  auto first =
      run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_fashion_mnist") +
                  " --batch-size 60 --max-steps 40 --checkpoint-dir " + dir);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(json_int(first.output, "train_samples"), 40 * 60) << first.output;

  auto second =
      run_command(bin("dtrain") + " run --nproc-per-node 3 -- " + bin("train_fashion_mnist") +
                  " --batch-size 60 --resume --checkpoint-dir " + dir);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from " + dir +
                               "/checkpoint-40.ckpt at epoch 1, 2400 samples into it, step 40"),
            std::string::npos)
      << second.output;
  EXPECT_EQ(json_int(second.output, "train_samples"), 60000 - 40 * 60) << second.output;
  EXPECT_EQ(json_int(second.output, "steps"), 40 + (60000 - 2400) / 60) << second.output;
  std::filesystem::remove_all(dir);
}

TEST(Trainer, DataParallelStrategyTrains) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result = run_command(bin("train_fashion_mnist") +
                            " --strategy dp --devices 3 --batch-size 60 --max-steps 30");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("\"strategy\": \"dp\", \"replicas\": 3"), std::string::npos)
      << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 30 * 60) << result.output;
}

TEST(Trainer, ModelParallelReachesDdpAccuracyInOneEpoch) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result =
      run_command(bin("train_fashion_mnist") + " --strategy mp --devices 2 --micro-batches 4");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_NE(result.output.find("\"strategy\": \"mp\""), std::string::npos) << result.output;
  EXPECT_NE(
      result.output.find(
          "\"stages\": 2, \"data_parallel\": 1, \"micro_batches\": 4, \"schedule\": \"1f1b\""),
      std::string::npos)
      << result.output;
}

TEST(Trainer, PipelineOfTwoStagesReachesDdpAccuracyInOneEpoch) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result =
      run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_fashion_mnist") +
                  " --strategy pipeline --stages 2 --micro-batches 4 --schedule gpipe");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 60000) << result.output;
  EXPECT_NE(
      result.output.find(
          "\"stages\": 2, \"data_parallel\": 1, \"micro_batches\": 4, \"schedule\": \"gpipe\""),
      std::string::npos)
      << result.output;
}

TEST(Trainer, DataTimesPipelineTrains) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // 2 data-parallel pipelines x 2 stages, interleaved over 2 virtual stages each.
  auto result =
      run_command(bin("dtrain") + " run --nproc-per-node 4 -- " + bin("train_fashion_mnist") +
                  " --strategy pipeline --stages 2 --schedule interleaved --virtual-stages 2"
                  " --batch-size 60 --max-steps 30");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 30 * 60) << result.output;
  EXPECT_NE(result.output.find("\"stages\": 2, \"data_parallel\": 2"), std::string::npos)
      << result.output;
}

TEST(Trainer, BadPipelineCombinationIsOneLineOnEveryRank) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto uneven = run_command(bin("dtrain") + " run --nproc-per-node 3 -- " +
                                bin("train_fashion_mnist") + " --strategy pipeline --stages 2",
                            60);
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_NE(uneven.exit_code, 124) << uneven.output;
  EXPECT_NE(uneven.output.find("--stages 2 does not divide the 3 processes"), std::string::npos)
      << uneven.output;

  auto too_many =
      run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_fashion_mnist") +
                      " --strategy pipeline --stages 2 --schedule interleaved --virtual-stages 4",
                  60);
  EXPECT_NE(too_many.exit_code, 124) << too_many.output;
  EXPECT_NE(too_many.output.find("cannot cut a model of 6 layers into 8 chunks"), std::string::npos)
      << too_many.output;

  auto zero = run_command(bin("train_fashion_mnist") + " --strategy mp --micro-batches 0");
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_EQ(zero.output,
            "train_fashion_mnist: --micro-batches '0': expected an integer in 1..1048576\n");
}

TEST(Trainer, BadInputIsOneLineAndExitCode2) {
  auto bad_model = run_command(bin("train_fashion_mnist") + " --model resnet");
  EXPECT_EQ(bad_model.exit_code, 2);
  EXPECT_EQ(bad_model.output, "train_fashion_mnist: --model 'resnet': expected mlp or cnn\n");

  auto no_data = run_command(bin("train_fashion_mnist") + " --data /nonexistent/fmnist");
  EXPECT_EQ(no_data.exit_code, 2);
  EXPECT_NE(no_data.output.find("apt-get install dataset-fashion-mnist"), std::string::npos)
      << no_data.output;

  auto uneven = run_command(bin("dtrain") + " run --nproc-per-node 3 -- " +
                            bin("train_fashion_mnist") + " --batch-size 64");
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_NE(uneven.output.find("--batch-size 64 does not split evenly over 3 data-parallel "
                               "replicas; use a multiple of 3"),
            std::string::npos)
      << uneven.output;

  auto no_checkpoint =
      run_command(bin("train_fashion_mnist") + " --resume --checkpoint-dir /nonexistent/ckpt");
  EXPECT_EQ(no_checkpoint.exit_code, 2);
  EXPECT_NE(no_checkpoint.output.find("--resume: no checkpoint in /nonexistent/ckpt; run once"),
            std::string::npos)
      << no_checkpoint.output;
}

}  // namespace
}  // namespace dtrain
