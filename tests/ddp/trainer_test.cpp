// Tier-2 tests of the Fashion-MNIST trainer (tools/trainer): its defaults train at any world size
// (--batch-size is per rank), a run stopped mid-epoch and resumed at another world size processes
// every remaining training sample exactly once, and bad flags or data get one clear line and exit
// code 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::json_int;
using testing::json_number;
using testing::run_command;

std::string temp_dir(const std::string& stem) {
  auto dir = std::filesystem::temp_directory_path() / (stem + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(Trainer, ResumedAtAnotherWorldSizeSeesTheRestOfTheEpochOnce) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  std::string dir = temp_dir("dtrain-trainer");
  // 40 steps of 60 samples (30 per rank) on 2 ranks, then the rest of the epoch on 3 ranks (20
  // per rank: the same global batch).
  auto first =
      run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_fashion_mnist") +
                  " --batch-size 30 --max-steps 40 --checkpoint-dir " + dir);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(json_int(first.output, "train_samples"), 40 * 60) << first.output;

  auto second =
      run_command(bin("dtrain") + " run --nproc-per-node 3 -- " + bin("train_fashion_mnist") +
                  " --batch-size 20 --resume --checkpoint-dir " + dir);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from " + dir +
                               "/checkpoint-40.ckpt at epoch 1, 2400 samples into it, step 40"),
            std::string::npos)
      << second.output;
  EXPECT_EQ(json_int(second.output, "train_samples"), 60000 - 40 * 60) << second.output;
  EXPECT_EQ(json_int(second.output, "steps"), 40 + (60000 - 2400) / 60) << second.output;
  std::filesystem::remove_all(dir);
}

// The trainer's defaults at a world size that does not divide the old global batch of 64 (3) and at
// the ends of 1..8: --batch-size is per rank (32), so each trains on 32 x ranks samples per step,
// and five steps leave a finite loss about an untrained model's (ln 10 = 2.30) or below and a test
// accuracy well above chance (0.1). About 4, 9 and 24 s on 2 busy cores: 5 and 7 take no other
// path.
class TrainerDefaults : public ::testing::TestWithParam<int> {};

TEST_P(TrainerDefaults, TrainAtThisWorldSize) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const int world = GetParam();
  auto result = run_command(bin("dtrain") + " run --nproc-per-node " + std::to_string(world) +
                                " -- " + bin("train_fashion_mnist") + " --epochs 1 --max-steps 5",
                            120);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(json_int(result.output, "world_size"), world) << result.output;
  EXPECT_EQ(json_int(result.output, "per_rank_batch"), 32) << result.output;
  EXPECT_EQ(json_int(result.output, "global_batch"), 32 * world) << result.output;
  EXPECT_EQ(json_int(result.output, "steps"), 5) << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 5 * 32 * world) << result.output;
  const double loss = json_number(result.output, "final_loss");  // NaN when null (not finite)
  EXPECT_GT(loss, 0) << result.output;
  EXPECT_LT(loss, 2.35) << result.output;
  EXPECT_GT(json_number(result.output, "test_accuracy"), 0.2) << result.output;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TrainerDefaults, ::testing::Values(1, 3, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "ranks" + std::to_string(info.param);
                         });

// --strategy dp scatters the process's batch over its replicas as torch.nn.DataParallel does: the
// default 32 rows over 3 replicas are slices of 11, 11 and 10, and the global batch stays 32.
TEST(Trainer, DataParallelSplitsTheDefaultBatchUnevenly) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result =
      run_command(bin("train_fashion_mnist") + " --strategy dp --devices 3 --max-steps 5");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(json_int(result.output, "global_batch"), 32) << result.output;
  EXPECT_EQ(json_int(result.output, "per_rank_batch"), 32) << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 5 * 32) << result.output;
  const double loss = json_number(result.output, "final_loss");
  EXPECT_GT(loss, 0) << result.output;
  EXPECT_LT(loss, 2.35) << result.output;
}

// With the same --batch-size (per rank) at both world sizes the global batch changes at the resume,
// 64 to 96; the checkpoint's position is in samples, so the rest of the epoch is still seen once:
// 60000 - 40 x 64 = 57440 samples over 3 ranks are 19147 each (one padding repeat, counted as
// trained), 599 steps of 32 with a last one of 11.
TEST(Trainer, ResumedWithTheSamePerRankBatchAtAnotherWorldSizeSeesTheRestOnce) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  std::string dir = temp_dir("dtrain-trainer-per-rank");
  auto first = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " +
                           bin("train_fashion_mnist") + " --max-steps 40 --checkpoint-dir " + dir);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(json_int(first.output, "train_samples"), 40 * 64) << first.output;

  auto second = run_command(bin("dtrain") + " run --nproc-per-node 3 -- " +
                            bin("train_fashion_mnist") + " --resume --checkpoint-dir " + dir);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from " + dir +
                               "/checkpoint-40.ckpt at epoch 1, 2560 samples into it, step 40"),
            std::string::npos)
      << second.output;
  EXPECT_EQ(json_int(second.output, "global_batch"), 96) << second.output;
  EXPECT_EQ(json_int(second.output, "train_samples"), 3 * 19147) << second.output;
  EXPECT_EQ(json_int(second.output, "steps"), 40 + 599) << second.output;
  EXPECT_NE(second.output.find("\"epoch_samples\":[60001]"), std::string::npos) << second.output;
  std::filesystem::remove_all(dir);
}

TEST(Trainer, DataParallelStrategyTrains) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result = run_command(bin("train_fashion_mnist") +
                            " --strategy dp --devices 3 --batch-size 60 --max-steps 30");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("\"strategy\":\"dp\",\"replicas\":3"), std::string::npos)
      << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 30 * 60) << result.output;
}

TEST(Trainer, ModelParallelReachesDdpAccuracyInOneEpoch) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // One pipeline reads the whole global batch: 64, as the DDP main job's 2 ranks of 32.
  auto result = run_command(bin("train_fashion_mnist") +
                            " --strategy mp --devices 2 --micro-batches 4 --batch-size 64");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_NE(result.output.find("\"strategy\":\"mp\""), std::string::npos) << result.output;
  EXPECT_NE(result.output.find(
                "\"stages\":2,\"data_parallel\":1,\"micro_batches\":4,\"schedule\":\"1f1b\""),
            std::string::npos)
      << result.output;
}

TEST(Trainer, PipelineOfTwoStagesReachesDdpAccuracyInOneEpoch) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  auto result =
      run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_fashion_mnist") +
                  " --strategy pipeline --stages 2 --micro-batches 4 --schedule gpipe"
                  " --batch-size 64");  // one pipeline: the main job's global batch
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(json_number(result.output, "test_accuracy"), 0.84) << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 60000) << result.output;
  EXPECT_NE(result.output.find(
                "\"stages\":2,\"data_parallel\":1,\"micro_batches\":4,\"schedule\":\"gpipe\""),
            std::string::npos)
      << result.output;
}

TEST(Trainer, DataTimesPipelineTrains) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // 2 data-parallel pipelines x 2 stages, interleaved over 2 virtual stages each.
  auto result =
      run_command(bin("dtrain") + " run --nproc-per-node 4 -- " + bin("train_fashion_mnist") +
                  " --strategy pipeline --stages 2 --schedule interleaved --virtual-stages 2"
                  " --batch-size 30 --max-steps 30");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(json_int(result.output, "train_samples"), 30 * 60) << result.output;
  EXPECT_NE(result.output.find("\"stages\":2,\"data_parallel\":2"), std::string::npos)
      << result.output;
  // dtrain run recovers in place by default; a pipeline cannot, and rank 0 says so in one line.
  EXPECT_NE(result.output.find("in-place recovery: not for --strategy pipeline (in place: ddp "
                               "only); a failure restarts the job from its last checkpoint"),
            std::string::npos)
      << result.output;
}

// --grad-accum 2 with half the rows per pass trains as one pass of them all (the same rows a
// step, each pass adding its half of the mean loss's gradient), in every strategy that reduces
// across ranks: DDP in place (dtrain run's default), ZeRO-2, 2 data-parallel pipelines of 2
// stages, and DataParallel in one process. After 5 SGD steps the loss and the test accuracy are the
// whole batch's (printed to 6 digits; float sums in another order may move the last one). A pass
// whose loss is not weighted by its share doubles the step, and a pass that reads no new rows
// trains on others: either ends elsewhere. Reducing in every pass would give the same numbers (the
// average is linear), so DDP's step records (DTRAIN_PROFILE) count the reductions: one pass of two
// communicates, in place and in the restart path. (ZeRO's and the pipeline's no_sync are counted by
// DistributedPipeline.ZeroReducesAndGathersOncePerStep and ShardedDataParallel's own tests.)
TEST(Trainer, GradientAccumulationTrainsAsTheWholeBatch) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  for (const auto& [ranks, strategy] : {std::pair<int, std::string>{2, ""},
                                        {2, " --strategy zero --zero-stage 2"},
                                        {4, " --strategy pipeline --stages 2"},
                                        {1, " --strategy dp"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + strategy);
    const std::string run = bin("dtrain") + " run --nproc-per-node " + std::to_string(ranks) +
                            " -- " + bin("train_fashion_mnist") + " --max-steps 5 --device cpu" +
                            strategy;
    auto whole = run_command(run + " --batch-size 32");
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    auto halves = run_command(run + " --batch-size 16 --grad-accum 2");
    ASSERT_EQ(halves.exit_code, 0) << halves.output;
    // The trainer's global batch is per rank x ranks.
    EXPECT_EQ(json_int(halves.output, "global_batch"), json_int(whole.output, "global_batch"))
        << halves.output;
    EXPECT_NEAR(json_number(halves.output, "final_loss"), json_number(whole.output, "final_loss"),
                2e-5)
        << whole.output << halves.output;
    EXPECT_NEAR(json_number(halves.output, "test_accuracy"),
                json_number(whole.output, "test_accuracy"), 1e-4)
        << whole.output << halves.output;
  }
  const std::string profile = temp_dir("dtrain-grad-accum") + "/steps.jsonl";
  for (const std::string recovery : {"in-place", "restart"}) {
    SCOPED_TRACE(recovery);
    std::filesystem::remove(profile);
    auto run =
        run_command("env DTRAIN_PROFILE=" + profile + " " + bin("dtrain") + " run --recovery " +
                    recovery + " --nproc-per-node 2 -- " + bin("train_fashion_mnist") +
                    " --max-steps 3 --device cpu --batch-size 16 --grad-accum 2");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    // Rank 0's records, a pass each (a record is written when the next pass begins, so the last
    // pass may have none): the first pass of a step only accumulates, the second reduces.
    std::ifstream records(profile);
    std::vector<bool> communicated;
    for (std::string line; std::getline(records, line);) {
      if (line.find("\"rank\":0,") == std::string::npos) continue;
      communicated.push_back(line.find("\"comm_ops\":0,") == std::string::npos);
    }
    EXPECT_GE(communicated.size(), 5u) << profile;
    for (size_t i = 0; i < communicated.size(); ++i) {
      EXPECT_EQ(communicated[i], i % 2 == 1) << "pass " << i << " of rank 0 in " << profile;
    }
  }
  std::filesystem::remove_all(std::filesystem::path(profile).parent_path());
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

  auto no_checkpoint =
      run_command(bin("train_fashion_mnist") + " --resume --checkpoint-dir /nonexistent/ckpt");
  EXPECT_EQ(no_checkpoint.exit_code, 2);
  EXPECT_NE(no_checkpoint.output.find("--resume: no checkpoint in /nonexistent/ckpt; run once"),
            std::string::npos)
      << no_checkpoint.output;
}

}  // namespace
}  // namespace dtrain
