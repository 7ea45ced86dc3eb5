// The store protocol of in-place recovery (src/recovery/membership.h), tier 1: members as threads
// over one in-memory store, each with a record of its own (threads share a pid, so the records
// carry made-up pids and a host name no process here has, unless a test wants the pid check).
#include "recovery/membership.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
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

  member0.mark_finished();
  Membership late(store, record(3, /*newcomer=*/true), 10s);
  EXPECT_EQ(late.wait_for_admission(late.request_admission()), std::nullopt);
}

}  // namespace
}  // namespace dtrain::detail
