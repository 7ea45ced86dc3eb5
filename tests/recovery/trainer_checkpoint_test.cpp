// The trainer's checkpoints under in-place recovery, with real processes: three workers of
// train_fashion_mnist under `dtrain run --recovery in-place`; job rank 0 (the one that saves) is
// killed (SIGKILL) after step 7 and not replaced. The survivors go on at two, and the checkpoints
// after the failure are written by the new generation's rank 0 (job rank 1) and load. A whole-job
// restart then resumes from the newest (--resume, the path a launcher's restart takes too): every
// sample of the epoch is used exactly once (epoch_samples), and the result equals what the restart
// path gives when it resumes from the same checkpoint. And a SIGTERM stops every worker at one
// step, and the whole group resumes. --batch-size 500 keeps an epoch at 40 steps of three workers:
// seconds, not minutes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <regex>

#include "dtrain/checkpoint.h"
#include "dtrain/data.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using testing::bin;
using testing::json_int;
using testing::json_list;
using testing::json_number;
using testing::run_command;

const std::string kTrainer = " -- " + bin("train_fashion_mnist") + " --batch-size 500 ";

// What one checkpoint file holds of the trainer's position (loaded alone, from a folder of its
// own: load_latest reads the newest file of a folder).
struct Saved {
  int64_t step = -1;
  int64_t samples_consumed = -1;
  std::string generation;
  std::vector<int64_t> epoch_samples;
};
Saved load_one(const std::string& file, const std::string& scratch) {
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  fs::copy_file(file, scratch + "/" + fs::path(file).filename().string());
  CheckpointOptions options;
  options.dir = scratch;
  Checkpointer checkpointer(options);
  DistributedSampler sampler(60000, 1, 0);
  TrainingState state;
  state.sampler = &sampler;
  state.rng = false;
  Saved saved;
  if (!checkpointer.load_latest(state)) return saved;
  saved.step = state.step;
  saved.samples_consumed = sampler.state().samples_consumed;
  saved.generation = state.values["generation"];
  auto counts = state.tensors["epoch_samples"];
  for (int64_t e = 0; e < counts.numel(); ++e)
    saved.epoch_samples.push_back(counts[e].item<int64_t>());
  return saved;
}

TEST(TrainerInPlace, CheckpointsFollowTheGroupAndAWholeJobRestartResumesFromThem) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string dir = testing::temp_dir("inplace-ckpt");
  const std::string checkpoints = dir + "/ckpt";
  fs::create_directories(dir);

  // Steps 1-7 at three workers (1500 samples each), 8-25 at two (1000): 28500 samples.
  auto first =
      run_command("env DTRAIN_TEST_KILL_AT_STEP=0:7 " + bin("dtrain") +
                      " run --nproc-per-node 3 --recovery in-place --max-restarts 0" + kTrainer +
                      "--max-steps 25 --checkpoint-every 5 --keep-checkpoints 10 "
                      "--checkpoint-dir " +
                      checkpoints,
                  120);
  SCOPED_TRACE(first.output);
  ASSERT_EQ(first.exit_code, 0);
  EXPECT_NE(first.output.find("killed by signal 9"), std::string::npos);
  EXPECT_EQ(json_int(first.output, "recoveries"), 1);
  EXPECT_EQ(json_int(first.output, "steps_redone"), 1);
  EXPECT_EQ(json_int(first.output, "world_size"), 2);
  EXPECT_EQ(json_int(first.output, "steps"), 25);
  EXPECT_EQ(json_list(first.output, "epoch_samples"), "[28500]");

  // Step 5 was saved by job rank 0 in the first generation; every later one by the second
  // generation's rank 0, each with the position and counts of its committed steps.
  const std::string scratch = dir + "/one";
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {5, 7500}, {10, 13500}, {15, 18500}, {20, 23500}, {25, 28500}};
  for (const auto& [step, samples] : expected) {
    const std::string file = checkpoints + "/checkpoint-" + std::to_string(step) + ".ckpt";
    ASSERT_TRUE(fs::exists(file)) << file;
    const Saved saved = load_one(file, scratch);
    EXPECT_EQ(saved.step, step) << file;
    EXPECT_EQ(saved.generation, step < 7 ? "0" : "1") << file;
    EXPECT_EQ(saved.samples_consumed, samples) << file;
    EXPECT_EQ(saved.epoch_samples, std::vector<int64_t>{samples}) << file;
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(checkpoints), fs::directory_iterator{}), 5)
      << "a checkpoint other than steps 5, 10, 15, 20 and 25";

  // The whole job again, resuming from step 25 at three workers: in place, and as the restart path
  // does from a copy of the same folder.
  const std::string copy = dir + "/ckpt-copy";
  fs::copy(checkpoints, copy);
  auto in_place = run_command(bin("dtrain") + " run --nproc-per-node 3 --recovery in-place" +
                                  kTrainer + "--resume --checkpoint-dir " + checkpoints,
                              120);
  auto restart = run_command(bin("dtrain") + " run --nproc-per-node 3 --recovery restart" +
                                 kTrainer + "--resume --checkpoint-dir " + copy,
                             120);
  SCOPED_TRACE(in_place.output);
  SCOPED_TRACE(restart.output);
  ASSERT_EQ(in_place.exit_code, 0);
  ASSERT_EQ(restart.exit_code, 0);
  const std::string resumed = "resumed from " + checkpoints +
                              "/checkpoint-25.ckpt at epoch 1, 28500 samples into it, step 25";
  EXPECT_NE(in_place.output.find(resumed), std::string::npos);
  EXPECT_NE(in_place.output.find("\"recovery\":\"in-place\""), std::string::npos);
  EXPECT_EQ(json_list(in_place.output, "epoch_samples"), "[60000]");  // each sample once
  EXPECT_EQ(json_int(in_place.output, "train_samples"), 60000 - 28500);
  EXPECT_EQ(json_int(in_place.output, "steps"), 25 + 21);
  EXPECT_EQ(json_list(restart.output, "epoch_samples"), "[60000]");
  EXPECT_EQ(json_int(restart.output, "steps"), 25 + 21);
  // The same 21 steps of three ranks from the same state: the same model (equal here; the margins
  // are below one test sample and the loss's sixth digit).
  EXPECT_NEAR(json_number(in_place.output, "final_loss"), json_number(restart.output, "final_loss"),
              1e-6);
  EXPECT_NEAR(json_number(in_place.output, "test_accuracy"),
              json_number(restart.output, "test_accuracy"), 1e-5);
  fs::remove_all(dir);
}

TEST(TrainerInPlace, ASigtermStopsEveryWorkerAndTheWholeGroupResumes) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // Only job rank 1 receives SIGTERM, after step 10: the three agree inside the next step's body,
  // rank 0 saves step 10 and all exit 143; the launcher restarts the whole group (a newcomer would
  // find nobody to join), which resumes from that checkpoint and finishes the epoch.
  const std::string dir = testing::temp_dir("inplace-stop");
  auto run = run_command("env DTRAIN_TEST_KILL_AT_STEP=1:10:15 " + bin("dtrain") +
                             " run --nproc-per-node 3 --recovery in-place --max-restarts 1" +
                             kTrainer + "--checkpoint-dir " + dir,
                         120);
  SCOPED_TRACE(run.output);
  ASSERT_EQ(run.exit_code, 0);
  EXPECT_NE(
      run.output.find("stopped by SIGTERM after step 10: saved " + dir + "/checkpoint-10.ckpt"),
      std::string::npos);
  EXPECT_NE(run.output.find("restarting the whole group from the last checkpoint"),
            std::string::npos);
  EXPECT_NE(run.output.find("restart 1: resumed from " + dir +
                            "/checkpoint-10.ckpt at epoch 1, 15000 samples into it, step 10"),
            std::string::npos);
  EXPECT_EQ(run.output.find("restarting it alone"), std::string::npos);
  EXPECT_EQ(json_list(run.output, "epoch_samples"), "[60000]");
  EXPECT_EQ(json_int(run.output, "steps"), 40);
  EXPECT_EQ(json_int(run.output, "recoveries"), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
