// Parsing `dtrain scale`'s flags (see scale_options.h) with CLI11 (flags.h), spelled as in `dtrain
// run`: "--flag value" and "--flag=value"; the first word that is not a flag (or the word after
// "--") starts the program.
#include "launcher/cli/scale_options.h"

#include <algorithm>
#include <string_view>

#include "common/format.h"
#include "dtrain/errors.h"
#include "launcher/cli/flags.h"
#include "launcher/cli/run_options.h"

namespace dtrain::cli {
namespace {

[[noreturn]] void fail(const std::string& message) { throw UsageError("dtrain scale: " + message); }

constexpr int kMaxWorkers = 1024;

// "1,2,4": ascending after sorting, no duplicates.
std::vector<int> parse_nproc(const std::string& text) {
  const std::string expected =
      "worker counts like 1,2,4 (integers in 1.." + std::to_string(kMaxWorkers) + ")";
  auto bad = [&](const std::string& what) { fail("--nproc: " + expected_but_got(what, text)); };
  std::vector<int> counts;
  std::string_view rest = text;
  do {
    std::size_t comma = rest.find(',');
    std::optional<long long> value = integer_in(rest.substr(0, comma), 1, kMaxWorkers);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (!value || (comma != std::string_view::npos && rest.empty())) bad(expected);
    counts.push_back(static_cast<int>(*value));
  } while (!rest.empty());
  std::sort(counts.begin(), counts.end());
  if (std::adjacent_find(counts.begin(), counts.end()) != counts.end())
    bad(expected + ", each once");
  return counts;
}

bool ends_with(const std::string& text, std::string_view suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

ScaleOptions parse_scale_options(const std::vector<std::string>& args) {
  ScaleOptions options;
  CLI::App app;
  prepare_command_line(app, "dtrain scale");
  auto integer_range = [](long long low, long long high) {
    return integer(low, high, "an integer in " + std::to_string(low) + ".." + std::to_string(high));
  };
  std::string nproc;
  CLI::Option* nproc_flag = add_valued_flag(app, "--nproc", nproc);
  CLI::Option* steps = add_valued_flag(app, "--steps", options.steps, {integer_range(1, 1000000)});
  double seconds = 0;
  CLI::Option* seconds_flag = add_valued_flag(
      app, "--seconds", seconds, {number(0, 86400, "a number of seconds in (0, 86400]")});
  add_valued_flag(app, "--warmup-steps", options.warmup_steps, {integer_range(0, 1000000)});
  add_valued_flag(app, "--time-limit", options.time_limit_s,
                  {number(0, 7 * 86400.0, "a number of seconds above 0 (at most a week)")});
  double link_gbps = 0;
  CLI::Option* link_gbps_flag = add_valued_flag(
      app, "--link-gbps", link_gbps, {number(0, 1e6, "a bandwidth in Gbit/s above 0 (e.g. 100)")});
  CLI::Option* plot =
      add_valued_flag(app, "--plot", options.plot_path, {non_empty("a file name ending in .svg")});
  add_valued_flag(app, "--log-dir", options.log_dir, {non_empty("a directory")});
  add_valued_flag(app, "--grace-period", options.grace_period_s,
                  {number(0, 3600, "a number of seconds in (0, 3600]")});
  add_switch(app, "--json", options.json);
  add_switch(app, "--no-python", options.no_python);
  // Several hosts: torchrun's names and spellings, as `dtrain run` takes them (run_options.h).
  auto node_flag = [&app](std::string_view name, auto& target, CLI::Validator check) {
    return add_valued_flag(app, with_underscores(name), target, {std::move(check)});
  };
  node_flag("--nnodes", options.nnodes, integer_range(1, 1 << 16));
  CLI::Option* master_port =
      node_flag("--master-port", options.master_port, integer_range(1, 65535));
  const std::vector<std::pair<const char*, CLI::Option*>> node_flags = {
      {"--node-rank", node_flag("--node-rank", options.node_rank, integer_range(0, 1 << 16))},
      {"--master-addr",
       node_flag("--master-addr", options.master_addr, non_empty("a host name or address"))},
      {"--master-port", master_port},
      {"--nproc-per-node",
       node_flag("--nproc-per-node", options.nproc_per_node, integer_range(1, kMaxWorkers))}};

  std::optional<std::vector<std::string>> command = parse_command_line(app, args);
  if (!command) {
    options.help = true;
    return options;
  }
  options.command = std::move(*command);
  if (nproc_flag->count() > 0) {
    options.nproc = parse_nproc(nproc);
    options.nproc_given = true;
  }
  if (seconds_flag->count() > 0) options.seconds = seconds;
  if (link_gbps_flag->count() > 0) options.link_gbps = link_gbps;
  if (plot->count() > 0 && !ends_with(options.plot_path, ".svg")) {
    fail("--plot: only SVG is supported (a file name ending in .svg), got '" + options.plot_path +
         "'; convert it afterwards, e.g. `rsvg-convert -o plot.png plot.svg`");
  }
  if (steps->count() > 0 && options.seconds) {
    fail(
        "--steps and --seconds: give one of the two (stop after K measured steps, or after S "
        "seconds)");
  }
  if (options.seconds && *options.seconds >= options.time_limit_s) {
    fail("--time-limit: must exceed --seconds (" + detail::seconds_text(*options.seconds) +
         "), got " + detail::seconds_text(options.time_limit_s) +
         "; raise --time-limit or lower --seconds");
  }
  if (options.command.empty()) {
    fail("no program given; expected `dtrain scale [flags] [--] program [args...]`");
  }
  if (options.nnodes == 1) {
    for (const auto& [name, flag] : node_flags) {
      if (flag->count() > 0) {
        fail(std::string(name) + ": for several hosts, with --nnodes N above 1; give --nnodes " +
             "too (or leave it out to measure this host alone)");
      }
    }
    return options;
  }
  if (std::string problem = node_rank_problem(options.node_rank, options.nnodes);
      !problem.empty()) {
    fail(problem);
  }
  const int most = options.nnodes * options.nproc_per_node;
  if (!options.nproc_given) options.nproc = node_counts(options.nnodes, options.nproc_per_node);
  if (options.nproc.back() > most) {
    fail("--nproc: " + std::to_string(options.nproc.back()) + " workers, but --nnodes " +
         std::to_string(options.nnodes) + " x --nproc-per-node " +
         std::to_string(options.nproc_per_node) + " hold " + std::to_string(most) +
         "; lower the count or raise --nproc-per-node");
  }
  // Count i's workers meet at master_port + 1 + i.
  if (master_port->count() == 0 ||
      options.master_port + static_cast<int>(options.nproc.size()) > 65535) {
    fail("--master-port: required with --nnodes " + std::to_string(options.nnodes) +
         " (the same on every host), with the " + std::to_string(options.nproc.size()) +
         " port(s) above it free on node 0 (one per count), got " +
         (master_port->count() == 0 ? "none" : "'" + std::to_string(options.master_port) + "'"));
  }
  return options;
}

std::optional<SlurmAllocation> slurm_allocation(
    const std::function<const char*(const char*)>& getenv) {
  auto text = [&](const char* name) -> std::string {
    const char* value = getenv(name);
    return value == nullptr ? std::string() : std::string(value);
  };
  const char* nodes_name = getenv("SLURM_JOB_NUM_NODES") ? "SLURM_JOB_NUM_NODES" : "SLURM_NNODES";
  if (text("SLURM_JOB_ID").empty() || text(nodes_name).empty()) return std::nullopt;
  auto positive = [&](const char* name) {
    std::optional<long long> value = integer_in(text(name), 1, 1 << 20);
    if (!value) {
      fail("inside Slurm allocation " + text("SLURM_JOB_ID") + ": " + name + "=" + text(name) +
           " is not a positive integer; run dtrain scale from sbatch or salloc");
    }
    return static_cast<int>(*value);
  };
  SlurmAllocation allocation;
  allocation.job_id = text("SLURM_JOB_ID");
  allocation.nodes = positive(nodes_name);
  // "2" with --ntasks-per-node=2; salloc/sbatch leave it unset otherwise.
  std::optional<int> per_node;
  if (!text("SLURM_NTASKS_PER_NODE").empty()) per_node = positive("SLURM_NTASKS_PER_NODE");
  if (!text("SLURM_NTASKS").empty()) {
    allocation.tasks = positive("SLURM_NTASKS");
  } else {
    allocation.tasks = allocation.nodes * per_node.value_or(1);
  }
  allocation.tasks_per_node =
      per_node.value_or((allocation.tasks + allocation.nodes - 1) / allocation.nodes);
  return allocation;
}

std::vector<int> allocation_counts(int tasks) {
  std::vector<int> counts;
  for (int count = 1; count < tasks; count *= 2) counts.push_back(count);
  counts.push_back(tasks);
  return counts;
}

std::vector<int> node_counts(int nnodes, int per_node) {
  std::vector<int> counts = {1};
  for (int nodes = 1; nodes <= nnodes; ++nodes) {
    if (nodes * per_node > 1) counts.push_back(nodes * per_node);
  }
  return counts;
}

void fit_to_allocation(ScaleOptions& options, const SlurmAllocation& allocation) {
  if (options.nnodes > 1) {
    fail("--nnodes: inside Slurm allocation " + allocation.job_id +
         " the hosts are the allocation's nodes; drop --nnodes, --node-rank and the master flags");
  }
  if (!options.nproc_given) {
    options.nproc = allocation_counts(allocation.tasks);
    return;
  }
  if (options.nproc.back() > allocation.tasks) {
    fail("--nproc: " + std::to_string(options.nproc.back()) + " workers, but Slurm allocation " +
         allocation.job_id + " gives " + std::to_string(allocation.tasks) +
         " tasks (SLURM_NTASKS); ask for more (sbatch --ntasks) or leave --nproc out to measure " +
         "the allocation's own counts");
  }
}

std::string scale_usage() {
  return R"(usage: dtrain scale [flags] [--] program [args...]

Runs the program at each worker count under the same launcher as `dtrain run`, for a bounded time
each, with DTRAIN_PROFILE pointed at a temporary file, and reports whether more workers pay off:
samples/s, speed-up, parallel efficiency, where a step's time goes, a verdict per count with its
reason, and a prediction for 8, 16 and 64 workers from an alpha-beta model of the all-reduce.

flags:
  --nproc LIST          worker counts to run, e.g. 1,2,4 (default 1,2; in a Slurm allocation
                        of T tasks, the powers of two below T and T)
  --steps K             stop each run once every rank recorded K steps after the warm-up
                        (default 20)
  --seconds S           stop each run after S seconds instead (excludes --steps)
  --warmup-steps W      records of each rank dropped before measuring (default 3)
  --time-limit S        longest run of one count; a run still short of its steps then is stopped
                        and reported as over the limit (default 300)
  --link-gbps G         also predict with this interconnect bandwidth (Gbit/s)
  --plot FILE.svg       draw speed-up against workers: ideal, measured, predicted (SVG only)
  --json                print one JSON document on stdout instead of the table
  --log-dir DIR         keep each run's worker logs and profile records in DIR/workers<N>/
                        (default: a temporary folder, removed at the end)
  --grace-period S      seconds between SIGTERM and SIGKILL when stopping workers (default 5)
  --no-python           run a .py program directly, not through python3
  -h, --help            this text

several hosts (outside Slurm; every host runs the same command with its own --node-rank):
  --nnodes N            hosts in the job; counts are totals over them (default 1: this host)
  --node-rank R         this host's rank, 0 <= R < N; node 0 coordinates and reports
  --master-addr HOST    node 0, as the other hosts reach it (default 127.0.0.1)
  --master-port P       node 0's coordination store; the workers of the i-th count (from 0) meet
                        at P + 1 + i on node 0 (required with --nnodes above 1)
  --nproc-per-node K    workers per host (default 1); count W runs on the fewest hosts that hold
                        it. Default counts: 1, then K, 2K, ... N x K (the jump from one host to
                        two). The other hosts send their records to node 0 through its store; the
                        report notes the counts that crossed hosts, and once one did, the fitted
                        bandwidth is the link's between them.

Inside a Slurm allocation (sbatch, salloc: SLURM_JOB_ID and SLURM_JOB_NUM_NODES set), each
count runs as one step, `srun --ntasks=N --nodes=M --kill-on-bad-exit=1 program`, on the fewest
of the allocation's nodes that hold N tasks; the ranks take their places from Slurm's variables.
Give --log-dir on a file system every node shares when the allocation spans several.

Programs built on dtrain's DDP or DataParallel write the per-step records themselves. Any other
program (a PyTorch script) is measured by what it prints: the last "<number> samples/s" text or
JSON "samples_per_s" field of the lowest rank that prints one is taken as the whole job's
throughput; without one, only its run time (start to exit) is compared, which assumes it does the
same total work at every count. Exit code: 0 when every count ran, 1 when one failed (it is
reported in the table), 2 for bad flags.
)";
}

}  // namespace dtrain::cli
