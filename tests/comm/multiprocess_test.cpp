// Tier-2 tests of the communication layer: real processes started by `dtrain run`.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <regex>

#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::free_port;
using testing::json_number;
using testing::run_command;

TEST(MultiProcess, AllReduceAcrossThreeProcesses) {
  auto result =
      run_command(bin("dtrain") + " run --nproc-per-node 3 -- " + bin("comm_worker") + " sum");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(result.output.find("[rank" + std::to_string(rank) + "]: rank " +
                                 std::to_string(rank) + " sum 6"),
              std::string::npos)
        << result.output;
  }
}

TEST(MultiProcess, TwoStaticNodesOnOneMachineFormOneJob) {
  // Two launchers as two "nodes" of 2 workers each: ranks 0-1 on node 0, ranks 2-3 on node 1.
  std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    return bin("dtrain") + " run --nnodes 2 --node-rank " + std::to_string(rank) +
           " --nproc-per-node 2 " + "--master-addr 127.0.0.1 --master-port " + port + " -- " +
           bin("comm_worker") + " sum";
  };
  auto result =
      run_command("sh -c '" + node(1) + " & " + node(0) + "; status=$?; wait $! && exit $status'");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(result.output.find("[rank" + std::to_string(rank) + "]: rank " +
                                 std::to_string(rank) + " sum 10"),
              std::string::npos)
        << result.output;
  }
}

TEST(MultiProcess, PipelineAcrossTwoNodesEqualsSingleProcessModelParallel) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // Distributed model parallel: the CNN's two stages on two launchers ("nodes") of one process
  // each, against the same two stages in one process. Same data, seed and micro-batches: the same
  // training.
  const std::string train =
      bin("train_fashion_mnist") +
      " --model cnn --micro-batches 4 --schedule 1f1b --max-steps 40 --seed 3";
  auto single = run_command(train + " --strategy mp --devices 2");
  ASSERT_EQ(single.exit_code, 0) << single.output;

  std::string port = std::to_string(free_port());
  auto node = [&](int rank) {
    return bin("dtrain") + " run --nnodes 2 --node-rank " + std::to_string(rank) +
           " --nproc-per-node 1 --master-addr 127.0.0.1 --master-port " + port + " -- " + train +
           " --strategy pipeline --stages 2";
  };
  auto two_nodes =
      run_command("sh -c '" + node(1) + " & " + node(0) + "; status=$?; wait $! && exit $status'");
  ASSERT_EQ(two_nodes.exit_code, 0) << two_nodes.output;
  EXPECT_NE(two_nodes.output.find("\"world_size\":2"), std::string::npos) << two_nodes.output;

  const double loss = json_number(single.output, "final_loss");
  ASSERT_GT(loss, 0) << single.output;
  EXPECT_NEAR(json_number(two_nodes.output, "final_loss"), loss, 1e-4 * loss)
      << single.output << two_nodes.output;
  EXPECT_NEAR(json_number(two_nodes.output, "test_accuracy"),
              json_number(single.output, "test_accuracy"), 1e-3)
      << single.output << two_nodes.output;
}

TEST(MultiProcess, RankThatNeverJoinsIsNamedAndTheJobStops) {
  // Rank 2 skips the second all-reduce; ranks 0 and 1 time out after 2 s and name it.
  auto result = run_command(bin("dtrain") + " run --nproc-per-node 3 --grace-period 2 -- " +
                            bin("comm_worker") + " skip 2 2");
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find(
                "all_reduce #2 on group 'default' timed out after 2 s; ranks {2} never joined "
                "(rank 2 last seen at all_reduce #1, "),
            std::string::npos)
      << result.output;
}

TEST(MultiProcess, RankThatDiesIsNamedWithoutWaitingForTheTimeout) {
  // The all-reduce timeout is 100 s; the command's limit of 60 s fails the test unless the death is
  // seen at once (shared memory: the peer's pid is gone).
  auto result = run_command(
      bin("dtrain") + " run --nproc-per-node 3 -- " + bin("comm_worker") + " vanish 1 100",
      /*time_limit_s=*/60);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.exit_code, 124) << "the dead rank was not noticed before the time limit\n"
                                   << result.output;
  // The real cause, and when it happened: seconds into the wait, not the 100 s timeout.
  EXPECT_TRUE(std::regex_search(
      result.output,
      std::regex(
          "all_reduce #2 on group 'default' failed after [0-9.]+ s \\(group rank 1 \\(pid ")))
      << result.output;
}

TEST(MultiProcess, RankThatDiesDuringADdpStepIsNamedWithoutWaitingForTheTimeout) {
  // DDP's buckets are reduced in shared memory (Note [Gradient buckets in shared memory]); the
  // waiting ranks see the dead peer's pid gone, as in a plain all-reduce.
  auto result = run_command(
      bin("dtrain") + " run --nproc-per-node 3 -- " + bin("comm_worker") + " ddp-vanish 1 100",
      /*time_limit_s=*/60);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.exit_code, 124) << "the dead rank was not noticed before the time limit\n"
                                   << result.output;
  EXPECT_TRUE(std::regex_search(
      result.output,
      std::regex("on group 'default' failed after [0-9.]+ s \\(group rank 1 \\(pid ")))
      << result.output;
}

TEST(MultiProcess, PeerThatDiesBeforeItsSendIsNamedWithoutWaitingForTheTimeout) {
  // Point to point through shared memory: rank 0 waits in a recv from rank 2, which exits. The
  // timeout is 100 s, the command's limit 60 s.
  auto result = run_command(
      bin("dtrain") + " run --nproc-per-node 3 -- " + bin("comm_worker") + " recv-vanish 2 100",
      /*time_limit_s=*/60);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.exit_code, 124) << "the dead rank was not noticed before the time limit\n"
                                   << result.output;
  EXPECT_TRUE(std::regex_search(
      result.output,
      std::regex(
          "recv with rank 2 on group 'default' failed after [0-9.]+ s \\(group rank 2 \\(pid ")))
      << result.output;
  EXPECT_NE(result.output.find("rank 2 did not post the matching send (tag 9)"), std::string::npos)
      << result.output;
}

TEST(MultiProcess, PipelineStageThatDiesIsNamedInSeconds) {
  // Stage 1 of 3 vanishes mid-step; the timeout is 100 s, the command's limit 60 s.
  auto result = run_command(
      bin("dtrain") + " run --nproc-per-node 3 -- " + bin("pipeline_worker") + " vanish 1 100",
      /*time_limit_s=*/60);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.exit_code, 124) << "the dead stage was not noticed before the time limit\n"
                                   << result.output;
  EXPECT_NE(result.output.find("with rank 1 on group 'default.pipeline0'"), std::string::npos)
      << result.output;
}

TEST(MultiProcess, BadRankVariableIsOneLineAndExitCode2) {
  auto result = run_command("env RANK=5 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 " +
                            bin("comm_worker") + " sum");
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find(
                "environment variable RANK='5': expected an integer in 0..1 (WORLD_SIZE=2)"),
            std::string::npos)
      << result.output;
}

TEST(MultiProcess, PyTorchDdpScriptRunsUnmodified) {
  const std::string python = testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  auto result = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + python + " " +
                            std::string(DTRAIN_SOURCE_DIR) + "/tests/python/ddp_smoke.py");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("ddp rank=0 world=2 in_sync=True"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("ddp rank=1 world=2 in_sync=True"), std::string::npos)
      << result.output;
}

TEST(MultiProcess, AllReduceBenchmarkRunsUnderTheLauncher) {
  auto result = run_command(bin("dtrain") + " run --nproc-per-node 3 -- " + bin("bench_allreduce") +
                            " --max-bytes 65536 --max-iters 10");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("busbw_GB/s"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("       65536 "), std::string::npos) << result.output;
}

TEST(MultiProcess, PointToPointBenchmarkRunsUnderTheLauncher) {
  auto result = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("bench_p2p") +
                            " --max-bytes 4096 --max-iters 10");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  // Both transports measured, up to the largest size asked for.
  EXPECT_NE(result.output.find("{\"bench\":\"p2p\",\"transport\":\"shm\",\"bytes\":4096,"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("{\"bench\":\"p2p\",\"transport\":\"gloo\",\"bytes\":4096,"),
            std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace dtrain
