// `dtrain scale`'s analysis and renderings (see scale_report.h).
//
// Note [Verdict rules]
// Speed-up S(N) = throughput(N) / throughput(N0), N0 the fewest workers that ran (normally 1);
// parallel efficiency E(N) = S(N) / (N / N0). The verdict for a count N > N0:
//   S < 1               "slower than N0 workers: not worth it"
//   E >= 75%            "worth it"
//   50% <= E < 75%      "marginal", and what the devices added since the previous count buy
//   E < 50%             "not worth it", and what the devices added since the previous count buy
// The reason splits the time lost per step against ideal scaling (the baseline's step time scaled
// to N's per-rank samples) into three parts, from the records:
//   contention     (compute per sample at N - at N0) * samples per rank: the same work computes
//                  slower when more workers share the host (cores, memory bandwidth, caches)
//   communication  exposed communication at N - at N0 scaled: time the step waits on all-reduces
//   fixed cost     optimizer and everything else per step that did not shrink with the per-rank
//                  batch (with a fixed global batch, the optimizer's share grows with N)
// E >= 90% reads "compute-bound" (nothing much is lost); otherwise the largest part names the
// reason ("contention", "communication-bound", "fixed per-step cost").
//
// Note [Prediction]
// Fitted on the largest count M that ran with communication. Step time at N workers:
//   T(N) = c * b(N) + F + x * A(N)
// c: compute per sample at M (contention seen there included); b(N): samples per rank, G/N for a
// fixed global batch G (strong scaling) or b(M) (weak); F: the rest of M's step (optimizer, data,
// gaps); A(N): a ring all-reduce of the step's gradient bytes n in k operations,
// 2(N-1) k alpha + 2(N-1)/N n / bandwidth, alpha and bandwidth fitted by least squares to every
// measured step (comm_s against comm_bytes, comm_ops); x: M's exposed communication / A(M) (the
// overlap as measured; above 1 when steps also wait for the slower rank). Throughput
// N b(N) / T(N); speed-up against the measured baseline. At N = M this gives back M's measured
// throughput whatever the fit's error, which the tests check.
#include "launcher/cli/scale_report.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/format.h"

namespace dtrain::cli::scale {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

std::string ms(double seconds) { return format("%.2f", seconds * 1e3); }
std::string percent(double fraction) { return format("%.0f%%", fraction * 100); }
std::string times(double factor) { return format("%.2fx", factor); }

std::string workers_text(int n) { return std::to_string(n) + (n == 1 ? " worker" : " workers"); }
std::string devices_text(int n) { return std::to_string(n) + (n == 1 ? " device" : " devices"); }

bool usable(double value) { return std::isfinite(value); }

// The rate speed-ups compare: samples/s, or runs per second for a run-time-only row.
double rate_of(const Row& row, const RunResult& run) {
  if (row.source == "profile" || row.source == "printed") return row.samples_per_s;
  if (row.source == "run time") return run.wall_s > 0 ? 1.0 / run.wall_s : kNaN;
  return kNaN;
}

bool rate_kind_samples(const Row& row) {
  return row.source == "profile" || row.source == "printed";
}

// Means over one rank's measured records, and its throughput on the records' own clock.
struct RankSummary {
  long long steps = 0;
  double interval_s = 0, step_s = 0, compute_s = 0, exposed_s = 0, optimizer_s = 0, comm_s = 0,
         comm_bytes = 0, comm_ops = 0, samples = 0, samples_per_s = 0;
};

RankSummary summarize_rank(const std::vector<StepRecord>& records, std::size_t first) {
  RankSummary summary;
  std::size_t count = records.size() - first;
  summary.steps = static_cast<long long>(count);
  double samples_in_window = 0;
  for (std::size_t i = first; i < records.size(); ++i) {
    const StepRecord& r = records[i];
    summary.step_s += r.step_s;
    summary.compute_s += r.forward_s + r.backward_s;
    summary.exposed_s += r.exposed_comm_s;
    summary.optimizer_s += r.optimizer_s;
    summary.comm_s += r.comm_s;
    summary.comm_bytes += r.comm_bytes;
    summary.comm_ops += r.comm_ops;
    summary.samples += r.samples;
  }
  double n = static_cast<double>(count);
  double sum_step_s = summary.step_s;
  for (double* mean :
       {&summary.step_s, &summary.compute_s, &summary.exposed_s, &summary.optimizer_s,
        &summary.comm_s, &summary.comm_bytes, &summary.comm_ops, &summary.samples}) {
    *mean /= n;
  }
  // Wall time per step from the end of the step before the window to the end of the last one: it
  // includes what happens between steps (data loading, logging), which step_s may not. Without a
  // step before the window, the first record only marks the start.
  double span = 0;
  if (first > 0) {
    span = records.back().time - records[first - 1].time;
    samples_in_window = summary.samples * n;
  } else if (count >= 2) {
    span = records.back().time - records.front().time;
    samples_in_window = summary.samples * n - records.front().samples;
    n -= 1;
  }
  if (span <= 0 || n <= 0) {  // a clock that did not move: fall back to the steps' own times
    span = sum_step_s;
    n = static_cast<double>(count);
    samples_in_window = summary.samples * n;
  }
  summary.interval_s = span / n;
  summary.samples_per_s = span > 0 ? samples_in_window / span : kNaN;
  return summary;
}

void fill_from_records(const RunResult& run, int warmup_steps, Row& row,
                       std::vector<std::string>& notes) {
  std::map<int, std::vector<StepRecord>> by_rank;
  for (const StepRecord& record : run.records) {
    if (record.rank >= 0 && record.rank < run.workers) by_rank[record.rank].push_back(record);
  }
  std::size_t most = 0;
  for (const auto& [rank, records] : by_rank) most = std::max(most, records.size());
  std::size_t skip = static_cast<std::size_t>(warmup_steps);
  if (most <= skip) {
    notes.push_back(workers_text(run.workers) + ": no rank recorded more than the " +
                    std::to_string(warmup_steps) +
                    " warm-up steps; measured them, warm-up included");
    skip = 0;
  }
  std::vector<RankSummary> ranks;
  long long fewest = std::numeric_limits<long long>::max();
  for (const auto& [rank, records] : by_rank) {
    if (records.size() <= skip) continue;
    ranks.push_back(summarize_rank(records, skip));
    fewest = std::min(fewest, ranks.back().steps);
  }
  row.ranks_recorded = static_cast<int>(ranks.size());
  row.measured_steps = ranks.empty() ? 0 : fewest;
  if (row.ranks_recorded < run.workers) {
    notes.push_back(workers_text(run.workers) + ": only " + std::to_string(row.ranks_recorded) +
                    " of " + std::to_string(run.workers) +
                    " ranks wrote measured records; the throughput counts those");
  }
  double n = static_cast<double>(ranks.size());
  double samples_per_s = 0;
  for (const RankSummary& r : ranks) {
    row.interval_s += r.interval_s / n;
    row.step_s += r.step_s / n;
    row.compute_s += r.compute_s / n;
    row.exposed_comm_s += r.exposed_s / n;
    row.optimizer_s += r.optimizer_s / n;
    row.comm_s += r.comm_s / n;
    row.comm_bytes += r.comm_bytes / n;
    row.comm_ops += r.comm_ops / n;
    row.samples_per_rank_step += r.samples / n;
    samples_per_s += r.samples_per_s;
  }
  row.other_s = row.interval_s - row.compute_s - row.exposed_comm_s - row.optimizer_s;
  if (row.samples_per_rank_step > 0) {
    row.samples_per_s = samples_per_s;
    row.compute_per_sample_s = row.compute_s / row.samples_per_rank_step;
  } else if (run.printed_samples_per_s) {
    notes.push_back(workers_text(run.workers) +
                    ": the records carry no sample counts; samples/s is the program's own");
    row.samples_per_s = *run.printed_samples_per_s;
  } else {
    notes.push_back(workers_text(run.workers) +
                    ": the records carry no sample counts and the program printed no samples/s: "
                    "no throughput");
    row.samples_per_s = kNaN;
  }
  if (row.comm_s > 0 && row.comm_bytes > 0) {
    row.algorithm_gbps = row.comm_bytes * 8 / row.comm_s / 1e9;
    row.bus_gbps = row.algorithm_gbps * 2.0 * (run.workers - 1) / run.workers;
  }
  if (run.malformed_records > 0) {
    notes.push_back(workers_text(run.workers) + ": " + std::to_string(run.malformed_records) +
                    " profile line(s) were not valid records and were skipped");
  }
}

// Note [Verdict rules], the verdict half.
std::string verdict_for(const Row& row, const Row* previous, int baseline_workers) {
  std::string head = workers_text(row.workers) + ": ";
  if (!usable(row.speedup)) return head + "no comparable throughput";
  std::string extra;
  if (previous != nullptr && usable(previous->speedup) && previous->speedup > 0) {
    int added = row.workers - previous->workers;
    double gain = row.speedup / previous->speedup - 1;
    extra = (added == 1 ? std::string("the extra device buys ")
                        : "the extra " + devices_text(added) + " buy ") +
            format("%.0f%%", gain * 100) + " over " + workers_text(previous->workers);
  }
  if (row.speedup < 1.0) {
    return head + times(row.speedup) + ": slower than " + workers_text(baseline_workers) +
           ": not worth it";
  }
  std::string measured = times(row.speedup) + " faster, " + percent(row.efficiency) + " efficient";
  if (row.efficiency >= 0.75) return head + measured + ": worth it";
  if (row.efficiency >= 0.5)
    return head + measured + ": marginal" + (extra.empty() ? "" : "; " + extra);
  return head + measured + ": not worth it" + (extra.empty() ? "" : "; " + extra);
}

// Note [Verdict rules], the reason half.
void explain(Row& row, const Row& base, unsigned host_cpus) {
  double scale =
      base.samples_per_rank_step > 0 ? row.samples_per_rank_step / base.samples_per_rank_step : 1.0;
  double ideal = base.interval_s * scale;
  row.lost_s = row.interval_s - ideal;
  row.lost_contention_s =
      (row.compute_per_sample_s - base.compute_per_sample_s) * row.samples_per_rank_step;
  row.lost_comm_s = row.exposed_comm_s - base.exposed_comm_s * scale;
  row.lost_fixed_s = (row.optimizer_s + row.other_s) - (base.optimizer_s + base.other_s) * scale;
  if (row.efficiency >= 0.9) {
    double comm_share = row.exposed_comm_s / row.interval_s;
    if (comm_share >= 0.25) {
      row.reason = "scales so far, but the step waits " + ms(row.exposed_comm_s) + " ms of " +
                   ms(row.interval_s) + " ms (" + percent(comm_share) +
                   ") on communication: that limits more workers";
    } else {
      row.reason = "compute-bound: computation is " + percent(row.compute_s / row.interval_s) +
                   " of the step; exposed communication " + ms(row.exposed_comm_s) + " ms";
    }
    if (row.efficiency > 1.05 && row.compute_per_sample_s < 0.95 * base.compute_per_sample_s) {
      row.reason += "; superlinear: compute per sample fell from " +
                    format("%.3f", base.compute_per_sample_s * 1e3) + " to " +
                    format("%.3f", row.compute_per_sample_s * 1e3) +
                    " ms (smaller per-rank batches, or a baseline whose threads competed for "
                    "the cores)";
    }
    return;
  }
  double largest = std::max({row.lost_contention_s, row.lost_comm_s, row.lost_fixed_s});
  if (largest == row.lost_contention_s) {
    row.reason =
        "contention: compute per sample rose from " +
        format("%.3f", base.compute_per_sample_s * 1e3) + " to " +
        format("%.3f", row.compute_per_sample_s * 1e3) + " ms (" +
        format("%+.0f%%", (row.compute_per_sample_s / base.compute_per_sample_s - 1) * 100) +
        ") with " + std::to_string(row.workers) + " workers sharing this host's " +
        std::to_string(host_cpus) + " CPU(s), memory bandwidth and caches";
  } else if (largest == row.lost_comm_s) {
    row.reason = "communication-bound: the step waits " + ms(row.exposed_comm_s) + " ms of " +
                 ms(row.interval_s) + " ms on communication" +
                 (row.bus_gbps > 0
                      ? " (all-reduce at " + format("%.2f", row.bus_gbps) + " Gbit/s bus bandwidth)"
                      : "");
  } else {
    row.reason = "fixed per-step cost: optimizer and other per-step work take " +
                 ms(row.optimizer_s + row.other_s) + " ms of " + ms(row.interval_s) +
                 " ms and do not shrink with the per-rank batch";
  }
  if (static_cast<unsigned>(row.workers) > host_cpus) {
    row.reason += "; " + std::to_string(row.workers) + " workers on " + std::to_string(host_cpus) +
                  " CPU(s) oversubscribe this host, so waits include peers that are not running";
  }
}

// Least squares comm_s = alpha * x1 + beta * x2, x1 = 2(N-1) ops, x2 = 2(N-1)/N bytes, both
// coefficients kept >= 0.
CommModel fit_model(const std::vector<RunResult>& runs, const std::vector<Row>& rows,
                    int warmup_steps, int max_workers) {
  struct Point {
    double x1, x2, y;
  };
  std::vector<Point> points;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!rows[i].ok || rows[i].source != "profile" || runs[i].workers < 2) continue;
    if (runs[i].workers > max_workers) continue;
    // The same warm-up as the table's (fill_from_records): none when no rank got past it.
    std::map<int, int> per_rank;
    for (const StepRecord& r : runs[i].records) ++per_rank[r.rank];
    int skip = 0;
    for (const auto& [rank, count] : per_rank) skip = count > warmup_steps ? warmup_steps : skip;
    std::map<int, int> seen;
    for (const StepRecord& r : runs[i].records) {
      if (seen[r.rank]++ < skip) continue;
      if (r.comm_s <= 0 || r.comm_bytes <= 0) continue;
      double n = runs[i].workers;
      double ops = r.comm_ops > 0 ? r.comm_ops : 1;
      points.push_back({2 * (n - 1) * ops, 2 * (n - 1) / n * r.comm_bytes, r.comm_s});
    }
  }
  CommModel model;
  model.points = static_cast<int>(points.size());
  if (points.empty()) {
    model.how = "no step with communication was measured (a run with 2 or more workers is needed)";
    return model;
  }
  double s11 = 0, s12 = 0, s22 = 0, s1y = 0, s2y = 0;
  for (const Point& p : points) {
    s11 += p.x1 * p.x1;
    s12 += p.x1 * p.x2;
    s22 += p.x2 * p.x2;
    s1y += p.x1 * p.y;
    s2y += p.x2 * p.y;
  }
  double det = s11 * s22 - s12 * s12;
  double alpha = 0, beta = 0;
  // Nearly collinear: every step moved the same bytes in the same number of operations on the
  // same world size, so latency and bandwidth cannot be told apart.
  bool separable = det > 1e-6 * s11 * s22;
  if (separable) {
    alpha = (s1y * s22 - s2y * s12) / det;
    beta = (s2y * s11 - s1y * s12) / det;
  }
  if (!separable || alpha < 0 || beta <= 0) {
    alpha = 0;
    beta = s2y / s22;
    model.how = separable ? "bandwidth only (the latency term fitted below zero; set to 0)"
                          : "bandwidth only: every measured step moved the same bytes in the same "
                            "operations, so latency is not separable (set to 0: optimistic at "
                            "many workers)";
  } else {
    model.how = "least squares";
  }
  if (beta <= 0) {
    model.how = "the measured transfers do not fit a ring all-reduce";
    return model;
  }
  // Relative to the mean measured time: single steps of a few microseconds would dominate a mean
  // of relative errors.
  double sq = 0, mean_y = 0;
  for (const Point& p : points) {
    double predicted = alpha * p.x1 + beta * p.x2;
    sq += (predicted - p.y) * (predicted - p.y);
    mean_y += p.y / static_cast<double>(points.size());
  }
  sq /= mean_y * mean_y;
  model.fitted = true;
  model.alpha_s = alpha;
  model.bytes_per_s = 1.0 / beta;
  model.rms_relative_error = std::sqrt(sq / static_cast<double>(points.size()));
  return model;
}

std::string gbps_text(double bytes_per_s) { return format("%.3g", bytes_per_s * 8 / 1e9); }

}  // namespace

double CommModel::seconds(int workers, double bytes, double ops,
                          double bytes_per_s_override) const {
  if (workers < 2) return 0;
  double n = workers;
  double bandwidth = bytes_per_s_override > 0 ? bytes_per_s_override : bytes_per_s;
  return 2 * (n - 1) * std::max(ops, 1.0) * alpha_s + 2 * (n - 1) / n * bytes / bandwidth;
}

std::optional<StepRecord> parse_record(const std::string& line, std::string* why) {
  nlohmann::json json = nlohmann::json::parse(line, nullptr, false);
  auto reject = [&](const std::string& reason) -> std::optional<StepRecord> {
    if (why != nullptr) *why = reason;
    return std::nullopt;
  };
  if (json.is_discarded() || !json.is_object()) return reject("not a JSON object");
  StepRecord record;
  auto number = [&](const char* key, double* out) {
    auto found = json.find(key);
    if (found == json.end() || !found->is_number()) return false;
    *out = found->get<double>();
    return std::isfinite(*out);
  };
  double rank = 0, world = 0, step = 0;
  struct Field {
    const char* key;
    double* out;
  };
  const Field fields[] = {{"rank", &rank},
                          {"world_size", &world},
                          {"step", &step},
                          {"step_s", &record.step_s},
                          {"forward_s", &record.forward_s},
                          {"backward_s", &record.backward_s},
                          {"exposed_comm_s", &record.exposed_comm_s},
                          {"optimizer_s", &record.optimizer_s},
                          {"comm_s", &record.comm_s},
                          {"comm_bytes", &record.comm_bytes},
                          {"comm_ops", &record.comm_ops},
                          {"samples", &record.samples},
                          {"time", &record.time}};
  for (const Field& field : fields) {
    if (!number(field.key, field.out)) {
      return reject(std::string("field '") + field.key + "' missing or not a number");
    }
  }
  record.rank = static_cast<int>(rank);
  record.world_size = static_cast<int>(world);
  record.step = static_cast<long long>(step);
  return record;
}

std::optional<double> printed_samples_per_s(const std::string& line) {
  // JSON field anywhere in the line (the trainer's final summary, a logger's JSON line).
  constexpr std::string_view kKey = "\"samples_per_s\"";
  if (std::size_t at = line.rfind(kKey); at != std::string::npos) {
    std::size_t colon = line.find_first_not_of(" \t", at + kKey.size());
    if (colon != std::string::npos && line[colon] == ':') {
      const char* start = line.c_str() + colon + 1;
      char* end = nullptr;
      double value = std::strtod(start, &end);
      if (end != start && std::isfinite(value) && value >= 0) return value;
    }
  }
  // "<number> samples/s": the number right before the word (one space or none between).
  constexpr std::string_view kWord = "samples/s";
  if (std::size_t at = line.rfind(kWord); at != std::string::npos && at > 0) {
    std::size_t end = at;
    while (end > 0 && line[end - 1] == ' ') --end;
    std::size_t begin = end;
    while (begin > 0 &&
           (std::isdigit(static_cast<unsigned char>(line[begin - 1])) || line[begin - 1] == '.' ||
            line[begin - 1] == 'e' || line[begin - 1] == 'E' || line[begin - 1] == '+' ||
            line[begin - 1] == '-')) {
      --begin;
    }
    if (begin < end) {
      std::string number = line.substr(begin, end - begin);
      char* stop = nullptr;
      double value = std::strtod(number.c_str(), &stop);
      if (stop == number.c_str() + number.size() && std::isfinite(value) && value >= 0) {
        return value;
      }
    }
  }
  return std::nullopt;
}

PredictionPoint predict(const Report& report, int workers) {
  const Prediction& p = report.prediction;
  PredictionPoint point;
  point.workers = workers;
  point.speedup_at_link = kNaN;
  double per_rank = p.samples_per_rank;
  if (p.scaling == "strong") {
    double global = p.samples_per_rank * p.fitted_on_workers;
    per_rank = global / workers;
    if (per_rank < 1.0) {
      point.possible = false;
      point.speedup = kNaN;
      point.samples_per_s = kNaN;
      return point;
    }
  }
  auto rate = [&](double bytes_per_s) {
    double comm = report.model.seconds(workers, p.bytes_per_step, p.ops_per_step, bytes_per_s);
    double step = p.compute_per_sample_s * per_rank + p.fixed_s + p.exposed_share * comm;
    return workers * per_rank / step;
  };
  point.samples_per_s = rate(0);
  point.speedup = point.samples_per_s / p.baseline_samples_per_s;
  if (report.link_gbps) {
    point.speedup_at_link = rate(*report.link_gbps * 1e9 / 8) / p.baseline_samples_per_s;
  }
  return point;
}

Report analyze(const std::vector<RunResult>& runs_in, const AnalysisSettings& settings) {
  std::vector<RunResult> runs = runs_in;
  std::sort(runs.begin(), runs.end(),
            [](const RunResult& a, const RunResult& b) { return a.workers < b.workers; });
  Report report;
  report.link_gbps = settings.link_gbps;
  report.warmup_steps = settings.warmup_steps;
  report.notes = settings.notes;
  unsigned host_cpus = settings.host_cpus > 0
                           ? static_cast<unsigned>(settings.host_cpus)
                           : static_cast<unsigned>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));

  for (const RunResult& run : runs) {
    Row row;
    row.workers = run.workers;
    row.ok = run.ok;
    row.status = run.ok ? (run.time_limit ? "time limit" : "ok") : run.ending;
    row.exit_code = run.ok ? 0 : run.exit_code;
    row.samples_per_s = kNaN;
    row.speedup = row.efficiency = kNaN;
    if (!run.ok) report.any_failed = true;
    if (run.ok && !run.records.empty()) {
      row.source = "profile";
      fill_from_records(run, settings.warmup_steps, row, report.notes);
    } else if (run.ok && run.printed_samples_per_s) {
      row.source = "printed";
      row.samples_per_s = *run.printed_samples_per_s;
    } else if (run.ok && run.finished_by_itself) {
      row.source = "run time";
      row.run_time_s = run.wall_s;
    } else {
      row.source = "none";
    }
    if (run.time_limit) {
      report.notes.push_back(workers_text(run.workers) + ": stopped at --time-limit (" +
                             run.ending + ")");
    }
    if (!run.ok && !run.failure_line.empty()) {
      report.notes.push_back(workers_text(run.workers) + ": " + run.ending +
                             "; its last stderr line: " + run.failure_line);
    }
    report.rows.push_back(row);
  }

  // Speed-up and efficiency against the fewest workers that gave a rate.
  const Row* base = nullptr;
  std::size_t base_index = 0;
  for (std::size_t i = 0; i < report.rows.size(); ++i) {
    if (report.rows[i].ok && usable(rate_of(report.rows[i], runs[i]))) {
      base = &report.rows[i];
      base_index = i;
      break;
    }
  }
  if (base != nullptr) {
    report.baseline_workers = base->workers;
    double base_rate = rate_of(*base, runs[base_index]);
    const Row* previous = nullptr;
    for (std::size_t i = 0; i < report.rows.size(); ++i) {
      Row& row = report.rows[i];
      if (!row.ok) continue;
      double rate = rate_of(row, runs[i]);
      if (!usable(rate) || rate_kind_samples(row) != rate_kind_samples(*base)) continue;
      row.speedup = rate / base_rate;
      row.efficiency = row.speedup / (static_cast<double>(row.workers) / base->workers);
      if (&row == base) {
        row.verdict = workers_text(row.workers) + ": the baseline";
      } else {
        row.verdict = verdict_for(row, previous, base->workers);
        if (row.source == "profile" && base->source == "profile" && base->interval_s > 0) {
          explain(row, *base, host_cpus);
        }
      }
      if (row.source == "printed") {
        row.reason =
            "limited to what was measured: the program's own samples/s (it writes no "
            "dtrain profile records: no breakdown, no prediction)";
      } else if (row.source == "run time") {
        row.reason =
            "limited to what was measured: run time from start to exit, which assumes "
            "the same total work at every count (no records, no printed samples/s)";
      }
      previous = &row;
    }
  }
  for (Row& row : report.rows) {
    if (row.ok && row.verdict.empty()) {
      row.verdict = workers_text(row.workers) + ": nothing measured" +
                    (row.source == "none" ? " (no records, no printed samples/s, stopped before "
                                            "it finished)"
                                          : "");
    }
    if (!row.ok) row.verdict = workers_text(row.workers) + ": failed (" + row.status + ")";
  }

  // Counts with more workers than the host has CPUs measure the oversubscription more than the
  // transfers (a descheduled peer stalls every collective): the fit and the prediction leave them
  // out when a count that fits the host communicated.
  int fitting = std::numeric_limits<int>::max();
  for (const Row& row : report.rows) {
    if (row.ok && row.source == "profile" && row.workers >= 2 && row.comm_s > 0 &&
        static_cast<unsigned>(row.workers) <= host_cpus) {
      fitting = static_cast<int>(host_cpus);
    }
  }
  report.model = fit_model(runs, report.rows, settings.warmup_steps, fitting);

  // Note [Prediction].
  Prediction& prediction = report.prediction;
  const Row* fitted = nullptr;
  for (const Row& row : report.rows) {
    if (row.ok && row.source == "profile" && row.workers >= 2 && row.workers <= fitting &&
        row.comm_s > 0 && row.samples_per_rank_step > 0) {
      fitted = &row;
    }
  }
  if (base == nullptr || base->source != "profile" || !usable(base->samples_per_s)) {
    prediction.why_not = "needs dtrain profile records with sample counts";
  } else if (fitted == nullptr) {
    prediction.why_not = "needs a run with 2 or more workers that communicated";
  } else if (!report.model.fitted) {
    prediction.why_not = report.model.how;
  } else {
    prediction.available = true;
    prediction.fitted_on_workers = fitted->workers;
    prediction.compute_per_sample_s = fitted->compute_per_sample_s;
    // Exposed communication scales with the modelled all-reduce; the ratio is taken at the fitted
    // count, so the prediction gives back its measured step there whatever the fit's error. It may
    // exceed 1: a step also waits for the slower rank to arrive, which no transfer time contains.
    double modelled = report.model.seconds(fitted->workers, fitted->comm_bytes, fitted->comm_ops);
    prediction.exposed_share = modelled > 0 ? fitted->exposed_comm_s / modelled : 1.0;
    prediction.fixed_s =
        std::max(0.0, fitted->interval_s - fitted->compute_s - fitted->exposed_comm_s);
    prediction.bytes_per_step = fitted->comm_bytes;
    prediction.ops_per_step = fitted->comm_ops;
    prediction.samples_per_rank = fitted->samples_per_rank_step;
    prediction.baseline_samples_per_s = base->samples_per_s;
    prediction.baseline_workers = base->workers;

    // Strong or weak scaling, from how the per-rank samples changed between the baseline and the
    // fitted count.
    std::string evidence;
    if (base->workers == fitted->workers) {
      prediction.scaling = "weak";
      evidence = "only one worker count measured: assumed weak scaling (per-rank batch fixed at " +
                 format("%.0f", fitted->samples_per_rank_step) + " samples)";
    } else {
      double ratio = fitted->samples_per_rank_step / base->samples_per_rank_step;
      double strong = ratio * fitted->workers / base->workers;
      std::string seen =
          "per-rank samples per step went from " + format("%.0f", base->samples_per_rank_step) +
          " at " + workers_text(base->workers) + " to " +
          format("%.0f", fitted->samples_per_rank_step) + " at " + workers_text(fitted->workers);
      if (std::abs(strong - 1) < 0.15) {
        prediction.scaling = "strong";
        evidence = "strong scaling: the global batch of " +
                   format("%.0f", fitted->samples_per_rank_step * fitted->workers) +
                   " samples is split over the workers (" + seen + ")";
      } else if (std::abs(ratio - 1) < 0.15) {
        prediction.scaling = "weak";
        evidence = "weak scaling: each worker keeps its batch (" + seen +
                   "; train_fashion_mnist's --batch-size is per rank and works this way)";
      } else {
        prediction.scaling = "weak";
        evidence = "assumed weak scaling: each worker keeps its batch (" + seen + ")";
      }
    }
    prediction.assumptions.push_back(evidence);
    if (fitting != std::numeric_limits<int>::max() && report.rows.back().workers > fitting) {
      prediction.assumptions.push_back("fitted on counts up to " + std::to_string(fitting) +
                                       " workers only: more oversubscribe "
                                       "this host's " +
                                       std::to_string(host_cpus) +
                                       " CPU(s) and would measure that instead");
    }
    prediction.assumptions.push_back(
        "compute per sample " + format("%.4f", prediction.compute_per_sample_s * 1e3) +
        " ms, as measured at " + workers_text(fitted->workers) +
        " (contention seen there included); every added worker computes as fast (a device of "
        "its own)");
    prediction.assumptions.push_back(
        "all-reduce: a ring, 2(N-1) ops alpha + 2(N-1)/N bytes / bandwidth, " +
        format("%.3g", prediction.bytes_per_step / 1e6) + " MB in " +
        format("%.3g", prediction.ops_per_step) + " op(s) per step; alpha " +
        format("%.3g", report.model.alpha_s * 1e6) + " us, bandwidth " +
        gbps_text(report.model.bytes_per_s) + " Gbit/s (" + report.model.how + ", " +
        std::to_string(report.model.points) + " steps, rms error " +
        percent(report.model.rms_relative_error) + ")");
    std::string waited = "the step waited " + ms(fitted->exposed_comm_s) +
                         " ms on communication at " + workers_text(fitted->workers) + ", ";
    if (prediction.exposed_share <= 1.0) {
      prediction.assumptions.push_back(
          "overlap as measured: " + waited + percent(prediction.exposed_share) + " of the " +
          ms(modelled) + " ms the model gives its all-reduces; the same share at every count");
    } else {
      prediction.assumptions.push_back(
          "no overlap: " + waited + format("%.2f", prediction.exposed_share) + " times the " +
          ms(modelled) +
          " ms the model gives its all-reduces (the rest is waiting for the slower rank); "
          "scaled with the all-reduce at every count");
    }
    prediction.assumptions.push_back(
        "the rest of the step (optimizer, data, gaps between steps) stays " +
        ms(prediction.fixed_s) + " ms at every count");
    prediction.assumptions.push_back(
        "every link as fast as the fitted (or --link-gbps) bandwidth: no topology, no slower "
        "links between hosts, no congestion");

    std::set<int> counts(settings.predict_at.begin(), settings.predict_at.end());
    int largest = std::max(*counts.rbegin(), fitted->workers);
    for (int n = 1; n <= largest; n *= 2) counts.insert(n);
    for (const Row& row : report.rows) counts.insert(row.workers);
    for (int n : counts) {
      if (n >= fitted->workers) prediction.points.push_back(predict(report, n));
    }
  }
  return report;
}

// ----------------------------------------------------------------------------------------------
// Renderings.

namespace {

std::string cell(double value, const char* pattern) {
  return usable(value) ? format(pattern, value) : "-";
}

}  // namespace

std::string render_text(const Report& report, const std::string& title) {
  std::ostringstream out;
  out << title << "\n\n";
  char line[512];
  std::snprintf(line, sizeof line, "%7s %11s %9s %10s %9s %10s %10s %9s %11s  %s\n", "workers",
                "samples/s", "speed-up", "efficiency", "step ms", "compute ms", "exposed ms",
                "other ms", "comm Gbit/s", "status");
  out << line;
  for (const Row& row : report.rows) {
    bool profile = row.source == "profile";
    std::string status = row.status;
    if (row.ok && row.source == "run time") {
      status += " (run time " + detail::seconds_text(row.run_time_s) + ")";
    } else if (row.ok && row.source != "profile") {
      status += " (" + row.source + ")";
    }
    std::snprintf(
        line, sizeof line, "%7d %11s %9s %10s %9s %10s %10s %9s %11s  %s\n", row.workers,
        cell(row.samples_per_s, "%.1f").c_str(),
        usable(row.speedup) ? times(row.speedup).c_str() : "-",
        usable(row.efficiency) ? percent(row.efficiency).c_str() : "-",
        profile ? ms(row.interval_s).c_str() : "-", profile ? ms(row.compute_s).c_str() : "-",
        profile ? ms(row.exposed_comm_s).c_str() : "-",
        profile ? ms(row.optimizer_s + row.other_s).c_str() : "-",
        profile && row.bus_gbps > 0 ? format("%.2f", row.bus_gbps).c_str() : "-", status.c_str());
    out << line;
  }
  out << "\n("
      << (report.baseline_workers > 0
              ? "speed-up and efficiency against " + workers_text(report.baseline_workers)
              : std::string("no count gave a throughput to compare"))
      << "; times per rank and step after " << report.warmup_steps
      << " warm-up steps; other = optimizer and everything between compute and communication; "
         "comm Gbit/s = ring bus bandwidth of the all-reduces)\n";

  out << "\nverdict:\n";
  for (const Row& row : report.rows) {
    out << "  " << row.verdict << "\n";
    if (!row.reason.empty()) out << "    why: " << row.reason << "\n";
  }
  for (const std::string& note : report.notes) out << "  note: " << note << "\n";

  const Prediction& p = report.prediction;
  out << "\nprediction";
  if (!p.available) {
    out << ": not available: " << p.why_not << "\n";
    return out.str();
  }
  out << " (fitted on " << workers_text(p.fitted_on_workers) << ", " << p.scaling << " scaling):\n";
  std::snprintf(line, sizeof line, "  %7s %11s %9s %10s", "workers", "samples/s", "speed-up",
                "efficiency");
  out << line;
  if (report.link_gbps) out << format("   speed-up at %g Gbit/s", *report.link_gbps);
  out << "\n";
  std::set<int> shown = {p.fitted_on_workers, 8, 16, 64};
  for (const PredictionPoint& point : p.points) {
    if (!shown.count(point.workers)) continue;
    if (!point.possible) {
      out << format("  %7.0f", point.workers)
          << "   n/a: the global batch has fewer samples than "
             "workers\n";
      continue;
    }
    double efficiency = point.speedup / (static_cast<double>(point.workers) / p.baseline_workers);
    std::snprintf(line, sizeof line, "  %7d %11.1f %9s %10s", point.workers, point.samples_per_s,
                  times(point.speedup).c_str(), percent(efficiency).c_str());
    out << line;
    if (report.link_gbps) out << format("   %21.2fx", point.speedup_at_link);
    if (point.workers == p.fitted_on_workers) out << "   (measured point)";
    out << "\n";
  }
  out << "assumptions:\n";
  for (const std::string& assumption : p.assumptions) out << "  - " << assumption << "\n";
  return out.str();
}

std::string render_json(const Report& report, const std::vector<std::string>& command) {
  using nlohmann::json;
  auto number = [](double value) { return usable(value) ? json(value) : json(nullptr); };
  json document;
  document["command"] = command;
  document["warmup_steps"] = report.warmup_steps;
  document["baseline_workers"] = report.baseline_workers;
  json rows = json::array();
  for (const Row& row : report.rows) {
    json r;
    r["workers"] = row.workers;
    r["ok"] = row.ok;
    r["status"] = row.status;
    r["exit_code"] = row.exit_code;
    r["source"] = row.source;
    r["samples_per_s"] = number(row.samples_per_s);
    r["speedup"] = number(row.speedup);
    r["efficiency"] = number(row.efficiency);
    r["verdict"] = row.verdict;
    r["reason"] = row.reason;
    if (row.source == "run time") r["run_time_s"] = row.run_time_s;
    if (row.source == "profile") {
      r["measured_steps"] = row.measured_steps;
      r["ranks_recorded"] = row.ranks_recorded;
      r["step_interval_s"] = row.interval_s;
      r["step_s"] = row.step_s;
      r["compute_s"] = row.compute_s;
      r["exposed_comm_s"] = row.exposed_comm_s;
      r["optimizer_s"] = row.optimizer_s;
      r["other_s"] = row.other_s;
      r["comm_s"] = row.comm_s;
      r["comm_bytes"] = row.comm_bytes;
      r["comm_ops"] = row.comm_ops;
      r["samples_per_rank_step"] = row.samples_per_rank_step;
      r["compute_per_sample_s"] = row.compute_per_sample_s;
      r["algorithm_gbps"] = row.algorithm_gbps;
      r["bus_gbps"] = row.bus_gbps;
      r["lost_s"] = {{"total", row.lost_s},
                     {"contention", row.lost_contention_s},
                     {"communication", row.lost_comm_s},
                     {"fixed", row.lost_fixed_s}};
    }
    rows.push_back(r);
  }
  document["runs"] = rows;
  json model;
  model["fitted"] = report.model.fitted;
  model["how"] = report.model.how;
  model["alpha_s"] = report.model.alpha_s;
  model["bandwidth_gbps"] = report.model.bytes_per_s * 8 / 1e9;
  model["rms_relative_error"] = report.model.rms_relative_error;
  model["points"] = report.model.points;
  document["comm_model"] = model;
  const Prediction& p = report.prediction;
  json prediction;
  prediction["available"] = p.available;
  if (!p.available) {
    prediction["why_not"] = p.why_not;
  } else {
    prediction["scaling"] = p.scaling;
    prediction["fitted_on_workers"] = p.fitted_on_workers;
    prediction["link_gbps"] = report.link_gbps ? json(*report.link_gbps) : json(nullptr);
    prediction["assumptions"] = p.assumptions;
    json points = json::array();
    for (const PredictionPoint& point : p.points) {
      points.push_back({{"workers", point.workers},
                        {"possible", point.possible},
                        {"samples_per_s", number(point.samples_per_s)},
                        {"speedup", number(point.speedup)},
                        {"speedup_at_link", number(point.speedup_at_link)}});
    }
    prediction["points"] = points;
  }
  document["prediction"] = prediction;
  document["failed"] = report.any_failed;
  return document.dump(2) + "\n";
}

namespace {

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

std::string render_svg(const Report& report, const std::string& title) {
  // Log-log axes: ideal scaling is the diagonal, and 1..64 workers fit on one page.
  constexpr double kWidth = 720, kHeight = 480, kLeft = 70, kRight = 200, kTop = 50, kBottom = 60;
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  int base = std::max(1, report.baseline_workers);
  double x_max = base;
  double y_min = 1, y_max = 1;
  for (const Row& row : report.rows) {
    x_max = std::max<double>(x_max, row.workers);
    if (usable(row.speedup)) {
      y_min = std::min(y_min, row.speedup);
      y_max = std::max(y_max, row.speedup);
    }
  }
  for (const PredictionPoint& point : report.prediction.points) {
    if (!point.possible) continue;
    x_max = std::max<double>(x_max, point.workers);
    for (double s : {point.speedup, point.speedup_at_link}) {
      if (usable(s) && s > 0) {
        y_min = std::min(y_min, s);
        y_max = std::max(y_max, s);
      }
    }
  }
  if (x_max <= base) x_max = base * 2.0;
  y_max = std::max(y_max, x_max / base);  // the ideal line's end
  double lx0 = std::log2(static_cast<double>(base)), lx1 = std::log2(x_max);
  double ly0 = std::floor(std::log2(y_min)), ly1 = std::ceil(std::log2(y_max));
  if (ly1 <= ly0) ly1 = ly0 + 1;
  auto px = [&](double workers) {
    return kLeft + (std::log2(workers) - lx0) / (lx1 - lx0) * plot_w;
  };
  auto py = [&](double speedup) {
    return kTop + plot_h - (std::log2(speedup) - ly0) / (ly1 - ly0) * plot_h;
  };
  auto num = [](double v) { return format("%.1f", v); };

  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" viewBox=\"0 0 " << kWidth << " " << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kLeft << "\" y=\"25\" font-size=\"14\">" << xml_escape(title)
      << "</text>\n";
  // Axes, grid and ticks at powers of two.
  svg << "<g id=\"axes\" stroke=\"#999\" stroke-width=\"1\">\n";
  for (double t = std::ceil(lx0); t <= lx1 + 1e-9; t += 1) {
    double x = px(std::exp2(t));
    svg << "<line x1=\"" << num(x) << "\" y1=\"" << num(kTop) << "\" x2=\"" << num(x) << "\" y2=\""
        << num(kTop + plot_h) << "\" stroke=\"#eee\"/>\n";
    svg << "<text x=\"" << num(x) << "\" y=\"" << num(kTop + plot_h + 18)
        << "\" text-anchor=\"middle\" stroke=\"none\" fill=\"black\">"
        << static_cast<long long>(std::exp2(t)) << "</text>\n";
  }
  for (double t = ly0; t <= ly1 + 1e-9; t += 1) {
    double y = py(std::exp2(t));
    svg << "<line x1=\"" << num(kLeft) << "\" y1=\"" << num(y) << "\" x2=\"" << num(kLeft + plot_w)
        << "\" y2=\"" << num(y) << "\" stroke=\"#eee\"/>\n";
    svg << "<text x=\"" << num(kLeft - 8) << "\" y=\"" << num(y + 4)
        << "\" text-anchor=\"end\" stroke=\"none\" fill=\"black\">" << format("%g", std::exp2(t))
        << "x</text>\n";
  }
  svg << "<line x1=\"" << num(kLeft) << "\" y1=\"" << num(kTop + plot_h) << "\" x2=\""
      << num(kLeft + plot_w) << "\" y2=\"" << num(kTop + plot_h) << "\"/>\n"
      << "<line x1=\"" << num(kLeft) << "\" y1=\"" << num(kTop) << "\" x2=\"" << num(kLeft)
      << "\" y2=\"" << num(kTop + plot_h) << "\"/>\n</g>\n";
  svg << "<text x=\"" << num(kLeft + plot_w / 2) << "\" y=\"" << num(kHeight - 15)
      << "\" text-anchor=\"middle\">workers</text>\n"
      << "<text x=\"18\" y=\"" << num(kTop + plot_h / 2)
      << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 " << num(kTop + plot_h / 2)
      << ")\">speed-up over " << xml_escape(workers_text(base)) << "</text>\n";

  // Ideal: speed-up N / base.
  svg << "<polyline id=\"ideal\" fill=\"none\" stroke=\"#888\" stroke-dasharray=\"6 4\" points=\""
      << num(px(base)) << "," << num(py(1)) << " " << num(px(x_max)) << "," << num(py(x_max / base))
      << "\"/>\n";
  auto polyline = [&](const char* id, const char* colour, const char* dash, bool at_link) {
    std::string points;
    for (const PredictionPoint& point : report.prediction.points) {
      double s = at_link ? point.speedup_at_link : point.speedup;
      if (!point.possible || !usable(s) || s <= 0) continue;
      points += num(px(point.workers)) + "," + num(py(s)) + " ";
    }
    if (points.empty()) return;
    points.pop_back();
    svg << "<polyline id=\"" << id << "\" fill=\"none\" stroke=\"" << colour
        << "\" stroke-width=\"2\"" << dash << " points=\"" << points << "\"/>\n";
  };
  polyline("predicted", "#1f77b4", "", false);
  if (report.link_gbps) polyline("predicted-link", "#ff7f0e", " stroke-dasharray=\"4 3\"", true);
  svg << "<g id=\"measured\">\n";
  for (const Row& row : report.rows) {
    if (!usable(row.speedup) || row.speedup <= 0) continue;
    svg << "<circle cx=\"" << num(px(row.workers)) << "\" cy=\"" << num(py(row.speedup))
        << "\" r=\"5\" fill=\"#d62728\"><title>" << xml_escape(row.verdict)
        << "</title></circle>\n";
  }
  svg << "</g>\n";
  // Legend.
  double lx = kLeft + plot_w + 15, ly = kTop + 10;
  svg << "<g id=\"legend\">\n"
      << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly) << "\" x2=\"" << num(lx + 25)
      << "\" y2=\"" << num(ly) << "\" stroke=\"#888\" stroke-dasharray=\"6 4\"/><text x=\""
      << num(lx + 32) << "\" y=\"" << num(ly + 4) << "\">ideal</text>\n"
      << "<circle cx=\"" << num(lx + 12) << "\" cy=\"" << num(ly + 22)
      << "\" r=\"5\" fill=\"#d62728\"/><text x=\"" << num(lx + 32) << "\" y=\"" << num(ly + 26)
      << "\">measured</text>\n";
  if (report.prediction.available) {
    svg << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly + 44) << "\" x2=\"" << num(lx + 25)
        << "\" y2=\"" << num(ly + 44) << "\" stroke=\"#1f77b4\" stroke-width=\"2\"/><text x=\""
        << num(lx + 32) << "\" y=\"" << num(ly + 48) << "\">predicted</text>\n";
    if (report.link_gbps) {
      svg << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly + 66) << "\" x2=\"" << num(lx + 25)
          << "\" y2=\"" << num(ly + 66)
          << "\" stroke=\"#ff7f0e\" stroke-width=\"2\" stroke-dasharray=\"4 3\"/><text x=\""
          << num(lx + 32) << "\" y=\"" << num(ly + 70) << "\">predicted, "
          << format("%g", *report.link_gbps) << " Gbit/s</text>\n";
    }
  } else {
    svg << "<text x=\"" << num(lx) << "\" y=\"" << num(ly + 48) << "\">no prediction</text>\n";
  }
  svg << "</g>\n</svg>\n";
  return svg.str();
}

}  // namespace dtrain::cli::scale
