// The flags of `dtrain run`, torchrun's names and meanings: parsing them into RunOptions and
// checking the combinations. Pure functions of the argument list (no file system, no network), so
// every rule can be unit-tested; the checks that look at the machine live in run_command.cpp.
#pragma once

#include <string>
#include <vector>

namespace dtrain::cli {

// --rdzv-conf key=value,... (seconds unless said otherwise).
struct RendezvousConf {
  // Longest wait for a round to complete: MIN nodes to arrive, or room for a waiting node.
  double timeout_s = 900;
  // After MIN nodes have joined, how long the first round stays open for more (torchrun's 30 s).
  double last_call_timeout_s = 30;
  // Longest wait to reach the rendezvous store at start (the agent hosting it may start later); any
  // one call to it later waits at most min(this, 15 s). Not torchrun's join_timeout, which bounds
  // the whole rendezvous (600 s; dtrain's `timeout`): torchrun's read_timeout (60 s) sets this too.
  double join_timeout_s = 60;
  // Heartbeat period, and missed heartbeats after which a node counts as dead.
  double keep_alive_interval_s = 1;
  int keep_alive_max_attempt = 3;
};

// Bits of a worker's streams in RunOptions::console_streams and log_streams, as torchrun's
// --redirects and --tee number them (3: both).
constexpr int kStdoutStream = 1;
constexpr int kStderrStream = 2;

struct RunOptions {
  // Workers on this node: --nproc-per-node N; 'cpu': the CPUs this process may run on; 'gpu': the
  // CUDA devices it sees; 'auto': the devices if there are any, else the CPUs (torchrun's rules).
  int nproc_per_node = 1;
  // Nodes in the job: --nnodes N, or MIN:MAX for an elastic job (then nnodes is MAX).
  int nnodes = 1;
  int min_nodes = 1;
  // --rdzv-backend: "static" (fixed nodes, --node-rank/--master-addr/--master-port), "c10d" or
  // "etcd" (elastic: agents rendezvous at --rdzv-endpoint).
  std::string rdzv_backend = "static";
  // --rdzv-endpoint HOST[:PORT]; the port defaults to 29400 (c10d) or 2379 (etcd). With etcd, the
  // flag may list every member of its cluster, HOST[:PORT],...: these are the first one's.
  std::string rdzv_host;
  int rdzv_port = 0;
  // --rdzv-endpoint's value as given: one endpoint, or with etcd the list of members.
  std::string rdzv_endpoint;
  RendezvousConf rdzv_conf;
  // --rdzv-token (DTRAIN_RDZV_TOKEN is read by run_command, so it stays out of process listings).
  std::string rdzv_token;
  // Seconds between the agent's looks at the rendezvous while workers run: --monitor-interval.
  double monitor_interval_s = 0.5;
  // This node's rank among the nodes: --node-rank, 0 <= node_rank < nnodes.
  int node_rank = 0;
  // Host of the node running global rank 0, which hosts the store: --master-addr.
  std::string master_addr = "127.0.0.1";
  // Store port: --master-port. 0 picks a free one for every attempt (single node only).
  int master_port = 0;
  // How often the local group is restarted after a failure before giving up: --max-restarts.
  int max_restarts = 0;
  // --recovery: "restart" stops the node's workers when one fails and restarts them all (they
  // resume from their checkpoint); "in-place" restarts only the failed worker, as a newcomer the
  // survivors admit into their group (under c10d/etcd a node lost or joining changes the running
  // round in place too: Note [Rounds in place]). In place by default: the workers of a program
  // that does not recover in place restart together anyway (in_place_recovery.h). Workers see it
  // as DTRAIN_RECOVERY.
  std::string recovery = "in-place";
  // When not empty, each rank's output is also appended to <log_dir>/rank<R>.log: --log-dir.
  std::string log_dir;
  // Which streams of local rank i go to the console and to its log file (bits kStdoutStream,
  // kStderrStream), from torchrun's --redirects (file only), --tee (file and console) and
  // --local-ranks-filter (the console shows only these ranks). Empty when none of the three is
  // given: every stream to the console, and to the log with --log-dir.
  std::vector<int> console_streams;
  std::vector<int> log_streams;
  // ROLE_NAME of the workers: --role (torchrun's default "default").
  std::string role = "default";
  // The address this node advertises to the other agents of an elastic job, which becomes
  // MASTER_ADDR when it runs rank 0: --local-addr. Empty: the address of the route to the
  // rendezvous endpoint.
  std::string local_addr;
  // --start-method spawn|fork|forkserver: accepted for torchrun's command lines; every worker is a
  // new program (fork and exec), which is what spawn gives a Python worker.
  std::string start_method = "spawn";
  // One line each (without "dtrain run: ") for flags that were accepted but change nothing here;
  // run_main prints them.
  std::vector<std::string> warnings;
  // TORCHELASTIC_RUN_ID: --run-id or torchrun's --rdzv-id; torchrun's default is "none" (a single
  // node with a free port gets a random one instead, see run_command.cpp).
  std::string run_id = "none";
  // --run-id or --rdzv-id was given.
  bool run_id_given = false;
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
// line to print, e.g. "dtrain run: --nproc-per-node: expected a positive integer, 'auto', 'cpu'
// or 'gpu', got '0'".
RunOptions parse_run_options(const std::vector<std::string>& args);

// "--node-rank: expected an integer in 0..N-1 (below --nnodes N), got 'R'" when R >= N, else "":
// the rule `dtrain run` and `dtrain scale` share.
std::string node_rank_problem(int node_rank, int nnodes);

// Whether the options ask for the elastic rendezvous (c10d or etcd) rather than the static one.
inline bool is_elastic(const RunOptions& options) { return options.rdzv_backend != "static"; }

// Whether a failed worker is restarted alone (--recovery in-place).
inline bool recovers_in_place(const RunOptions& options) { return options.recovery == "in-place"; }

// The CPUs this process may run on (its affinity mask, which taskset and container limits narrow):
// what --nproc-per-node auto means on a machine without GPUs.
int usable_cpus();

// The CUDA devices this process sees (CUDA_VISIBLE_DEVICES narrows them), 0 without an NVIDIA
// driver: what --nproc-per-node gpu means, and auto where there are any.
int visible_gpus();

// The text `dtrain run --help` prints.
std::string run_usage();

}  // namespace dtrain::cli
