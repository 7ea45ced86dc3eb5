// The store protocol of in-place recovery (src/recovery/membership.h), tier 1: members as threads
// over one in-memory store, each with a record of its own (threads share a pid, so the records
// carry made-up pids and a host name no process here has, unless a test wants the pid check).
#include "recovery/membership.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "dtrain/errors.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

MemberRecord record(int job_rank, bool newcomer = false) {
  MemberRecord r;
  r.job_rank = job_rank;
  r.host = "membership-test-host";  // not this machine: never "seen dead"
  r.pid = 4000000 + job_rank;
  r.pid_namespace = 1;
  r.newcomer = newcomer;
  return r;
}

std::vector<int> ranks_of(const std::vector<MemberRecord>& members) {
  std::vector<int> ranks;
  for (const auto& m : members) ranks.push_back(m.job_rank);
  return ranks;
}

TEST(Membership, TheFirstGenerationWaitsForEveryRankAndAllAgree) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::future<std::vector<MemberRecord>>> joined;
  for (int rank : {2, 0, 1}) {
    joined.push_back(std::async(std::launch::async, [&, rank] {
      if (rank == 1) std::this_thread::sleep_for(100ms);  // the others wait for it
      return Membership(store, record(rank), 10s).form(0, {}, 3, std::nullopt);
    }));
  }
  for (auto& j : joined) EXPECT_EQ(ranks_of(j.get()), (std::vector<int>{0, 1, 2}));
}

TEST(Membership, AMemberThatNeverComesIsLeftOutAfterSettleAndALatecomerIsToldSo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> previous = {record(0), record(1), record(2)};
  const auto begun = Clock::now();
  std::vector<std::future<std::vector<MemberRecord>>> survivors;
  for (int rank : {0, 1}) {
    survivors.push_back(std::async(std::launch::async, [&, rank] {
      return Membership(store, record(rank), 10s).form(1, previous, 0, 300ms);
    }));
  }
  for (auto& s : survivors) EXPECT_EQ(ranks_of(s.get()), (std::vector<int>{0, 1}));
  EXPECT_GE(Clock::now() - begun, 300ms) << "closed before settle without the missing member";
  try {
    Membership(store, record(2), 10s).form(1, previous, 0, 300ms);
    FAIL() << "a latecomer was let into a closed generation";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("formed without this process"), std::string::npos)
        << e.what();
  }
}

TEST(Membership, AMemberSeenDeadOnThisHostIsNotWaitedFor) {
  // A real pid that is gone: a child that exited and was reaped.
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  waitpid(child, nullptr, 0);
  MemberRecord dead = MemberRecord::of_this_process(2, false);
  dead.pid = child;
  ASSERT_TRUE(dead.seen_dead());
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> previous = {record(0), record(1), dead};
  const auto begun = Clock::now();
  std::vector<std::future<std::vector<MemberRecord>>> survivors;
  for (int rank : {0, 1}) {
    survivors.push_back(std::async(std::launch::async, [&, rank] {
      return Membership(store, record(rank), 10s).form(1, previous, 0, 60s);
    }));
  }
  for (auto& s : survivors) EXPECT_EQ(ranks_of(s.get()), (std::vector<int>{0, 1}));
  EXPECT_LT(Clock::now() - begun, 5s) << "waited for a member whose process is gone";
}

// Note [Heartbeats]: on another host, a member's death is told by its launcher's exit notice
// (`dtrain run --recovery in-place` writes it when it reaps the worker), not waited for until
// settle; a notice under a registering process's own name is an earlier process's and goes.
TEST(Membership, AMemberWhoseLauncherSaidItExitedIsNotWaitedFor) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> previous = {record(0), record(1), record(2)};
  auto set = [&](const std::string& key, const std::string& value) {
    store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  };
  set(Heartbeats::exit_key(record(2)), "killed by signal 9 (SIGKILL)");
  const auto begun = Clock::now();
  std::vector<std::future<std::vector<MemberRecord>>> survivors;
  for (int rank : {0, 1}) {
    survivors.push_back(std::async(std::launch::async, [&, rank] {
      return Membership(store, record(rank), 10s).form(1, previous, 0, 60s);
    }));
  }
  for (auto& s : survivors) EXPECT_EQ(ranks_of(s.get()), (std::vector<int>{0, 1}));
  EXPECT_LT(Clock::now() - begun, 5s) << "waited for a member whose launcher said it exited";
  EXPECT_TRUE(store->check({Heartbeats::exit_key(record(2))}));

  // A notice left by the pid's previous owner: gone once this process has registered.
  set(Heartbeats::exit_key(record(3)), "exited with code 1");
  EXPECT_EQ(ranks_of(Membership(store, record(3), 10s).form(2, {record(3)}, 0, 60s)),
            (std::vector<int>{3}));
  EXPECT_FALSE(store->check({Heartbeats::exit_key(record(3))}))
      << "a registering process kept an exit notice under its own name";
}

// RecoveryStats::departed: of the members missing after a re-formation, only those whose own exit
// notice says they left on SIGTERM; a failed one, a silent one, or one still there is not counted.
TEST(Membership, OnlyAMemberThatLeftOnSigtermCountsAsDeparted) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto set = [&](const std::string& key, const std::string& value) {
    store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  };
  set(Heartbeats::exit_key(record(1)), Heartbeats::kLeftOnSigterm);
  set(Heartbeats::exit_key(record(2)), "killed by signal 9 (SIGKILL)");
  set(Heartbeats::exit_key(record(4)), Heartbeats::kLeftOnSigterm);  // a stale notice: still in
  Membership membership(store, record(0), 10s);
  const std::vector<MemberRecord> previous = {record(0), record(1), record(2), record(3),
                                              record(4)};
  EXPECT_EQ(ranks_of(membership.departed(previous, {record(0), record(4)})), (std::vector<int>{1}));
  EXPECT_TRUE(membership.departed(previous, previous).empty());
}

TEST(Membership, ANewcomerJoinsTheGenerationItIsAdmittedToAndALateOneFindsTheJobOver) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> previous = {record(0), record(1)};
  Membership first(store, record(2, /*newcomer=*/true), 10s);
  const int64_t number = first.request_admission();
  EXPECT_EQ(number, 1);
  Membership member0(store, record(0), 10s), member1(store, record(1), 10s);
  EXPECT_EQ(member0.newcomers_requested(), 1);
  member0.admit(1, 1, 5);
  auto newcomer = std::async(std::launch::async, [&] {
    const auto generation = first.wait_for_admission(number);
    EXPECT_EQ(generation, std::optional<int64_t>(5));
    return first.form(*generation, {}, 0, 300ms);
  });
  auto m0 = std::async(std::launch::async, [&] { return member0.form(5, previous, 1, 10s); });
  auto m1 = std::async(std::launch::async, [&] { return member1.form(5, previous, 1, 10s); });
  // Members first by job rank, then the newcomer; every one sees the same list.
  for (auto* f : {&newcomer, &m0, &m1}) EXPECT_EQ(ranks_of(f->get()), (std::vector<int>{0, 1, 2}));

  member0.mark_finished(/*completed=*/true);
  Membership late(store, record(3, /*newcomer=*/true), 10s);
  EXPECT_EQ(late.wait_for_admission(late.request_admission()), std::nullopt);
}

// Note [Heartbeats]: a member whose counter stops while this process reaches the store is lost, and
// a generation closes without waiting `settle` for it.
TEST(Heartbeats, AMemberWhoseHeartbeatStoppedIsLostAndNotWaitedFor) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> previous = {record(0), record(1), record(2)};
  store->add(Heartbeats::key(record(2)), 1);  // registered once, then its host went away
  std::vector<std::shared_ptr<Heartbeats>> beats;
  for (int rank : {0, 1}) {
    store->add(Heartbeats::key(record(rank)), 1);
    beats.push_back(std::make_shared<Heartbeats>(store, record(rank), 300ms, "test:0"));
    beats.back()->watch(0, previous);
  }
  std::atomic<bool> stop{false};
  std::thread watcher([&] {
    for (int round = 0; round < 400 && !stop; ++round) {  // 20 s at most
      for (auto& b : beats) b->round();
      std::this_thread::sleep_for(50ms);
    }
  });
  const auto begun = Clock::now();
  std::vector<std::future<std::vector<MemberRecord>>> survivors;
  for (int i : {0, 1}) {
    survivors.push_back(std::async(std::launch::async, [&, i] {
      Membership membership(store, record(i), 10s);
      membership.use_heartbeats(beats[i]);
      return membership.form(1, previous, 0, 60s);
    }));
  }
  for (auto& s : survivors) EXPECT_EQ(ranks_of(s.get()), (std::vector<int>{0, 1}));
  const auto took = Clock::now() - begun;
  EXPECT_GE(took, 300ms) << "lost before lost_after";
  EXPECT_LT(took, 5s) << "waited for a member whose heartbeat had stopped";
  EXPECT_TRUE(beats[0]->lost(record(2)));
  EXPECT_FALSE(beats[0]->lost(record(1)));
  const std::string verdict = beats[0]->verdict(0);
  EXPECT_NE(verdict.find("rank 2"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("sent no heartbeat"), std::string::npos) << verdict;
  EXPECT_EQ(beats[0]->verdict(1), "") << "a verdict on a generation it does not watch";
  EXPECT_EQ(beats[0]->cut_off(), "");
  stop = true;
  watcher.join();
}

// A store that stops answering, as over a cut link.
class UnreachableStore : public c10d::HashStore {
 public:
  std::atomic<bool> cut{false};
  int64_t add(const std::string& key, int64_t value) override {
    if (cut) throw std::runtime_error("connection timed out");
    return HashStore::add(key, value);
  }
};

TEST(Heartbeats, AProcessThatReachesNoStoreIsCutOffAndJudgesNobody) {
  auto store = c10::make_intrusive<UnreachableStore>();
  const std::vector<MemberRecord> members = {record(0), record(1)};
  for (int rank : {0, 1}) store->add(Heartbeats::key(record(rank)), 1);
  Heartbeats beats(store, record(0), 300ms, "10.0.0.1:29500");
  beats.watch(0, members);
  beats.round();
  store->cut = true;
  const auto begun = Clock::now();
  while (beats.cut_off().empty() && Clock::now() - begun < 5s) {
    EXPECT_THROW(beats.round(), std::runtime_error);
    std::this_thread::sleep_for(50ms);
  }
  const std::string cut = beats.cut_off();
  EXPECT_NE(cut.find("store at 10.0.0.1:29500"), std::string::npos) << cut;
  EXPECT_NE(cut.find("cut off"), std::string::npos) << cut;
  EXPECT_NE(beats.verdict(0).find("cut off"), std::string::npos);
  EXPECT_FALSE(beats.lost(record(1))) << "a process cut off judged another lost";
  // Back: the next round that goes through ends it.
  store->cut = false;
  beats.round();
  EXPECT_EQ(beats.cut_off(), "");
  // Retired (training over): no more verdicts.
  beats.retire();
  std::this_thread::sleep_for(350ms);
  EXPECT_EQ(beats.verdict(0), "");
  EXPECT_EQ(beats.cut_off(), "");
}

// Note [A link cut between members]: what a record carries survives the store.
TEST(MemberRecord, KnockAddressAndUnreachableMembersRoundTrip) {
  MemberRecord r = record(3, /*newcomer=*/true);
  EXPECT_EQ(MemberRecord::parse(r.text()).text(), r.text());
  r.knock_address = "10.77.0.3";
  r.knock_port = 40123;
  r.unreachable = {record(1).id(), record(2).id()};
  const MemberRecord back = MemberRecord::parse(r.text());
  EXPECT_EQ(back.knock_address, "10.77.0.3");
  EXPECT_EQ(back.knock_port, 40123);
  EXPECT_EQ(back.unreachable, r.unreachable);
  EXPECT_TRUE(back.newcomer);
  EXPECT_THROW(MemberRecord::parse("3 host 42 1 0"), InternalError);
}

// Of each pair that cannot reach each other, the one in the most pairs goes, the higher rank of
// equals: a cut between two hosts keeps the side with more members.
TEST(MemberRecord, AGenerationClosesWithoutOneOfEachPairThatCannotReachEachOther) {
  auto cut = [](MemberRecord a, const MemberRecord& b) {
    a.unreachable.push_back(b.id());
    return a;
  };
  // Three hosts, one member each; the link between hosts 1 and 2 is cut, and only rank 1 noticed.
  EXPECT_EQ(ranks_of(without_cut_pairs({record(0), cut(record(1), record(2)), record(2)})),
            (std::vector<int>{0, 1}));
  // Nothing cut: all stay, in order.
  EXPECT_EQ(ranks_of(without_cut_pairs({record(0), record(1), record(2)})),
            (std::vector<int>{0, 1, 2}));
  // Two hosts of two members each and a host of one, cut from both of the others' second host
  // (ranks 2 and 3 on it): rank 4 is in two pairs and goes, and nobody else.
  EXPECT_EQ(ranks_of(without_cut_pairs({record(0), record(1), record(2), record(3),
                                        cut(cut(record(4), record(2)), record(3))})),
            (std::vector<int>{0, 1, 2, 3}));
  // Hosts A (ranks 0, 1) and B (ranks 2, 3) cut from each other: all of B goes.
  auto a0 = cut(cut(record(0), record(2)), record(3));
  auto a1 = cut(cut(record(1), record(2)), record(3));
  EXPECT_EQ(ranks_of(without_cut_pairs({a0, a1, record(2), record(3)})), (std::vector<int>{0, 1}));
}

// A member whose waits stall knocks at the others: one that refuses (nothing listens at its
// address) is reported, and one that answers is not. No stall, no knock.
TEST(Heartbeats, AStalledWaitKnocksAtTheMembersAndNamesOneThatCannotBeReached) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  elastic::KnockTarget listening("127.0.0.1");
  int closed_port = 0;
  {
    elastic::KnockTarget gone("127.0.0.1");
    closed_port = gone.port();
  }
  MemberRecord answering = record(1), refusing = record(2);
  answering.knock_address = refusing.knock_address = "127.0.0.1";
  answering.knock_port = listening.port();
  refusing.knock_port = closed_port;
  const std::vector<MemberRecord> members = {record(0), answering, refusing};
  for (const auto& m : members) store->add(Heartbeats::key(m), 1);
  Heartbeats beats(store, record(0), 300ms, "test:0");
  beats.watch(0, members);
  // The others' heartbeats go on throughout: only a knock can tell.
  auto others_beat = [&] {
    store->add(Heartbeats::key(answering), 1);
    store->add(Heartbeats::key(refusing), 1);
  };
  // Rounds without a wait asking: no knock, whatever the time.
  for (int round = 0; round < 8; ++round) {
    others_beat();
    beats.round();
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(beats.unreachable().empty()) << "knocked with no wait stalled";
  // A wait that asks every 50 ms (as a slow collective's does), for an operation issued now: after
  // lost_after, the knock.
  std::string verdict;
  const auto stalled = Clock::now();
  for (int round = 0; round < 100 && verdict.empty(); ++round) {  // 5 s at most
    others_beat();
    beats.round();
    listening.drain();
    std::this_thread::sleep_for(50ms);
    verdict = beats.verdict(0, stalled);
  }
  EXPECT_GE(Clock::now() - stalled, 300ms) << "knocked before the wait had stalled lost_after";
  EXPECT_NE(verdict.find("rank 2"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("refused a connection at 127.0.0.1:" + std::to_string(closed_port)),
            std::string::npos)
      << verdict;
  EXPECT_EQ(beats.unreachable(), std::vector<std::string>{refusing.id()});
  // A member that finished training (its counter retired) may have exited: no failure.
  store->set(Heartbeats::key(refusing), std::vector<uint8_t>{'d', 'o', 'n', 'e'});
  beats.round();
  EXPECT_EQ(beats.verdict(0), "");
}

// A port on loopback that answers no knock, as a host behind a cut link does: a listener with a
// backlog of 0 whose one queued connection is never accepted, so the kernel drops every further
// SYN (no refusal, no reset).
class SilentPort {
 public:
  SilentPort() {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    bind(listener_, reinterpret_cast<sockaddr*>(&address), length);
    listen(listener_, 0);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    connect(filler_, reinterpret_cast<sockaddr*>(&address), length);  // fills the queue
  }
  ~SilentPort() {
    close(filler_);
    close(listener_);
  }
  int port() const { return port_; }

 private:
  int listener_ = socket(AF_INET, SOCK_STREAM, 0);
  int filler_ = socket(AF_INET, SOCK_STREAM, 0);
  int port_ = 0;
};

// Rank 0 (this process) and rank 1, whose knocks go to `silent`, both with heartbeat counters.
std::vector<MemberRecord> with_a_silent_member(c10d::Store& store, const SilentPort& silent) {
  MemberRecord cut = record(1);
  cut.knock_address = "127.0.0.1";
  cut.knock_port = silent.port();
  const std::vector<MemberRecord> members = {record(0), cut};
  for (const auto& m : members) store.add(Heartbeats::key(m), 1);
  return members;
}

// Note [A link cut between members]: a member that answers no knock while its heartbeats go on is
// named as cut from this one; for a wait on a later operation that answer is stale (the link may be
// back) and judges nothing until the next knock.
TEST(Heartbeats, AMemberThatAnswersNoKnockIsCutAndTheAnswerGoesStaleAfterTheStall) {
  SilentPort silent;
  ASSERT_EQ(elastic::knock("127.0.0.1", silent.port(), 500ms), elastic::Knock::kSilent)
      << "this kernel answers a full listener's SYNs: nothing here is silent";
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> members = with_a_silent_member(*store, silent);
  const MemberRecord& cut = members[1];
  Heartbeats beats(store, record(0), 300ms, "test:0");
  beats.watch(0, members);
  // A stalled wait (asks every 50 ms, with a late one of 250 ms, as on a busy machine: a gap that
  // must not restart the stall), the other's heartbeats going on, until the knock's answer.
  std::string verdict;
  const auto stalled = Clock::now();
  for (int round = 0; round < 200 && verdict.empty(); ++round) {  // 10 s at most
    store->add(Heartbeats::key(cut), 1);
    beats.round();
    std::this_thread::sleep_for(round == 4 ? 250ms : 50ms);
    verdict = beats.verdict(0, stalled);
  }
  EXPECT_GE(Clock::now() - stalled, Heartbeats::kKnockTimeout) << "judged before the knock's time";
  EXPECT_NE(verdict.find("rank 1"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("answered no connection at 127.0.0.1:" + std::to_string(silent.port())),
            std::string::npos)
      << verdict;
  EXPECT_NE(verdict.find("is cut"), std::string::npos) << verdict;
  EXPECT_EQ(beats.unreachable(), std::vector<std::string>{cut.id()});
  // A wait for an operation issued after that knock began: the answer is stale (the link may be
  // back), until a knock of its own.
  store->add(Heartbeats::key(cut), 1);
  beats.round();
  EXPECT_EQ(beats.verdict(0, Clock::now()), "");
  EXPECT_TRUE(beats.unreachable().empty());
  // Before a new generation connects, a knock on the spot finds it again.
  const std::string now = beats.knock_now();
  EXPECT_NE(now.find("answered no connection"), std::string::npos) << now;
  EXPECT_EQ(beats.unreachable(), std::vector<std::string>{cut.id()});
}

// A knock cut short judges nothing, and a process on its way out does not wait out its 3.5 s:
// knock_each() gives up within a slice of 100 ms, and so does a Heartbeats destroyed while its
// watcher's knock is in flight (the future's destructor waits for it).
TEST(Heartbeats, AKnockInFlightEndsSoonWhenGivenUp) {
  SilentPort silent;
  ASSERT_EQ(elastic::knock("127.0.0.1", silent.port(), 500ms), elastic::Knock::kSilent)
      << "this kernel answers a full listener's SYNs: nothing here is silent";
  const auto targets = std::vector<std::vector<elastic::SocketAddress>>{
      elastic::resolve_addresses("127.0.0.1", silent.port())};
  std::atomic<bool> give_up{false};
  auto begun = Clock::now();
  auto knocking = std::async(std::launch::async, [&] {
    return elastic::knock_each(targets, Heartbeats::kKnockTimeout, [&] { return give_up.load(); });
  });
  std::this_thread::sleep_for(200ms);
  give_up = true;
  EXPECT_EQ(knocking.get(), std::vector<elastic::Knock>{elastic::Knock::kUnknown});
  EXPECT_LT(Clock::now() - begun, 1500ms) << "the knock waited on after it was given up";

  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<MemberRecord> members = with_a_silent_member(*store, silent);
  {
    Heartbeats beats(store, record(0), 300ms, "test:0");
    beats.watch(0, members);
    const auto stalled = Clock::now();
    // Rounds of a stalled wait until the watcher's knock is in flight (lost_after, 300 ms).
    for (int round = 0; round < 10; ++round) {
      beats.round();
      beats.verdict(0, stalled);
      std::this_thread::sleep_for(50ms);
    }
    beats.round();
    begun = Clock::now();
  }
  EXPECT_LT(Clock::now() - begun, 1500ms) << "destroying the heartbeats waited for the knock";
}

// An address every host has (docker0's, loopback) given by members on two hosts is a setting to
// mend, named with both members; on one host, or where a member listens nowhere, it is fine.
TEST(MemberRecord, TheSameAddressOnTwoHostsIsASettingToMend) {
  MemberRecord a = record(0), b = record(1), c = record(2);
  a.knock_address = b.knock_address = c.knock_address = "172.17.0.1";
  b.host = "other-host";
  const std::string problem = shared_address_problem({a, b});
  EXPECT_NE(problem.find(a.label()), std::string::npos) << problem;
  EXPECT_NE(problem.find(b.label()), std::string::npos) << problem;
  EXPECT_NE(problem.find("both give 172.17.0.1"), std::string::npos) << problem;
  EXPECT_NE(problem.find("GLOO_SOCKET_IFNAME"), std::string::npos) << problem;
  EXPECT_EQ(shared_address_problem({a, c}), "") << "two ranks of one host share its address";
  b.knock_address = "10.77.0.2";
  EXPECT_EQ(shared_address_problem({a, b, c}), "");
  a.knock_address = b.knock_address = "";
  b.host = c.host = "other-host";
  EXPECT_EQ(shared_address_problem({a, b}), "") << "members that listen nowhere";
}

TEST(MemberRecord, TheStoresHostIsNeverTheOneLeftOut) {
  MemberRecord r0 = record(0), r1 = record(1), r2 = record(2);
  r1.unreachable = {r0.id()};
  r2.unreachable = {r0.id()};
  // Rank 0 is cut from both others: it would go, but it hosts the store.
  EXPECT_EQ(ranks_of(without_cut_pairs({r0, r1, r2}, /*store_holder=*/0)), (std::vector<int>{0}));
  EXPECT_EQ(ranks_of(without_cut_pairs({r0, r1, r2})), (std::vector<int>{1, 2}));
}

}  // namespace
}  // namespace dtrain::detail
