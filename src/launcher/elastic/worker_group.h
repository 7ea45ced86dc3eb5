// WorkerGroup: the local worker processes of one node - spawning them with torchrun's environment,
// relaying their output line by line with a rank prefix (and into per-rank log files), watching for
// the first failure, and stopping them all (SIGTERM to each worker's process group, SIGKILL after a
// grace period, every child reaped). The agent of `dtrain run` (src/launcher/cli/agent.h) drives
// one WorkerGroup through its restart loop, one round of its rendezvous (static or elastic) per
// start(); with --recovery in-place it replaces a single failed worker through restart_worker().
// dtrain::spawn (src/spawn/spawn.cpp) runs a program's own ranks through it too: one supervisor for
// both, LibTorch-free (a static library that libdtrain links too).
//
// Limits: a worker's children are signalled through its process group, so one that moves to a group
// of its own (setsid, a daemon) escapes stop(). If the launcher is SIGKILLed, the kernel kills the
// workers (PR_SET_PDEATHSIG) but not their children; a worker that wants those gone should set the
// same flag.
//
// Contract: single-threaded use from one thread; start() forks, so the calling process should not
// hold locks in other threads across it. No method installs signal handlers: the caller passes a
// file descriptor (a self-pipe, see signal_pipe.h) that wakes wait() and stop() when a signal
// arrives.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::elastic {

class SignalPipe;  // signal_pipe.h

// What stays fixed for the lifetime of the group, across restarts.
struct WorkerGroupOptions {
  // argv of every worker; command[0] is a path or a name looked up on PATH when start() runs.
  std::vector<std::string> command;
  // Workers on this node (LOCAL_WORLD_SIZE).
  int local_world_size = 1;
  // ROLE_NAME; torchrun's default role.
  std::string role = "default";
  // TORCHELASTIC_RUN_ID; "none" is torchrun's default when no --rdzv-id is given.
  std::string run_id = "none";
  // TORCHELASTIC_MAX_RESTARTS; only exported, the caller owns the restart loop.
  int max_restarts = 0;
  // When not empty: append each worker's output to <log_dir>/rank<GLOBAL_RANK>.log (the folder must
  // exist).
  std::string log_dir;
  // Time between SIGTERM and SIGKILL when stopping workers.
  std::chrono::milliseconds grace_period{5000};
  // Where the prefixed worker lines go: stdout lines to out_fd, stderr lines to err_fd.
  int out_fd = 1;
  int err_fd = 2;
  // By local rank, which streams (bit 1: stdout, bit 2: stderr) go to out_fd/err_fd and which to
  // the log file: torchrun's --redirects, --tee and --local-ranks-filter. Empty: all of them.
  // The stderr tail of the failure summary keeps every line either way.
  std::vector<int> console_streams;
  std::vector<int> log_streams;
  // How many of each worker's last stderr lines are kept for the failure summary.
  std::size_t stderr_tail_lines = 20;
  // Set when this process is a child subreaper (prctl PR_SET_CHILD_SUBREAPER) and every child it
  // has is this group's: then processes the workers leave behind are reparented here, and the group
  // reaps them with waitpid(-1) so none stays a zombie. Leave it false in a process with other
  // children.
  bool reap_orphans = false;
  // Extra variables for every worker, applied after the inherited environment and before
  // torchrun's.
  std::vector<std::pair<std::string, std::string>> extra_env;
  // DTRAIN_RECOVERY: how the caller recovers from a worker's failure ("restart": the whole group;
  // "in-place": the failed worker alone, through restart_worker()), so the workers know whether
  // to expect a newcomer.
  std::string recovery = "restart";
  // false: the workers get none of the variables that place a rank (RANK, LOCAL_RANK,
  // WORLD_SIZE, MASTER_ADDR, ... ; inherited ones are dropped too), for a worker that is itself a
  // launcher whose tasks take theirs from it (`dtrain scale` in a Slurm allocation: srun).
  bool rank_variables = true;
  // Who supervises, as messages name it: "dtrain run", or "dtrain::spawn" for the ranks a program
  // starts itself (dtrain/spawn.h).
  std::string name = "dtrain run";
  // The file exec runs; empty: command[0], looked up on PATH. dtrain::spawn runs /proc/self/exe
  // with the program's own argv, so that a rank's argv[0] is the program's.
  std::string executable;
  // false: the workers write to this process's stdout and stderr themselves (no rank prefix, no
  // log files, no stderr tail), as dtrain::spawn's ranks print as the program they are.
  bool relay_output = true;
};

// What one attempt of the group runs as: a round of the agent's rendezvous, fixed by the flags
// (static) or agreed with the other nodes (elastic).
struct WorkerGroupRound {
  // GROUP_RANK: this node's rank among the nodes.
  int group_rank = 0;
  // GROUP_WORLD_SIZE: number of nodes.
  int group_world_size = 1;
  // RANK of local rank 0; the static rendezvous uses group_rank * local_world_size.
  int base_rank = 0;
  // WORLD_SIZE: workers over all nodes.
  int world_size = 1;
  // MASTER_ADDR / MASTER_PORT: where the workers' store is: hosted by rank 0
  // (TORCHELASTIC_USE_AGENT_STORE=False), or by the launcher of node 0 when agent_store
  // (TORCHELASTIC_USE_AGENT_STORE=True; --recovery in-place, so that it outlives any worker).
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool agent_store = false;
  // TORCHELASTIC_RESTART_COUNT: 0 for the first attempt.
  int restart_count = 0;
  // The node was admitted into a round whose workers already run and recover in place (an elastic
  // rendezvous, --recovery in-place): every worker starts as a newcomer (DTRAIN_RECOVERY_JOIN=1)
  // that the running workers admit and give their state.
  bool join_running = false;
};

// How a worker process ended.
struct WorkerExit {
  int global_rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  // Exit code when the worker exited, -1 when a signal killed it.
  int exit_code = -1;
  // Signal number when a signal killed it, 0 otherwise.
  int signal = 0;
  // TORCHELASTIC_RESTART_COUNT of the attempt it belonged to.
  int restart_count = 0;
  // Its last stderr lines (without the rank prefix), oldest first.
  std::vector<std::string> stderr_tail;
  // Its TORCHELASTIC_ERROR_FILE, where PyTorch's @record and dtrain::spawn's ranks write the
  // exception that ended it (if any); the file goes with the group.
  std::string error_file;

  bool succeeded() const { return signal == 0 && exit_code == 0; }
  // Exit code 2: how dtrain programs, Python's argparse and most command-line tools say "bad flag,
  // variable or file". A restart would fail the same way (or, worse, resume from a folder the user
  // named by mistake), so launchers do not restart for it.
  bool usage_error() const { return signal == 0 && exit_code == 2; }
  // "exited with code 3" or "killed by signal 9 (SIGKILL)".
  std::string describe() const;
  // The exit code a launcher reports for it: the worker's code, or 128 + signal; never 0 for a
  // failure.
  int launcher_exit_code() const;
};

// What wait() saw.
struct WaitResult {
  enum class State {
    kSucceeded,    // every worker exited with code 0
    kFailed,       // a worker failed; the others may still run (call stop())
    kInterrupted,  // the interrupt fd became readable; workers still run (call stop())
  };
  State state = State::kSucceeded;
  // The failures reaped in the wake-up that ended wait(), first observed first; failures[0] is the
  // root cause. Set with kFailed, and also with kInterrupted when the interrupt fd and a failure
  // came in the same wake-up (those exits are reaped: a later wait() does not report them again).
  std::vector<WorkerExit> failures;
};

class WorkerGroup {
 public:
  explicit WorkerGroup(WorkerGroupOptions options);
  // Kills (SIGKILL, no grace) and reaps workers still running: the owner is going away.
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Spawns local_world_size workers for `round`. Each worker: its own process group, SIGKILL when
  // this process dies (PR_SET_PDEATHSIG), stdin from /dev/null, stdout and stderr to pipes read by
  // wait()/stop() (unless relay_output is false), TORCHELASTIC_ERROR_FILE in a temporary folder
  // that goes with the group. Throws dtrain::UsageError when a log file or the error file's folder
  // cannot be made, dtrain::InternalError when pipes or fork fail; in both cases no worker of this
  // round is left running. Requires the previous round stopped.
  void start(const WorkerGroupRound& round);

  // Blocks until every worker exited with code 0, a worker failed, or `interrupt_fd` (if >= 0)
  // became readable, relaying output meanwhile. It does not read from interrupt_fd. No timeout of
  // its own: workers run as long as they run; the interrupt fd is the way out.
  WaitResult wait(int interrupt_fd = -1);

  // Stops every worker still running: SIGTERM to each worker's process group (which also reaches
  // its children), SIGKILL to the groups after options.grace_period or as soon as `interrupt_fd`
  // (if >= 0) becomes readable (a second Ctrl-C), then reaps them. Relays their last output,
  // flushes unterminated last lines and closes the pipes and logs. Blocks at most about
  // grace_period plus a few seconds. `grace`, when given, replaces options.grace_period for this
  // stop. Returns how each worker that was still running ended.
  std::vector<WorkerExit> stop(int interrupt_fd = -1,
                               std::optional<std::chrono::milliseconds> grace = std::nullopt);
  // The same for a stop the launcher began on its own (a worker failed, a new round), with the
  // launcher's signal pipe: the workers had their SIGTERM before any signal came, so the first
  // signal that arrives meanwhile is taken from `signals` into *signo (0 when none came) and they
  // keep their grace (a trainer may be saving a checkpoint); only a second one cuts it short with
  // SIGKILL, as it does for a stop that a signal began.
  std::vector<WorkerExit> stop(SignalPipe& signals, int* signo,
                               std::optional<std::chrono::milliseconds> grace = std::nullopt);
  // Whether the last stop() had to send SIGKILL (a worker outlived its grace).
  bool last_stop_killed() const { return last_stop_killed_; }

  // In-place recovery: spawns local rank `local_rank` again, its previous process reaped (wait()
  // reported it), while the other workers keep running. The newcomer gets the current round's
  // environment with TORCHELASTIC_RESTART_COUNT=restart_count and DTRAIN_RECOVERY_JOIN=1, which
  // tells it to join the survivors' group and take its state from a live peer; a fresh
  // TORCHELASTIC_ERROR_FILE (attempt_<restart_count>); its log appended to. What the old process
  // left in its process group is killed first. Throws as start() does; then that worker is not
  // running and the others are untouched.
  void restart_worker(int local_rank, int restart_count);

  // Workers of the current round not yet reaped.
  int running() const;
  // The same, each with its ranks and pid.
  struct RunningWorker {
    int local_rank = 0;
    int global_rank = 0;
    pid_t pid = -1;
  };
  std::vector<RunningWorker> running_workers() const;
  // SIGKILL to a running worker's process group (it, and what it started), the others untouched;
  // the next wait() reaps it and reports it killed by signal 9. For a worker that cannot be asked
  // to stop (a stopped or hung process: in_place_recovery.cpp, end_stragglers()).
  void kill_worker(int local_rank);
  const WorkerGroupOptions& options() const { return options_; }

 private:
  struct Stream;
  struct Worker;

  // TORCHELASTIC_ERROR_FILE of a local rank's attempt: <root>/attempt_<restart count>/<local
  // rank>/error.json, the folders created (the root on first use). Throws dtrain::UsageError when
  // they cannot be.
  std::string make_error_file(int restart_count, int local_rank);
  // Both stop()s: `signals` null for the first (interrupt_fd's first readiness SIGKILLs).
  std::vector<WorkerExit> stop_workers(int interrupt_fd,
                                       std::optional<std::chrono::milliseconds> grace,
                                       SignalPipe* signals, int* signo);
  // Opens <log_dir>/rank<R>.log for appending when there is a log folder. Throws
  // dtrain::UsageError when it cannot.
  void open_log(Worker& worker);
  // A worker's environment: shared_env_ with `overrides` replacing the round's values, plus the
  // worker's own variables.
  std::vector<std::string> worker_env(
      const Worker& worker,
      const std::vector<std::pair<std::string, std::string>>& overrides) const;
  void spawn(Worker& worker, const std::vector<std::string>& env);
  // Polls the pipes (and the extra fd) for up to timeout_ms; relays what arrived. Returns true when
  // extra_fd is readable.
  bool pump(int timeout_ms, int extra_fd);
  void read_stream(Worker& worker, Stream& stream, std::size_t max_bytes);
  void emit_lines(Worker& worker, Stream& stream, std::string_view data, bool flush_partial);
  // Reaps exited workers without blocking; appends their exits to `exits` in the order seen.
  void reap(std::vector<WorkerExit>* exits);
  void record_exit(Worker& worker, int status, std::vector<WorkerExit>* exits);
  void signal_groups(int signo);
  bool any_group_alive();
  void close_worker(Worker& worker);
  void write_log(Worker& worker, const std::string& text);

  WorkerGroupOptions options_;
  WorkerGroupRound round_;
  std::vector<Worker> workers_;
  // What start() resolved for the round, kept for restart_worker(): the program's path, and the
  // environment every worker of the round shares.
  std::string executable_;
  std::vector<std::string> shared_env_;
  int dev_null_ = -1;
  bool last_stop_killed_ = false;
  // A private temporary folder holding the workers' TORCHELASTIC_ERROR_FILEs; removed with the
  // group (a SIGKILLed launcher leaves it behind, as torchrun leaves its folders every time). Empty
  // until the first start().
  std::string error_file_root_;
};

// "SIGKILL" for 9, "signal 42" for numbers without a name.
std::string signal_name(int signo);

// The path exec would run for `name`: `name` itself when it contains '/', else the first executable
// match on PATH. Empty when there is none; `*why` then says "not found on PATH" or "not
// executable".
std::string find_executable(const std::string& name, std::string* why = nullptr);

}  // namespace dtrain::elastic
