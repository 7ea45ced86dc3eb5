// Parsing `dtrain scale`'s flags (see scale_options.h). Spellings as in `dtrain run`: "--flag
// value" and "--flag=value"; the first word that is not a flag (or the word after "--") starts the
// program.
#include "cli/scale_options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "cli/parse_integer.h"
#include "dtrain/errors.h"

namespace dtrain::cli {
namespace {

[[noreturn]] void fail(const std::string& message) { throw UsageError("dtrain scale: " + message); }

[[noreturn]] void bad_value(std::string_view flag, std::string_view expected,
                            std::string_view got) {
  fail(std::string(flag) + ": expected " + std::string(expected) + ", got '" + std::string(got) +
       "'");
}

int parse_int(std::string_view flag, std::string_view text, long long low, long long high) {
  std::optional<long long> value = parse_integer(text);
  if (!value || *value < low || *value > high) {
    bad_value(flag, "an integer in " + std::to_string(low) + ".." + std::to_string(high), text);
  }
  return static_cast<int>(*value);
}

// A number in (low, high].
double parse_number(std::string_view flag, const std::string& text, double low, double high,
                    std::string_view expected) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(value) || value <= low || value > high) {
    bad_value(flag, expected, text);
  }
  return value;
}

constexpr int kMaxWorkers = 1024;

// "1,2,4": ascending after sorting, no duplicates.
std::vector<int> parse_nproc(const std::string& text) {
  constexpr std::string_view kFlag = "--nproc";
  const std::string expected =
      "worker counts like 1,2,4 (integers in 1.." + std::to_string(kMaxWorkers) + ")";
  std::vector<int> counts;
  std::string_view rest = text;
  do {
    std::size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    std::optional<long long> value = parse_integer(item);
    if (!value || *value < 1 || *value > kMaxWorkers) bad_value(kFlag, expected, text);
    counts.push_back(static_cast<int>(*value));
    if (comma != std::string_view::npos && rest.empty()) bad_value(kFlag, expected, text);
  } while (!rest.empty());
  std::sort(counts.begin(), counts.end());
  if (std::adjacent_find(counts.begin(), counts.end()) != counts.end()) {
    bad_value(kFlag, expected + ", each once", text);
  }
  return counts;
}

bool ends_with(const std::string& text, std::string_view suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

ScaleOptions parse_scale_options(const std::vector<std::string>& args) {
  ScaleOptions options;
  bool steps_given = false;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-' || arg == "-") break;

    std::string name(arg);
    std::optional<std::string> inline_value;
    if (std::size_t equals = arg.find('='); equals != std::string_view::npos) {
      name = std::string(arg.substr(0, equals));
      inline_value = std::string(arg.substr(equals + 1));
    }
    auto is_switch = [&](std::string_view flag) {
      if (name != flag) return false;
      if (inline_value) fail(name + ": takes no value, got '" + *inline_value + "'");
      return true;
    };
    if (is_switch("--help") || is_switch("-h")) {
      options.help = true;
      continue;
    }
    if (is_switch("--json")) {
      options.json = true;
      continue;
    }
    if (is_switch("--no-python")) {
      options.no_python = true;
      continue;
    }
    static constexpr std::string_view kValued[] = {
        "--nproc",     "--steps", "--seconds", "--warmup-steps", "--time-limit",
        "--link-gbps", "--plot",  "--log-dir", "--grace-period"};
    if (std::find(std::begin(kValued), std::end(kValued), name) == std::end(kValued)) {
      fail("unknown flag '" + name +
           "'; see `dtrain scale --help` (the program's own flags go "
           "after the program, or after --)");
    }
    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      fail(name + ": expected a value, got none");
    }

    if (name == "--nproc") {
      options.nproc = parse_nproc(value);
    } else if (name == "--steps") {
      options.steps = parse_int(name, value, 1, 1000000);
      steps_given = true;
    } else if (name == "--seconds") {
      options.seconds = parse_number(name, value, 0, 86400, "a number of seconds in (0, 86400]");
    } else if (name == "--warmup-steps") {
      options.warmup_steps = parse_int(name, value, 0, 1000000);
    } else if (name == "--time-limit") {
      options.time_limit_s =
          parse_number(name, value, 0, 7 * 86400.0, "a number of seconds above 0 (at most a week)");
    } else if (name == "--link-gbps") {
      options.link_gbps =
          parse_number(name, value, 0, 1e6, "a bandwidth in Gbit/s above 0 (e.g. 100)");
    } else if (name == "--plot") {
      if (value.empty()) bad_value(name, "a file name ending in .svg", value);
      if (!ends_with(value, ".svg")) {
        fail("--plot: only SVG is supported (a file name ending in .svg), got '" + value +
             "'; convert it afterwards, e.g. `rsvg-convert -o plot.png plot.svg`");
      }
      options.plot_path = value;
    } else if (name == "--log-dir") {
      if (value.empty()) bad_value(name, "a directory", value);
      options.log_dir = value;
    } else if (name == "--grace-period") {
      options.grace_period_s =
          parse_number(name, value, 0, 3600, "a number of seconds in (0, 3600]");
    }
  }
  options.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (options.help) return options;
  if (steps_given && options.seconds) {
    fail(
        "--steps and --seconds: give one of the two (stop after K measured steps, or after S "
        "seconds)");
  }
  if (options.seconds && *options.seconds >= options.time_limit_s) {
    fail("--time-limit: must exceed --seconds " + std::to_string(*options.seconds) + ", got '" +
         std::to_string(options.time_limit_s) + "'");
  }
  if (options.command.empty()) {
    fail("no program given; expected `dtrain scale [flags] [--] program [args...]`");
  }
  return options;
}

std::string scale_usage() {
  return R"(usage: dtrain scale [flags] [--] program [args...]

Runs the program at each worker count under the same launcher as `dtrain run`, for a bounded time
each, with DTRAIN_PROFILE pointed at a temporary file, and reports whether more workers pay off:
samples/s, speed-up, parallel efficiency, where a step's time goes, a verdict per count with its
reason, and a prediction for 8, 16 and 64 workers from an alpha-beta model of the all-reduce.

flags:
  --nproc LIST          worker counts to run, e.g. 1,2,4 (default 1,2)
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

Programs built on dtrain's DDP or DataParallel write the per-step records themselves. Any other
program (a PyTorch script) is measured by what it prints: the last "<number> samples/s" text or
JSON "samples_per_s" field of the lowest rank that prints one is taken as the whole job's
throughput; without one, only its run time (start to exit) is compared, which assumes it does the
same total work at every count. Exit code: 0 when every count ran, 1 when one failed (it is
reported in the table), 2 for bad flags.
)";
}

}  // namespace dtrain::cli
