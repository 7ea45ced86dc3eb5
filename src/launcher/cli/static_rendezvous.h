// The static rendezvous of `dtrain run` (--rdzv-backend static, the default), torchrun's
// StaticTCPRendezvous: every node runs its own `dtrain run` with its --node-rank and the same
// --nnodes and --master-addr/--master-port, so every round is given by the flags, and nothing
// coordinates the nodes beyond the workers' own store.
//
// A new round after a failure is therefore this node's restart alone, counted against
// --max-restarts on this node: only this node's group restarts, and workers on the other nodes
// notice the lost peer in their next collective and fail too (then their launchers restart them).
// The restart counts of different nodes may drift apart. With --rdzv-backend c10d or etcd the
// elastic rendezvous (elastic_rendezvous.h) restarts every node's group together instead.
#pragma once

#include "launcher/cli/agent.h"
#include "launcher/cli/run_options.h"

namespace dtrain::cli {

// --max-restarts on this node. Each restart, of the whole group or (--recovery in-place) of one
// worker, spends one; the number spent is the restarted workers' TORCHELASTIC_RESTART_COUNT.
class RestartBudget {
 public:
  explicit RestartBudget(int max) : max_(max) {}
  int max() const { return max_; }
  int spent() const { return spent_; }
  int left() const { return max_ - spent_; }
  // Spends one restart; false, spending nothing, when none is left.
  bool spend();

 private:
  int max_;
  int spent_ = 0;
};

class StaticRendezvous final : public AgentRendezvous {
 public:
  // `auto_port`: a fresh free MASTER_PORT for every round (no --master-port, a single node).
  // `master_unresolved`: --master-addr did not resolve when the flags were checked.
  StaticRendezvous(const RunOptions& options, bool auto_port, bool master_unresolved = false);

  // The round of the flags: node rank --node-rank of --nnodes, WORLD_SIZE --nnodes *
  // --nproc-per-node, TORCHELASTIC_RESTART_COUNT the restarts spent so far. At once, except the
  // first round while --master-addr does not resolve: its name is waited for up to --rdzv-conf
  // join_timeout (a scheduler may register the master's name only once its node runs, as
  // torchrun's store waits for it), then the job ends with exit code 1 (a scheduler retries it,
  // and the flag may be right), or at once on a signal (128 + signal).
  std::optional<elastic::WorkerGroupRound> next_round(elastic::SignalPipe& signals,
                                                      int* exit_code) override;
  // A new round while a restart is left (spending it), else the end of the job; a usage error (exit
  // code 2) ends it at once, as a restart would fail the same way.
  elastic::Verdict report_failure(const elastic::WorkerExit& root) override;

  // Shared with the in-place recovery, whose restarts of single workers spend the same budget.
  RestartBudget& restarts() { return restarts_; }

 private:
  // Waits for --master-addr to resolve (see next_round()); false, with *exit_code, when the job
  // ends first. Node 0 then checks the port (UsageError when in use).
  bool wait_for_master(elastic::SignalPipe& signals, int* exit_code);

  RunOptions options_;
  bool auto_port_;
  bool master_unresolved_;
  RestartBudget restarts_;
};

}  // namespace dtrain::cli
