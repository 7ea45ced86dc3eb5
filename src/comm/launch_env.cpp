// Reads who this process is from a launcher's environment: torchrun / `dtrain run`, Slurm's srun,
// Open MPI's mpirun. One binary then runs under any of them without flags.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "comm/thread_launch.h"
#include "dtrain/comm.h"

namespace dtrain {
namespace {

using Getenv = std::function<const char*(const char*)>;

// Parses a whole decimal integer in [min, max]; anything else is a UsageError naming the variable.
int parse_int(const Getenv& env, const char* name, int min, int max, const std::string& accepted) {
  const char* text = env(name);
  std::string value = text ? text : "";
  errno = 0;
  char* end = nullptr;
  long parsed = value.empty() ? 0 : std::strtol(value.c_str(), &end, 10);
  if (value.empty() || errno != 0 || *end != '\0' || parsed < min || parsed > max) {
    throw UsageError("environment variable " + std::string(name) + "='" + value + "': expected " +
                     accepted +
                     ". Launch with `dtrain run`, torchrun, srun or mpirun, or fix the variable.");
  }
  return static_cast<int>(parsed);
}

// A restart counter: 0 when unset; a UsageError naming it when it is not a count.
int64_t restart_count(const Getenv& env, const char* name, const char* set_by) {
  const char* value = env(name);
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  long long count = std::strtoll(value, &end, 10);
  if (*end != '\0' || count < 0 || errno != 0) {
    throw UsageError(std::string(name) + " '" + value +
                     "': expected a non-negative integer (set by " + set_by +
                     "); unset it or fix it");
  }
  return count;
}

bool has(const Getenv& env, const char* name) {
  const char* value = env(name);
  return value != nullptr && *value != '\0';
}

std::string get(const Getenv& env, const char* name) {
  const char* value = env(name);
  return value ? value : "";
}

// The first host of a Slurm node list: "node[03-05,9],gpu1" -> "node03"; "a,b" -> "a".
std::string first_slurm_host(const std::string& nodelist) {
  std::string host;
  for (size_t i = 0; i < nodelist.size(); ++i) {
    char c = nodelist[i];
    if (c == ',') break;
    if (c == '[') {
      size_t stop = nodelist.find_first_of("-,]", i + 1);
      host += nodelist.substr(i + 1, stop - i - 1);
      break;
    }
    host += c;
  }
  return host;
}

void fill_master(const Getenv& env, LaunchInfo& info) {
  info.master_addr = get(env, "MASTER_ADDR");
  if (has(env, "MASTER_PORT")) {
    info.master_port = parse_int(env, "MASTER_PORT", 1, 65535, "a TCP port in 1..65535");
  }
}

thread_local const detail::ThreadLaunch* thread_launch = nullptr;

}  // namespace

namespace detail {

const ThreadLaunch* current_thread_launch() { return thread_launch; }

ScopedThreadLaunch::ScopedThreadLaunch(ThreadLaunch launch)
    : launch_(std::move(launch)), previous_(thread_launch) {
  thread_launch = &launch_;
}

ScopedThreadLaunch::~ScopedThreadLaunch() { thread_launch = previous_; }

}  // namespace detail

LaunchInfo launch_info_from_env(const Getenv& getenv_override) {
  if (thread_launch != nullptr && !getenv_override) {
    // A rank of dtrain::spawn's thread mode: the process environment describes the process, not the
    // rank.
    LaunchInfo info;
    info.rank = info.local_rank = thread_launch->rank;
    info.world_size = info.local_world_size = thread_launch->world_size;
    info.source = "spawn-threads";
    return info;
  }
  Getenv env =
      getenv_override ? getenv_override : Getenv([](const char* n) { return std::getenv(n); });
  LaunchInfo info;
  const std::string count = "a non-negative integer";

  if (has(env, "RANK") || has(env, "WORLD_SIZE")) {
    // torchrun and `dtrain run`: both variables or neither.
    info.source = "torchrun";
    info.world_size =
        parse_int(env, "WORLD_SIZE", 1, INT_MAX, "a positive integer (set with RANK)");
    info.rank = parse_int(env, "RANK", 0, info.world_size - 1,
                          "an integer in 0.." + std::to_string(info.world_size - 1) +
                              " (WORLD_SIZE=" + std::to_string(info.world_size) + ")");
    info.local_world_size =
        has(env, "LOCAL_WORLD_SIZE")
            ? parse_int(env, "LOCAL_WORLD_SIZE", 1, info.world_size, "an integer in 1..WORLD_SIZE")
            : info.world_size;
    info.local_rank = has(env, "LOCAL_RANK")
                          ? parse_int(env, "LOCAL_RANK", 0, info.local_world_size - 1,
                                      "an integer in 0..LOCAL_WORLD_SIZE-1")
                          : info.rank % info.local_world_size;
    info.node_rank = has(env, "GROUP_RANK") ? parse_int(env, "GROUP_RANK", 0, INT_MAX, count)
                                            : info.rank / info.local_world_size;
    fill_master(env, info);
  } else if (has(env, "SLURM_PROCID")) {
    info.source = "slurm";
    info.world_size = parse_int(env, "SLURM_NTASKS", 1, INT_MAX, "a positive integer");
    info.rank =
        parse_int(env, "SLURM_PROCID", 0, info.world_size - 1, "an integer below SLURM_NTASKS");
    info.local_rank =
        has(env, "SLURM_LOCALID") ? parse_int(env, "SLURM_LOCALID", 0, INT_MAX, count) : 0;
    // SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node; otherwise assume an even spread.
    int nodes = has(env, "SLURM_NNODES")
                    ? parse_int(env, "SLURM_NNODES", 1, INT_MAX, "a positive integer")
                    : 1;
    info.local_world_size =
        has(env, "SLURM_NTASKS_PER_NODE")
            ? parse_int(env, "SLURM_NTASKS_PER_NODE", 1, INT_MAX, "a positive integer")
            : (info.world_size + nodes - 1) / nodes;
    info.node_rank =
        has(env, "SLURM_NODEID") ? parse_int(env, "SLURM_NODEID", 0, INT_MAX, count) : 0;
    fill_master(env, info);
    if (info.master_addr.empty()) {
      info.master_addr =
          first_slurm_host(has(env, "SLURM_STEP_NODELIST") ? get(env, "SLURM_STEP_NODELIST")
                                                           : get(env, "SLURM_NODELIST"));
    }
    if (info.master_port == 0 && has(env, "SLURM_JOB_ID")) {
      // Every task of a job derives the same port from the job id (as PyTorch Lightning does), so
      // srun needs no extra variable; jobs sharing a node get different ports.
      info.master_port =
          15000 +
          static_cast<int>(std::strtoul(get(env, "SLURM_JOB_ID").c_str(), nullptr, 10) % 20000);
    }
  } else if (has(env, "OMPI_COMM_WORLD_RANK")) {
    info.source = "openmpi";
    info.world_size = parse_int(env, "OMPI_COMM_WORLD_SIZE", 1, INT_MAX, "a positive integer");
    info.rank = parse_int(env, "OMPI_COMM_WORLD_RANK", 0, info.world_size - 1,
                          "an integer below OMPI_COMM_WORLD_SIZE");
    info.local_world_size =
        has(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
            ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, INT_MAX, "a positive integer")
            : info.world_size;
    info.local_rank = has(env, "OMPI_COMM_WORLD_LOCAL_RANK")
                          ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, INT_MAX, count)
                          : info.rank % info.local_world_size;
    // mpirun places ranks by node in blocks by default (--map-by slot).
    info.node_rank = info.rank / info.local_world_size;
    fill_master(env, info);
  } else {
    info.source = "none";
    fill_master(env, info);
  }
  // The larger, not the sum: the two can count the same event. A requeued Slurm job that runs
  // `dtrain run` starts its launcher afresh (TORCHELASTIC_RESTART_COUNT 0 again), but a requeued
  // node job rejoining an elastic rendezvous that outlived it gets the next round, which counts
  // that requeue too. The larger never counts a restart twice, and is above 0 exactly when either
  // layer restarted this run, which is all that deciding to resume needs.
  info.restarts =
      std::max(restart_count(env, "TORCHELASTIC_RESTART_COUNT", "`dtrain run` or torchrun"),
               restart_count(env, "SLURM_RESTART_COUNT", "Slurm, in a requeued job"));
  return info;
}

}  // namespace dtrain
