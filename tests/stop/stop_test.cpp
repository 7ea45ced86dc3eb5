// Tests for the agreed stop on SIGTERM (dtrain/stop.h). Tier 1: ranks as threads over an in-memory
// store, each with its own flag, world sizes 1..5: every rank stops after the same step. The
// handler on a real SIGTERM. Tier 2: tests/workers/libtorch_program under `dtrain run` with one
// rank SIGTERMed: both ranks stop after the same step with exit code 143, rank 0 saves, and the
// resumed run ends with the parameters of a run that was never stopped.
#include "dtrain/stop.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <filesystem>

#include "stop/stop_flag.h"
#include "support/equivalence.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::run_command;

// Runs body(rank, group) on world_size thread-ranks, with the group as the public API takes it.
void run_shared_group(int world_size,
                      const std::function<void(int, const std::shared_ptr<ProcessGroup>&)>& body) {
  const std::string method = testing::unique_store_name("stop");
  testing::run_ranks(world_size, [&](int rank) {
    InitOptions options;
    options.init_method = method;
    options.rank = rank;
    options.world_size = world_size;
    options.timeout = std::chrono::seconds(60);
    body(rank, init_process_group(options));
  });
}

// first_flag_step[r]: the step after which rank r's own flag is set (-1: never). Returns, per
// rank, the step after which the agreement said stop (-1: it never did in kSteps).
constexpr int kSteps = 8;
std::vector<int> stop_steps(const std::vector<int>& first_flag_step) {
  const int world_size = static_cast<int>(first_flag_step.size());
  std::vector<int> stopped(world_size, -1);
  run_shared_group(world_size, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    for (int step = 0; step < kSteps; ++step) {
      const bool mine = first_flag_step[rank] >= 0 && step >= first_flag_step[rank];
      if (detail::agree_to_stop(*group, mine, {})) {
        stopped[rank] = step;
        return;
      }
    }
  });
  return stopped;
}

TEST(AgreeToStop, EveryRankStopsAfterTheStepOfTheFirstFlag) {
  for (int world_size = 1; world_size <= 5; ++world_size) {
    for (int signalled = 0; signalled < world_size; ++signalled) {
      SCOPED_TRACE("world_size " + std::to_string(world_size) + ", only rank " +
                   std::to_string(signalled) + " signalled");
      std::vector<int> flags(world_size, -1);
      flags[signalled] = 3;
      EXPECT_EQ(stop_steps(flags), std::vector<int>(world_size, 3));
    }
    SCOPED_TRACE("world_size " + std::to_string(world_size) + ", signalled one by one");
    std::vector<int> staggered(world_size);
    for (int rank = 0; rank < world_size; ++rank) staggered[rank] = 5 - rank % 3;
    const int first = *std::min_element(staggered.begin(), staggered.end());
    EXPECT_EQ(stop_steps(staggered), std::vector<int>(world_size, first));
    EXPECT_EQ(stop_steps(std::vector<int>(world_size, -1)), std::vector<int>(world_size, -1));
  }
}

TEST(ShouldStop, AgreesOnThisProcesssFlag) {
  detail::clear_stop_request();
  EXPECT_FALSE(stop_requested());
  std::vector<int> answers(3, -1);
  run_shared_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    answers[rank] = should_stop(group);
  });
  EXPECT_EQ(answers, std::vector<int>(3, 0));
  request_stop();
  EXPECT_TRUE(stop_requested());
  run_shared_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    answers[rank] = should_stop(group);
    answers[rank] += should_stop(group);  // the flag stays set
  });
  EXPECT_EQ(answers, std::vector<int>(3, 2));
  detail::clear_stop_request();
}

TEST(ShouldStop, SigtermSetsTheFlagInsteadOfEndingTheProcess) {
  static_assert(kStopExitCode == 128 + SIGTERM);
  detail::clear_stop_request();
  install_stop_handler();
  install_stop_handler();  // idempotent
  EXPECT_FALSE(stop_requested());
  std::raise(SIGTERM);
  EXPECT_TRUE(stop_requested());
  detail::clear_stop_request();
  std::signal(SIGTERM, SIG_DFL);
}

TEST(ShouldStop, NullGroupIsAUsageError) {
  try {
    should_stop(nullptr);
    ADD_FAILURE() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("group is null"), std::string::npos) << e.what();
  }
}

std::vector<torch::Tensor> load_parameters(const std::string& path) {
  std::vector<torch::Tensor> parameters;
  torch::load(parameters, path);
  return parameters;
}

TEST(StopProcesses, OneRankSigtermedStopsBothAfterTheSameStepAndTheResumeEndsAsAnUnstoppedRun) {
  const std::string dir = testing::temp_dir("dtrain-stop");
  std::filesystem::create_directories(dir);
  const std::string launch =
      bin("dtrain") + " run --nproc-per-node 2 -- " + bin("libtorch_program") + " ddp " + dir;

  // Only rank 1 gets SIGTERM, after step 5 of 12 (in the first epoch, 6 steps long). Rank 0 must
  // learn it from the agreement, or it would wait in step 6's all-reduce for a rank that left.
  auto stopped = run_command(launch + "/stopped.pt --sigterm-at 1:5 " + dir);
  EXPECT_EQ(stopped.exit_code, kStopExitCode) << stopped.output;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(stopped.output.find("rank " + std::to_string(rank) + " stopped after step 5"),
              std::string::npos)
        << stopped.output;
  }
  EXPECT_NE(stopped.output.find("exited with code 143"), std::string::npos) << stopped.output;
  ASSERT_TRUE(std::filesystem::exists(dir + "/sampler.pt")) << stopped.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/stopped.pt")) << "the stopped run went on";

  // The resumed run trains the remaining 7 steps: the rest of the first epoch (its set_epoch keeps
  // the loaded position), then the second.
  auto resumed = run_command(launch + "/resumed.pt --resume " + dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("rank 1 trained 7 steps"), std::string::npos) << resumed.output;
  auto whole = run_command(launch + "/whole.pt");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_LT(testing::relative_error(load_parameters(dir + "/resumed.pt"),
                                    load_parameters(dir + "/whole.pt")),
            1e-5);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
