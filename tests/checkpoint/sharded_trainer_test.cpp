// Tier-2 tests of the trainer's --strategy zero (tools/trainer) through `dtrain run`: each stage
// reaches DDP's accuracy bar in one epoch while saving sharded checkpoints, and a run saved at 2
// ranks with stage 3 resumes at 3 ranks with stage 1, seeing the rest of the epoch once.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "support/subprocess.h"
#include "support/system.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using testing::bin;
using testing::json_int;
using testing::json_number;
using testing::run_command;

std::string zero_trainer(int ranks, int stage, const std::string& flags) {
  return bin("dtrain") + " run --nproc-per-node " + std::to_string(ranks) + " -- " +
         bin("train_fashion_mnist") + " --strategy zero --zero-stage " + std::to_string(stage) +
         " " + flags;
}

class ZeroTrainer : public ::testing::TestWithParam<int> {};

TEST_P(ZeroTrainer, ReachesDdpAccuracyInOneEpochWithShardedCheckpoints) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const int stage = GetParam();
  const std::string dir = testing::temp_dir("dtrain-zero-trainer");
  auto result = run_command(zero_trainer(2, stage, "--checkpoint-dir " + dir), 300);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_EQ(json_int(result.output, "zero_stage"), stage) << result.output;
  // The end of the epoch was saved as a sharded checkpoint: both ranks' files and the metadata.
  const std::string last = dir + "/checkpoint-" + std::to_string(json_int(result.output, "steps"));
  for (const char* file : {"metadata.ckpt", "rank-0-of-2.ckpt", "rank-1-of-2.ckpt"})
    EXPECT_TRUE(fs::exists(last + "/" + file)) << last << "/" << file;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroTrainer, ::testing::Values(2, 3));

TEST(ZeroTrainerResume, SavedAt2RanksStage3ResumesAt3RanksStage1) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string dir = testing::temp_dir("dtrain-zero-resume");
  // 40 steps of 60 samples (30 per rank) on 2 ranks, then the rest of the epoch on 3 ranks.
  auto first = run_command(
      zero_trainer(2, 3, "--batch-size 30 --max-steps 40 --checkpoint-dir " + dir), 120);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(json_int(first.output, "train_samples"), 40 * 60) << first.output;

  auto second =
      run_command(zero_trainer(3, 1, "--batch-size 20 --resume --checkpoint-dir " + dir), 300);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from " + dir +
                               "/checkpoint-40 at epoch 1, 2400 samples into it, step 40"),
            std::string::npos)
      << second.output;
  EXPECT_EQ(json_int(second.output, "train_samples"), 60000 - 40 * 60) << second.output;
  EXPECT_GE(json_number(second.output, "test_accuracy"), 0.84) << second.output;
  EXPECT_TRUE(fs::exists(dir + "/checkpoint-" + std::to_string(json_int(second.output, "steps")) +
                         "/rank-2-of-3.ckpt"))
      << second.output;
  fs::remove_all(dir);
}

TEST(ZeroTrainerResume, AsyncCheckpointsAreAUsageError) {
  auto result = run_command(bin("train_fashion_mnist") +
                            " --strategy zero --checkpoint-dir /tmp/unused --async-checkpoints");
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("--async-checkpoints is not supported with --strategy zero"),
            std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace dtrain
