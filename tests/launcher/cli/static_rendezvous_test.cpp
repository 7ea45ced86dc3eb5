// The static rendezvous in-process: its rounds are the flags, a failure spends one of this node's
// --max-restarts (shared with the in-place recovery's restarts of single workers), and nothing
// changes under running workers. The same through the real binary: launcher_test.cpp and
// recovery_test.cpp.
#include "launcher/cli/static_rendezvous.h"

#include <gtest/gtest.h>

#include <span>

namespace dtrain::cli {
namespace {

using elastic::Verdict;

RunOptions two_nodes(int max_restarts) {
  RunOptions options;
  options.nnodes = 2;
  options.node_rank = 1;
  options.nproc_per_node = 3;
  options.master_addr = "10.1.2.3";
  options.master_port = 29500;
  options.max_restarts = max_restarts;
  return options;
}

elastic::WorkerExit exited(int code) {
  elastic::WorkerExit exit;
  exit.global_rank = 4;
  exit.exit_code = code;
  return exit;
}

// A pipe for no signal: next_round() takes one, and the static rendezvous never reads it.
class StaticRendezvousTest : public ::testing::Test {
 protected:
  elastic::SignalPipe signals_{std::span<const int>{}};

  elastic::WorkerGroupRound next(StaticRendezvous& rendezvous) {
    int exit_code = -1;
    std::optional<elastic::WorkerGroupRound> round = rendezvous.next_round(signals_, &exit_code);
    EXPECT_TRUE(round.has_value());
    return round.value_or(elastic::WorkerGroupRound{});
  }
};

TEST_F(StaticRendezvousTest, TheRoundIsTheFlags) {
  StaticRendezvous rendezvous(two_nodes(0), /*auto_port=*/false);
  elastic::WorkerGroupRound round = next(rendezvous);
  EXPECT_EQ(round.group_rank, 1);
  EXPECT_EQ(round.group_world_size, 2);
  EXPECT_EQ(round.base_rank, 3);
  EXPECT_EQ(round.world_size, 6);
  EXPECT_EQ(round.master_addr, "10.1.2.3");
  EXPECT_EQ(round.master_port, 29500);
  EXPECT_EQ(round.restart_count, 0);
  EXPECT_FALSE(round.agent_store);
  // Nothing to watch while the workers run.
  EXPECT_EQ(rendezvous.monitor_interval().count(), 0);
  EXPECT_EQ(rendezvous.check().kind, Verdict::Kind::kKeepRunning);
}

TEST_F(StaticRendezvousTest, WithoutAMasterPortEveryRoundPicksAFreePort) {
  RunOptions options = two_nodes(0);
  options.nnodes = 1;
  options.node_rank = 0;
  options.master_port = 0;
  StaticRendezvous rendezvous(options, /*auto_port=*/true);
  EXPECT_GT(next(rendezvous).master_port, 0);
}

TEST_F(StaticRendezvousTest, EachFailureSpendsARestartUntilNoneIsLeft) {
  StaticRendezvous rendezvous(two_nodes(2), false);
  next(rendezvous);
  Verdict first = rendezvous.report_failure(exited(5));
  EXPECT_EQ(first.kind, Verdict::Kind::kNewRound);
  EXPECT_EQ(first.message, "restarting the worker group of this node: attempt 1 (restart 1 of 2)");
  EXPECT_EQ(next(rendezvous).restart_count, 1);
  Verdict second = rendezvous.report_failure(exited(5));
  EXPECT_EQ(second.kind, Verdict::Kind::kNewRound);
  EXPECT_EQ(second.message, "restarting the worker group of this node: attempt 2 (restart 2 of 2)");
  EXPECT_EQ(next(rendezvous).restart_count, 2);
  Verdict last = rendezvous.report_failure(exited(5));
  EXPECT_EQ(last.kind, Verdict::Kind::kShutdown);
  EXPECT_EQ(last.message, "no restarts left (--max-restarts 2)");
  EXPECT_EQ(rendezvous.restarts().spent(), 2);
}

// A restart would fail the same way: exit code 2 ends the job with restarts left, spending none.
TEST_F(StaticRendezvousTest, AUsageErrorEndsTheJobWithRestartsLeft) {
  StaticRendezvous rendezvous(two_nodes(3), false);
  next(rendezvous);
  Verdict verdict = rendezvous.report_failure(exited(2));
  EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown);
  EXPECT_NE(verdict.message.find("not restarting: exit code 2 is a usage error"), std::string::npos)
      << verdict.message;
  EXPECT_EQ(rendezvous.restarts().spent(), 0);

  StaticRendezvous no_restarts(two_nodes(0), false);
  EXPECT_EQ(no_restarts.report_failure(exited(2)).message, "no restarts left (--max-restarts 0)");
}

// --recovery in-place restarts single workers from the same budget: the whole group's next restart
// counts on from them.
TEST_F(StaticRendezvousTest, RestartsOfSingleWorkersShareTheBudget) {
  StaticRendezvous rendezvous(two_nodes(2), false);
  next(rendezvous);
  EXPECT_TRUE(rendezvous.restarts().spend());
  EXPECT_EQ(rendezvous.restarts().left(), 1);
  EXPECT_EQ(rendezvous.report_failure(exited(1)).message,
            "restarting the worker group of this node: attempt 2 (restart 2 of 2)");
  EXPECT_EQ(next(rendezvous).restart_count, 2);
  EXPECT_FALSE(rendezvous.restarts().spend());
  EXPECT_EQ(rendezvous.report_failure(exited(1)).kind, Verdict::Kind::kShutdown);
}

}  // namespace
}  // namespace dtrain::cli
