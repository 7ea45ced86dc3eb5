// `dtrain scale`'s renderings of a Report (see scale_report.h): the text table with the verdicts
// and the prediction, the JSON document, the SVG plot. Apart from the analysis (scale_analysis.cpp)
// because they decide nothing: they lay out the numbers and words the analysis computed.
#include "launcher/cli/scale_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/format.h"
#include "launcher/cli/scale_internal.h"

namespace dtrain::cli::scale {
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
    r["nodes"] = row.nodes;
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
