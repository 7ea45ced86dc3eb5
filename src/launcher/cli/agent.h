// The agent of `dtrain run`: one per node, one loop for every rendezvous backend, as in torchrun.
// It asks its rendezvous for the next round, runs the local WorkerGroup in it (WORLD_SIZE, ranks,
// MASTER_ADDR/PORT), watches the workers and, where anything can change under them, the
// rendezvous; a failure, a signal or a new round is answered by stopping the workers and asking the
// rendezvous what comes next. Two rendezvous kinds:
//   - static (--rdzv-backend static, the default; static_rendezvous.h): the round is given by the
//     flags, and a new round after a failure is a restart of this node's group alone;
//   - elastic (c10d, etcd; elastic_rendezvous.h): the agents of every node agree on each round
//     through a store (Note [Rounds] in launcher/elastic/rendezvous.h).
// How a failure is recovered from is a policy of the loop (--recovery): the whole group restarts
// from a new round, or (in-place; in_place_recovery.h) the failed worker restarts alone while the
// others keep running.
#pragma once

#include <chrono>
#include <optional>

#include "launcher/cli/run_command.h"
#include "launcher/cli/run_options.h"
#include "launcher/elastic/rendezvous.h"
#include "launcher/elastic/signal_pipe.h"
#include "launcher/elastic/worker_group.h"

namespace dtrain::cli {

// The rendezvous as the agent's loop drives it (torchrun's RendezvousHandler, cut to what that loop
// needs). A verdict's message is the launcher line to say, to which the loop adds what it did (";
// stopped 2 worker(s) of this node", "; exiting with code 3"). The defaults are those of a
// rendezvous nothing changes under: the static one.
class AgentRendezvous {
 public:
  virtual ~AgentRendezvous() = default;

  // Blocks until this node's next round is decided and returns what its workers run as. Returns
  // nullopt when the job ends first (a signal came, the rendezvous failed or timed out), having
  // said why; *exit_code is then the launcher's exit code.
  virtual std::optional<elastic::WorkerGroupRound> next_round(elastic::SignalPipe& signals,
                                                              int* exit_code) = 0;

  // How often the loop calls check() while the workers run; zero: never.
  virtual std::chrono::milliseconds monitor_interval() const { return {}; }
  // One look at the job while the workers run: keep running; a new round (the loop stops the
  // workers and calls next_round()); or the end of the job (the loop stops the workers, calls
  // leave_ended_job() and exits with code 1). It holds up the loop, and with it the relaying of the
  // workers' output, while it runs: the elastic rendezvous's at most the rest of the keep-alive
  // patience (Note [A store that stops answering] in elastic_rendezvous.cpp).
  virtual elastic::Verdict check() { return {}; }
  // Node 0's launcher saw this round's workers form an in-place group: from now on a node lost or
  // joining may change the running round instead of restarting every worker (elastic only).
  // Returns false when the rendezvous could not be told (the loop tries again at its next look).
  virtual bool workers_recover_in_place() { return true; }

  // A local worker failed, `root` first, and this node's workers are stopped: a new round, or the
  // end of the job (the loop calls leave_ended_job() and exits with the worker's code).
  virtual elastic::Verdict report_failure(const elastic::WorkerExit& root) = 0;

  // This node's workers all succeeded and are stopped: says so to the others, and blocks while this
  // node must stay for them, at most until `signal_fd` is readable.
  virtual void finish(int signal_fd) { (void)signal_fd; }
  // The job ended (a kShutdown verdict) and the workers are stopped: out of it, so that nobody
  // waits for this node.
  virtual void leave_ended_job() {}
  // A signal `signo` ends this node's part: leaving() before its workers are stopped (the others
  // need not count their failures against --max-restarts), leave() after, saying how this node's
  // workers ended.
  virtual void leaving(int signo) { (void)signo; }
  virtual void leave(int signo, elastic::WorkersLeft workers) {
    (void)signo;
    (void)workers;
  }
};

// Runs the agent to the end of the job; returns the exit code (0 when this node's workers all
// succeeded; see run_usage()). Throws dtrain::UsageError for bad flags found late (a rendezvous
// that refuses this node's token, a log file that cannot be made), other dtrain errors when the
// rendezvous cannot start.
int run_agent(const RunOptions& options, const LaunchPlan& plan);

}  // namespace dtrain::cli
