// Tier-2 tests on two hosts: two Linux network namespaces that the test makes and removes itself
// (tests/support/namespace_hosts.h), each with its own address (10.77.0.1 and 10.77.0.2) and its
// own hostname, which resolves nowhere - as on a cluster whose nodes know each other only by
// address. One launcher runs in each. Nothing is set by hand: no GLOO_SOCKET_IFNAME, no /etc/hosts
// entry. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and `ip` and `unshare`; skips with the reason
// elsewhere.
#include <gtest/gtest.h>

#include <string>

#include "support/namespace_hosts.h"
#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::json_number;
using testing::NamespaceHosts;
using testing::run_command;

TEST(TwoHosts, DdpAcrossTwoHostsEqualsOneProcessWithNothingSetByHand) {
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  NamespaceHosts hosts(2);
  if (!hosts.problem().empty()) GTEST_SKIP() << hosts.problem();

  // One process on the global batch (2 x 16), against DDP of one rank per host (16 each): the same
  // samples in every step, so the same training up to the order of float sums.
  const std::string train =
      bin("train_fashion_mnist") + " --model mlp --max-steps 30 --seed 5 --epochs 1";
  auto single = run_command(train + " --batch-size 32");
  ASSERT_EQ(single.exit_code, 0) << single.output;

  auto node = [&](int host) {
    return hosts.on(host, bin("dtrain") + " run --nnodes 2 --node-rank " + std::to_string(host) +
                              " --nproc-per-node 1 --master-addr " + NamespaceHosts::address(0) +
                              " --master-port 29511 -- " + train + " --batch-size 16");
  };
  auto both = run_command(
      "env DTRAIN_TIMEOUT_S=30 sh -c '" + node(1) + " & " + node(0) + "; s=$?; wait $! && exit $s'",
      150);
  ASSERT_EQ(both.exit_code, 0) << both.output;
  EXPECT_NE(both.output.find("\"world_size\":2"), std::string::npos) << both.output;
  // The final model, judged on the 10000 test images: the same predictions up to a few images that
  // sit on a decision boundary (final_loss is rank 0's own half of the last batch, so it differs).
  const double accuracy = json_number(single.output, "test_accuracy");
  ASSERT_GT(accuracy, 0.3) << single.output;
  EXPECT_NEAR(json_number(both.output, "test_accuracy"), accuracy, 5e-4)
      << single.output << both.output;
}

TEST(TwoHosts, WorkerWaitsForAMasterThatIsNotUpYet) {
  NamespaceHosts hosts(2);
  if (!hosts.problem().empty()) GTEST_SKIP() << hosts.problem();
  // Node 1 starts 4 s before node 0, whose launcher hosts the store: node 1 keeps trying instead of
  // failing at the first refused connection.
  auto node = [&](int host) {
    return hosts.on(host, bin("dtrain") + " run --nnodes 2 --node-rank " + std::to_string(host) +
                              " --nproc-per-node 1 --master-addr " + NamespaceHosts::address(0) +
                              " --master-port 29512 -- " + bin("comm_worker") + " sum");
  };
  auto both = run_command("env DTRAIN_TIMEOUT_S=30 sh -c '" + node(1) + " & sleep 4; " + node(0) +
                              "; s=$?; wait $! && exit $s'",
                          120);
  EXPECT_EQ(both.exit_code, 0) << both.output;
  EXPECT_NE(both.output.find("rank 1 sum 3"), std::string::npos) << both.output;
}

}  // namespace
}  // namespace dtrain
