// `dtrain scale`'s analysis (see scale_report.h): from the rows of the runs to the speed-up and
// efficiency against the baseline, the verdict and its reason per worker count, the alpha-beta fit
// of the all-reduce and the prediction beyond what was run. The rows' measurements come from
// scale_records.cpp, the renderings of the result are in scale_report.cpp; this file decides, they
// read and lay out.
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
//   T(N) = c * b(N) + F + A(N) - min((1 - x) * A(N), h * b(N)) + W
// c: compute per sample at M (contention seen there included); b(N): samples per rank, G/N for a
// fixed global batch G (strong scaling) or b(M) (weak); F: the rest of M's step (optimizer, data,
// gaps); A(N): a ring all-reduce of the step's gradient bytes n in k operations,
// 2(N-1) k alpha + 2(N-1)/N n / bandwidth, alpha and bandwidth fitted by least squares to every
// measured step (comm_s against comm_bytes, comm_ops); x: M's exposed communication / A(M), at most
// 1 (the overlap as measured); W: what M's exposed communication exceeds A(M) by, 0 when it does
// not: the steps also waited for the slower rank to arrive, which no transfer time contains, so W
// stays as measured at every count and link. (Scaling it with A(N) instead, as before, predicted
// 0.12x for 2 workers over a 1 Gbit/s link where two namespace hosts measured 0.20x.)
// The hidden part, (1 - x) A(N), can never exceed the compute it overlaps with: h is M's backward
// pass per sample (the whole compute when no backward time was recorded), or M's hidden
// communication per sample where that was more. Without this cap a slow link (--link-gbps) kept
// one host's overlap and hid 52% of a 37.6 ms all-reduce behind 1 ms of backward (issue 21).
// Throughput N b(N) / T(N); speed-up against the measured baseline. At N = M this gives back M's
// measured throughput whatever the fit's error, which the tests check.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "launcher/cli/scale_internal.h"
#include "launcher/cli/scale_report.h"

namespace dtrain::cli::scale {
namespace {

std::string devices_text(int n) { return std::to_string(n) + (n == 1 ? " device" : " devices"); }

// The rate speed-ups compare: samples/s, or runs per second for a run-time-only row.
double rate_of(const Row& row, const RunResult& run) {
  if (row.source == "profile" || row.source == "printed") return row.samples_per_s;
  if (row.source == "run time") return run.wall_s > 0 ? 1.0 / run.wall_s : kNaN;
  return kNaN;
}

bool rate_kind_samples(const Row& row) {
  return row.source == "profile" || row.source == "printed";
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
// coefficients kept >= 0, over the steps of counts up to `max_workers` that ran on `min_nodes`
// hosts or more.
CommModel fit_model(const std::vector<RunResult>& runs, const std::vector<Row>& rows,
                    int warmup_steps, int max_workers, int min_nodes) {
  struct Point {
    double x1, x2, y;
  };
  std::vector<Point> points;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (!rows[i].ok || rows[i].source != "profile" || runs[i].workers < 2) continue;
    if (runs[i].workers > max_workers || runs[i].nodes < min_nodes) continue;
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
    double hidden = std::min((1 - p.exposed_share) * comm, p.hide_per_sample_s * per_rank);
    double step =
        p.compute_per_sample_s * per_rank + p.fixed_s + comm - hidden + p.slower_rank_wait_s;
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
    row.nodes = run.nodes;
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
  // A ring is as slow as its slowest link: once a count crossed between hosts, the fit and the
  // prediction take only such counts, so the bandwidth is the link's between the hosts.
  int crossing = 1;
  for (const Row& row : report.rows) {
    if (row.ok && row.source == "profile" && row.comm_s > 0 && row.nodes > 1) crossing = 2;
    if (row.nodes > 1) {
      report.notes.push_back(workers_text(row.workers) + " ran on " + std::to_string(row.nodes) +
                             " hosts: their all-reduces crossed between hosts");
    }
  }
  report.model = fit_model(runs, report.rows, settings.warmup_steps, fitting, crossing);

  // Note [Prediction].
  Prediction& prediction = report.prediction;
  const Row* fitted = nullptr;
  for (const Row& row : report.rows) {
    if (row.ok && row.source == "profile" && row.workers >= 2 && row.workers <= fitting &&
        row.nodes >= crossing && row.comm_s > 0 && row.samples_per_rank_step > 0) {
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
    // Exposed communication scales with the modelled all-reduce up to the whole of it; the ratio
    // is taken at the fitted count, so the prediction gives back its measured step there whatever
    // the fit's error. What the step waited beyond the whole all-reduce is the slower rank's
    // arrival, kept as it was (Note [Prediction]).
    double modelled = report.model.seconds(fitted->workers, fitted->comm_bytes, fitted->comm_ops);
    prediction.exposed_share =
        modelled > 0 ? std::min(1.0, fitted->exposed_comm_s / modelled) : 1.0;
    prediction.slower_rank_wait_s = std::max(0.0, fitted->exposed_comm_s - modelled);
    // What the all-reduces can hide behind: the backward pass, or what did hide at the fitted count
    // if that was more (the model's A(M) may exceed the measured transfers), so that the prediction
    // still gives its measured step back there.
    double hiding_compute = fitted->backward_s > 0 ? fitted->backward_s : fitted->compute_s;
    prediction.hide_per_sample_s =
        std::max(hiding_compute, modelled - fitted->exposed_comm_s) / fitted->samples_per_rank_step;
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
    if (prediction.slower_rank_wait_s == 0) {
      prediction.assumptions.push_back(
          "overlap as measured: " + waited + percent(prediction.exposed_share) + " of the " +
          ms(modelled) +
          " ms the model gives its all-reduces; the same share at every count, but no more "
          "hidden than the backward pass covers (" +
          ms(prediction.hide_per_sample_s * prediction.samples_per_rank) + " ms at " +
          workers_text(fitted->workers) + ", scaled with the samples per rank)");
    } else {
      prediction.assumptions.push_back(
          "no overlap: " + waited + format("%.2f", fitted->exposed_comm_s / modelled) +
          " times the " + ms(modelled) +
          " ms the model gives its all-reduces; the all-reduce scales with the count and the "
          "link, the rest (" +
          ms(prediction.slower_rank_wait_s) +
          " ms, waiting for the slower rank) stays as measured");
    }
    prediction.assumptions.push_back(
        "the rest of the step (optimizer, data, gaps between steps) stays " +
        ms(prediction.fixed_s) + " ms at every count");
    if (crossing > 1) {
      prediction.assumptions.push_back(
          "the fitted bandwidth is the link's between hosts: fitted only on counts that ran on "
          "several hosts (" +
          workers_text(fitted->workers) + " on " + std::to_string(fitted->nodes) +
          "), whose ring is as slow as that link; every added host joins over the same link");
    }
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

}  // namespace dtrain::cli::scale
