// `dtrain scale`'s analysis: from the per-step records (DTRAIN_PROFILE: one JSON object per line
// and rank with the fields of StepRecord; extra fields are ignored) or the printed throughput of
// each run, to the table, the verdict per worker count, the alpha-beta fit of the all-reduce, the
// prediction beyond what was run, and the renderings (text, JSON, SVG). Pure functions of the
// measurements: the tests feed them known numbers.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dtrain::cli::scale {

// One line of DTRAIN_PROFILE: one training step of one rank (seconds, bytes, samples).
struct StepRecord {
  int rank = 0;
  int world_size = 1;
  long long step = 0;
  double step_s = 0;
  double forward_s = 0;
  double backward_s = 0;
  double exposed_comm_s = 0;
  double optimizer_s = 0;
  double comm_s = 0;
  double comm_bytes = 0;
  double comm_ops = 0;
  double samples = 0;
  double time = 0;  // unix time at the end of the step
};

// Parses one record line; nothing when it is not a JSON object with every required field (the
// reason then goes to *why).
std::optional<StepRecord> parse_record(const std::string& line, std::string* why = nullptr);

// A program's own throughput report in one output line: the JSON field "samples_per_s": N, or the
// number right before the word "samples/s" ("throughput: 1234.5 samples/s"). Nothing otherwise.
std::optional<double> printed_samples_per_s(const std::string& line);

// What one run (one worker count) produced.
struct RunResult {
  int workers = 1;
  // Hosts the workers ran on (dtrain scale --nnodes: a count above --nproc-per-node spans several).
  int nodes = 1;
  // Whether every worker ended well: exited 0, or was stopped by `dtrain scale` itself.
  bool ok = true;
  // How it ended, for the table: "stopped after 20 steps", "finished", "rank 1 exited with code 3".
  std::string ending;
  // The exit code the run counts as (0 when ok).
  int exit_code = 0;
  // The last stderr line of the failing rank, when one failed.
  std::string failure_line;
  // Whether it ran into --time-limit.
  bool time_limit = false;
  // Whether the workers exited by themselves with code 0 (not stopped by us).
  bool finished_by_itself = false;
  // Seconds from the start of the workers to the end of the last one.
  double wall_s = 0;
  // Every record, in file order.
  std::vector<StepRecord> records;
  // Lines of the profile file that were not records.
  int malformed_records = 0;
  // The job's throughput as printed by the program (see printed_samples_per_s), if it printed one.
  std::optional<double> printed_samples_per_s;
};

struct AnalysisSettings {
  int warmup_steps = 3;
  std::optional<double> link_gbps;
  // Worker counts of the prediction.
  std::vector<int> predict_at = {8, 16, 64};
  // Said under the verdicts (how the runs were set up).
  std::vector<std::string> notes;
  // CPUs of the host the runs shared; 0: this machine's. More workers than this oversubscribe it.
  int host_cpus = 0;
};

// How one worker count did.
struct Row {
  int workers = 1;
  int nodes = 1;  // hosts it ran on; above 1, its all-reduces crossed between hosts
  bool ok = true;
  std::string status;      // "ok", or how it failed
  int exit_code = 0;       // the run's exit code (0 unless it failed)
  std::string source;      // "profile", "printed", "run time" or "none": where the rate comes from
  int ranks_recorded = 0;  // ranks with at least one measured record
  long long measured_steps = 0;  // fewest measured records of any rank
  // Job throughput (all ranks); NaN when unknown (run time only).
  double samples_per_s = 0;
  // Start to exit of the workers, for a "run time" row.
  double run_time_s = 0;
  // Means per rank and step over the measured records (profile rows).
  double interval_s =
      0;  // wall time per step from the records' clock (step plus what lies between)
  double step_s = 0, compute_s = 0, exposed_comm_s = 0, optimizer_s = 0;
  double backward_s = 0;  // the part of compute_s that all-reduces can overlap with
  double other_s = 0;     // interval - compute - exposed communication - optimizer
  double comm_s = 0, comm_bytes = 0, comm_ops = 0;
  double samples_per_rank_step = 0;
  double compute_per_sample_s = 0;
  // Payload bytes / all-reduce time, and the bus bandwidth of a ring (2(N-1)/N of the payload
  // crosses each link), Gbit/s; 0 when there was no communication.
  double algorithm_gbps = 0, bus_gbps = 0;
  // Relative to the baseline row (the fewest workers that ran); NaN when not comparable.
  double speedup = 0, efficiency = 0;
  // Lost time per step against ideal scaling, split by cause (seconds; profile rows past the
  // baseline).
  double lost_s = 0, lost_contention_s = 0, lost_comm_s = 0, lost_fixed_s = 0;
  std::string verdict;  // "2 workers: 1.6x faster, 80% efficient: worth it"
  std::string reason;   // "compute-bound: ..."
};

// The alpha-beta model of a ring all-reduce fitted to the measured transfers.
struct CommModel {
  bool fitted = false;
  std::string how;                // how it was fitted, or why not
  double alpha_s = 0;             // latency per ring step
  double bytes_per_s = 0;         // link bandwidth (1/beta)
  double rms_relative_error = 0;  // root mean square error / mean measured time
  int points = 0;
  // Seconds for `ops` all-reduces carrying `bytes` payload in total on `workers` ranks.
  double seconds(int workers, double bytes, double ops, double bytes_per_s_override = 0) const;
};

struct PredictionPoint {
  int workers = 0;
  bool possible = true;  // false when a strong-scaling global batch has fewer samples than workers
  double speedup = 0;
  double speedup_at_link = 0;  // with --link-gbps (NaN without)
  double samples_per_s = 0;
};

struct Prediction {
  bool available = false;
  std::string why_not;
  std::string scaling;  // "strong" or "weak"
  int fitted_on_workers = 0;
  // From the fitted count up: powers of two, the measured and the requested counts.
  std::vector<PredictionPoint> points;
  std::vector<std::string> assumptions;
  // The model's inputs, all taken from the row it was fitted on unless said otherwise.
  double compute_per_sample_s = 0;
  double fixed_s = 0;  // per-step time that is neither compute nor exposed communication
  // Exposed communication / the model's all-reduce time, at most 1 (1: nothing hides).
  double exposed_share = 1;
  // What the fitted step waited beyond the model's whole all-reduce: the slower rank's arrival,
  // not a transfer, so it does not grow with a slower link (Note [Prediction]).
  double slower_rank_wait_s = 0;
  // Compute per sample that communication can hide behind (the backward pass): the hidden part of
  // an all-reduce never exceeds it times the samples per rank.
  double hide_per_sample_s = 0;
  double bytes_per_step = 0, ops_per_step = 0;
  double samples_per_rank = 0;  // at the fitted row; the global batch is this times its workers
  double baseline_samples_per_s = 0;  // measured, at the baseline row
  int baseline_workers = 0;
};

struct Report {
  std::vector<Row> rows;
  int baseline_workers = 0;
  CommModel model;
  Prediction prediction;
  std::optional<double> link_gbps;
  int warmup_steps = 0;
  std::vector<std::string> notes;
  bool any_failed = false;
};

Report analyze(const std::vector<RunResult>& runs, const AnalysisSettings& settings);

// Predicted throughput and speed-up at `workers` from the report's fitted model (exposed for the
// test that the model reproduces the point it was fitted on).
PredictionPoint predict(const Report& report, int workers);

// The human report: table, verdicts, prediction and its assumptions.
std::string render_text(const Report& report, const std::string& title);
// One JSON document.
std::string render_json(const Report& report, const std::vector<std::string>& command);
// Speed-up against workers (log-log): ideal line, measured points, prediction.
std::string render_svg(const Report& report, const std::string& title);

}  // namespace dtrain::cli::scale
