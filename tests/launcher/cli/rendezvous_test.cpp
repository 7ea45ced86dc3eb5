// The rendezvous in-process: several Rendezvous objects (one per simulated node, on threads) over
// one in-memory backend, with heartbeats of 50 ms, so every rule of Note [Rounds] is checked in
// milliseconds; the backend contract for the in-memory and the c10d backends; the c10d store's
// address binding and token handshake.
#include "launcher/elastic/rendezvous.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>

#include "backend_contract.h"
#include "dtrain/errors.h"
#include "launcher/elastic/c10d_backend.h"
#include "launcher/elastic/ports.h"

namespace {

using namespace std::chrono_literals;
using dtrain::elastic::C10dBackend;
using dtrain::elastic::C10dStoreServer;
using dtrain::elastic::NodeInfo;
using dtrain::elastic::Rendezvous;
using dtrain::elastic::RendezvousBackend;
using dtrain::elastic::RendezvousSettings;
using dtrain::elastic::RendezvousState;
using dtrain::elastic::RoundAssignment;
using dtrain::elastic::Verdict;
using dtrain::elastic::VersionedState;

// One stored state shared by every node's backend object: the store.
struct MemoryStore {
  std::mutex mutex;
  std::optional<VersionedState> state;
  uint64_t next_version = 1;
  std::atomic<bool> unreachable{false};  // every call fails, as a stalled etcd's would
};

class MemoryBackend : public RendezvousBackend {
 public:
  explicit MemoryBackend(std::shared_ptr<MemoryStore> store) : store_(std::move(store)) {}
  std::string name() const override { return "memory"; }
  std::optional<VersionedState> get_state() override {
    fail_if_unreachable();
    std::lock_guard<std::mutex> lock(store_->mutex);
    return store_->state;
  }
  SetResult set_state(const std::string& state, std::optional<uint64_t> expected) override {
    fail_if_unreachable();
    std::lock_guard<std::mutex> lock(store_->mutex);
    bool matches = expected ? (store_->state && store_->state->version == *expected)
                            : !store_->state.has_value();
    if (matches) store_->state = VersionedState{state, store_->next_version++};
    return SetResult{*store_->state, matches};
  }

 private:
  void fail_if_unreachable() const {
    if (store_->unreachable) throw dtrain::TimeoutError("memory store: unreachable (test)");
  }
  std::shared_ptr<MemoryStore> store_;
};

class RendezvousTest : public testing::Test {
 protected:
  RendezvousSettings settings(int min_nodes, int max_nodes) const {
    RendezvousSettings s;
    s.job_id = "test";
    s.min_nodes = min_nodes;
    s.max_nodes = max_nodes;
    s.timeout = 10s;
    s.last_call_timeout = 5s;
    s.keep_alive_interval = 50ms;
    s.keep_alive_max_attempt = 3;
    s.max_restarts = 1;
    return s;
  }
  // A simulated node; it beats unless `beat` is false (a node that died silently).
  std::unique_ptr<Rendezvous> node(const std::string& name, const RendezvousSettings& s,
                                   int nproc = 1, bool beat = true) {
    NodeInfo info;
    info.id = name + "_1_0";
    info.host = name;
    info.addr = "10.0.0." + std::to_string(++nodes_);
    info.nproc = nproc;
    auto rendezvous =
        std::make_unique<Rendezvous>(std::make_unique<MemoryBackend>(store_), s, info);
    if (beat) rendezvous->start_keep_alive();
    return rendezvous;
  }
  // next_round on a thread; the port identifies the node's MASTER_PORT candidate.
  std::future<std::optional<RoundAssignment>> join(Rendezvous& rendezvous, int port) {
    return std::async(std::launch::async,
                      [&rendezvous, port] { return rendezvous.next_round(port, -1); });
  }
  static RoundAssignment get(std::future<std::optional<RoundAssignment>>& future) {
    EXPECT_EQ(future.wait_for(10s), std::future_status::ready) << "round did not complete";
    std::optional<RoundAssignment> round = future.get();
    EXPECT_TRUE(round.has_value());
    return round.value_or(RoundAssignment{});
  }
  // Blocks until `rendezvous`'s node is a participant of the stored round, so that a join meant to
  // come first is registered before the next one starts (bounded).
  void wait_until_joined(const Rendezvous& rendezvous) {
    auto joined = [&] {
      std::lock_guard<std::mutex> lock(store_->mutex);
      if (!store_->state) return false;
      std::vector<std::string> ids = RendezvousState::from_json(store_->state->state).participants;
      return std::find(ids.begin(), ids.end(), rendezvous.self().id) != ids.end();
    };
    for (int i = 0; i < 10000 && !joined(); ++i) std::this_thread::sleep_for(1ms);
    ASSERT_TRUE(joined()) << rendezvous.self().id << " did not join within 10 s";
  }
  // Polls check() until it says something (bounded).
  static Verdict check_until_news(Rendezvous& rendezvous) {
    for (int i = 0; i < 200; ++i) {
      Verdict verdict = rendezvous.check();
      if (verdict.kind != Verdict::Kind::kKeepRunning) return verdict;
      std::this_thread::sleep_for(10ms);
    }
    ADD_FAILURE() << "check() saw nothing within 2 s";
    return {};
  }

  std::shared_ptr<MemoryStore> store_ = std::make_shared<MemoryStore>();
  int nodes_ = 0;
};

TEST_F(RendezvousTest, MemoryBackendKeepsTheContract) {
  MemoryBackend backend(store_);
  dtrain::cli::testing_support::expect_backend_contract(backend);
}

// MAX nodes close the round at once; ranks by join order; WORLD_SIZE sums the nodes' workers; rank
// 0's address and port are the master.
TEST_F(RendezvousTest, MaxNodesCloseTheRoundWithRanksAndMaster) {
  auto a = node("a", settings(1, 2), 2);
  auto b = node("b", settings(1, 2), 1);
  auto first = join(*a, 1001);
  wait_until_joined(*a);
  auto second = join(*b, 1002);
  RoundAssignment ra = get(first);
  RoundAssignment rb = get(second);
  EXPECT_EQ(ra.round, 0);
  EXPECT_EQ(rb.round, 0);
  EXPECT_EQ(ra.group_rank, 0);
  EXPECT_EQ(rb.group_rank, 1);
  EXPECT_EQ(ra.world_size, 3);
  EXPECT_EQ(rb.world_size, 3);
  EXPECT_EQ(ra.base_rank, 0);
  EXPECT_EQ(rb.base_rank, 2);
  EXPECT_EQ(rb.group_world_size, 2);
  EXPECT_EQ(rb.master_addr, a->self().addr);
  EXPECT_EQ(rb.master_port, 1001);
}

// MIN nodes and the last call: the round closes after the window, not before.
TEST_F(RendezvousTest, MinNodesCloseAfterTheLastCall) {
  RendezvousSettings s = settings(1, 2);
  s.last_call_timeout = 300ms;
  auto a = node("a", s);
  auto start = std::chrono::steady_clock::now();
  auto round = join(*a, 1);
  RoundAssignment ra = get(round);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  EXPECT_EQ(ra.group_world_size, 1);
}

// A node whose heartbeat stops is dead after 3 intervals: a new round without it, or the end of the
// job when fewer than MIN remain, naming it.
TEST_F(RendezvousTest, SilentNodeIsLostAndTheJobShrinksOrEnds) {
  for (int min_nodes : {1, 2}) {
    SCOPED_TRACE("min " + std::to_string(min_nodes));
    store_ = std::make_shared<MemoryStore>();
    auto a = node("a", settings(min_nodes, 2));
    auto b = node("b", settings(min_nodes, 2), 1, /*beat=*/false);  // dies once the round closed
    auto first = join(*a, 1);
    auto second = join(*b, 2);
    get(first);
    get(second);
    Verdict verdict = check_until_news(*a);
    EXPECT_NE(verdict.message.find("host b (node b_1_0) lost: no heartbeat for 0.15 s"),
              std::string::npos)
        << verdict.message;
    if (min_nodes == 1) {
      EXPECT_EQ(verdict.kind, Verdict::Kind::kNewRound);
      auto again = join(*a, 3);
      RoundAssignment alone = get(again);
      EXPECT_EQ(alone.round, 1);
      EXPECT_EQ(alone.world_size, 1);
    } else {
      EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown);
      EXPECT_NE(verdict.message.find("1 node(s) left, fewer than the minimum of 2"),
                std::string::npos)
          << verdict.message;
    }
  }
}

// A node lost after another one finished ends the job instead of restarting it: a restart would run
// the job again without the finished node's share (the rule report_failure follows too).
TEST_F(RendezvousTest, NodeLostAfterAnotherFinishedEndsTheJob) {
  auto a = node("a", settings(1, 3));
  auto b = node("b", settings(1, 3), 1, /*beat=*/false);  // dies once the round closed
  auto c = node("c", settings(1, 3));
  auto joined_a = join(*a, 1), joined_b = join(*b, 2), joined_c = join(*c, 3);
  get(joined_a);
  get(joined_b);
  get(joined_c);
  a->finish();
  Verdict verdict = check_until_news(*c);
  EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown) << verdict.message;
  EXPECT_NE(verdict.message.find("not restarting: host a (node a_1_0) had already finished"),
            std::string::npos)
      << verdict.message;
}

// A node whose workers succeed just after another node's failure opened a new round: the job ends
// rather than rerun without it.
TEST_F(RendezvousTest, FinishAfterAnotherNodesFailureEndsTheJob) {
  auto a = node("a", settings(2, 2));
  auto b = node("b", settings(2, 2));
  auto joined_a = join(*a, 1), joined_b = join(*b, 2);
  get(joined_a);
  get(joined_b);
  EXPECT_EQ(b->report_failure("worker rank 1 exited with code 1").kind, Verdict::Kind::kNewRound);
  a->finish();
  Verdict verdict = check_until_news(*b);
  EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown) << verdict.message;
  EXPECT_NE(verdict.message.find("not restarting: host a (node a_1_0) had already finished"),
            std::string::npos)
      << verdict.message;
}

// A store that nobody could reach for longer than the heartbeat timeout: no heartbeat landed, and
// that is not evidence that anyone died; once it answers again, the job keeps running.
TEST_F(RendezvousTest, StoreOutageIsNotTakenForLostNodes) {
  auto a = node("a", settings(1, 2));
  auto b = node("b", settings(1, 2));
  auto joined_a = join(*a, 1), joined_b = join(*b, 2);
  get(joined_a);
  get(joined_b);
  EXPECT_EQ(a->check().kind, Verdict::Kind::kKeepRunning);
  store_->unreachable = true;
  std::this_thread::sleep_for(400ms);  // heartbeat timeout: 3 x 50 ms
  store_->unreachable = false;
  for (int i = 0; i < 30; ++i) {
    Verdict verdict = a->check();
    ASSERT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
    std::this_thread::sleep_for(10ms);
  }
}

// A worker failure opens a new round for every node, counted against --max-restarts (1 here).
TEST_F(RendezvousTest, FailuresRestartEveryNodeUpToMaxRestarts) {
  auto a = node("a", settings(2, 2));
  auto b = node("b", settings(2, 2));
  auto ja = join(*a, 1);
  auto jb = join(*b, 2);
  get(ja);
  get(jb);
  Verdict failed = b->report_failure("worker rank 1 exited with code 3");
  EXPECT_EQ(failed.kind, Verdict::Kind::kNewRound);
  EXPECT_EQ(failed.message, "worker rank 1 exited with code 3 (restart 1 of 1)");
  EXPECT_EQ(a->check().kind, Verdict::Kind::kNewRound);
  ja = join(*a, 1);
  jb = join(*b, 2);
  EXPECT_EQ(get(ja).round, 1);
  EXPECT_EQ(get(jb).round, 1);
  Verdict last = a->report_failure("worker rank 0 exited with code 4");
  EXPECT_EQ(last.kind, Verdict::Kind::kShutdown);
  EXPECT_NE(last.message.find("no restarts left (--max-restarts 1)"), std::string::npos);
  EXPECT_EQ(b->check().kind, Verdict::Kind::kShutdown);
}

// Note [Failures caused by a lost node]: when a peer dies, the survivors' workers fail before its
// heartbeat expires; that failure spends no restart, also when none is left.
TEST_F(RendezvousTest, FailureCausedByALostNodeSpendsNoRestart) {
  for (int max_restarts : {0, 1}) {
    SCOPED_TRACE("max restarts " + std::to_string(max_restarts));
    store_ = std::make_shared<MemoryStore>();
    RendezvousSettings s = settings(1, 2);
    s.max_restarts = max_restarts;
    auto a = node("a", s);
    auto b = node("b", s, 1, /*beat=*/false);  // dies as soon as the round runs
    auto ja = join(*a, 1);
    auto jb = join(*b, 2);
    get(ja);
    get(jb);
    Verdict failed = a->report_failure("worker rank 0 exited with code 1");
    ASSERT_EQ(failed.kind, Verdict::Kind::kNewRound) << failed.message;
    ja = join(*a, 1);
    RoundAssignment alone = get(ja);
    EXPECT_EQ(alone.world_size, 1);
    // The failure was refunded (or never counted): a real one now still has its restart.
    Verdict real = a->report_failure("worker rank 0 exited with code 2");
    if (max_restarts == 1) {
      EXPECT_EQ(real.kind, Verdict::Kind::kNewRound) << real.message;
      EXPECT_EQ(real.message, "worker rank 0 exited with code 2 (restart 1 of 1)");
    } else {
      EXPECT_EQ(real.kind, Verdict::Kind::kShutdown) << real.message;
    }
  }
}

// With no restarts left and every peer alive, the failure ends the job (after one heartbeat
// timeout of waiting for a loss that would explain it).
TEST_F(RendezvousTest, FailureWithNoRestartsLeftEndsTheJob) {
  RendezvousSettings s = settings(2, 2);
  s.max_restarts = 0;
  auto a = node("a", s);
  auto b = node("b", s);
  auto ja = join(*a, 1);
  auto jb = join(*b, 2);
  get(ja);
  get(jb);
  Verdict failed = a->report_failure("worker rank 0 exited with code 1");
  EXPECT_EQ(failed.kind, Verdict::Kind::kShutdown);
  EXPECT_NE(failed.message.find("no restarts left (--max-restarts 0)"), std::string::npos);
  EXPECT_EQ(b->check().kind, Verdict::Kind::kShutdown);
}

// A node arriving while a round runs waits; the running node admits it at its next check.
TEST_F(RendezvousTest, WaitingNodeMakesTheJobGrow) {
  RendezvousSettings s = settings(1, 2);
  s.last_call_timeout = 0ms;
  auto a = node("a", s);
  auto c = node("c", s);
  auto ja = join(*a, 1);
  EXPECT_EQ(get(ja).world_size, 1);
  auto jc = join(*c, 3);
  EXPECT_EQ(jc.wait_for(200ms), std::future_status::timeout) << "joined a running round";
  Verdict grow = check_until_news(*a);
  EXPECT_EQ(grow.kind, Verdict::Kind::kNewRound);
  EXPECT_NE(grow.message.find("host c (node c_1_0) waiting to join"), std::string::npos);
  ja = join(*a, 1);
  RoundAssignment ra = get(ja);
  RoundAssignment rc = get(jc);
  EXPECT_EQ(ra.round, 1);
  EXPECT_EQ(ra.world_size, 2);
  EXPECT_EQ(ra.group_rank, 0);  // the survivor keeps rank 0
  EXPECT_EQ(rc.group_rank, 1);
}

// A node that leaves (SIGTERM) makes the others shrink at once, without a heartbeat timeout.
TEST_F(RendezvousTest, LeavingNodeShrinksTheJobAtOnce) {
  RendezvousSettings s = settings(1, 2);
  s.keep_alive_interval = 10s;  // a heartbeat timeout would take 30 s
  auto a = node("a", s);
  auto b = node("b", s);
  auto ja = join(*a, 1);
  auto jb = join(*b, 2);
  get(ja);
  get(jb);
  b->announce_leaving();
  // Workers failing while a peer leaves spend no restart.
  EXPECT_EQ(a->report_failure("worker rank 0 exited with code 1").kind, Verdict::Kind::kNewRound);
  b->leave("received SIGTERM");
  ja = join(*a, 1);
  RoundAssignment ra = get(ja);
  EXPECT_EQ(ra.world_size, 1);
  EXPECT_EQ(a->report_failure("again").message, "again (restart 1 of 1)");
}

// A round that cannot complete names who came and how many were needed.
TEST_F(RendezvousTest, TimeoutNamesPresentNodesAndTheMinimum) {
  RendezvousSettings s = settings(2, 3);
  s.timeout = 200ms;
  auto a = node("a", s);
  try {
    a->next_round(1, -1);
    FAIL() << "no timeout";
  } catch (const dtrain::TimeoutError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("rendezvous 'test' round 0 did not complete within 0.2 s: 1 node(s) "
                        "joined (host a (node a_1_0)), at least 2 needed (--nnodes 2:3)"),
              std::string::npos)
        << error.what();
  }
}

// RFC 4231, test case 2.
// Note [Reusing a run id]: a job that finished leaves its state behind (etcd keeps it); a new
// agent under the same id starts a new job at round 0 instead of waiting in the old one until its
// timeout.
TEST_F(RendezvousTest, FinishedJobsStateStartsOverForANewAgent) {
  auto a = node("a", settings(1, 1));
  auto first = join(*a, 1001);
  EXPECT_EQ(get(first).round, 0);
  a->finish();
  a.reset();
  auto c = node("c", settings(1, 1));
  auto again = join(*c, 1003);
  RoundAssignment rc = get(again);
  EXPECT_EQ(rc.round, 0);
  EXPECT_EQ(rc.group_world_size, 1);
  EXPECT_EQ(rc.master_port, 1003);
}

// A job that was shut down: a newcomer waits until the old agents are gone (their heartbeats stop),
// then starts over; it is never told the old job's reason as if it were its own.
TEST_F(RendezvousTest, ShutDownJobsStateStartsOverOnceItsAgentsAreGone) {
  RendezvousSettings s = settings(1, 1);
  s.max_restarts = 0;
  auto a = node("a", s);
  auto first = join(*a, 1001);
  EXPECT_EQ(get(first).round, 0);
  EXPECT_EQ(a->report_failure("worker rank 0 exited with code 1").kind, Verdict::Kind::kShutdown);
  a.reset();  // its agent exits without leaving: only its silence frees the state
  auto c = node("c", s);
  auto again = join(*c, 1003);
  RoundAssignment rc = get(again);
  EXPECT_EQ(rc.round, 0);
  EXPECT_EQ(rc.master_port, 1003);
}

TEST(C10dStore, HmacSha256MatchesTheRfc) {
  std::string mac = dtrain::elastic::hmac_sha256("Jefe", "what do ya want for nothing?");
  std::string hex;
  for (unsigned char byte : mac) {
    char two[3];
    snprintf(two, sizeof(two), "%02x", byte);
    hex += two;
  }
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(C10dStore, KeepsTheBackendContractWithAToken) {
  int port = dtrain::elastic::pick_free_port();
  auto server = C10dStoreServer::try_host("127.0.0.1", port, "tok", nullptr);
  ASSERT_NE(server, nullptr);
  C10dBackend backend("127.0.0.1", port, "job", "tok", 5s);
  dtrain::cli::testing_support::expect_backend_contract(backend);
  // A second agent on the same endpoint cannot host it too.
  EXPECT_EQ(C10dStoreServer::try_host("127.0.0.1", port, "tok", nullptr), nullptr);
}

// The store listens on the endpoint's address only: on Linux every 127.x.y.z is this machine, so a
// store bound to every interface would also answer at 127.0.0.2.
TEST(C10dStore, ListensOnTheEndpointAddressOnly) {
  int port = dtrain::elastic::pick_free_port();
  auto server = C10dStoreServer::try_host("127.0.0.1", port, "", nullptr);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->address(), "127.0.0.1:" + std::to_string(port));
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in other{};
  other.sin_family = AF_INET;
  other.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.2", &other.sin_addr);
  EXPECT_NE(connect(fd, reinterpret_cast<sockaddr*>(&other), sizeof(other)), 0);
  close(fd);
}

TEST(C10dStore, RefusesWrongAndMissingTokensAndLogsThePeer) {
  int port = dtrain::elastic::pick_free_port();
  std::mutex mutex;
  std::vector<std::string> log;
  auto server = C10dStoreServer::try_host("127.0.0.1", port, "right", [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    log.push_back(line);
  });
  ASSERT_NE(server, nullptr);
  for (const char* token : {"wrong", ""}) {
    C10dBackend backend("127.0.0.1", port, "job", token, 5s);
    try {
      backend.get_state();
      ADD_FAILURE() << "accepted token '" << token << "'";
    } catch (const dtrain::UsageError& error) {
      EXPECT_NE(std::string(error.what()).find("refused this node"), std::string::npos)
          << error.what();
    }
  }
  // An open store and a client with a token: the client refuses to talk to it.
  int open_port = dtrain::elastic::pick_free_port();
  auto open_server = C10dStoreServer::try_host("127.0.0.1", open_port, "", nullptr);
  C10dBackend careful("127.0.0.1", open_port, "job", "right", 5s);
  EXPECT_THROW(careful.get_state(), dtrain::UsageError);

  C10dBackend good("127.0.0.1", port, "job", "right", 5s);
  EXPECT_FALSE(good.get_state().has_value());
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(log.size(), 2u);
  EXPECT_NE(log[0].find("refused a connection from 127.0.0.1:"), std::string::npos) << log[0];
  EXPECT_NE(log[0].find("wrong token"), std::string::npos) << log[0];
  EXPECT_NE(log[1].find("it presented no token"), std::string::npos) << log[1];
}

// The store's host is gone: calls fail within their timeout with the endpoint named.
TEST(C10dStore, ClientSaysWhenTheStoreIsGone) {
  int port = dtrain::elastic::pick_free_port();
  auto server = C10dStoreServer::try_host("127.0.0.1", port, "", nullptr);
  C10dBackend backend("127.0.0.1", port, "job", "", 2s);
  backend.get_state();
  server.reset();
  try {
    backend.get_state();
    FAIL() << "no error";
  } catch (const dtrain::CommError& error) {
    EXPECT_NE(std::string(error.what()).find("127.0.0.1:" + std::to_string(port)),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
