// Elastic `dtrain run` end to end: several real agents (build/bin/dtrain) on loopback forming one
// job through the c10d rendezvous, with /bin/sh workers that append what they were started as
// (WORLD_SIZE, RANK, GROUP_RANK, TORCHELASTIC_RESTART_COUNT) to an events file and then wait for a
// "finish" file, fail on request, or block. Faults: kill -9 of an agent, a third agent arriving, a
// failing worker, a blocked worker whose peer node died, strangers with wrong or no token, SIGTERM,
// the store's host dying, a rendezvous that cannot complete.
//
// Heartbeats (0.2 s, dead after 3 missed) and the monitor interval (0.1 s) are short so each test
// takes seconds. Every wait is bounded; agents still running at the end are SIGKILLed (their
// workers die with them through PR_SET_PDEATHSIG).
//
// The scenarios that do not depend on the c10d store run for each backend (test parameter): c10d
// always, etcd when the etcd backend and its test server (tests/launcher/elastic/etcd_server.h) are
// in the build and /usr/bin/etcd is installed (else skipped with the reason).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <regex>
#include <set>

#include "support/subprocess.h"
#include "test_support.h"
#ifdef DTRAIN_HAVE_ETCD_SERVER_FIXTURE
#include "launcher/elastic/etcd_server.h"
#endif

namespace {

using namespace dtrain::cli::testing_support;

// Bounds that only turn a hang into a failure; the events they wait for take well under a second
// to a few seconds.
constexpr auto kEventTimeout = 20s;
constexpr auto kExitTimeout = 20s;

struct Backend {
  std::string name;      // "c10d" or "etcd"
  std::string endpoint;  // HOST:PORT
};

// `dtrain run` of one elastic agent: --nnodes `nnodes`, the backend, short heartbeats and monitor
// interval, a last call of 5 s (the first round closes as soon as MAX nodes joined), a 1 s grace
// period, then `extra` flags, then the worker command.
Args agent_args(const Backend& backend, const std::string& job, const std::string& nnodes,
                const Args& extra, const Args& command) {
  Args args = {DTRAIN_LAUNCHER,
               "run",
               "--nnodes",
               nnodes,
               "--rdzv-backend",
               backend.name,
               "--rdzv-endpoint",
               backend.endpoint,
               "--rdzv-id",
               job,
               "--rdzv-conf",
               "timeout=30,last_call_timeout=5,join_timeout=10,keep_alive_interval=0.2,"
               "keep_alive_max_attempt=3",
               "--monitor-interval",
               "0.1",
               "--grace-period",
               "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  args.insert(args.end(), command.begin(), command.end());
  return args;
}

// What a worker appended to the events file when it started.
struct Start {
  int world_size = -1;
  int rank = -1;
  int group_rank = -1;
  int group_world_size = -1;
  int restart_count = -1;
  std::string token;  // DTRAIN_RDZV_TOKEN as the worker saw it ("unset" when absent)
};

class ElasticTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "etcd") {
#ifdef DTRAIN_HAVE_ETCD_SERVER_FIXTURE
      if (!dtrain::testing::EtcdServer::available()) {
        GTEST_SKIP() << dtrain::testing::EtcdServer::skip_reason();
      }
      etcd_ = std::make_unique<dtrain::testing::EtcdServer>();
      etcd_->start();
      backend_ = Backend{"etcd", etcd_->endpoint()};
#else
      GTEST_SKIP() << "the etcd backend is not part of this build";
#endif
    } else {
      backend_ = Backend{"c10d", "127.0.0.1:" + std::to_string(dtrain::testing::free_port())};
    }
  }

  // The worker: records its start, then fails if asked to (a file fail_rc<R>_rank<N>), then waits
  // for the finish file. With `block`, it ignores SIGTERM and blocks in sleep instead, like a rank
  // stuck in a collective whose peer is gone.
  Args worker(bool block = false) const {
    std::string script =
        "echo \"start ws=$WORLD_SIZE rank=$RANK gr=$GROUP_RANK gws=$GROUP_WORLD_SIZE "
        "rc=$TORCHELASTIC_RESTART_COUNT tok=${DTRAIN_RDZV_TOKEN-unset} pid=$$\" >> \"$1/events\"\n"
        "trap 'echo \"sigterm rank=$RANK pid=$$\" >> \"$1/events\"; exit 0' TERM\n"
        "if [ -e \"$1/fail_rc${TORCHELASTIC_RESTART_COUNT}_rank$RANK\" ]; then exit 3; fi\n"
        "if [ -e \"$1/usage_rc${TORCHELASTIC_RESTART_COUNT}_rank$RANK\" ]; then exit 2; fi\n";
    // fail_now_rc<R>: a worker of restart count R fails at once, as a rank whose collective lost
    // its peer does.
    script += block ? "trap '' TERM\nsleep 1000\n"
                    : "while [ ! -e \"$1/finish\" ]; do\n"
                      "  if [ -e \"$1/fail_now_rc$TORCHELASTIC_RESTART_COUNT\" ]; then "
                      "exit 1; fi\n"
                      "  sleep 0.05\n"
                      "done\n";
    return {"/bin/sh", "-c", script, "sh", dir_.path().string()};
  }

  // Starts an agent; its output goes to agent<N>.out/.err.
  ChildProcess& start_agent(const std::string& nnodes, const Args& extra = {},
                            const EnvChanges& env = {}, bool block = false) {
    std::string name = "agent" + std::to_string(agents_.size());
    agents_.push_back(
        std::make_unique<ChildProcess>(agent_args(backend_, "job", nnodes, extra, worker(block)),
                                       dir_ / (name + ".out"), dir_ / (name + ".err"), env));
    return *agents_.back();
  }
  // The first agent: with c10d, waits until it hosts the store, so that the tests know which agent
  // the job depends on (the one they never kill, except in the test of exactly that).
  ChildProcess& start_first_agent(const std::string& nnodes, const Args& extra = {},
                                  const EnvChanges& env = {}, bool block = false) {
    ChildProcess& agent = start_agent(nnodes, extra, env, block);
    if (backend_.name == "c10d") {
      EXPECT_TRUE(wait_until(
          [&] { return err(0).find("hosting the c10d rendezvous store") != std::string::npos; },
          kEventTimeout))
          << err(0);
    }
    return agent;
  }
  std::string err(std::size_t agent) const {
    return read_file(dir_ / ("agent" + std::to_string(agent) + ".err"));
  }

  std::vector<Start> starts() const {
    std::vector<Start> found;
    std::istringstream lines(read_file(dir_ / "events"));
    static const std::regex pattern(
        R"(start ws=(\d+) rank=(\d+) gr=(\d+) gws=(\d+) rc=(\d+) tok=(\S*) pid=\d+)");
    for (std::string line; std::getline(lines, line);) {
      std::smatch match;
      if (!std::regex_match(line, match, pattern)) continue;
      found.push_back(Start{std::stoi(match[1]), std::stoi(match[2]), std::stoi(match[3]),
                            std::stoi(match[4]), std::stoi(match[5]), match[6]});
    }
    return found;
  }
  // The starts of restart count `rc`, once `n` of them were recorded (bounded wait).
  std::vector<Start> wait_for_starts(int rc, std::size_t n) {
    std::vector<Start> of_round;
    bool seen = wait_until(
        [&] {
          of_round.clear();
          for (const Start& start : starts()) {
            if (start.restart_count == rc) of_round.push_back(start);
          }
          return of_round.size() >= n;
        },
        kEventTimeout);
    EXPECT_TRUE(seen) << "expected " << n
                      << " worker start(s) with TORCHELASTIC_RESTART_COUNT=" << rc << "; events:\n"
                      << read_file(dir_ / "events") << "\nagent 0:\n"
                      << err(0) << (agents_.size() > 1 ? "\nagent 1:\n" + err(1) : "");
    return of_round;
  }

  void finish() { write_file(dir_ / "finish", ""); }

#ifdef DTRAIN_HAVE_ETCD_SERVER_FIXTURE
  std::unique_ptr<dtrain::testing::EtcdServer> etcd_;
#endif
  TempDir dir_;
  Backend backend_;
  std::vector<std::unique_ptr<ChildProcess>> agents_;
};

// Scenarios that only the c10d store has: its token, its host, its endpoint.
using C10dElasticTest = ElasticTest;

// Two agents of one worker each (--nnodes 1:2) form one job of WORLD_SIZE 2: distinct node and
// global ranks, and both exit 0 when the workers succeed.
TEST_P(ElasticTest, TwoAgentsFormOneJob) {
  ChildProcess& a = start_first_agent("1:2");
  ChildProcess& b = start_agent("1:2", {"--nproc-per-node", "2"});
  std::vector<Start> round0 = wait_for_starts(0, 3);
  ASSERT_EQ(round0.size(), 3u);
  std::set<int> ranks;
  std::set<int> group_ranks;
  for (const Start& start : round0) {
    EXPECT_EQ(start.world_size, 3);
    EXPECT_EQ(start.group_world_size, 2);
    ranks.insert(start.rank);
    group_ranks.insert(start.group_rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(group_ranks, (std::set<int>{0, 1}));
  finish();
  ASSERT_TRUE(a.wait(kExitTimeout));
  ASSERT_TRUE(b.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 0) << err(0);
  EXPECT_EQ(b.exit_code(), 0) << err(1);
  if (backend_.name == "c10d") {
    EXPECT_NE(err(0).find("is open: any process that can reach it can join"), std::string::npos)
        << err(0);
  }
}

// kill -9 of one agent: the other notices by heartbeat, restarts its worker alone (WORLD_SIZE 1,
// restart count 1); a third agent started later makes the job grow back to two nodes.
TEST_P(ElasticTest, KilledAgentShrinksTheJobAndANewAgentGrowsIt) {
  ChildProcess& a = start_first_agent("1:2");
  ChildProcess& b = start_agent("1:2");
  std::vector<Start> round0 = wait_for_starts(0, 2);
  ASSERT_EQ(round0.size(), 2u);

  kill(b.pid(), SIGKILL);
  b.wait(kExitTimeout);
  std::vector<Start> round1 = wait_for_starts(1, 1);
  ASSERT_EQ(round1.size(), 1u);
  EXPECT_EQ(round1[0].world_size, 1);
  EXPECT_EQ(round1[0].group_world_size, 1);
  EXPECT_EQ(round1[0].rank, 0);
  EXPECT_NE(err(0).find("lost: no heartbeat for 0.6 s"), std::string::npos) << err(0);

  ChildProcess& c = start_agent("1:2");
  std::vector<Start> round2 = wait_for_starts(2, 2);
  ASSERT_EQ(round2.size(), 2u);
  for (const Start& start : round2) EXPECT_EQ(start.world_size, 2);
  EXPECT_NE(err(0).find("waiting to join: the job grows"), std::string::npos) << err(0);

  finish();
  ASSERT_TRUE(a.wait(kExitTimeout));
  ASSERT_TRUE(c.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 0) << err(0);
  EXPECT_EQ(c.exit_code(), 0) << err(2);
}

// When a node dies, the other's workers fail at once (their collectives lose the peer), seconds
// before its heartbeat expires: the job still continues at the smaller size with --max-restarts 0,
// since that failure is the lost node's doing (Note [Failures caused by a lost node]).
TEST_P(ElasticTest, WorkerFailureCausedByALostNodeSpendsNoRestart) {
  ChildProcess& a = start_first_agent("1:2");
  ChildProcess& b = start_agent("1:2");
  ASSERT_EQ(wait_for_starts(0, 2).size(), 2u);
  kill(b.pid(), SIGKILL);
  b.wait(kExitTimeout);
  write_file(dir_ / "fail_now_rc0", "");  // node 0's worker of round 0, node 1's is gone
  std::vector<Start> round1 = wait_for_starts(1, 1);
  ASSERT_EQ(round1.size(), 1u);
  EXPECT_EQ(round1[0].world_size, 1);
  EXPECT_NE(err(0).find("lost: no heartbeat"), std::string::npos) << err(0);
  EXPECT_EQ(err(0).find("no restarts left"), std::string::npos) << err(0);
  finish();
  ASSERT_TRUE(a.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 0) << err(0);
}

// A worker that fails restarts every node's group with TORCHELASTIC_RESTART_COUNT incremented, and
// the failure is named on the other node; with no restarts left the job ends with its exit code.
TEST_P(ElasticTest, WorkerFailureRestartsEveryNodeUpToMaxRestarts) {
  // Rank 1 fails in rounds 0 and 1; round 2 (the second restart) runs to the end.
  write_file(dir_ / "fail_rc0_rank1", "");
  write_file(dir_ / "fail_rc1_rank1", "");
  ChildProcess& a = start_first_agent("2:2", {"--max-restarts", "2"});
  ChildProcess& b = start_agent("2:2", {"--max-restarts", "2"});
  std::vector<Start> round2 = wait_for_starts(2, 2);
  ASSERT_EQ(round2.size(), 2u);
  std::set<int> ranks;
  for (const Start& start : round2) {
    EXPECT_EQ(start.world_size, 2);
    ranks.insert(start.rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));
  finish();
  ASSERT_TRUE(a.wait(kExitTimeout));
  ASSERT_TRUE(b.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 0) << err(0);
  EXPECT_EQ(b.exit_code(), 0) << err(1);
  std::string all = err(0) + err(1);
  EXPECT_NE(all.find("exited with code 3 (restart 1 of 2)"), std::string::npos) << all;
  EXPECT_NE(all.find("exited with code 3 (restart 2 of 2)"), std::string::npos) << all;
}

// With no restarts left the job ends: the node whose worker failed exits with the worker's code,
// the other with 1, both naming the failure.
TEST_P(ElasticTest, WorkerFailureWithNoRestartsLeftEndsTheJob) {
  write_file(dir_ / "fail_rc0_rank1", "");
  ChildProcess& a = start_first_agent("2:2");
  ChildProcess& b = start_agent("2:2");
  ASSERT_TRUE(a.wait(kExitTimeout));
  ASSERT_TRUE(b.wait(kExitTimeout));
  std::string all = err(0) + err(1);
  std::multiset<int> codes = {a.exit_code(), b.exit_code()};
  EXPECT_EQ(codes, (std::multiset<int>{1, 3})) << all;
  EXPECT_EQ(count(all, "exited with code 3; no restarts left (--max-restarts 0)"), 2) << all;
}

// A worker that exits with code 2 (a bad flag, variable or file) ends the job on every node even
// with restarts left: a restart would fail the same way.
TEST_P(ElasticTest, WorkerUsageErrorEndsTheJobWithoutRestarts) {
  write_file(dir_ / "usage_rc0_rank1", "");
  ChildProcess& a = start_first_agent("2:2", {"--max-restarts", "3"});
  ChildProcess& b = start_agent("2:2", {"--max-restarts", "3"});
  ASSERT_TRUE(a.wait(kExitTimeout)) << err(0) << err(1);
  ASSERT_TRUE(b.wait(kExitTimeout));
  std::string all = err(0) + err(1);
  std::multiset<int> codes = {a.exit_code(), b.exit_code()};
  EXPECT_EQ(codes, (std::multiset<int>{1, 2})) << all;
  EXPECT_NE(all.find("a usage error (a bad flag, variable or file), which a restart cannot fix"),
            std::string::npos)
      << all;
  for (const Start& start : starts()) EXPECT_EQ(start.restart_count, 0) << all;
}

// A worker blocked (ignoring SIGTERM, as a rank stuck in a collective) whose peer node died is
// stopped by its agent in seconds; with MIN 2 the job cannot continue, and the agent says which
// node was lost.
TEST_P(ElasticTest, BlockedWorkerOfALostPeerIsStoppedAndTheLostNodeNamed) {
  ChildProcess& a = start_first_agent("2:2", {}, {}, /*block=*/true);
  ChildProcess& b = start_agent("2:2", {}, {}, /*block=*/true);
  ASSERT_EQ(wait_for_starts(0, 2).size(), 2u);
  std::vector<pid_t> worker_pids;
  std::istringstream lines(read_file(dir_ / "events"));
  for (std::string line; std::getline(lines, line);) {
    worker_pids.push_back(std::stoi(line.substr(line.rfind("pid=") + 4)));
  }

  kill(b.pid(), SIGKILL);
  b.wait(kExitTimeout);
  Clock::time_point killed = Clock::now();
  ASSERT_TRUE(a.wait(kExitTimeout));
  double seconds = std::chrono::duration<double>(Clock::now() - killed).count();
  EXPECT_EQ(a.exit_code(), 1) << err(0);
  // Heartbeats 0.6 s + 0.5 s (not --grace-period: Note [Stopping after a loss]) + reaping; the
  // collective's own timeout would be 30 min.
  EXPECT_LT(seconds, 10.0) << err(0);
  EXPECT_NE(err(0).find("(SIGKILL after 0.5 s: they cannot stop together with a lost peer)"),
            std::string::npos)
      << err(0);
  EXPECT_NE(err(0).find("lost: no heartbeat"), std::string::npos) << err(0);
  EXPECT_NE(err(0).find("fewer than the minimum of 2"), std::string::npos) << err(0);
  std::regex lost_node(R"(host \S+ \(node \S+_\d+_[0-9a-f]+\) lost)");
  EXPECT_TRUE(std::regex_search(err(0), lost_node)) << err(0);
  for (pid_t pid : worker_pids) EXPECT_FALSE(process_alive(pid)) << "worker " << pid;
}

// With DTRAIN_RDZV_TOKEN the store refuses, and logs with their address, a stranger speaking
// garbage, an agent with the wrong token and one with none; those agents exit 2 with one line; the
// job itself carries on and an agent with the right token joins it. Workers never see the token.
TEST_P(C10dElasticTest, TokenKeepsStrangersOutAndTheJobRuns) {
  EnvChanges token = {{"DTRAIN_RDZV_TOKEN", "s3cret"}};
  // Starts alone after a short last call.
  ChildProcess& a = start_first_agent("1:2", {"--rdzv-conf", "last_call_timeout=0.3"}, token);
  std::vector<Start> round0 = wait_for_starts(0, 1);
  ASSERT_EQ(round0.size(), 1u);
  EXPECT_EQ(round0[0].token, "unset");

  // A stranger that connects and sends a hello with a made-up mac.
  int stranger = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(std::stoi(backend_.endpoint.substr(10))));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(stranger, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  std::string hello = std::string("\0\0\0\x41H", 5) + std::string(64, 'x');
  ASSERT_EQ(send(stranger, hello.data(), hello.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(hello.size()));
  EXPECT_TRUE(wait_until([&] { return err(0).find("wrong token") != std::string::npos; }, 10s))
      << err(0);
  close(stranger);

  ChildProcess& wrong = start_agent("1:2", {}, {{"DTRAIN_RDZV_TOKEN", "guess"}});
  ChildProcess& none = start_agent("1:2", {}, {{"DTRAIN_RDZV_TOKEN", std::nullopt}});
  ASSERT_TRUE(wrong.wait(kExitTimeout));
  ASSERT_TRUE(none.wait(kExitTimeout));
  EXPECT_EQ(wrong.exit_code(), 2) << err(1);
  EXPECT_EQ(none.exit_code(), 2) << err(2);
  EXPECT_NE(err(1).find("refused this node: wrong token"), std::string::npos) << err(1);
  EXPECT_NE(err(2).find("refused this node: it requires a token"), std::string::npos) << err(2);
  EXPECT_EQ(count(err(1), "\n"), 1) << err(1);
  EXPECT_NE(err(0).find("refused a connection from 127.0.0.1:"), std::string::npos) << err(0);
  EXPECT_NE(err(0).find("it presented no token"), std::string::npos) << err(0);
  EXPECT_EQ(err(0).find("is open"), std::string::npos) << err(0);

  // The job was not disturbed (no new round) and grows with the right token.
  EXPECT_EQ(starts().size(), 1u) << read_file(dir_ / "events");
  ChildProcess& right = start_agent("1:2", {}, token);
  std::vector<Start> round1 = wait_for_starts(1, 2);
  ASSERT_EQ(round1.size(), 2u);
  for (const Start& start : round1) {
    EXPECT_EQ(start.world_size, 2);
    EXPECT_EQ(start.token, "unset");
  }
  finish();
  ASSERT_TRUE(a.wait(kExitTimeout));
  ASSERT_TRUE(right.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 0) << err(0);
  EXPECT_EQ(right.exit_code(), 0) << err(4);
}

// SIGTERM to an agent: its workers get SIGTERM (they record it and exit), it leaves the rendezvous,
// and the other node shrinks at once, long before the heartbeat timeout (set to 30 s here).
TEST_P(ElasticTest, SigtermIsPassedToWorkersAndTheNodeLeavesCleanly) {
  Args slow_heartbeat = {"--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=30"};
  ChildProcess& a = start_first_agent("1:2", slow_heartbeat);
  ChildProcess& b = start_agent("1:2", slow_heartbeat);
  ASSERT_EQ(wait_for_starts(0, 2).size(), 2u);
  Clock::time_point signalled = Clock::now();
  kill(b.pid(), SIGTERM);
  ASSERT_TRUE(b.wait(kExitTimeout));
  EXPECT_EQ(b.exit_code(), 128 + SIGTERM) << err(1);
  std::vector<Start> round1 = wait_for_starts(1, 1);
  double seconds = std::chrono::duration<double>(Clock::now() - signalled).count();
  ASSERT_EQ(round1.size(), 1u);
  EXPECT_EQ(round1[0].world_size, 1);
  EXPECT_LT(seconds, 15.0);  // the heartbeat would take 30 s
  EXPECT_NE(err(0).find("left the job (received SIGTERM)"), std::string::npos) << err(0);
  EXPECT_NE(read_file(dir_ / "events").find("sigterm"), std::string::npos)
      << read_file(dir_ / "events");
  finish();
  ASSERT_TRUE(a.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 0) << err(0);
}

// The agent hosting the c10d store dies: the other cannot continue (torchrun's c10d has the same
// limit) and says so instead of hanging.
TEST_P(C10dElasticTest, LosingTheC10dStoreHostEndsTheJobWithAMessage) {
  ChildProcess& a = start_first_agent("1:2");
  ChildProcess& b = start_agent("1:2");
  ASSERT_EQ(wait_for_starts(0, 2).size(), 2u);
  kill(a.pid(), SIGKILL);
  a.wait(kExitTimeout);
  ASSERT_TRUE(b.wait(kExitTimeout));
  EXPECT_EQ(b.exit_code(), 1) << err(1);
  EXPECT_NE(err(1).find("lost the rendezvous"), std::string::npos) << err(1);
  EXPECT_NE(err(1).find("cannot continue"), std::string::npos) << err(1);
}

// SIGTERM to the agent hosting the c10d store: the store leaves with it, so it ends the job and the
// other node says why (instead of finding the store gone).
TEST_P(C10dElasticTest, SignalledStoreHostEndsTheJobWithItsReason) {
  ChildProcess& a = start_first_agent("1:2");
  ChildProcess& b = start_agent("1:2");
  ASSERT_EQ(wait_for_starts(0, 2).size(), 2u);
  kill(a.pid(), SIGTERM);
  ASSERT_TRUE(a.wait(kExitTimeout));
  ASSERT_TRUE(b.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 128 + SIGTERM) << err(0);
  EXPECT_EQ(b.exit_code(), 1) << err(1);
  EXPECT_NE(err(1).find("which hosts the c10d rendezvous store, received SIGTERM"),
            std::string::npos)
      << err(1);
}

// A rendezvous that cannot complete in its timeout names the nodes present and how many it needed.
TEST_P(ElasticTest, RendezvousTimeoutNamesWhoIsThereAndHowManyAreNeeded) {
  ChildProcess& a = start_first_agent("2:3", {"--rdzv-conf", "timeout=1"});
  ASSERT_TRUE(a.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 1) << err(0);
  std::regex message(
      R"(round 0 did not complete within 1 s: 1 node\(s\) joined \(host \S+ \(node \S+\)\), )"
      R"(at least 2 needed \(--nnodes 2:3\))");
  EXPECT_TRUE(std::regex_search(err(0), message)) << err(0);
  EXPECT_TRUE(starts().empty());
}

// Nothing answers at a c10d endpoint of another machine's address: one line, exit 2.
// Exit 1, not 2: the flags may be right and the store's node only late, so a scheduler may retry.
TEST_P(C10dElasticTest, UnreachableEndpointEndsAsAFailedRendezvous) {
  // 192.0.2.1 (TEST-NET-1) is never this machine's, so this agent cannot host the store.
  backend_.endpoint = "192.0.2.1:29400";
  ChildProcess& a = start_agent("1:2", {"--rdzv-conf", "join_timeout=1"});
  ASSERT_TRUE(a.wait(kExitTimeout));
  EXPECT_EQ(a.exit_code(), 1) << err(0);
  EXPECT_NE(err(0).find("--rdzv-endpoint 192.0.2.1:29400: no rendezvous store answered within 1 s"),
            std::string::npos)
      << err(0);
}

// A c10d endpoint whose host name does not resolve yet (a scheduler registers the name of the
// store's node once that node runs) is waited for up to join_timeout like one that refuses, then
// ends the agent with one line naming the host, the resolver's answer and how long it tried, and
// exit code 1, which a scheduler retries. It used to be exit code 2 at once.
TEST_P(C10dElasticTest, EndpointThatDoesNotResolveIsWaitedForThenEndsWithExitCodeOne) {
  backend_.endpoint = "master-0.svc.invalid:29400";
  ChildProcess& a = start_agent("1:2", {"--rdzv-conf", "join_timeout=2"});
  ASSERT_TRUE(a.wait(kExitTimeout)) << err(0);
  EXPECT_EQ(a.exit_code(), 1) << err(0);
  EXPECT_GE(a.seconds(), 2) << err(0);
  EXPECT_NE(err(0).find("dtrain run: --rdzv-endpoint master-0.svc.invalid:29400: the host name "
                        "'master-0.svc.invalid' does not resolve ("),
            std::string::npos)
      << err(0);
  EXPECT_NE(err(0).find(") after trying for 2"), std::string::npos) << err(0);
  EXPECT_TRUE(starts().empty());
}

// A signal during the first join ends it at once with 128 + signal, whether the agent waits
// between tries (the endpoint refuses: a port bound on 127.0.0.1 but not listening, which this
// agent cannot host the store on either) or inside a call (a program that accepts and says
// nothing: the store's greeting is waited for), not after join_timeout or the call's timeout.
TEST_P(C10dElasticTest, SignalDuringTheFirstJoinEndsItAtOnce) {
  int bound = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(bound, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(bind(bound, reinterpret_cast<sockaddr*>(&address), length), 0);
  ASSERT_EQ(getsockname(bound, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ForeignListener silent("");
  for (const std::string& endpoint :
       {"127.0.0.1:" + std::to_string(ntohs(address.sin_port)), silent.endpoint()}) {
    SCOPED_TRACE(endpoint);
    backend_.endpoint = endpoint;
    const std::size_t agent = agents_.size();
    ChildProcess& a = start_agent("1:2", {"--rdzv-conf", "join_timeout=60"});
    // Said just before the first call to the store.
    ASSERT_TRUE(wait_until([&] { return err(agent).find(" is open: ") != std::string::npos; },
                           kEventTimeout))
        << err(agent);
    std::this_thread::sleep_for(500ms);  // into the wait between tries, or the call
    Clock::time_point sent = Clock::now();
    kill(a.pid(), SIGINT);
    ASSERT_TRUE(a.wait(kExitTimeout)) << err(agent);
    EXPECT_EQ(a.exit_code(), 128 + SIGINT) << err(agent);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - sent).count(), 3) << err(agent);
    EXPECT_NE(err(agent).find("received SIGINT while joining the rendezvous; leaving"),
              std::string::npos)
        << err(agent);
  }
  close(bound);
  EXPECT_TRUE(starts().empty());
}

// Another program holds the c10d endpoint's port (issue 21: an HTTP server, or a program that
// accepts and says nothing). Both agents say so in one line within seconds, long before the join
// timeout (30 s here), and exit 1, the code of a failed rendezvous that a scheduler may retry, not
// 2 (bad flags).
TEST_P(C10dElasticTest, PortHeldByAnotherProgramIsNamedWithinSeconds) {
  for (const std::string& greeting :
       {std::string("HTTP/1.1 400 Bad Request\r\n\r\n"), std::string()}) {
    SCOPED_TRACE(greeting.empty() ? "silent" : "HTTP");
    ForeignListener foreign(greeting);
    backend_.endpoint = foreign.endpoint();
    std::size_t first = agents_.size();
    ChildProcess& a = start_agent("1:2", {"--rdzv-conf", "join_timeout=30"});
    ChildProcess& b = start_agent("1:2", {"--rdzv-conf", "join_timeout=30"});
    ASSERT_TRUE(a.wait(kExitTimeout)) << err(first);
    ASSERT_TRUE(b.wait(kExitTimeout)) << err(first + 1);
    for (std::size_t agent : {first, first + 1}) {
      EXPECT_EQ(agents_[agent]->exit_code(), 1) << err(agent);
      EXPECT_NE(err(agent).find("dtrain run: --rdzv-endpoint " + foreign.endpoint() +
                                " answers, but is not a dtrain/c10d rendezvous store"),
                std::string::npos)
          << err(agent);
      EXPECT_NE(err(agent).find("pick another port"), std::string::npos) << err(agent);
      EXPECT_EQ(count(err(agent), "rendezvous store"), 1) << err(agent);
    }
    EXPECT_GE(foreign.accepted(), 2);
  }
  EXPECT_TRUE(starts().empty());
}

INSTANTIATE_TEST_SUITE_P(Backends, ElasticTest, testing::Values("c10d", "etcd"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });
INSTANTIATE_TEST_SUITE_P(Backends, C10dElasticTest, testing::Values("c10d"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
