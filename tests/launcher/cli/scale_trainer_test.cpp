// `dtrain scale` on the real trainer: train_fashion_mnist's DDP writes DTRAIN_PROFILE records, and
// the report built from them must be complete and self-consistent at 1 and 2 workers. The test
// itself needs no LibTorch; it runs build/bin/dtrain and build/bin/train_fashion_mnist.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "support/system.h"
#include "test_support.h"

namespace dtrain::cli {
namespace {

using namespace testing_support;

// The trainer's MLP (784-256-128-10, float32): the bytes every DDP step all-reduces.
constexpr double kMlpGradientBytes = 4.0 * (784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);

TEST(ScaleTrainer, ReportFromTheTrainersRecordsAtOneAndTwoWorkers) {
  if (!dtrain::testing::have_fashion_mnist()) GTEST_SKIP() << dtrain::testing::kNoFashionMnist;
  TempDir dir;
  std::string plot = dir / "speedup.svg";
  ChildProcess scale(
      {std::string(DTRAIN_BIN_DIR) + "/dtrain", "scale", "--nproc", "1,2", "--steps", "10",
       "--json", "--plot", plot, "--", std::string(DTRAIN_BIN_DIR) + "/train_fashion_mnist",
       "--strategy", "ddp", "--batch-size", "32"},
      dir / "out", dir / "err");
  ASSERT_TRUE(scale.wait(240s)) << read_file(dir / "err");
  ASSERT_EQ(scale.exit_code(), 0) << read_file(dir / "err");
  nlohmann::json report = nlohmann::json::parse(read_file(dir / "out"));
  ASSERT_EQ(report["runs"].size(), 2u);
  for (const nlohmann::json& run : report["runs"]) {
    int workers = run["workers"];
    SCOPED_TRACE("workers " + std::to_string(workers));
    EXPECT_EQ(run["source"], "profile");
    EXPECT_EQ(run["measured_steps"], 10);
    EXPECT_EQ(run["ranks_recorded"], workers);
    EXPECT_EQ(run["samples_per_rank_step"].get<double>(), 32.0);  // --batch-size is per rank
    EXPECT_GT(run["samples_per_s"].get<double>(), 0);
    EXPECT_GT(run["compute_s"].get<double>(), 0);
    // The measured parts fit in the step (the rest is the records' "other"), the parts and the
    // rest make up the interval, and the step interval on the records' clock is no shorter than
    // the step. How large each part is depends on the machine and is not checked.
    double parts = run["compute_s"].get<double>() + run["exposed_comm_s"].get<double>() +
                   run["optimizer_s"].get<double>();
    EXPECT_LE(parts, run["step_s"].get<double>() + 1e-6);
    EXPECT_NEAR(parts + run["other_s"].get<double>(), run["step_interval_s"].get<double>(), 1e-9);
    EXPECT_GE(run["step_interval_s"].get<double>(), 0.9 * run["step_s"].get<double>());
  }
  const nlohmann::json& two = report["runs"][1];
  EXPECT_EQ(two["comm_bytes"].get<double>(), kMlpGradientBytes);
  EXPECT_GT(two["comm_s"].get<double>(), 0);
  EXPECT_GT(two["bus_gbps"].get<double>(), 0);
  EXPECT_EQ(two["verdict"].get<std::string>().rfind("2 workers: ", 0), 0u) << two["verdict"];
  EXPECT_FALSE(two["reason"].get<std::string>().empty());

  const nlohmann::json& prediction = report["prediction"];
  ASSERT_TRUE(prediction["available"].get<bool>()) << prediction.dump();
  EXPECT_EQ(prediction["scaling"], "weak");  // --batch-size is per rank
  const std::string weak =
      "weak scaling: each worker keeps its batch (per-rank samples per step went from 32 at 1 "
      "worker to 32 at 2 workers; train_fashion_mnist's --batch-size is per rank";
  bool named = false;
  for (const nlohmann::json& assumption : prediction["assumptions"])
    named = named || assumption.get<std::string>().rfind(weak, 0) == 0;
  EXPECT_TRUE(named) << prediction["assumptions"].dump();
  EXPECT_EQ(prediction["fitted_on_workers"], 2);
  bool reproduced = false;
  for (const nlohmann::json& point : prediction["points"]) {
    if (point["workers"] == 2) {
      EXPECT_NEAR(point["speedup"].get<double>(), two["speedup"].get<double>(),
                  0.01 * two["speedup"].get<double>());
      reproduced = true;
    }
  }
  EXPECT_TRUE(reproduced);
  std::string svg = read_file(plot);
  EXPECT_EQ(count(svg, "<svg"), 1);
  EXPECT_EQ(count(svg, "</svg>"), 1);
  EXPECT_EQ(count(svg, "<circle"), 2 + 1);  // measured points and the legend's
}

}  // namespace
}  // namespace dtrain::cli
