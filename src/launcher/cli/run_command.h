// `dtrain run`: checks the flags against the machine (program, interpreter, port, log folder), then
// hands over to the agent (agent.h), whose one loop runs the local worker group under a static or
// elastic rendezvous, restarting it after failures, and turns the outcome into an exit code.
#pragma once

#include <string>
#include <vector>

#include "launcher/cli/run_options.h"
#include "launcher/elastic/ports.h"
#include "launcher/elastic/worker_group.h"

namespace dtrain::cli {

// What the checks against the machine resolved.
struct LaunchPlan {
  // argv of every worker, with the Python interpreter in front for a .py program.
  std::vector<std::string> command;
  // Whether a fresh free port is picked for every attempt (no --master-port on a single node).
  bool auto_port = false;
  // --master-addr's name did not resolve when checked: the static rendezvous waits for it before
  // the first round (static_rendezvous.h), and node 0 checks the port then.
  bool master_unresolved = false;
};

// Checks what parse_run_options cannot: the program (or interpreter) exists and is executable, the
// log folder can be created, and an explicit master port can be bound when this node hosts the
// master (once --master-addr resolves: a name that does not resolve yet is no bad flag, a host
// that can be nobody's name is). Throws dtrain::UsageError with a one-line message.
LaunchPlan prepare_launch(const RunOptions& options);

// Node 0's check that the store's port is free at --master-addr, given probe_port()'s answer.
// Throws dtrain::UsageError when it is in use.
void check_master_port_free(const RunOptions& options, elastic::PortProbe probe);

// The warning `dtrain run` gives when `ranks` workers on this node outnumber the `cores` CPU cores
// the launcher may use (usable_cpus()), or "" when they fit.
std::string oversubscription_warning(int ranks, int cores);

// Entry point of `dtrain run ARGS...`: returns the process exit code (see run_usage()). Prints the
// usage for --help, one line and 2 for bad input; blocks until the workers are done.
int run_main(const std::vector<std::string>& args);

// Shared with the agent (agent.cpp) and its rendezvous and recovery.
// One launcher line ("dtrain run: <message>") to stderr in one write.
void say(const std::string& message);
// One line for an exception (dtrain's own messages already start with "dtrain run: ").
void print_error(const std::exception& error);
// The first failing worker, how it ended, and its last stderr lines.
void print_failure_summary(const elastic::WaitResult& result,
                           const elastic::WorkerGroupRound& round);
// The worker group's options from the flags; makes this process the workers' subreaper.
elastic::WorkerGroupOptions worker_group_options(const RunOptions& options, const LaunchPlan& plan);

}  // namespace dtrain::cli
