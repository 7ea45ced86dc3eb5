// What scale_records.cpp, scale_analysis.cpp and scale_report.cpp share, and no caller of
// scale_report.h needs: the number formats of the verdicts and the table, and the step from a run's
// records to its row (fill_from_records).
#pragma once

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "launcher/cli/scale_report.h"

namespace dtrain::cli::scale {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

inline std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

inline std::string ms(double seconds) { return format("%.2f", seconds * 1e3); }
inline std::string percent(double fraction) { return format("%.0f%%", fraction * 100); }
inline std::string times(double factor) { return format("%.2fx", factor); }

inline std::string workers_text(int n) {
  return std::to_string(n) + (n == 1 ? " worker" : " workers");
}

inline bool usable(double value) { return std::isfinite(value); }

// Fills the profile part of `row` from the run's records: means per rank and step over the records
// after `warmup_steps` (all of them when no rank got past it), the throughput, the all-reduce
// bandwidth. What it could not measure goes to `notes`.
void fill_from_records(const RunResult& run, int warmup_steps, Row& row,
                       std::vector<std::string>& notes);

}  // namespace dtrain::cli::scale
