// `dtrain scale` on two hosts outside Slurm (--nnodes 2): two network-namespace hosts
// (support/namespace_hosts.h), each running the same command with its own --node-rank, the
// LibTorch-free scale_worker as the program. Node 0 must report the 1-worker count on its own host
// and the 2-worker count across both, with the records of host 1's rank, which reach node 0 only
// through node 0's store (the records' folders are each host's own temporary ones).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "support/namespace_hosts.h"
#include "test_support.h"

namespace {

using dtrain::cli::testing_support::read_file;
using dtrain::cli::testing_support::TempDir;
using dtrain::testing::NamespaceHosts;
using dtrain::testing::run_command;

// Both hosts' `dtrain scale`, node 1 in the background; node 0's stdout and each node's stderr go
// to `dir`. Returns node 0's exit code and, after it, node 1's, as the shell reports them.
std::string run_on_two_hosts(const NamespaceHosts& hosts, const TempDir& dir,
                             const std::string& worker_flags) {
  auto node = [&](int host) {
    const std::string rank = std::to_string(host);
    return hosts.on(host, std::string(DTRAIN_LAUNCHER) + " scale --nnodes 2 --node-rank " + rank +
                              " --nproc-per-node 1 --master-addr " + NamespaceHosts::address(0) +
                              " --master-port 29541 --steps 5 --time-limit 30 --json -- " +
                              DTRAIN_SCALE_WORKER + worker_flags) +
           " 2> " + dir.path().string() + "/node" + rank + ".err";
  };
  return run_command("sh -c '" + node(1) + " & " + node(0) + " > " + (dir / "out") +
                         "; echo node0=$?; wait $!; echo node1=$?'",
                     90)
      .output;
}

TEST(ScaleHosts, MeasuresOneWorkerAndTheSecondHostWithTheRecordsOfBoth) {
  NamespaceHosts hosts(2);
  if (!hosts.problem().empty()) GTEST_SKIP() << hosts.problem();
  TempDir dir;
  std::string exits = run_on_two_hosts(hosts, dir, "");
  const std::string node0 = read_file(dir / "node0.err"), node1 = read_file(dir / "node1.err");
  ASSERT_NE(exits.find("node0=0"), std::string::npos) << exits << node0 << node1;
  EXPECT_NE(exits.find("node1=0"), std::string::npos) << exits << node1;
  EXPECT_NE(node1.find("node 1: done; node 0 reports"), std::string::npos) << node1;

  nlohmann::json report = nlohmann::json::parse(read_file(dir / "out"));
  ASSERT_EQ(report["runs"].size(), 2u) << report.dump(2);
  const auto& one = report["runs"][0];
  const auto& two = report["runs"][1];
  EXPECT_EQ(one["workers"], 1);
  EXPECT_EQ(one["nodes"], 1);
  EXPECT_EQ(one["ranks_recorded"], 1);
  EXPECT_EQ(two["workers"], 2);
  EXPECT_EQ(two["nodes"], 2);
  // Rank 1 ran on host 1 only: its records came through the store.
  EXPECT_EQ(two["ranks_recorded"], 2) << report.dump(2);
  EXPECT_EQ(two["measured_steps"], 5);
  EXPECT_EQ(two["status"], "ok");
  ASSERT_TRUE(report["prediction"]["available"].get<bool>()) << report.dump(2);
  EXPECT_NE(report["prediction"]["assumptions"].dump().find("the link's between hosts"),
            std::string::npos)
      << report.dump(2);
}

TEST(ScaleHosts, AFailureOnTheSecondHostIsReportedByNodeZeroNamingIt) {
  NamespaceHosts hosts(2);
  if (!hosts.problem().empty()) GTEST_SKIP() << hosts.problem();
  TempDir dir;
  std::string exits = run_on_two_hosts(hosts, dir, " --fail-at-world 2");
  const std::string node1 = read_file(dir / "node1.err");
  EXPECT_NE(exits.find("node0=1"), std::string::npos) << exits << read_file(dir / "node0.err");
  EXPECT_NE(exits.find("node1=1"), std::string::npos) << exits << node1;
  nlohmann::json report = nlohmann::json::parse(read_file(dir / "out"));
  ASSERT_EQ(report["runs"].size(), 2u) << report.dump(2);
  EXPECT_EQ(report["runs"][0]["status"], "ok");
  EXPECT_EQ(report["runs"][1]["status"], "node 1: rank 1 exited with code 3") << report.dump(2);
  EXPECT_EQ(report["runs"][1]["exit_code"], 3);
}

}  // namespace
