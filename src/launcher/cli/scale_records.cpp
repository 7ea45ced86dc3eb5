// `dtrain scale`'s measurements (see scale_report.h): one DTRAIN_PROFILE line to a StepRecord, a
// program's printed samples/s, and a run's records to the means of its Row (fill_from_records).
// Apart from the analysis (scale_analysis.cpp) because this is the part that reads what the workers
// wrote; the analysis only compares rows.
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>

#include "launcher/cli/scale_internal.h"
#include "launcher/cli/scale_report.h"

namespace dtrain::cli::scale {
namespace {

// Means over one rank's measured records, and its throughput on the records' own clock.
struct RankSummary {
  long long steps = 0;
  double interval_s = 0, step_s = 0, compute_s = 0, backward_s = 0, exposed_s = 0, optimizer_s = 0,
         comm_s = 0, comm_bytes = 0, comm_ops = 0, samples = 0, samples_per_s = 0;
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
    summary.backward_s += r.backward_s;
    summary.exposed_s += r.exposed_comm_s;
    summary.optimizer_s += r.optimizer_s;
    summary.comm_s += r.comm_s;
    summary.comm_bytes += r.comm_bytes;
    summary.comm_ops += r.comm_ops;
    summary.samples += r.samples;
  }
  double n = static_cast<double>(count);
  double sum_step_s = summary.step_s;
  for (double* mean : {&summary.step_s, &summary.compute_s, &summary.backward_s, &summary.exposed_s,
                       &summary.optimizer_s, &summary.comm_s, &summary.comm_bytes,
                       &summary.comm_ops, &summary.samples}) {
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

}  // namespace

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
    row.backward_s += r.backward_s / n;
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

}  // namespace dtrain::cli::scale
