// --recovery in-place (see in_place_recovery.h).
#include "launcher/cli/in_place_recovery.h"

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <thread>
#include <utility>

#include "common/process_identity.h"
#include "dtrain/exit_codes.h"  // kLeftExitCode
#include "launcher/cli/run_command.h"

namespace dtrain::cli {

using elastic::WaitResult;
using elastic::WorkerExit;

namespace {

bool readable(int fd) {
  struct pollfd p {
    fd, POLLIN, 0
  };
  return poll(&p, 1, 0) > 0;
}

// The key the workers' first in-place generation writes when it forms (src/recovery/membership.h):
// its presence says the program recovers in place (dtrain::ResilientDataParallel). As the store
// holds it: c10d's client puts "/" before every key.
constexpr const char* kInPlaceGroupFormed = "/dtrain/recovery/g0/closed";
// Written by the members once training is over (ResilientDataParallel::finish(); not when they
// stop together on SIGTERM), each also under kDonePrefix + "<host>/<process group>/<pid
// namespace>": the worker this launcher started, whose pid is its process group's.
constexpr const char* kJobCompleted = "/dtrain/recovery/completed";
constexpr const char* kDonePrefix = "/dtrain/recovery/done/";

std::string done_key(pid_t worker) { return kDonePrefix + detail::process_key(worker); }

// A call into node 0's store (a worker's exit notice, the question whether the workers recover in
// place) costs at most this much when that store is out of reach (the link to node 0 is cut): the
// survivors then tell a death by its heartbeat.
constexpr auto kStoreCallTimeout = std::chrono::seconds(1);
// How long another node's launcher waits for node 0's store to come up (see
// ask_whether_group_formed): node 0's launcher hosts it as soon as it has its round.
constexpr auto kStoreStartTimeout = std::chrono::seconds(10);

}  // namespace

InPlaceRecovery::InPlaceRecovery(bool auto_port, RestartBudget& restarts, bool one_node_job)
    : auto_port_(auto_port), restarts_(restarts), one_node_job_(one_node_job) {}

void InPlaceRecovery::prepare(elastic::WorkerGroupRound& round) {
  round.agent_store = true;
  // The round says which node is node 0: under an elastic rendezvous that may change from round to
  // round, so a store of this node's is dropped whatever this round makes of it (its port is free
  // again for the new one, and its keys belong to the last round's generations).
  store_.reset();
  formed_answer_.reset();
  finished_seen_.reset();
  killed_stragglers_.clear();
  exit_code_after_completion_ = 0;
  if (round.group_rank != 0) return;
  // A job of one node for good: the address the workers are given (loopback on a static node);
  // else every interface, as rank 0's TCPStore listens, also while an elastic round has one node
  // (a node that joins it in place reaches the store from elsewhere).
  store_ = std::make_unique<elastic::WorkerStore>(one_node_job_ ? round.master_addr : "",
                                                  auto_port_ ? 0 : round.master_port);
  round.master_port = store_->port();
}

bool InPlaceRecovery::group_formed() const {
  return store_ != nullptr && store_->contains(kInPlaceGroupFormed);
}

bool InPlaceRecovery::group_formed_in(const elastic::WorkerGroupRound& round) const {
  if (round.group_rank == 0) return group_formed();
  return elastic::check_in_worker_store(round.master_addr, round.master_port, kInPlaceGroupFormed,
                                        kStoreCallTimeout) == elastic::KeyCheck::kPresent;
}

// The notice of a death (Note [Heartbeats], src/recovery/membership.h): a survivor on another host
// cannot check the dead worker's pid, and would otherwise wait for it min(settle, lost_after),
// about 2 s, before going on without it. The key names the process as its membership record does:
// this host's name, its pid (the launcher execs the program itself, so the pid is the worker's)
// and the pid namespace; the value says how it ended.
void InPlaceRecovery::announce_exits(const elastic::WorkerGroupRound& round,
                                     const WaitResult& ended) {
  std::vector<std::pair<std::string, std::string>> notices;
  std::string ranks;
  for (const WorkerExit& failure : ended.failures) {
    // One that left the job (Note [Leaving in place]) wrote its own notice, which says so: the
    // others count it as departed, not failed (Membership::departed).
    if (failure.signal == 0 && failure.exit_code == kLeftExitCode) continue;
    notices.emplace_back("/dtrain/recovery/exited/" + detail::process_key(failure.pid),
                         failure.describe());
    ranks += (ranks.empty() ? "rank " : ", rank ") + std::to_string(failure.global_rank) + " " +
             failure.describe();
  }
  if (notices.empty()) return;
  std::string why;
  const elastic::KeyCheck answer = elastic::set_and_check_in_worker_store(
      round.master_addr, round.master_port, notices, kInPlaceGroupFormed, kStoreCallTimeout, &why);
  // Node 0 reads its own store directly (restart_alone()).
  if (store_ == nullptr) formed_answer_ = answer;
  if (answer == elastic::KeyCheck::kNoStore || answer == elastic::KeyCheck::kNoAnswer) {
    say("could not tell the other workers through their store at " + round.master_addr + ":" +
        std::to_string(round.master_port) + " that " + ranks + " (" + why +
        "); they go on without it once its heartbeat stops");
  }
}

// Another node than 0 asks node 0's store. One that refuses the connection is not up yet (this
// node's workers started, and one failed, before node 0's launcher hosted it) or gone with that
// launcher: no group can have formed around it either way, but the first may answer any moment, so
// it is asked again for a while. One that does not answer (node 0's host lost, or the link to it
// cut) leaves this node unable to tell (kNoAnswer): its workers are then taken to have formed the
// group, so that a minority cut off by a partition rejoins as newcomers once the link returns. A
// signal for the launcher (`signal_fd` readable) ends the asking at once.
elastic::KeyCheck InPlaceRecovery::ask_whether_group_formed(const elastic::WorkerGroupRound& round,
                                                            int signal_fd) const {
  const auto give_up = std::chrono::steady_clock::now() + kStoreStartTimeout;
  for (;;) {
    const elastic::KeyCheck answer = elastic::check_in_worker_store(
        round.master_addr, round.master_port, kInPlaceGroupFormed, kStoreCallTimeout);
    if (answer != elastic::KeyCheck::kNoStore || std::chrono::steady_clock::now() >= give_up ||
        readable(signal_fd)) {
      return answer;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// With no restart left for a worker, the survivors of an in-place group go on without it (a
// smaller job, not a stopped one). The whole group stops instead, as in restart mode, where: a
// signal came for the launcher; a usage error (exit code 2) cannot be fixed by a restart; the
// workers never formed an in-place group (a program that does not recover in place: its survivors
// fail too); a worker stopped on SIGTERM or none is left (one node); no restart is left and this
// node cannot tell whether they did (node 0's store does not answer). (Rank 0's death is no
// reason: prepare() put the store in node 0's launcher, which outlives it.)
bool InPlaceRecovery::restart_alone(elastic::WorkerGroup& group,
                                    const elastic::WorkerGroupRound& round,
                                    const WaitResult& failed, int signal_fd) {
  // The answer announce_exits() got with the exit notices: this call's, whichever way it returns.
  const std::optional<elastic::KeyCheck> asked = std::exchange(formed_answer_, std::nullopt);
  if (readable(signal_fd)) return false;
  const std::vector<WorkerExit>& failures = failed.failures;
  if (std::any_of(failures.begin(), failures.end(),
                  [](const WorkerExit& failure) { return failure.usage_error(); })) {
    return false;  // the static rendezvous says why it does not restart
  }
  // Once training is over (the members marked the job completed) nothing is restarted: a worker
  // left out of the group while it did not answer (stopped, stalled) that ended afterwards took no
  // part in the end (no done key), and the job's result stands; one that took part and then failed
  // (in its own code after finish()) is the launcher's exit code, not a newcomer with nothing to
  // join. Before, the first restarted the whole group, which trained the job again.
  auto ask = [&](const std::string& key) {
    return store_ != nullptr
               ? (store_->contains(key) ? elastic::KeyCheck::kPresent : elastic::KeyCheck::kAbsent)
               : elastic::check_in_worker_store(round.master_addr, round.master_port, key,
                                                kStoreCallTimeout);
  };
  if (ask(kJobCompleted) == elastic::KeyCheck::kPresent) {
    for (const WorkerExit& failure : failures) {
      const std::string who = "rank " + std::to_string(failure.global_rank) + "/" +
                              std::to_string(round.world_size) + " (local rank " +
                              std::to_string(failure.local_rank) + ", pid " +
                              std::to_string(failure.pid) + ") " + failure.describe();
      if (ask(done_key(failure.pid)) == elastic::KeyCheck::kAbsent) {
        say(who + " after the others completed the job without it: not restarted");
        continue;
      }
      say(who + " after training completed: not restarted; dtrain run exits with its code");
      if (exit_code_after_completion_ == 0) {
        exit_code_after_completion_ = failure.launcher_exit_code();
      }
    }
    return true;
  }
  const int left = restarts_.left();
  bool in_place_group = false;
  bool known = true;
  if (store_ != nullptr) {
    in_place_group = store_->contains(kInPlaceGroupFormed);
  } else {
    // Asked already with the exit notice; a store not up yet (or gone) is asked again.
    elastic::KeyCheck answer = asked.value_or(elastic::KeyCheck::kNoStore);
    if (answer == elastic::KeyCheck::kNoStore) answer = ask_whether_group_formed(round, signal_fd);
    in_place_group = answer == elastic::KeyCheck::kPresent;
    known = answer != elastic::KeyCheck::kNoAnswer;
  }
  if (known && !in_place_group) {
    if (left > 0) {
      say("the workers formed no in-place group (the program does not use "
          "dtrain::ResilientDataParallel, or failed before it did): restarting the whole group "
          "from the last checkpoint");
    }
    return false;
  }
  // Nobody to go on or to admit a newcomer: every worker of a one-node job failed, or one stopped
  // on SIGTERM (exit code 143, dtrain/stop.h), which its peers agreed to and saved the job's
  // checkpoint for. The whole group restarts and resumes from that checkpoint, as in restart mode.
  const bool stopped = std::any_of(failures.begin(), failures.end(), [](const WorkerExit& failure) {
    return failure.signal == 0 && failure.exit_code == 128 + SIGTERM;
  });
  if (in_place_group && (stopped || (round.group_world_size == 1 && group.running() == 0))) {
    if (left > 0) {
      say(stopped ? "a worker stopped on SIGTERM (exit code 143) with its peers: restarting the "
                    "whole group from the last checkpoint"
                  : "no worker is left to admit a newcomer: restarting the whole group from the "
                    "last checkpoint");
    }
    return false;
  }
  if (!in_place_group && static_cast<std::size_t>(std::max(left, 0)) < failures.size()) {
    return false;
  }
  if (group.running() == 0 && left <= 0) return false;  // nobody left to go on
  for (const WorkerExit& failure : failures) {
    const std::string who = "rank " + std::to_string(failure.global_rank) + "/" +
                            std::to_string(round.world_size) + " (local rank " +
                            std::to_string(failure.local_rank) + ", pid " +
                            std::to_string(failure.pid) + ") " + failure.describe() +
                            " on attempt " + std::to_string(failure.restart_count);
    if (!restarts_.spend()) {
      say(who + "; no restart left to replace it (--max-restarts " +
          std::to_string(restarts_.max()) + "): the other " + std::to_string(group.running()) +
          " worker(s) go on without it");
      continue;
    }
    say(who + "; restarting it alone as a newcomer, the other workers keep running (restart " +
        std::to_string(restarts_.spent()) + " of " + std::to_string(restarts_.max()) + ")");
    // Its TORCHELASTIC_RESTART_COUNT: the restarts spent, which under a static rendezvous is every
    // restart of this node so far; under an elastic one the budget is this node's own while the
    // round number counts the job's, so the count never goes below the failed run's and the new
    // run never shares an earlier attempt's number (and error-file folder) with it.
    group.restart_worker(failure.local_rank,
                         std::max(restarts_.spent(), failure.restart_count + 1));
  }
  return true;
}

void InPlaceRecovery::end_stragglers(elastic::WorkerGroup& group,
                                     const elastic::WorkerGroupRound& round) {
  if (store_ == nullptr || !store_->contains(kJobCompleted)) return;
  const auto now = std::chrono::steady_clock::now();
  if (!finished_seen_) finished_seen_ = now;
  if (now - *finished_seen_ < kStragglerGrace) return;
  for (const elastic::WorkerGroup::RunningWorker& worker : group.running_workers()) {
    if (store_->contains(done_key(worker.pid))) continue;  // a member finishing its own way
    // Killed once: one in uninterruptible sleep dies when it wakes, and is reaped then.
    if (!killed_stragglers_.insert(worker.pid).second) continue;
    say("rank " + std::to_string(worker.global_rank) + "/" + std::to_string(round.world_size) +
        " (local rank " + std::to_string(worker.local_rank) + ", pid " +
        std::to_string(worker.pid) + ") took no part in the end of the job and still runs " +
        std::to_string(kStragglerGrace.count()) +
        " s after the others ended it (it was left out of the group while it did not answer: "
        "stopped or hung): killing it");
    group.kill_worker(worker.local_rank);
  }
}

}  // namespace dtrain::cli
