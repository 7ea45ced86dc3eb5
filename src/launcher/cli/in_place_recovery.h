// --recovery in-place, a policy of the agent's loop (agent.h) under either rendezvous: the
// survivors carry on, the library (DTRAIN_RECOVERY=in-place, dtrain::ResilientDataParallel)
// re-forms their group without the dead worker, and the launcher restarts that worker alone as a
// newcomer (restart_alone()). Node 0's launcher hosts the workers' store (WorkerStore,
// TORCHELASTIC_USE_AGENT_STORE=True), so that it outlives every worker, rank 0 included; a program
// whose workers never formed an in-place group gets the whole-group restart instead. Every node's
// launcher writes its failed workers' deaths into that store (announce_exits()), so that survivors
// on other hosts do not wait for them.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <set>

#include "launcher/cli/run_options.h"
#include "launcher/cli/static_rendezvous.h"
#include "launcher/elastic/worker_group.h"
#include "launcher/elastic/worker_store.h"

namespace dtrain::cli {

class InPlaceRecovery {
 public:
  // `auto_port`: the store takes a free port (no --master-port, a single static node). Restarts of
  // single workers spend `restarts`, which must outlive this object: the static rendezvous's
  // budget, or under an elastic one a budget of this node's own (the rendezvous counts its rounds).
  // `one_node_job`: no other node can ever take part (--nnodes 1 or 1:1), so the store need not
  // listen beyond the address the workers are given.
  InPlaceRecovery(bool auto_port, RestartBudget& restarts, bool one_node_job);

  // Before the whole group starts in a round: points the workers at the launcher's store, and on
  // the round's node 0 hosts a fresh one (the last one's keys belong to its generations).
  void prepare(elastic::WorkerGroupRound& round);

  // On node 0: whether this round's workers have formed their in-place group (they use
  // dtrain::ResilientDataParallel). Elsewhere false: only node 0 holds the store.
  bool group_formed() const;
  // The same on any node, asked now: node 0 reads its store, another node asks node 0's (one call
  // of at most a second). For a node leaving on SIGTERM (Note [Rounds in place]).
  bool group_formed_in(const elastic::WorkerGroupRound& round) const;

  // Tells the workers on every host, through their store, that each worker of `ended` has failed
  // and is dead, and in the same exchange asks whether the workers formed their in-place group
  // (restart_alone() uses the answer on another node than 0; node 0 reads its own store). A store
  // out of reach costs at most one second, and one line.
  void announce_exits(const elastic::WorkerGroupRound& round, const elastic::WaitResult& ended);

  // Restarts each worker of `failed` alone, as a newcomer the survivors admit into their group, and
  // returns true; the other workers keep running. Also true, restarting nothing, once training is
  // over (a worker left out while it stalled, ending afterwards; or one failing after the end).
  // Returns false, restarting nothing, where the whole group must stop instead (see
  // in_place_recovery.cpp), `signal_fd` readable among them.
  bool restart_alone(elastic::WorkerGroup& group, const elastic::WorkerGroupRound& round,
                     const elastic::WaitResult& failed, int signal_fd);

  // Node 0, at each of the loop's looks (the rendezvous's, or kLookInterval): once the workers
  // ended the job, a worker of this node that took no part in the end (left out of the group while
  // it did not answer: stopped, hung) and still runs kStragglerGrace later is killed, with one
  // line, so that the launcher ends instead of waiting for it for good. restart_alone() then
  // restarts nothing.
  void end_stragglers(elastic::WorkerGroup& group, const elastic::WorkerGroupRound& round);

  // The launcher's exit code once the workers are all gone: 0, or that of the first worker that
  // took part in the end of training and failed afterwards (restart_alone() restarted nothing).
  int exit_code_after_completion() const { return exit_code_after_completion_; }
  static constexpr std::chrono::milliseconds kLookInterval{1000};
  static constexpr std::chrono::seconds kStragglerGrace{10};

 private:
  elastic::KeyCheck ask_whether_group_formed(const elastic::WorkerGroupRound& round,
                                             int signal_fd) const;

  bool auto_port_;
  RestartBudget& restarts_;
  bool one_node_job_;
  // Node 0's: the workers' store of the current start of the whole group.
  std::unique_ptr<elastic::WorkerStore> store_;
  // Elsewhere: node 0's store's answer, asked with the last exit notice, until restart_alone()
  // takes it.
  std::optional<elastic::KeyCheck> formed_answer_;
  // Node 0's: when end_stragglers() first saw the job completed, and whom it killed since.
  std::optional<std::chrono::steady_clock::time_point> finished_seen_;
  std::set<pid_t> killed_stragglers_;
  int exit_code_after_completion_ = 0;
};

}  // namespace dtrain::cli
