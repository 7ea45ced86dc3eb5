// The flags of `dtrain run`, torchrun's names and meanings: parsing them into RunOptions and
// checking the combinations. Pure functions of the argument list (no file system, no network), so
// every rule can be unit-tested; the checks that look at the machine live in run_command.cpp.
#pragma once

#include <string>
#include <vector>

namespace dtrain::cli {

struct RunOptions {
  // Workers on this node: --nproc-per-node N, or 'auto'/'cpu' for the CPUs this process may run on.
  int nproc_per_node = 1;
  // Nodes in the job: --nnodes N (or N:N). Static for now: every node runs its own `dtrain run`.
  int nnodes = 1;
  // This node's rank among the nodes: --node-rank, 0 <= node_rank < nnodes.
  int node_rank = 0;
  // Host of the node running global rank 0, which hosts the store: --master-addr.
  std::string master_addr = "127.0.0.1";
  // Store port: --master-port. 0 picks a free one for every attempt (single node only).
  int master_port = 0;
  // How often the local group is restarted after a failure before giving up: --max-restarts.
  int max_restarts = 0;
  // When not empty, each rank's output is also appended to <log_dir>/rank<R>.log: --log-dir.
  std::string log_dir;
  // TORCHELASTIC_RUN_ID: --run-id or torchrun's --rdzv-id; torchrun's default is "none".
  std::string run_id = "none";
  // Seconds between SIGTERM and SIGKILL when stopping workers: --grace-period.
  double grace_period_s = 5.0;
  // Run a .py program directly instead of through the Python interpreter: --no-python.
  bool no_python = false;
  // --standalone: a single node with a free port (torchrun's flag; accepted for compatibility).
  bool standalone = false;
  // -h/--help was given: print the usage and exit 0, whatever else is on the line.
  bool help = false;
  // The program and its arguments, exactly as given after the flags (or after "--").
  std::vector<std::string> command;
};

// Parses the arguments that follow "dtrain run". Throws dtrain::UsageError whose what() is the one
// line to print, e.g. "dtrain run: --nproc-per-node: expected a positive integer or 'auto', got
// '0'".
RunOptions parse_run_options(const std::vector<std::string>& args);

// The text `dtrain run --help` prints.
std::string run_usage();

}  // namespace dtrain::cli
