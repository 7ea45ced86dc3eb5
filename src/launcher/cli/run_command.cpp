// `dtrain run`: the machine checks, the failure summary and the other pieces the agent (agent.h)
// shares, and run_main, which turns the flags into an agent run and its outcome into an exit code
// (see run_command.h). The agent's one loop runs the workers under a static or an elastic
// rendezvous, restarting them after failures.
#include "launcher/cli/run_command.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <system_error>

#include "common/format.h"
#include "dtrain/errors.h"
#include "launcher/cli/agent.h"
#include "launcher/elastic/ports.h"

namespace dtrain::cli {

using elastic::WaitResult;
using elastic::WorkerExit;

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
  group_options.console_streams = options.console_streams;
  group_options.log_streams = options.log_streams;
  group_options.role = options.role;
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
    if (!elastic::plausible_host(options.master_addr)) {
      fail("--master-addr: '" + options.master_addr +
           "' is not a host name or address; expected one of the node running rank 0");
    }
    elastic::PortProbe probe = elastic::probe_port(options.master_addr, options.master_port);
    // A name that does not resolve yet is waited for, as torchrun's store does: a scheduler may
    // register the master's name only once its node runs, after this one started.
    plan.master_unresolved = probe == elastic::PortProbe::kUnresolvable;
    check_master_port_free(options, probe);
  }
  return plan;
}

void check_master_port_free(const RunOptions& options, elastic::PortProbe probe) {
  // Only the node whose rank 0 will host the store checks: elsewhere the port is the master's
  // business.
  if (probe == elastic::PortProbe::kInUse && options.node_rank == 0) {
    fail("--master-port " + std::to_string(options.master_port) + ": port is already in use on " +
         options.master_addr + "; pick another or pass 0 for a free one");
  }
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
  for (const std::string& warning : options.warnings) say(warning);
  try {
    return run_agent(options, plan);
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
