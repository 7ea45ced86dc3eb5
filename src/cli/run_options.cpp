// Parsing `dtrain run`'s flags (see run_options.h). Accepted spellings follow torchrun: "--flag
// value",
// "--flag=value", and the underscore forms ("--nproc_per_node") that torchrun also takes.
#include "cli/run_options.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "dtrain/errors.h"

namespace dtrain::cli {
namespace {

[[noreturn]] void fail(const std::string& message) { throw UsageError("dtrain run: " + message); }

[[noreturn]] void bad_value(std::string_view flag, std::string_view expected,
                            std::string_view got) {
  fail(std::string(flag) + ": expected " + std::string(expected) + ", got '" + std::string(got) +
       "'");
}

// The whole of `text` as a decimal int, or nothing: no sign other than '-', no spaces, no overflow.
std::optional<long long> parse_integer(std::string_view text) {
  long long value = 0;
  const char* end = text.data() + text.size();
  auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end) return std::nullopt;
  return value;
}

int parse_in_range(std::string_view flag, std::string_view text, long long low, long long high,
                   std::string_view expected) {
  std::optional<long long> value = parse_integer(text);
  if (!value || *value < low || *value > high) bad_value(flag, expected, text);
  return static_cast<int>(*value);
}

// The CPUs this process may run on (its affinity mask, which taskset and container limits narrow),
// which is what 'auto' means on a machine without GPUs.
int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

enum class Flag {
  kNprocPerNode,
  kNnodes,
  kNodeRank,
  kMasterAddr,
  kMasterPort,
  kMaxRestarts,
  kLogDir,
  kRunId,
  kGracePeriod,
  kNoPython,
  kStandalone,
  kHelp,
};

struct FlagSpec {
  std::string_view name;  // canonical dash spelling, as in error messages
  Flag flag;
  bool takes_value;
};

constexpr FlagSpec kFlags[] = {
    {"--nproc-per-node", Flag::kNprocPerNode, true},
    {"--nnodes", Flag::kNnodes, true},
    {"--node-rank", Flag::kNodeRank, true},
    {"--master-addr", Flag::kMasterAddr, true},
    {"--master-port", Flag::kMasterPort, true},
    {"--max-restarts", Flag::kMaxRestarts, true},
    {"--log-dir", Flag::kLogDir, true},
    {"--run-id", Flag::kRunId, true},
    {"--rdzv-id", Flag::kRunId, true},  // torchrun's name for the run id
    {"--grace-period", Flag::kGracePeriod, true},
    {"--no-python", Flag::kNoPython, false},
    {"--standalone", Flag::kStandalone, false},
    {"--help", Flag::kHelp, false},
    {"-h", Flag::kHelp, false},
};

const FlagSpec* find_flag(std::string_view name) {
  // torchrun accepts "--nproc_per_node" as well as "--nproc-per-node": compare with '_' read as
  // '-'.
  std::string dashed(name);
  std::replace(dashed.begin() + std::min<std::size_t>(2, dashed.size()), dashed.end(), '_', '-');
  for (const FlagSpec& spec : kFlags) {
    if (spec.name == dashed) return &spec;
  }
  return nullptr;
}

void check_combinations(RunOptions& options, bool port_given) {
  if (options.standalone) {
    if (options.nnodes != 1) {
      fail("--standalone: runs a single node, but --nnodes is " + std::to_string(options.nnodes) +
           "; drop one of the two");
    }
    if (port_given && options.master_port != 0) {
      fail("--master-port: --standalone picks a free port itself; drop one of the two, got '" +
           std::to_string(options.master_port) + "'");
    }
  }
  if (options.node_rank >= options.nnodes) {
    fail("--node-rank: expected an integer in 0.." + std::to_string(options.nnodes - 1) +
         " (below --nnodes " + std::to_string(options.nnodes) + "), got '" +
         std::to_string(options.node_rank) + "'");
  }
  if (options.nnodes > 1 && options.master_port == 0) {
    fail("--master-port: required with --nnodes " + std::to_string(options.nnodes) +
         " (every node must name the same port), got " + (port_given ? "'0'" : "none"));
  }
  if (options.command.empty()) {
    fail("no program given; expected `dtrain run [flags] [--] program [args...]`");
  }
}

}  // namespace

RunOptions parse_run_options(const std::vector<std::string>& args) {
  RunOptions options;
  bool port_given = false;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    // The first word that is not a flag starts the program; its own flags are its business.
    if (arg.empty() || arg[0] != '-' || arg == "-") break;

    std::string_view name = arg;
    std::optional<std::string> inline_value;
    if (std::size_t equals = arg.find('=');
        equals != std::string_view::npos && arg.rfind("--", 0) == 0) {
      name = arg.substr(0, equals);
      inline_value = std::string(arg.substr(equals + 1));
    }
    const FlagSpec* spec = find_flag(name);
    if (spec == nullptr) {
      fail("unknown flag '" + std::string(name) +
           "'; see `dtrain run --help` (put the program's own flags after the program)");
    }
    std::string value;
    if (spec->takes_value) {
      if (inline_value) {
        value = *inline_value;
      } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        value = args[++i];
      } else {
        fail(std::string(spec->name) + ": missing value");
      }
    } else if (inline_value) {
      fail(std::string(spec->name) + ": takes no value, got '" + *inline_value + "'");
    }

    switch (spec->flag) {
      case Flag::kNprocPerNode:
        if (value == "auto" || value == "cpu") {
          options.nproc_per_node = usable_cpus();
        } else {
          options.nproc_per_node =
              parse_in_range(spec->name, value, 1, 1 << 20, "a positive integer or 'auto'");
        }
        break;
      case Flag::kNnodes: {
        std::string_view text = value;
        std::size_t colon = text.find(':');
        constexpr std::string_view kExpected = "a positive integer N or N:N";
        int low = parse_in_range(spec->name, text.substr(0, colon), 1, 1 << 20, kExpected);
        int high = low;
        if (colon != std::string_view::npos) {
          high = parse_in_range(spec->name, text.substr(colon + 1), 1, 1 << 20, kExpected);
        }
        if (low != high) {
          fail(std::string(spec->name) +
               ": elastic ranges arrive with the elastic issue; expected a fixed count N or N:N, "
               "got '" +
               value + "'");
        }
        options.nnodes = low;
        break;
      }
      case Flag::kNodeRank:
        options.node_rank = parse_in_range(spec->name, value, 0, 1 << 20, "a non-negative integer");
        break;
      case Flag::kMasterAddr:
        if (value.empty()) bad_value(spec->name, "a host name or address", value);
        options.master_addr = value;
        break;
      case Flag::kMasterPort:
        options.master_port =
            parse_in_range(spec->name, value, 0, 65535, "a port in 1..65535, or 0 for a free one");
        port_given = true;
        break;
      case Flag::kMaxRestarts:
        options.max_restarts =
            parse_in_range(spec->name, value, 0, 1 << 30, "a non-negative integer");
        break;
      case Flag::kLogDir:
        if (value.empty()) bad_value(spec->name, "a directory", value);
        options.log_dir = value;
        break;
      case Flag::kRunId:
        if (value.empty()) bad_value(spec->name, "a non-empty id", value);
        options.run_id = value;
        break;
      case Flag::kGracePeriod: {
        char* end = nullptr;
        double seconds = std::strtod(value.c_str(), &end);
        // A day is far beyond any sane grace period; the bound also keeps the milliseconds in
        // range.
        if (value.empty() || *end != '\0' || !std::isfinite(seconds) || seconds < 0 ||
            seconds > 86400) {
          bad_value(spec->name, "a number of seconds in 0..86400", value);
        }
        options.grace_period_s = seconds;
        break;
      }
      case Flag::kNoPython:
        options.no_python = true;
        break;
      case Flag::kStandalone:
        options.standalone = true;
        break;
      case Flag::kHelp:
        options.help = true;
        return options;  // help wins over everything else on the line, as in torchrun
    }
  }
  options.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  check_combinations(options, port_given);
  return options;
}

std::string run_usage() {
  return R"(usage: dtrain run [flags] [--] program [args...]

Starts --nproc-per-node copies of `program` on this node with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), relays their output prefixed
with [rank<R>]:, stops them all when one fails and restarts the group up to --max-restarts times.
A program ending in .py runs under $DTRAIN_PYTHON (default: python3 on PATH) unless --no-python.

flags (also as --flag=value, and with '_' for '-' as torchrun spells them):
  --nproc-per-node N     workers on this node; 'auto' or 'cpu': one per usable CPU (default 1)
  --nnodes N             nodes in the job (N:N accepted; elastic ranges come later) (default 1)
  --node-rank R          this node's rank, 0 <= R < nnodes (default 0)
  --master-addr HOST     host of the node running rank 0 (default 127.0.0.1)
  --master-port PORT     store port on the master; 0 or absent: a free one (single node only)
  --max-restarts K       restarts of the local group after a failure (default 0)
  --log-dir DIR          also append each rank's output to DIR/rank<R>.log
  --run-id ID            TORCHELASTIC_RUN_ID (alias --rdzv-id) (default none)
  --grace-period SECS    time between SIGTERM and SIGKILL when stopping workers (default 5)
  --no-python            run a .py program directly instead of through python
  --standalone           single node with a free port (torchrun compatibility)
  -h, --help             this text

With --nnodes > 1 every node runs `dtrain run` with its own --node-rank and the same --master-addr
and --master-port; restarts are node-local for now.
Exit code: 0 when every worker succeeds; the first failing worker's exit code (128 + signal if a
signal killed it); 128 + signal when dtrain run itself is interrupted; 2 for bad flags.
)";
}

}  // namespace dtrain::cli
