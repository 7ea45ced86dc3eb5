// The rendezvous in-process: several Rendezvous objects (one per simulated node, their blocking
// calls on threads) over one in-memory backend and one fake clock (Note [The rendezvous clock]).
// The time stands still until a test moves it on, and heartbeats land only when the test writes
// them, so every deadline of Note [Rounds] is checked to the millisecond and no test sleeps through
// one. Then the backend contract for the in-memory and the c10d backends; the c10d store's address
// binding and token handshake; a client that meets another program on the store's port. Over 600
// lines: every deadline of the note has its own test.
#include "launcher/elastic/rendezvous.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend_contract.h"
#include "dtrain/errors.h"
#include "launcher/elastic/c10d_backend.h"
#include "support/subprocess.h"
#include "test_support.h"

namespace {

using namespace std::chrono_literals;
using dtrain::elastic::C10dBackend;
using dtrain::elastic::C10dStoreServer;
using dtrain::elastic::NodeInfo;
using dtrain::elastic::Rendezvous;
using dtrain::elastic::RendezvousBackend;
using dtrain::elastic::RendezvousClock;
using dtrain::elastic::RendezvousSettings;
using dtrain::elastic::RendezvousState;
using dtrain::elastic::RoundAssignment;
using dtrain::elastic::Verdict;
using dtrain::elastic::VersionedState;
using dtrain::elastic::WorkersLeft;

// One stored state shared by every node's backend object: the store.
struct MemoryStore {
  std::mutex mutex;
  std::optional<VersionedState> state;
  uint64_t next_version = 1;
  std::atomic<bool> unreachable{false};  // every call fails, as a stalled etcd's would
  std::function<void()> stall;           // run (once) inside the next get_state: a slow store
};

class MemoryBackend : public RendezvousBackend {
 public:
  MemoryBackend(std::shared_ptr<MemoryStore> store, std::shared_ptr<std::atomic<int>> reads)
      : store_(std::move(store)), reads_(std::move(reads)) {}
  std::string name() const override { return "memory"; }
  std::optional<VersionedState> get_state() override {
    ++*reads_;
    fail_if_unreachable();
    std::function<void()> stall;
    {
      std::lock_guard<std::mutex> lock(store_->mutex);
      std::swap(stall, store_->stall);
    }
    if (stall) stall();
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
  std::shared_ptr<std::atomic<int>> reads_;  // get_state calls: one per poll of a blocking call
};

// The time the rendezvous reads: it stands still until the test advances it.
class FakeClock {
 public:
  void advance(std::chrono::milliseconds time) { ms_ += time.count(); }
  RendezvousClock clock() {
    return {
        [this] { return std::chrono::steady_clock::time_point(std::chrono::milliseconds(ms_)); },
        [this] {
          return std::chrono::system_clock::time_point(std::chrono::milliseconds(kStart + ms_));
        }};
  }

 private:
  static constexpr int64_t kStart = 1'700'000'000'000;  // the wall clock at 0 (2023-11-14)
  std::atomic<int64_t> ms_{0};
};

constexpr auto kInterval = 50ms;                   // the heartbeat period of settings() ...
constexpr auto kHeartbeatTimeout = 3 * kInterval;  // ... and the silence that makes a node dead

class RendezvousTest : public testing::Test {
 protected:
  RendezvousSettings settings(int min_nodes, int max_nodes) {
    RendezvousSettings s;
    s.job_id = "test";
    s.min_nodes = min_nodes;
    s.max_nodes = max_nodes;
    s.timeout = 10s;
    s.last_call_timeout = 5s;
    s.keep_alive_interval = kInterval;
    s.keep_alive_max_attempt = 3;
    s.max_restarts = 1;
    s.clock = clock_.clock();
    return s;
  }
  // A simulated node. Its keep-alive thread is not started: pass() writes its heartbeats.
  std::unique_ptr<Rendezvous> node(const std::string& name, const RendezvousSettings& s,
                                   int nproc = 1) {
    NodeInfo info;
    info.id = name + "_1_0";
    info.host = name;
    info.addr = "10.0.0." + std::to_string(++nodes_);
    info.nproc = nproc;
    auto reads = std::make_shared<std::atomic<int>>(0);
    reads_[info.id] = reads;
    return std::make_unique<Rendezvous>(std::make_unique<MemoryBackend>(store_, reads), s, info);
  }
  // next_round on a thread; the port identifies the node's MASTER_PORT candidate.
  std::future<std::optional<RoundAssignment>> join(Rendezvous& rendezvous, int port) {
    return std::async(std::launch::async,
                      [&rendezvous, port] { return rendezvous.next_round(port, -1); });
  }
  // report_failure on a thread, for the cases where it waits for a loss that would explain it.
  static std::future<Verdict> report(Rendezvous& rendezvous, const std::string& what) {
    return std::async(std::launch::async,
                      [&rendezvous, what] { return rendezvous.report_failure(what); });
  }
  // What a blocking call started on a thread returned (or threw). One that has not returned within
  // 10 s is a failure; the time then jumps a day ahead, past every deadline, so that the call
  // returns and the test reports the rest instead of hanging.
  template <typename T>
  T settle(std::future<T>& future, const std::string& what) {
    if (future.wait_for(10s) != std::future_status::ready) {
      ADD_FAILURE() << what << " within 10 s";
      clock_.advance(24h);
    }
    return future.get();
  }
  RoundAssignment get(std::future<std::optional<RoundAssignment>>& future) {
    std::optional<RoundAssignment> round = settle(future, "the round did not complete");
    EXPECT_TRUE(round.has_value());
    return round.value_or(RoundAssignment{});
  }
  Verdict get(std::future<Verdict>& future) {
    return settle(future, "report_failure did not return");
  }
  // Moves the time on by `time` in steps of one heartbeat interval; after each whole interval every
  // node in `beating` writes its heartbeat, as its keep-alive thread would (ignoring errors, as the
  // thread does). The other nodes are silent. When `blocked` is a node whose call waits on another
  // thread, each step first lets that call poll (wait_for_polls), so that it sees every heartbeat
  // as it lands and every time in between, as it would on a real clock.
  void pass(std::chrono::milliseconds time, const std::vector<Rendezvous*>& beating,
            const Rendezvous* blocked = nullptr) {
    while (time > 0ms) {
      if (blocked != nullptr) wait_for_polls(*blocked);
      std::chrono::milliseconds step = std::min(time, std::chrono::milliseconds(kInterval));
      clock_.advance(step);
      time -= step;
      if (step < kInterval) continue;
      for (Rendezvous* node : beating) {
        try {
          node->keep_alive();
        } catch (const std::exception&) {
        }
      }
    }
  }
  // Blocks until the call that `rendezvous` is blocked in (on another thread) has read the state
  // twice more: the first of those reads began after this was called, and the second one shows
  // that the call looked at the time after it and went on waiting (bounded).
  void wait_for_polls(const Rendezvous& rendezvous) {
    std::atomic<int>& reads = *reads_.at(rendezvous.self().id);
    int target = reads + 2;
    for (int i = 0; i < 10000 && reads < target; ++i) std::this_thread::sleep_for(1ms);
    ASSERT_GE(reads, target) << rendezvous.self().id << " stopped polling within 10 s";
  }
  RendezvousState stored() {
    std::lock_guard<std::mutex> lock(store_->mutex);
    return store_->state ? RendezvousState::from_json(store_->state->state) : RendezvousState{};
  }
  // Blocks until the stored state satisfies `holds`, e.g. a join meant to come first is registered
  // before the next one starts (bounded).
  void wait_until_stored(const std::function<bool(const RendezvousState&)>& holds,
                         const std::string& what) {
    for (int i = 0; i < 10000 && !holds(stored()); ++i) std::this_thread::sleep_for(1ms);
    ASSERT_TRUE(holds(stored())) << what << " not within 10 s";
  }
  void wait_until_joined(const Rendezvous& rendezvous) {
    wait_until_stored(
        [&](const RendezvousState& state) {
          return std::count(state.participants.begin(), state.participants.end(),
                            rendezvous.self().id) > 0;
        },
        rendezvous.self().id + " joined");
  }

  // Round 0 of `first` (node 0, MASTER_PORT 1001) and `second` (1002), MAX 2, whose workers then
  // formed an in-place group: node 0 says so (Note [Rounds in place]).
  // `marked`: node 0's agent has seen the workers' in-place group (mark_in_place()).
  void run_in_place(Rendezvous& first, Rendezvous& second, bool marked = true) {
    auto joined_first = join(first, 1001);
    wait_until_joined(first);
    auto joined_second = join(second, 1002);
    EXPECT_EQ(get(joined_first).group_rank, 0);
    EXPECT_EQ(get(joined_second).group_rank, 1);
    if (marked) first.mark_in_place();
  }

  std::shared_ptr<MemoryStore> store_ = std::make_shared<MemoryStore>();
  FakeClock clock_;
  std::map<std::string, std::shared_ptr<std::atomic<int>>> reads_;  // per node id
  int nodes_ = 0;
};

TEST_F(RendezvousTest, MemoryBackendKeepsTheContract) {
  MemoryBackend backend(store_, std::make_shared<std::atomic<int>>(0));
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

// The node whose agent hosts the c10d store takes node rank 0 in the first round, whenever it
// joined: the job then has one node it cannot lose, not two (Note [Rounds in place]).
TEST_F(RendezvousTest, TheStoresHostTakesNodeRankZero) {
  auto first = node("first", settings(2, 2));
  auto host = node("host", settings(2, 2));
  NodeInfo info = host->self();
  info.hosts_rendezvous = true;
  host = std::make_unique<Rendezvous>(std::make_unique<MemoryBackend>(store_, reads_.at(info.id)),
                                      settings(2, 2), info);
  auto jf = join(*first, 1001);
  wait_until_joined(*first);
  auto jh = join(*host, 1002);
  EXPECT_EQ(get(jh).group_rank, 0);
  RoundAssignment rf = get(jf);
  EXPECT_EQ(rf.group_rank, 1);
  EXPECT_EQ(rf.master_port, 1002);
}

// MIN nodes and the last call: the round closes when the window is over, not a millisecond before.
TEST_F(RendezvousTest, MinNodesCloseAfterTheLastCall) {
  RendezvousSettings s = settings(1, 2);
  s.last_call_timeout = 300ms;
  auto a = node("a", s);
  auto round = join(*a, 1);
  wait_until_joined(*a);  // the window opens with the MIN-th join
  clock_.advance(299ms);
  wait_for_polls(*a);
  EXPECT_FALSE(stored().complete) << "closed 1 ms before the end of the last call";
  clock_.advance(1ms);
  RoundAssignment ra = get(round);
  EXPECT_EQ(ra.group_world_size, 1);
}

// A node whose heartbeat stops is dead once it has been silent for longer than 3 intervals: a new
// round without it, or the end of the job when fewer than MIN remain, naming it.
TEST_F(RendezvousTest, SilentNodeIsLostAndTheJobShrinksOrEnds) {
  for (int min_nodes : {1, 2}) {
    SCOPED_TRACE("min " + std::to_string(min_nodes));
    store_ = std::make_shared<MemoryStore>();
    auto a = node("a", settings(min_nodes, 2));
    auto b = node("b", settings(min_nodes, 2));  // silent: it dies once the round closed
    auto first = join(*a, 1);
    auto second = join(*b, 2);
    get(first);
    get(second);
    pass(kHeartbeatTimeout, {a.get()});
    Verdict verdict = a->check();
    EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << "lost after exactly the timeout";
    pass(1ms, {a.get()});
    verdict = a->check();
    EXPECT_NE(verdict.message.find("host b (node b_1_0) lost: no heartbeat for 0.15 s"),
              std::string::npos)
        << verdict.message;
    if (min_nodes == 1) {
      EXPECT_EQ(verdict.kind, Verdict::Kind::kNewRound);
      EXPECT_TRUE(verdict.participant_lost) << "Note [Stopping after a loss]";
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
  auto b = node("b", settings(1, 3));  // silent: it dies once the round closed
  auto c = node("c", settings(1, 3));
  auto joined_a = join(*a, 1), joined_b = join(*b, 2), joined_c = join(*c, 3);
  get(joined_a);
  get(joined_b);
  get(joined_c);
  a->finish();
  pass(kHeartbeatTimeout + 1ms, {c.get()});
  Verdict verdict = c->check();
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
  Verdict verdict = b->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown) << verdict.message;
  EXPECT_NE(verdict.message.find("not restarting: host a (node a_1_0) had already finished"),
            std::string::npos)
      << verdict.message;
}

// A store that nobody could reach for longer than the heartbeat timeout: no heartbeat landed, and
// that is not evidence that anyone died; once it answers again, the job keeps running, and the
// count of a silent node's heartbeat timeout starts over from then.
TEST_F(RendezvousTest, StoreOutageIsNotTakenForLostNodes) {
  auto a = node("a", settings(1, 2));
  auto b = node("b", settings(1, 2));
  auto joined_a = join(*a, 1), joined_b = join(*b, 2);
  get(joined_a);
  get(joined_b);
  EXPECT_EQ(a->check().kind, Verdict::Kind::kKeepRunning);
  store_->unreachable = true;
  pass(400ms, {a.get(), b.get()});  // every heartbeat write fails
  store_->unreachable = false;
  Verdict verdict = a->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
  pass(kHeartbeatTimeout, {a.get()});  // b stays silent from here
  verdict = a->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
  pass(1ms, {a.get()});
  verdict = a->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kNewRound) << verdict.message;
  EXPECT_NE(verdict.message.find("host b (node b_1_0) lost"), std::string::npos) << verdict.message;
}

// One store call that took longer than half the heartbeat timeout: no heartbeat could land while
// it hung either, so the silence it covers is no evidence of death.
TEST_F(RendezvousTest, SlowStoreCallIsNotTakenForLostNodes) {
  auto a = node("a", settings(1, 2));
  auto b = node("b", settings(1, 2));
  auto joined_a = join(*a, 1), joined_b = join(*b, 2);
  get(joined_a);
  get(joined_b);
  EXPECT_EQ(a->check().kind, Verdict::Kind::kKeepRunning);
  store_->stall = [&] { clock_.advance(kHeartbeatTimeout + 50ms); };
  Verdict verdict = a->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
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
  auto reported = report(*a, "worker rank 0 exited with code 4");
  pass(kHeartbeatTimeout + kInterval, {a.get(), b.get()}, a.get());  // no loss explains it
  Verdict last = get(reported);
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
    auto b = node("b", s);  // silent: it dies as soon as the round runs
    auto ja = join(*a, 1);
    auto jb = join(*b, 2);
    get(ja);
    get(jb);
    // With no restart left, report_failure waits for b's heartbeat to expire; with one left, it
    // spends it at once, and the next round waits for b (expected back) until it expires. Nobody
    // is left to miss a's heartbeats: the time may jump.
    auto reported = report(*a, "worker rank 0 exited with code 1");
    if (max_restarts == 0) {
      wait_for_polls(*a);
      clock_.advance(kHeartbeatTimeout + 1ms);
    }
    Verdict failed = get(reported);
    ASSERT_EQ(failed.kind, Verdict::Kind::kNewRound) << failed.message;
    ja = join(*a, 1);
    if (max_restarts == 1) {
      wait_for_polls(*a);
      clock_.advance(kHeartbeatTimeout + 1ms);
    }
    RoundAssignment alone = get(ja);
    EXPECT_EQ(alone.world_size, 1);
    // The failure was refunded (or never counted): a real one now still has its restart.
    reported = report(*a, "worker rank 0 exited with code 2");
    if (max_restarts == 0) {
      wait_for_polls(*a);
      clock_.advance(kHeartbeatTimeout + kInterval);
    }
    Verdict real = get(reported);
    if (max_restarts == 1) {
      EXPECT_EQ(real.kind, Verdict::Kind::kNewRound) << real.message;
      EXPECT_EQ(real.message, "worker rank 0 exited with code 2 (restart 1 of 1)");
    } else {
      EXPECT_EQ(real.kind, Verdict::Kind::kShutdown) << real.message;
    }
  }
}

// With no restarts left and every peer alive, the failure ends the job after one heartbeat timeout
// and one interval of waiting for a loss that would explain it, not a millisecond before.
TEST_F(RendezvousTest, FailureWithNoRestartsLeftEndsTheJob) {
  RendezvousSettings s = settings(2, 2);
  s.max_restarts = 0;
  auto a = node("a", s);
  auto b = node("b", s);
  auto ja = join(*a, 1);
  auto jb = join(*b, 2);
  get(ja);
  get(jb);
  auto reported = report(*a, "worker rank 0 exited with code 1");
  pass(kHeartbeatTimeout + kInterval - 1ms, {a.get(), b.get()}, a.get());
  wait_for_polls(*a);
  EXPECT_EQ(reported.wait_for(0s), std::future_status::timeout) << "returned 1 ms early";
  pass(1ms, {a.get(), b.get()}, a.get());
  Verdict failed = get(reported);
  EXPECT_EQ(failed.kind, Verdict::Kind::kShutdown);
  EXPECT_NE(failed.message.find("no restarts left (--max-restarts 0)"), std::string::npos);
  EXPECT_EQ(b->check().kind, Verdict::Kind::kShutdown);
}

// A node arriving while a round runs waits; the running node admits it at its next check. (The
// time moves only to close the first round: the second one, which ever node joins it first, stays
// open for the other, the last call never ending.)
TEST_F(RendezvousTest, WaitingNodeMakesTheJobGrow) {
  RendezvousSettings s = settings(1, 2);
  auto a = node("a", s);
  auto c = node("c", s);
  auto ja = join(*a, 1);
  wait_until_joined(*a);
  clock_.advance(s.last_call_timeout);
  EXPECT_EQ(get(ja).world_size, 1);
  auto jc = join(*c, 3);
  wait_until_stored([](const RendezvousState& state) { return state.waiting.size() == 1; },
                    "c on the waiting list");
  EXPECT_EQ(jc.wait_for(0s), std::future_status::timeout) << "joined a running round";
  Verdict grow = a->check();
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

// Note [Rounds in place]: once node 0 says its workers recover in place, a lost node leaves the
// running round without a new one, and waiting nodes are admitted into it: the first into the lost
// node's ranks, the next into new ones while the job is below MAX. Nobody's ranks move.
TEST_F(RendezvousTest, InPlaceRoundLosesANodeAndAdmitsNewcomersWithoutANewRound) {
  RendezvousSettings s = settings(1, 3);
  s.last_call_timeout = kInterval;  // shorter than a heartbeat timeout: nobody is lost in it
  auto a = node("a", s, 2);
  auto b = node("b", s, 2);  // silent once the round runs: lost
  auto c = node("c", s, 2);
  auto d = node("d", s, 1);
  auto ja = join(*a, 1001);
  wait_until_joined(*a);
  auto jb = join(*b, 1002);
  wait_until_joined(*b);
  clock_.advance(s.last_call_timeout);
  RoundAssignment ra = get(ja);
  EXPECT_EQ(get(jb).base_rank, 2);
  EXPECT_FALSE(ra.join_running);
  a->mark_in_place();
  EXPECT_TRUE(stored().in_place);

  pass(kHeartbeatTimeout + 1ms, {a.get()});
  Verdict lost = a->check();
  EXPECT_EQ(lost.kind, Verdict::Kind::kKeepRunning) << lost.message;
  EXPECT_NE(lost.message.find("host b (node b_1_0) lost"), std::string::npos) << lost.message;
  EXPECT_NE(lost.message.find("goes on in place with 1 node(s)"), std::string::npos)
      << lost.message;
  EXPECT_EQ(stored().round, 0);
  EXPECT_EQ(a->check().message, "") << "a change is reported once";

  auto jc = join(*c, 1003);
  RoundAssignment rc = get(jc);  // admitted by its own join: no need to wait for a's next look
  EXPECT_TRUE(rc.join_running);
  EXPECT_EQ(rc.round, 0);
  EXPECT_EQ(rc.group_rank, 1);
  EXPECT_EQ(rc.base_rank, 2);  // b's ranks
  EXPECT_EQ(rc.world_size, 4);
  EXPECT_EQ(rc.master_addr, a->self().addr);
  EXPECT_EQ(rc.master_port, 1001);
  Verdict joined = a->check();
  EXPECT_EQ(joined.kind, Verdict::Kind::kKeepRunning);
  EXPECT_NE(joined.message.find("host c (node c_1_0) joins the running round in place as node "
                                "rank 1 (ranks 2..3)"),
            std::string::npos)
      << joined.message;

  auto jd = join(*d, 1004);
  RoundAssignment rd = get(jd);
  EXPECT_TRUE(rd.join_running);
  EXPECT_EQ(rd.group_rank, 2);
  EXPECT_EQ(rd.base_rank, 4);
  EXPECT_EQ(rd.world_size, 5);
  EXPECT_EQ(rd.group_world_size, 3);
  EXPECT_EQ(stored().round, 0);
}

// Node 0's agent hosts the workers' store: its loss ends the round in place too, and a round whose
// workers never said they recover in place restarts for any lost node (SilentNodeIsLost...).
TEST_F(RendezvousTest, InPlaceRoundStillRestartsWhenNodeZeroIsLost) {
  RendezvousSettings s = settings(1, 2);
  auto a = node("a", s);  // node 0, silent: lost
  auto b = node("b", s);
  run_in_place(*a, *b);
  pass(kHeartbeatTimeout + 1ms, {b.get()});
  Verdict verdict = b->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kNewRound) << verdict.message;
  EXPECT_TRUE(verdict.participant_lost) << "Note [Stopping after a loss]";
  EXPECT_FALSE(stored().in_place) << "the next round starts without it";
}

// In place or not, a loss that leaves fewer than MIN nodes, with nobody waiting, ends the job, and
// the workers get the short stop (Note [Stopping after a loss]).
TEST_F(RendezvousTest, InPlaceRoundBelowMinEndsTheJob) {
  RendezvousSettings s = settings(2, 2);
  auto a = node("a", s);
  auto b = node("b", s);  // silent once the round runs: lost
  run_in_place(*a, *b);
  pass(kHeartbeatTimeout + 1ms, {a.get()});
  Verdict verdict = a->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown) << verdict.message;
  EXPECT_TRUE(verdict.participant_lost);
  EXPECT_NE(verdict.message.find("1 node(s) left, fewer than the minimum of 2"), std::string::npos)
      << verdict.message;
}

// With MIN == MAX a lost node leaves the job below MIN, but a node already waiting takes its place
// in the same change: the job goes on in place instead of ending for want of a node that is there.
TEST_F(RendezvousTest, InPlaceRoundAtMinAdmitsAWaitingNodeForALostOne) {
  RendezvousSettings s = settings(2, 2);
  auto a = node("a", s);
  auto b = node("b", s);  // silent once the round runs: lost
  auto c = node("c", s);
  run_in_place(*a, *b);
  auto jc = join(*c, 1003);
  wait_until_stored([](const RendezvousState& state) { return state.waiting.size() == 1; },
                    "c on the waiting list");
  pass(kHeartbeatTimeout + 1ms, {a.get(), c.get()}, c.get());
  Verdict verdict = a->check();
  EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
  EXPECT_NE(verdict.message.find("host b (node b_1_0) lost"), std::string::npos) << verdict.message;
  EXPECT_NE(verdict.message.find("host c (node c_1_0) joins the running round in place as node "
                                 "rank 1 (ranks 1..1)"),
            std::string::npos)
      << verdict.message;
  RoundAssignment rc = get(jc);
  EXPECT_TRUE(rc.join_running);
  EXPECT_EQ(rc.base_rank, 1);
  EXPECT_EQ(stored().round, 0);
}

// A node that leaves (SIGTERM) makes the others shrink at once, without a heartbeat timeout: no
// time passes in this test.
TEST_F(RendezvousTest, LeavingNodeShrinksTheJobAtOnce) {
  auto a = node("a", settings(1, 2));
  auto b = node("b", settings(1, 2));
  auto ja = join(*a, 1);
  auto jb = join(*b, 2);
  get(ja);
  get(jb);
  b->announce_leaving();
  // Workers failing while a peer leaves spend no restart.
  Verdict verdict = a->report_failure("worker rank 0 exited with code 1");
  EXPECT_EQ(verdict.kind, Verdict::Kind::kNewRound);
  EXPECT_FALSE(verdict.participant_lost) << "a leaving peer's workers stop together with ours";
  b->leave("received SIGTERM");
  ja = join(*a, 1);
  RoundAssignment ra = get(ja);
  EXPECT_EQ(ra.world_size, 1);
  EXPECT_EQ(a->report_failure("again").message, "again (restart 1 of 1)");
}

// Note [Rounds in place]: a node whose workers all left in place (Note [Leaving in place]) is
// removed from the running round without a new one; one whose workers stopped with the others
// (at a checkpoint) opens a new round; below MIN the job ends, as it does for a node lost.
TEST_F(RendezvousTest, InPlaceRoundGoesOnWhenALeavingNodesWorkersLeftInPlace) {
  {
    auto a = node("a", settings(1, 2));
    auto b = node("b", settings(1, 2));
    run_in_place(*a, *b);
    // Marked by node 0's agent: its own agent's store call may have failed.
    b->leave("received SIGTERM", WorkersLeft::kInPlace);
    Verdict verdict = a->check();
    EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
    EXPECT_NE(verdict.message.find("host b (node b_1_0) left the job (received SIGTERM); the "
                                   "running round goes on in place with 1 node(s)"),
              std::string::npos)
        << verdict.message;
    EXPECT_EQ(stored().round, 0);
    EXPECT_TRUE(stored().in_place);
  }
  store_ = std::make_shared<MemoryStore>();
  {
    auto a = node("a", settings(1, 2));
    auto b = node("b", settings(1, 2));
    run_in_place(*a, *b);
    b->leave("received SIGTERM", WorkersLeft::kStopped);  // its workers stopped at a checkpoint
    EXPECT_EQ(a->check().kind, Verdict::Kind::kNewRound);
  }
  // Taken back before node 0's agent marked the round: its own agent found the workers' group
  // formed in place, and that is enough; exit codes 75 alone, unconfirmed, are not.
  store_ = std::make_shared<MemoryStore>();
  {
    auto a = node("a", settings(1, 2));
    auto b = node("b", settings(1, 2));
    run_in_place(*a, *b, /*marked=*/false);
    b->leave("received SIGTERM", WorkersLeft::kInPlaceConfirmed);
    Verdict verdict = a->check();
    EXPECT_EQ(verdict.kind, Verdict::Kind::kKeepRunning) << verdict.message;
    EXPECT_EQ(stored().round, 0);
    EXPECT_TRUE(stored().in_place);
  }
  store_ = std::make_shared<MemoryStore>();
  {
    auto a = node("a", settings(1, 2));
    auto b = node("b", settings(1, 2));
    run_in_place(*a, *b, /*marked=*/false);
    b->leave("received SIGTERM", WorkersLeft::kInPlace);
    EXPECT_EQ(a->check().kind, Verdict::Kind::kNewRound);
  }
  store_ = std::make_shared<MemoryStore>();
  {
    auto a = node("a", settings(2, 2));
    auto b = node("b", settings(2, 2));
    run_in_place(*a, *b);
    b->leave("received SIGTERM", WorkersLeft::kInPlaceConfirmed);  // below MIN
    Verdict verdict = a->check();
    EXPECT_EQ(verdict.kind, Verdict::Kind::kShutdown) << verdict.message;
    EXPECT_NE(verdict.message.find("1 node(s) left, fewer than the minimum of 2"),
              std::string::npos)
        << verdict.message;
  }
}

// A round that cannot complete fails at its timeout, not a millisecond before, naming who came and
// how many were needed.
TEST_F(RendezvousTest, TimeoutNamesPresentNodesAndTheMinimum) {
  RendezvousSettings s = settings(2, 3);
  s.timeout = 200ms;
  auto a = node("a", s);
  auto round = join(*a, 1);
  wait_until_joined(*a);
  clock_.advance(199ms);
  wait_for_polls(*a);
  EXPECT_EQ(round.wait_for(0s), std::future_status::timeout) << "gave up 1 ms early";
  clock_.advance(1ms);
  try {
    settle(round, "next_round did not give up");
    FAIL() << "no timeout";
  } catch (const dtrain::TimeoutError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("rendezvous 'test' round 0 did not complete within 0.2 s: 1 node(s) "
                        "joined (host a (node a_1_0)), at least 2 needed (--nnodes 2:3)"),
              std::string::npos)
        << error.what();
  }
}

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
  auto reported = report(*a, "worker rank 0 exited with code 1");
  wait_for_polls(*a);
  clock_.advance(kHeartbeatTimeout + kInterval);  // its wait for a loss that would explain it
  EXPECT_EQ(get(reported).kind, Verdict::Kind::kShutdown);
  a.reset();  // its agent exits without leaving: only its silence frees the state
  auto c = node("c", s);
  auto again = join(*c, 1003);
  wait_for_polls(*c);  // c has seen a's last heartbeat
  clock_.advance(kHeartbeatTimeout);
  wait_for_polls(*c);
  EXPECT_EQ(again.wait_for(0s), std::future_status::timeout) << "a was not silent for long enough";
  clock_.advance(1ms);
  RoundAssignment rc = get(again);
  EXPECT_EQ(rc.round, 0);
  EXPECT_EQ(rc.master_port, 1003);
}

// The keep-alive thread beats on the rendezvous clock: once per interval of it, catching up after
// a jump. (The interval is an hour: a thread on the real clock would never beat here.)
TEST_F(RendezvousTest, KeepAliveThreadBeatsOnTheRendezvousClock) {
  RendezvousSettings s = settings(1, 1);
  s.keep_alive_interval = 1h;
  auto a = node("a", s);
  auto round = join(*a, 1);
  get(round);
  std::string id = a->self().id;
  uint64_t start = stored().keep_alive.at(id);
  a->start_keep_alive();
  clock_.advance(1h);
  wait_until_stored(
      [&](const RendezvousState& state) { return state.keep_alive.at(id) == start + 1; },
      "one heartbeat after one interval");
  clock_.advance(2h);
  wait_until_stored(
      [&](const RendezvousState& state) { return state.keep_alive.at(id) == start + 3; },
      "two more heartbeats after two more intervals");
}

// RFC 4231, test case 2.
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
  int port = dtrain::testing::free_port();
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
  int port = dtrain::testing::free_port();
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
  int port = dtrain::testing::free_port();
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
  int open_port = dtrain::testing::free_port();
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
  int port = dtrain::testing::free_port();
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

// Another program holds the endpoint's port (issue 21): an HTTP server's answer, a few bytes of a
// binary protocol, or an accepted connection and silence. The client says so within the greeting
// timeout (5 s), far within its call timeout (20 s here), with an error that is not a timeout (the
// agent does not retry it) and names the endpoint.
TEST(C10dStore, ClientNamesAnotherProgramOnThePortWithinSeconds) {
  using dtrain::cli::testing_support::ForeignListener;
  constexpr auto kCallTimeout = 20s;
  for (const std::string& greeting :
       {std::string("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"),
        std::string("\x16\x03\x01", 3), std::string()}) {
    SCOPED_TRACE(greeting.empty() ? "silent" : greeting.substr(0, 8));
    ForeignListener foreign(greeting);
    C10dBackend backend("127.0.0.1", foreign.port(), "job", "", kCallTimeout);
    auto start = std::chrono::steady_clock::now();
    try {
      backend.get_state();
      ADD_FAILURE() << "got a state from another program";
    } catch (const dtrain::CommError& error) {
      std::string message = error.what();
      EXPECT_EQ(dynamic_cast<const dtrain::TimeoutError*>(&error), nullptr) << message;
      EXPECT_NE(message.find(foreign.endpoint() + " answers, but is not a dtrain/c10d rendezvous "
                                                  "store"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("another program"), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, kCallTimeout / 2);
  }
}

// A call that times out names its timeout as the call's own: mid-job the agent shortens it to what
// is left of its patience, far less than how long the store may have been silent.
TEST(C10dStore, ATimedOutCallNamesItsOwnTimeout) {
  dtrain::cli::testing_support::ForeignListener silent("");  // accepts, then never says a word
  C10dBackend backend("127.0.0.1", silent.port(), "job", "", 300ms);
  try {
    backend.get_state();
    ADD_FAILURE() << "got a state from a silent listener";
  } catch (const dtrain::TimeoutError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("the c10d rendezvous store at " + silent.endpoint() +
                        ": handshake not answered within the call's 0.3 s timeout"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
