// The flags of `dtrain scale`: parsing them into ScaleOptions. A pure function of the argument list
// (no file system), so every rule is unit-tested; the program itself is checked by the launcher's
// own prepare_launch (run_command.h) when the runs start.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dtrain::cli {

struct ScaleOptions {
  // Worker counts to run, ascending, no duplicates: --nproc 1,2,4.
  std::vector<int> nproc = {1, 2};
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
  // -h/--help: print the usage and exit 0.
  bool help = false;
  // The program and its arguments, as given after the flags (or after "--").
  std::vector<std::string> command;
};

// Parses the arguments that follow "dtrain scale". Throws dtrain::UsageError whose what() is the
// one line to print, e.g. "dtrain scale: --nproc: expected worker counts like 1,2,4 (integers in
// 1..1024), got '0'".
ScaleOptions parse_scale_options(const std::vector<std::string>& args);

// The text `dtrain scale --help` prints.
std::string scale_usage();

}  // namespace dtrain::cli
