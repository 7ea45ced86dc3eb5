// `dtrain scale`: runs a program at several worker counts under the launcher of `dtrain run` (the
// same WorkerGroup, environment and program checks), each with DTRAIN_PROFILE pointed at a file of
// its own, stops each run once it measured enough, and reports (scale_report.h) whether more
// workers pay off.
#pragma once

#include <string>
#include <vector>

namespace dtrain::cli {

// Entry point of `dtrain scale ARGS...`: returns the process exit code: 0 when every worker count
// ran, 1 when one failed (it is reported in the table, the other counts still run), 2 for bad
// flags, 128 + signal when interrupted. Blocks for at most about --time-limit plus the grace period
// per count.
int scale_main(const std::vector<std::string>& args);

}  // namespace dtrain::cli
