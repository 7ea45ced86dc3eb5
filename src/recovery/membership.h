// Who belongs to each generation of a group that recovers in place, agreed through the job's store
// (Note [In-place recovery], dtrain/recovery.h). Keys, all under "dtrain/recovery/":
//   g<G>/arrivals       counter of the processes that registered for generation G
//   g<G>/arrival/<n>    the n-th one's record (MemberRecord::text)
//   g<G>/closed         the generation's members, one record per line, in rank order: written once
//                       (compare-and-set), by whichever member first sees it complete
//   g<G>/failed         written by a member that abandoned generation G-1 after a failure, before
//                       it registers: the others stop waiting on G-1's collectives (Note
//                       [Heartbeats])
//   g<G>/newcomers      how many newcomers the members admitted into generation G (admit())
//   latest              the last generation that closed (a newcomer knocks at its members first:
//                       Note [A link cut between members])
//   newcomers           counter of the newcomers that asked to be admitted
//   admit/<k>           the generation newcomer k joins, written by the members that admit it
//   finished            written when training is over (or every member stops on SIGTERM): a
//                       newcomer still waiting has nothing to join
//   completed           written with finished when training is over (not when the job stops)
//   done/<host>/<process group>/<pid namespace>
//                       written by each member as it enters the end (finish()): once the job
//                       completed, its launcher kills a worker still running without it and
//                       restarts none (src/launcher/cli/in_place_recovery.cpp)
//   beat/<host>/<pid>/<pid namespace>
//                       a process's heartbeat counter (Heartbeats below), created when it registers
//   exited/<host>/<pid>/<pid namespace>
//                       written by the launcher that reaped that process after it failed (`dtrain
//                       run --recovery in-place`, src/launcher/cli/in_place_recovery.cpp): it is
//                       dead, on whichever host it ran (Note [Heartbeats]); the value says how it
//                       ended
// Only check(), add() and compare-and-set are used while waiting, never a blocking get() of a key
// that a dead process may never write: every wait is a bounded poll.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "launcher/elastic/ports.h"

namespace dtrain::detail {

// One process as the store knows it.
struct MemberRecord {
  int job_rank = 0;  // its RANK (a newcomer has the RANK of the worker it replaces)
  std::string host;  // its hostname
  int pid = 0;
  uint64_t pid_namespace = 0;  // a pid means something only within the same pid namespace
  bool newcomer = false;       // admitted in this generation (it holds no state yet)
  // Where it listens for knocks (Note [A link cut between members]): the address its group's
  // transport uses, and a port of its own; port 0 when it has none.
  std::string knock_address;
  int knock_port = 0;
  // The members of the generation it left that it found it cannot reach (their id()s): registered
  // with it, so that the next generation is closed without a pair that cannot connect.
  std::vector<std::string> unreachable;

  static MemberRecord of_this_process(int job_rank, bool newcomer);
  std::string text() const;
  static MemberRecord parse(const std::string& text);
  bool same_process(const MemberRecord& other) const {
    return host == other.host && pid == other.pid && pid_namespace == other.pid_namespace;
  }
  // "<host>/<pid>/<pid namespace>": names the process among every host's.
  std::string id() const;
  // True only when the process is on this host, in this pid namespace, and gone.
  bool seen_dead() const;
  std::string label() const;  // "rank 2 (pid 4242 on hostA)"
};

// Note [Heartbeats]
// A dead process resets its connections and is seen at once (by its peers' transport, or by its pid
// on this host); a lost host or a cut link resets nothing, and Gloo would wait for it until the
// timeout. So every member proves it is alive through the store that outlives the workers: a
// thread of its own (RecoveryCore's watcher, every ~100 ms) adds 1 to its counter
// "beat/<host>/<pid>/<pid namespace>" and reads the counters of the members of the generation it
// watches, on a store connection of its own, so that a store call stuck on a cut link holds up
// neither the training thread nor its store. Judged by this process's own clock, never by
// comparing clocks between hosts:
// - a member whose counter has not moved for `lost_after`, while this process's own rounds went
//   through, is lost (its host is gone, or cut off from the store);
// - when this process's own rounds have failed or hung for `lost_after`, it is cut off itself (or
//   the store's host is lost), and judges nobody else: the side of a partition that keeps the
//   store goes on, the other stops.
// - when a member has marked the next generation "failed" (it abandoned this one after a failure,
//   e.g. its connection to a dead peer was reset), this process stops waiting on this generation's
//   collectives too: a peer that has left will never finish them. (Else a member waiting on a peer
//   that abandoned, not on the dead one, would wait for the timeout and come after `settle`.)
// A process that dies resets its connections, so its peers' collectives fail at once; but the next
// generation's membership must also know that it will not register. On this host its pid says so
// (MemberRecord::seen_dead); on another host its launcher, which reaps it at once, writes
// "exited/<host>/<pid>/<pid namespace>" into the store, and form() reads that key for a missing
// member: the survivors do not wait min(`settle`, `lost_after`) for a process that is known dead.
// (A process with no launcher of dtrain's, or one that a wrapper script runs under another pid,
// has no such notice: it is waited for as before.) A process deletes a notice under its own name
// when it registers: pids are reused, and an earlier process's death is not this one's.
// Being ready costs the training thread nothing: verdict() reads what the last rounds saw (no store
// call), and it is asked only while a wait on Gloo is slow (GroupState::abandon_check). A member
// that finished training retires its counter ("done"), so that a slower peer's last collectives do
// not count it lost.
//
// Note [A link cut between members]
// A link cut between two members' hosts while both still reach the store resets nothing and stops
// no heartbeat: without more, the collective waits for the group's timeout, and the next
// generation, with both members in it, could not connect. So every member listens for knocks on
// the address its group's Gloo transport uses (a port of its own, in its MemberRecord). The kernel
// completes a knock's handshake for a listening program however busy it is, so a knock that nobody
// answers within kKnockTimeout (three SYNs) while the member's heartbeats go on means the network
// between the two hosts is cut (a refusal: its process is gone, or a firewall rejects it; a knock
// this process could not even try, out of sockets, judges nobody). Knocks happen:
// - during training, when the collective this process waits for was issued `lost_after` ago and
//   has not finished (verdict() is asked every 100 ms while a Gloo wait is slow, and told when the
//   operation was issued): its watcher knocks at every member it watches, at once, and again every
//   `lost_after` while the wait lasts. A member that answered nothing is named in the verdict,
//   which abandons the wait; an answer from a knock begun before the operation was issued is stale
//   and judges nothing. A collective slower than `lost_after` costs one connection per member
//   every `lost_after`, nothing else;
// - before every generation connects (knock_now(), on the training thread; the first one too,
//   which then re-forms as any other): Gloo's connection of every pair asks nothing while it
//   waits, so a pair cut while the generation formed (or before the job started), or a newcomer
//   the members cannot reach, is found first. That member does not come to the meeting (whose
//   waits ask), and the others stop on the failed mark it leaves.
// The member that found it registers for the next generation with the members it cannot reach
// (MemberRecord::unreachable). The member that closes it leaves out, of each pair that cannot
// reach each other, the one in the most such pairs, the higher job rank of equals, never the
// process that hosts the store (without_cut_pairs): a host cut from the others leaves with all its
// ranks. The one left out is told why, exits, and its launcher restarts it as a newcomer; a
// newcomer knocks at the members of the last generation ("latest") before it asks to be admitted,
// and waits while one does not answer: it rejoins when the link is back. The knocks test Gloo's
// network only (the members' Gloo addresses): NCCL's network may be another (InfiniBand), and a
// cut of it alone waits for the collective's timeout. A newcomer's gate knocks from it
// to the members only: a new node that the members cannot reach (a firewall that drops what comes
// in) is found by the knock before its first generation connects, and left out again.
class Heartbeats {
 public:
  // `store`: a connection of its own where the store allows (c10d::Store::clone()). `where`: the
  // store's address, for messages ("10.77.0.1:29500").
  Heartbeats(c10::intrusive_ptr<c10d::Store> store, MemberRecord self,
             std::chrono::milliseconds lost_after, std::string where);
  ~Heartbeats() { knocks_given_up_ = true; }

  // The counter of `member`, under "dtrain/recovery/".
  static std::string key(const MemberRecord& member);
  // Where `member`'s launcher says that it exited (the store's key, as key() is).
  static std::string exit_key(const MemberRecord& member);

  // From now on, watches the members of `generation` (their clocks start now).
  void watch(int64_t generation, const std::vector<MemberRecord>& members);
  // One round (the watcher thread): beats, reads the watched members' counters, whether a member
  // marked the next generation failed, and how many newcomers asked. Throws what the store throws;
  // a round that throws or hangs counts against this process only.
  void round();
  // After training, with no round running: marks this process's counter "done" (one store call;
  // errors are ignored); verdict() and cut_off() answer "" from then on.
  void retire();
  // A member that leaves the job (Note [Leaving in place], dtrain/recovery.h), with no round
  // running: writes its own exit notice (`how` it ended, as a launcher writes one for a process it
  // reaped), first, then retires. One store call each, on this connection's short timeout.
  void leave(const std::string& how);
  // What a member that leaves on SIGTERM (Note [Leaving in place]) writes as `how`: the notice
  // that tells a departure from a failure (Membership::departed).
  static constexpr const char* kLeftOnSigterm = "left on SIGTERM";

  // Thread-safe, no store call: "" while the operations of `generation`'s group should go on, else
  // why to abandon them: this process is cut off, a member is lost, or a member abandoned this
  // generation after a failure.
  // `waiting_since`: when the operation the caller waits for was issued (Note [A link cut between
  // members]: one that has not finished for lost_after makes the watcher knock); the default, now,
  // is a caller that is not waiting.
  std::string verdict(int64_t generation, std::chrono::steady_clock::time_point waiting_since =
                                              std::chrono::steady_clock::time_point::max()) const;
  // Whether `member` of the watched generation is lost (its counter stale for lost_after).
  bool lost(const MemberRecord& member) const;
  // "" unless this process has reached the store in no round for lost_after; then why it stops.
  std::string cut_off() const;
  // The newcomer count the last round read.
  int64_t newcomers_seen() const { return newcomers_seen_.load(); }
  // The members of the watched generation that the last knock found unreachable (their id()s):
  // Note [A link cut between members]. Thread-safe, no store call.
  std::vector<std::string> unreachable() const;
  // Knocks at every watched member now, on the calling thread (at most kKnockTimeout), and keeps
  // the answers as the watcher's are kept: "" when all answered, else why one cannot be reached.
  // Before a new generation connects: Gloo's connection asks nothing while it waits.
  std::string knock_now();

  // How long a knock waits for an answer: the first SYN and two retransmissions (at 1 s and 3 s),
  // so that a busy link that drops a SYN or two is not taken for a cut one.
  static constexpr std::chrono::milliseconds kKnockTimeout{3500};

 private:
  using Clock = std::chrono::steady_clock;
  struct Watched {
    MemberRecord record;
    std::string key;
    std::vector<uint8_t> count;                    // as last read
    Clock::time_point moved;                       // when it last changed, by this process's clock
    std::vector<elastic::SocketAddress> knock_at;  // where it listens for knocks (none: empty)
    elastic::Knock knocked = elastic::Knock::kAccepted;  // the last knock's answer
    Clock::time_point knocked_at;                        // when that knock began
    bool said = false;  // its being unreachable is in the log (once per finding)
  };
  std::string lost_text(const Watched& w, Clock::time_point now) const;
  // The watcher's part of Note [A link cut between members]: takes a finished knock's answers, or
  // starts one when the waits have stalled for lost_after. No store call; never blocks.
  void knock_if_stalled(Clock::time_point now);
  // Keeps the answers of a knock of `generation` begun at `begun` (with mutex_ held); says in the
  // log who answered nothing.
  void take_answers(int64_t generation, Clock::time_point begun,
                    const std::vector<elastic::Knock>& answers);
  // Whether `w`'s last knock says it cannot be reached now (with mutex_ held): an answer from a
  // knock begun before the operation waited for now was issued is stale (the link may have come
  // back since).
  bool unreachable_now(const Watched& w) const;
  std::string unreachable_text(const Watched& w) const;

  c10::intrusive_ptr<c10d::Store> store_;
  const MemberRecord self_;
  const std::string self_key_;
  const std::chrono::milliseconds lost_after_;
  const std::string where_;
  mutable std::mutex mutex_;  // guards the members below; never held across a store call
  int64_t generation_ = -1;
  std::vector<Watched> watched_;
  bool retired_ = false;       // retire() was called: no more rounds, no verdicts
  bool next_failed_ = false;   // generation_ + 1 marked failed (read by the last round)
  Clock::time_point reached_;  // the end of the last round that went through
  std::atomic<int64_t> newcomers_seen_{0};
  // What the last verdict() was asked about: the operation waited for, issued at waiting_since_,
  // and when it was asked (a wait asks every InFlight::kAbandonSlice, 100 ms, while it lasts).
  mutable Clock::time_point waiting_since_ = Clock::time_point::max(), asked_last_;
  Clock::time_point knocked_at_;  // when the watcher's last knock began
  // Set on destruction, so that a knock in flight ends within 100 ms instead of its 3.5 s: the
  // future's destructor waits for it, and a process on its way out should not. Declared before the
  // future, so that it outlives the knock.
  std::atomic<bool> knocks_given_up_{false};
  std::future<std::vector<elastic::Knock>> knocking_;  // the knock in flight, if valid()
  int64_t knocking_generation_ = -1;
};

// `members` less, of each pair where one registered that it cannot reach the other, the one in the
// most such pairs (of equals, the higher job rank; a newcomer after the others), never the one of
// job rank `store_holder` (the process that hosts the job's store: -1 when a launcher does): Note
// [A link cut between members]. The order of the others is kept.
std::vector<MemberRecord> without_cut_pairs(std::vector<MemberRecord> members,
                                            int store_holder = -1);

// "" unless two of `members` on different hosts publish the same address (where their Gloo
// transport and their knocks listen): an address that every host has, as a container bridge's
// (docker0's 172.17.0.1) or loopback, picked by GLOO_SOCKET_IFNAME or by the route to
// MASTER_ADDR. It reaches no other host, and every knock at it would find the asking host's own
// interface and be refused, which reads as a cut: a setting to mend, not a fault to recover from.
// Else why, naming both members and what to set.
std::string shared_address_problem(const std::vector<MemberRecord>& members);

class Membership {
 public:
  Membership(c10::intrusive_ptr<c10d::Store> root_store, MemberRecord self,
             std::chrono::milliseconds timeout);

  // Where the members' heartbeats are read (Note [Heartbeats]): form() no longer waits for a
  // member they show lost, and registering creates this process's counter.
  void use_heartbeats(std::shared_ptr<const Heartbeats> heartbeats) {
    heartbeats_ = std::move(heartbeats);
  }

  // Registers this process for generation `generation` and blocks until its membership is closed;
  // returns the members in rank order. It closes when `previous` members and `newcomers` more (or
  // as many as the others admitted into it, if more) have come, or, given `settle`, once every
  // missing member of `previous` is seen dead (its pid on this host, its launcher's exit notice,
  // or its heartbeat stale: Note [Heartbeats]) and the newcomers have come, or `settle` after this
  // process registered. Without `settle` (the first generation) it waits for everyone up to the
  // timeout and then throws TimeoutError naming the job ranks that never came. Throws CommError if
  // it closed without this process (it came late).
  std::vector<MemberRecord> form(int64_t generation, const std::vector<MemberRecord>& previous,
                                 int newcomers, std::optional<std::chrono::milliseconds> settle);

  // The members this process found it cannot reach (MemberRecord::unreachable, Note [A link cut
  // between members]), registered with it from the next form() on.
  void report_unreachable(std::vector<std::string> ids) { self_.unreachable = std::move(ids); }

  // After its first generation a newcomer is a member like any other.
  void joined();

  // Newcomer side: asks to be admitted (returns its number k), then waits up to the timeout for
  // the generation that admits it; nullopt when the job finished first (nothing left to join).
  int64_t request_admission();
  // Newcomer side, before it asks: knocks at the members of the last generation that closed (not
  // at the process it replaces), and waits while one does not answer, up to the timeout (Note [A
  // link cut between members]); says once in the log whom it waits for. kReady at once when no
  // generation has closed yet; kJobFinished when the job finished first (nothing left to join);
  // kStopRequested when `stop_requested` says so first (SIGTERM: it leaves without having asked).
  enum class Readiness { kReady, kJobFinished, kStopRequested };
  Readiness wait_until_members_answer(const std::function<bool()>& stop_requested);
  std::optional<int64_t> wait_for_admission(int64_t number);
  // Member side, on entering the end (finish()): this process takes part in it ("done/...": once
  // the job completed, a launcher kills a worker still running without it, left out while it
  // stalled).
  void mark_done();
  // Member side, at the end of training (`completed`) or of a stop that every member agreed to:
  // tells newcomers still waiting that there is nothing left, members whose end-of-training
  // barrier failed that another member's completed, and the launchers that training is over.
  void mark_finished(bool completed);
  // Whether a member marked the job finished. Throws when the store does not answer.
  bool finished() { return exists("finished"); }
  // Whether training completed (not a stop that every member agreed to). Throws likewise.
  bool completed() { return exists("completed"); }

  // Member side, before registering for `generation` after a failure: marks it failed, so that the
  // members still waiting on the last generation's collectives stop (Note [Heartbeats]).
  void mark_failed(int64_t generation);

  // Member side: how many newcomers have asked so far (one store round trip; thread-safe as the
  // store is), and the admission of numbers first..last into `generation` (written before this
  // member registers for it, so that form() on a member that missed the admission waits for them).
  int64_t newcomers_requested();
  void admit(int64_t first, int64_t last, int64_t generation);
  // Whether any process has registered for `generation` (one store check).
  bool started(int64_t generation);
  // The members of `previous` missing from `members` that left on SIGTERM (their own exit notice
  // says Heartbeats::kLeftOnSigterm), not those that failed: RecoveryStats::departed counts these,
  // whichever re-formation found them gone. A store check per missing member.
  std::vector<MemberRecord> departed(const std::vector<MemberRecord>& previous,
                                     const std::vector<MemberRecord>& members);

 private:
  std::string key(const std::string& name) const { return "dtrain/recovery/" + name; }
  bool exists(const std::string& name);
  std::string read(const std::string& name);
  void write(const std::string& name, const std::string& value);

  c10::intrusive_ptr<c10d::Store> store_;
  MemberRecord self_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const Heartbeats> heartbeats_;
};

}  // namespace dtrain::detail
