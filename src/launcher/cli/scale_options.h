// The flags of `dtrain scale`: parsing them into ScaleOptions. A pure function of the argument list
// (no file system), so every rule is unit-tested; the program itself is checked by the launcher's
// own prepare_launch (run_command.h) when the runs start.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::cli {

// The fewest hosts of `per_host` workers each that hold `workers` workers.
inline int hosts_for(int workers, int per_host) { return (workers + per_host - 1) / per_host; }

struct ScaleOptions {
  // Worker counts to run, ascending, no duplicates: --nproc 1,2,4. Inside a Slurm allocation the
  // default is allocation_counts() of its tasks instead, on several hosts node_counts().
  std::vector<int> nproc = {1, 2};
  bool nproc_given = false;
  // Steps every rank records after the warm-up before the workers are stopped: --steps K. The
  // default (20) applies when neither --steps nor --seconds is given.
  int steps = 20;
  // Stop each run after this many seconds instead: --seconds S (excludes --steps).
  std::optional<double> seconds;
  // Records of each rank dropped before measuring (first steps allocate, build buckets, warm
  // caches): --warmup-steps W.
  int warmup_steps = 3;
  // Longest run of one worker count before it is stopped and reported as over the time limit:
  // --time-limit S. Ends the wait for a program that never records K steps.
  double time_limit_s = 300;
  // Another interconnect bandwidth for the prediction, Gbit/s: --link-gbps G.
  std::optional<double> link_gbps;
  // Where to draw speed-up against workers (SVG): --plot FILE.svg.
  std::string plot_path;
  // One JSON document on stdout instead of the table: --json.
  bool json = false;
  // Keep each run's worker logs and profile records under DIR/workers<N>/: --log-dir DIR.
  std::string log_dir;
  // Seconds between SIGTERM and SIGKILL when stopping workers: --grace-period.
  double grace_period_s = 5.0;
  // Run a .py program directly instead of through the Python interpreter: --no-python.
  bool no_python = false;
  // Several hosts outside Slurm, with torchrun's static flags as `dtrain run` takes them: every
  // host runs the same `dtrain scale` with its own --node-rank. Counts are totals over the hosts:
  // count W runs on nodes_for(W) of them, --nproc-per-node on each but the last. Node 0 hosts the
  // coordination store at --master-addr:--master-port and reports; the workers of the i-th count
  // (from 0) meet at port master_port + 1 + i on node 0 (scale_nodes.h).
  int nnodes = 1;                         // --nnodes N
  int node_rank = 0;                      // --node-rank R, 0 <= R < N
  std::string master_addr = "127.0.0.1";  // --master-addr HOST: node 0, as the others reach it
  int master_port = 0;                    // --master-port P: required with --nnodes above 1
  int nproc_per_node = 1;                 // --nproc-per-node K
  int nodes_for(int workers) const { return hosts_for(workers, nproc_per_node); }
  // -h/--help: print the usage and exit 0.
  bool help = false;
  // The program and its arguments, as given after the flags (or after "--").
  std::vector<std::string> command;
};

// Parses the arguments that follow "dtrain scale". Throws dtrain::UsageError whose what() is the
// one line to print, e.g. "dtrain scale: --nproc: expected worker counts like 1,2,4 (integers in
// 1..1024), got '0'".
ScaleOptions parse_scale_options(const std::vector<std::string>& args);

// The Slurm allocation `dtrain scale` runs in (sbatch, salloc): the tasks it gives, on how many
// nodes, and the most on one node. Each worker count then runs as one srun step of that many tasks
// on as few of its nodes as hold them.
struct SlurmAllocation {
  std::string job_id;      // SLURM_JOB_ID
  int tasks = 1;           // SLURM_NTASKS, else nodes x SLURM_NTASKS_PER_NODE, else nodes
  int nodes = 1;           // SLURM_JOB_NUM_NODES (SLURM_NNODES)
  int tasks_per_node = 1;  // SLURM_NTASKS_PER_NODE, else tasks / nodes rounded up
  // srun's --nodes for `workers` tasks: the fewest nodes that hold them.
  int nodes_for(int workers) const { return hosts_for(workers, tasks_per_node); }
};

// The allocation described by `getenv` (SLURM_JOB_ID and SLURM_JOB_NUM_NODES set), or nullopt
// outside one. Throws dtrain::UsageError naming a variable whose value is not a positive integer.
std::optional<SlurmAllocation> slurm_allocation(
    const std::function<const char*(const char*)>& getenv);

// The worker counts measured by default in an allocation of `tasks` tasks: the powers of two below
// it, then `tasks` itself (6: 1,2,4,6).
std::vector<int> allocation_counts(int tasks);

// The worker counts measured by default on `nnodes` hosts of `per_node` workers each: 1, then each
// whole number of hosts (2 hosts of 2: 1,2,4), so the jump from one host to two is measured.
std::vector<int> node_counts(int nnodes, int per_node);

// Fits options.nproc to `allocation`: the default counts become allocation_counts(); counts given
// with --nproc must not exceed its tasks (UsageError naming SLURM_NTASKS otherwise).
// Throws UsageError when --nnodes is given too (the allocation's nodes are the hosts).
void fit_to_allocation(ScaleOptions& options, const SlurmAllocation& allocation);

// The text `dtrain scale --help` prints.
std::string scale_usage();

}  // namespace dtrain::cli
