// `dtrain run`: machine checks, the restart loop around one WorkerGroup, the failure summary and
// the exit code (see run_command.h).
//
// Static multi-node runs (--rdzv-backend static, the default): every node runs its own `dtrain run`
// with its --node-rank and the same --master-addr/--master-port, and nothing coordinates the nodes
// beyond the workers' own store. A restart is therefore node-local: when a worker fails, only this
// node's group restarts, and workers on the other nodes notice the lost peer in their next
// collective and fail too (then their launchers restart them). The attempt counters of different
// nodes may drift apart. With --rdzv-backend c10d or etcd, run_main hands over to the elastic agent
// (elastic_agent.h), whose rendezvous restarts every node's group together.
//
// With --recovery in-place (static only) the survivors carry on: the library
// (DTRAIN_RECOVERY=in-place, dtrain::ResilientDataParallel) re-forms their group without the dead
// worker, and the launcher restarts that worker alone as a newcomer (restart_alone() below). Node
// 0's launcher then hosts the workers' store (WorkerStore, TORCHELASTIC_USE_AGENT_STORE=True), so
// that it outlives every worker, rank 0 included; a program whose workers never formed an in-place
// group gets the whole-group restart instead. Every node's launcher writes its failed workers'
// deaths into that store (announce_exits()), so that survivors on other hosts do not wait for them.
#include "launcher/cli/run_command.h"

#include <poll.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <random>
#include <sstream>
#include <system_error>

#include "common/format.h"
#include "common/process_identity.h"
#include "dtrain/errors.h"
#include "launcher/cli/elastic_agent.h"
#include "launcher/elastic/ports.h"
#include "launcher/elastic/signal_pipe.h"
#include "launcher/elastic/worker_group.h"
#include "launcher/elastic/worker_store.h"

namespace dtrain::cli {

using elastic::WaitResult;
using elastic::WorkerExit;
using elastic::WorkerGroup;

namespace {
[[noreturn]] void fail(const std::string& message) { throw UsageError("dtrain run: " + message); }
}  // namespace

// The launcher's own messages: whole lines to stderr in one write, so they never split a worker's
// line.
void say(const std::string& message) {
  std::string line = "dtrain run: " + message + "\n";
  std::string_view rest = line;
  while (!rest.empty()) {
    ssize_t n = write(2, rest.data(), rest.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
}

// One line for an exception; dtrain's own messages already start with "dtrain run: ".
void print_error(const std::exception& error) {
  std::string message = error.what();
  const std::string prefix = "dtrain run: ";
  say(message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : "internal error: " + message);
}

namespace {
bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

// The summary of a failed attempt: the first failing worker (the root cause; the others were
// usually stopped by us or failed because it did), how it ended, and its last stderr lines.
void print_failure_summary(const WaitResult& result, const elastic::WorkerGroupRound& round) {
  const WorkerExit& root = result.failures.front();
  say("worker failed: rank " + std::to_string(root.global_rank) + "/" +
      std::to_string(round.world_size) + " (local rank " + std::to_string(root.local_rank) +
      ", pid " + std::to_string(root.pid) + ") " + root.describe() + " on attempt " +
      std::to_string(root.restart_count) +
      " (TORCHELASTIC_RESTART_COUNT=" + std::to_string(root.restart_count) + ")");
  if (root.stderr_tail.empty()) {
    say("rank " + std::to_string(root.global_rank) + " wrote nothing to stderr");
  } else {
    say("last " + std::to_string(root.stderr_tail.size()) + " stderr line(s) of rank " +
        std::to_string(root.global_rank) + ":");
    for (const std::string& line : root.stderr_tail) {
      // A line may be up to 64 KiB (a dumped tensor); the summary shows its start, the log has it
      // all.
      constexpr std::size_t kMaxSummaryLine = 2000;
      std::string shown =
          line.size() > kMaxSummaryLine ? line.substr(0, kMaxSummaryLine) + " [...]" : line;
      say("  [rank" + std::to_string(root.global_rank) + "]: " + shown);
    }
  }
  for (std::size_t i = 1; i < result.failures.size(); ++i) {
    const WorkerExit& other = result.failures[i];
    say("also failed at the same time: rank " + std::to_string(other.global_rank) + " (pid " +
        std::to_string(other.pid) + ") " + other.describe());
  }
}

namespace {
// A random (version 4) UUID in its usual text form, like Python's str(uuid.uuid4()).
std::string random_uuid() {
  std::random_device source;  // /dev/urandom on Linux
  unsigned char bytes[16];
  for (unsigned char& byte : bytes) byte = static_cast<unsigned char>(source() & 0xff);
  bytes[6] = static_cast<unsigned char>((bytes[6] & 0x0f) | 0x40);  // version 4
  bytes[8] = static_cast<unsigned char>((bytes[8] & 0x3f) | 0x80);  // RFC 4122 variant
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    text += kHex[bytes[i] >> 4];
    text += kHex[bytes[i] & 0x0f];
  }
  return text;
}
}  // namespace

elastic::WorkerGroupOptions worker_group_options(const RunOptions& options,
                                                 const LaunchPlan& plan) {
  elastic::WorkerGroupOptions group_options;
  group_options.command = plan.command;
  group_options.local_world_size = options.nproc_per_node;
  group_options.run_id = options.run_id;
  // torchrun runs a single node without --master-port (or with --standalone) as a standalone c10d
  // rendezvous whose id is a fresh uuid4, so each such job's TORCHELASTIC_RUN_ID is unique. dtrain
  // does the same, but keeps an id the user gave (torchrun's --standalone drops it).
  bool standalone = !is_elastic(options) && options.nnodes == 1 &&
                    (options.standalone || options.master_port == 0);
  if (standalone && !options.run_id_given) group_options.run_id = random_uuid();
  group_options.max_restarts = options.max_restarts;
  group_options.recovery = options.recovery;
  group_options.log_dir = options.log_dir;
  group_options.grace_period =
      std::chrono::milliseconds(static_cast<long long>(options.grace_period_s * 1000.0 + 0.5));
  // torchrun's rule: several workers on one node each get one OpenMP thread unless the user chose,
  // so N processes do not each spawn one thread per core.
  if (options.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    group_options.extra_env.emplace_back("OMP_NUM_THREADS", "1");
  }
  // Make this process the subreaper of the workers' descendants: what a worker leaves behind (a
  // background child of a shell script, a data-loader process) is reparented here instead of to
  // init, so the group can reap it and nothing stays a zombie. The launcher has no children but its
  // workers.
  group_options.reap_orphans = prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
  return group_options;
}

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

// --recovery in-place: tells the workers on every host, through their store, that each worker of
// `ended` has failed and is dead (Note [Heartbeats], src/recovery/membership.h): a survivor on
// another host cannot check its pid, and would otherwise wait for it min(settle, lost_after),
// about 2 s, before going on without it. The key names the process as its membership record does:
// this host's name, its pid (the launcher execs the program itself, so the pid is the worker's)
// and the pid namespace; the value says how it ended. A store out of reach (the link to node 0 is
// cut) costs at most kExitNoticeTimeout: the survivors then tell the death by its heartbeat.
constexpr auto kExitNoticeTimeout = std::chrono::seconds(1);
void announce_exits(const elastic::WorkerGroupRound& round, const WaitResult& ended) {
  if (!round.agent_store) return;
  for (const WorkerExit& failure : ended.failures) {
    const std::string key = "/dtrain/recovery/exited/" + detail::own_hostname() + "/" +
                            std::to_string(failure.pid) + "/" +
                            std::to_string(detail::own_pid_namespace());
    const std::string why = elastic::set_in_worker_store(round.master_addr, round.master_port, key,
                                                         failure.describe(), kExitNoticeTimeout);
    if (!why.empty()) {
      say("could not tell the other workers through their store at " + round.master_addr + ":" +
          std::to_string(round.master_port) + " that rank " + std::to_string(failure.global_rank) +
          " " + failure.describe() + " (" + why +
          "); they go on without it once its heartbeat stops");
    }
  }
}

// --recovery in-place: restarts each worker of `failed` alone, as a newcomer the survivors admit
// into their group (DTRAIN_RECOVERY_JOIN=1), and returns true; the other workers keep running.
// With no restart left for a worker, the survivors of an in-place group go on without it (a smaller
// job, not a stopped one). Returns false, restarting nothing, where the whole group must stop as
// in restart mode: a signal came for the launcher, a usage error (exit code 2) cannot be fixed by
// a restart, the workers never formed an in-place group (a program that does not recover in place:
// its survivors fail too), a worker stopped on SIGTERM or none is left (one node), or no restart is
// left and this node cannot tell that they did (the store is on node 0), or rank 0 died while it
// hosted the store.
bool restart_alone(const RunOptions& options, WorkerGroup& group,
                   const elastic::WorkerGroupRound& round, const elastic::WorkerStore* store,
                   const WaitResult& failed, int signal_fd, int* restarts) {
  if (!recovers_in_place(options) || readable(signal_fd)) return false;
  const std::vector<WorkerExit>& failures = failed.failures;
  if (std::any_of(failures.begin(), failures.end(),
                  [](const WorkerExit& failure) { return failure.usage_error(); })) {
    return false;  // the caller says why it does not restart
  }
  const int left = options.max_restarts - *restarts;
  const bool in_place_group = store != nullptr && store->contains(kInPlaceGroupFormed);
  if (store != nullptr && !in_place_group) {
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
  if (in_place_group && (stopped || (options.nnodes == 1 && group.running() == 0))) {
    if (left > 0) {
      say(stopped ? "a worker stopped on SIGTERM (exit code 143) with its peers: restarting the "
                    "whole group from the last checkpoint"
                  : "no worker is left to admit a newcomer: restarting the whole group from the "
                    "last checkpoint");
    }
    return false;
  }
  if (!round.agent_store &&
      std::any_of(failures.begin(), failures.end(),
                  [](const WorkerExit& failure) { return failure.global_rank == 0; })) {
    say("rank 0 hosts the store: restarting the whole group from the last checkpoint");
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
    if (*restarts >= options.max_restarts) {
      say(who + "; no restart left to replace it (--max-restarts " +
          std::to_string(options.max_restarts) + "): the other " + std::to_string(group.running()) +
          " worker(s) go on without it");
      continue;
    }
    ++*restarts;
    say(who + "; restarting it alone as a newcomer, the other workers keep running (restart " +
        std::to_string(*restarts) + " of " + std::to_string(options.max_restarts) + ")");
    group.restart_worker(failure.local_rank, *restarts);
  }
  return true;
}

int run_workers(const RunOptions& options, const LaunchPlan& plan) {
  // Installed before the first worker exists, so no Ctrl-C can slip between fork and the handler.
  elastic::SignalPipe signals(elastic::kLauncherSignals);
  WorkerGroup group(worker_group_options(options, plan));

  // Restarts so far, of the whole group or (--recovery in-place) of one worker: each counts
  // against --max-restarts, and the count is the restarted workers' TORCHELASTIC_RESTART_COUNT.
  int restarts = 0;
  // --recovery in-place: node 0's launcher hosts the workers' store, so that it outlives any
  // worker; a fresh one for each start of the whole group (the last one's keys belong to its
  // generations).
  std::unique_ptr<elastic::WorkerStore> store;
  for (;;) {
    elastic::WorkerGroupRound round;
    round.group_rank = options.node_rank;
    round.group_world_size = options.nnodes;
    round.base_rank = options.node_rank * options.nproc_per_node;
    round.world_size = options.nnodes * options.nproc_per_node;
    round.master_addr = options.master_addr;
    // A fresh port each attempt: the previous store's port may linger, or another program may have
    // taken it meanwhile.
    round.master_port = plan.auto_port ? elastic::pick_free_port() : options.master_port;
    round.agent_store = recovers_in_place(options);
    if (round.agent_store && options.node_rank == 0) {
      store.reset();  // its port is free again for the new one
      // One node: the loopback address the workers are given; several: every interface, as
      // rank 0's TCPStore listens.
      store = std::make_unique<elastic::WorkerStore>(options.nnodes == 1 ? round.master_addr : "",
                                                     plan.auto_port ? 0 : options.master_port);
      round.master_port = store->port();
    }
    round.restart_count = restarts;
    group.start(round);

    WaitResult result = group.wait(signals.fd());
    announce_exits(round, result);
    while (result.state == WaitResult::State::kFailed &&
           restart_alone(options, group, round, store.get(), result, signals.fd(), &restarts)) {
      result = group.wait(signals.fd());
      announce_exits(round, result);
    }
    if (result.state == WaitResult::State::kSucceeded) {
      group.stop();  // ends whatever the workers left running in their process groups
      return 0;
    }
    if (result.state == WaitResult::State::kInterrupted) {
      int signo = signals.take();
      say("received " + elastic::signal_name(signo) + "; stopping " +
          std::to_string(group.running()) + " worker(s): SIGTERM now, SIGKILL after " +
          detail::seconds_text(options.grace_period_s));
      group.stop(signals.fd());
      return 128 + signo;
    }

    if (group.running() > 0) {
      say("rank " + std::to_string(result.failures.front().global_rank) +
          " failed; stopping the other " + std::to_string(group.running()) +
          " worker(s) of this node");
    }
    group.stop(signals.fd());
    print_failure_summary(result, round);
    if (int signo = signals.take(); signo != 0) {
      say("received " + elastic::signal_name(signo) + "; not restarting");
      return 128 + signo;
    }
    int exit_code = result.failures.front().launcher_exit_code();
    if (result.failures.front().usage_error() && options.max_restarts > 0) {
      say("not restarting: exit code 2 is a usage error (a bad flag, variable or file), which a "
          "restart cannot fix; exiting with code 2");
      return exit_code;
    }
    if (restarts >= options.max_restarts) {
      say("no restarts left (--max-restarts " + std::to_string(options.max_restarts) +
          "); exiting with code " + std::to_string(exit_code));
      return exit_code;
    }
    ++restarts;
    say("restarting the worker group of this node: attempt " + std::to_string(restarts) +
        " (restart " + std::to_string(restarts) + " of " + std::to_string(options.max_restarts) +
        ")");
  }
}

}  // namespace

LaunchPlan prepare_launch(const RunOptions& options) {
  LaunchPlan plan;
  const std::string& program = options.command.front();
  std::string why;
  // torchrun runs its script with its own interpreter; `dtrain run` is not Python, so it uses
  // $DTRAIN_PYTHON or python3. "-u" as in torchrun: unbuffered output reaches the relay line by
  // line.
  if (!options.no_python && ends_with(program, ".py")) {
    const char* configured = std::getenv("DTRAIN_PYTHON");
    bool from_variable = configured != nullptr && *configured != '\0';
    std::string interpreter =
        elastic::find_executable(from_variable ? configured : "python3", &why);
    if (interpreter.empty() && from_variable) {
      fail("DTRAIN_PYTHON: '" + std::string(configured) + "': " + why +
           "; expected a Python interpreter (a path or a name on PATH)");
    }
    if (interpreter.empty()) {
      fail("program '" + program + "' is a Python script, but python3 is " + why +
           "; set DTRAIN_PYTHON to an interpreter or pass --no-python");
    }
    if (access(program.c_str(), R_OK) != 0) {
      fail("program '" + program + "': " + (errno == ENOENT ? "no such file" : "not readable"));
    }
    plan.command = {interpreter, "-u"};
    plan.command.insert(plan.command.end(), options.command.begin(), options.command.end());
  } else {
    if (elastic::find_executable(program, &why).empty()) {
      fail("program '" + program + "': " + why +
           "; expected an executable (a path or a name on PATH)");
    }
    plan.command = options.command;
  }

  if (!options.log_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(options.log_dir, error);
    if (error || !std::filesystem::is_directory(options.log_dir) ||
        access(options.log_dir.c_str(), W_OK) != 0) {
      fail("--log-dir: cannot create or write '" + options.log_dir + "'" +
           (error ? ": " + error.message() : std::string()) + "; expected a writable directory");
    }
  }

  plan.auto_port = options.master_port == 0;
  if (!plan.auto_port && !is_elastic(options)) {
    elastic::PortProbe probe = elastic::probe_port(options.master_addr, options.master_port);
    if (probe == elastic::PortProbe::kUnresolvable) {
      fail("--master-addr: cannot resolve '" + options.master_addr +
           "'; expected a host name or address of the node running rank 0");
    }
    // Only the node whose rank 0 will host the store checks: elsewhere the port is the master's
    // business.
    if (probe == elastic::PortProbe::kInUse && options.node_rank == 0) {
      fail("--master-port " + std::to_string(options.master_port) + ": port is already in use on " +
           options.master_addr + "; pick another or pass 0 for a free one");
    }
  }
  return plan;
}

std::string oversubscription_warning(int ranks, int cores) {
  if (ranks <= cores) return {};
  // Each rank of a CPU job wants a core of its own: with fewer, the kernel time-slices them, every
  // collective waits for the slowest, and the job runs slower than with fewer ranks.
  return "warning: --nproc-per-node " + std::to_string(ranks) + " starts " + std::to_string(ranks) +
         " ranks on this node, but this process may use only " + std::to_string(cores) +
         " CPU core(s) (its affinity mask): the ranks share cores and " +
         "every step slows down; run at most " + std::to_string(cores) +
         " rank(s) here, and keep OMP_NUM_THREADS at 1";
}

int run_main(const std::vector<std::string>& args) {
  RunOptions options;
  LaunchPlan plan;
  try {
    options = parse_run_options(args);
    if (options.help) {
      std::string usage = run_usage();
      ssize_t ignored = write(1, usage.data(), usage.size());
      (void)ignored;
      return 0;
    }
    plan = prepare_launch(options);
  } catch (const UsageError& error) {
    print_error(error);
    return 2;
  }
  if (std::string warning = oversubscription_warning(options.nproc_per_node, usable_cpus());
      !warning.empty()) {
    say(warning);
  }
  try {
    return is_elastic(options) ? run_elastic(options, plan) : run_workers(options, plan);
  } catch (const UsageError& error) {
    print_error(error);
    return 2;
  } catch (const std::exception& error) {
    // WorkerGroup's destructor has killed and reaped the workers by now.
    print_error(error);
    return 1;
  }
}

}  // namespace dtrain::cli
