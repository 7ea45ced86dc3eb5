// Who belongs to each generation of a group that recovers in place, agreed through the job's store
// (Note [In-place recovery], dtrain/recovery.h). Keys, all under "dtrain/recovery/":
//   g<G>/arrivals       counter of the processes that registered for generation G
//   g<G>/arrival/<n>    the n-th one's record (MemberRecord::text)
//   g<G>/closed         the generation's members, one record per line, in rank order: written once
//                       (compare-and-set), by whichever member first sees it complete
//   newcomers           counter of the newcomers that asked to be admitted
//   admit/<k>           the generation newcomer k joins, written by the members that admit it
//   finished            written when training is over: a newcomer still waiting has nothing to join
// Only check(), add() and compare-and-set are used while waiting, never a blocking get() of a key
// that a dead process may never write: every wait is a bounded poll.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace dtrain::detail {

// One process as the store knows it.
struct MemberRecord {
  int job_rank = 0;  // its RANK (a newcomer has the RANK of the worker it replaces)
  std::string host;  // its hostname
  int pid = 0;
  uint64_t pid_namespace = 0;  // a pid means something only within the same pid namespace
  bool newcomer = false;       // admitted in this generation (it holds no state yet)

  static MemberRecord of_this_process(int job_rank, bool newcomer);
  std::string text() const;
  static MemberRecord parse(const std::string& text);
  bool same_process(const MemberRecord& other) const {
    return host == other.host && pid == other.pid && pid_namespace == other.pid_namespace;
  }
  // True only when the process is on this host, in this pid namespace, and gone.
  bool seen_dead() const;
  std::string label() const;  // "rank 2 (pid 4242 on hostA)"
};

class Membership {
 public:
  Membership(c10::intrusive_ptr<c10d::Store> root_store, MemberRecord self,
             std::chrono::milliseconds timeout);

  // Registers this process for generation `generation` and blocks until its membership is closed;
  // returns the members in rank order. It closes when `previous` members and `newcomers` more have
  // come, or, given `settle`, once every missing member of `previous` is seen dead and the
  // newcomers have come, or `settle` after this process registered. Without `settle` (the first
  // generation) it waits for everyone up to the timeout and then throws TimeoutError naming the
  // job ranks that never came. Throws CommError if it closed without this process (it came late).
  std::vector<MemberRecord> form(int64_t generation, const std::vector<MemberRecord>& previous,
                                 int newcomers, std::optional<std::chrono::milliseconds> settle);

  // After its first generation a newcomer is a member like any other.
  void joined();

  // Newcomer side: asks to be admitted (returns its number k), then waits up to the timeout for
  // the generation that admits it; nullopt when the job finished first (nothing left to join).
  int64_t request_admission();
  std::optional<int64_t> wait_for_admission(int64_t number);
  // Member side, at the end of training: tells newcomers still waiting that there is nothing left.
  void mark_finished();

  // Member side: how many newcomers have asked so far (one store round trip; thread-safe as the
  // store is), and the admission of numbers first..last into `generation`.
  int64_t newcomers_requested();
  void admit(int64_t first, int64_t last, int64_t generation);
  // Whether any process has registered for `generation` (one store check).
  bool started(int64_t generation);

 private:
  std::string key(const std::string& name) const { return "dtrain/recovery/" + name; }
  bool exists(const std::string& name);
  std::string read(const std::string& name);
  void write(const std::string& name, const std::string& value);

  c10::intrusive_ptr<c10d::Store> store_;
  MemberRecord self_;
  std::chrono::milliseconds timeout_;
};

}  // namespace dtrain::detail
