// gpt_advise: which layout should I use for this transformer on N devices of M GB joined by B
// Gbit/s links? Times one block of the config on this machine (LibTorch, CPU), then lists the
// layouts train_gpt can run that fit in memory, fastest predicted first, with the cost that
// dominates each (tools/gpt/advise.h; doc/gpt.md, "Which layout: gpt_advise").
//
//   build/bin/gpt_advise --devices 8 --memory-gb 16 --bandwidth-gbps 100 --layers 8 --width 512
//
// Exit codes: 0 with a table, 1 when no layout fits (the smallest is named), 2 for impossible
// inputs (one line naming the flag).
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "console/flag_checks.h"
#include "dtrain/errors.h"
#include "gpt/advise.h"
#include "gpt/gpt.h"

namespace {

struct Flags {
  gpt::GptConfig model;
  int devices = 0;
  double memory_gb = 0;
  double bandwidth_gbps = 0;
  double latency_us = 20;
  int64_t batch_size = 8;    // windows per data-parallel rank (train_gpt's --batch-size)
  int64_t global_batch = 0;  // windows per step, split over dp (0: --batch-size per rank)
  int threads = 1;           // intra-op threads the block is timed with (one rank's share)
  int repeats = 3;
  int top = 10;
  bool all = false;
  bool json = false;
};

Flags parse(int argc, char** argv) {
  Flags flags;
  CLI::App app("gpt_advise: the layouts of train_gpt's transformer that fit, fastest first");
  // Each bad value is one line: "gpt_advise: --flag 'value': expected ...".
  const console::FlagChecks checks("gpt_advise");
  const int64_t kMany = int64_t{1} << 30;
  app.add_option("--devices", flags.devices, "devices (ranks) the job gets")
      ->required()
      ->transform(checks.integer_in("--devices", 1, kMany));
  app.add_option("--memory-gb", flags.memory_gb, "memory per device, GB (1e9 bytes)")
      ->required()
      ->transform(checks.number("--memory-gb"));
  app.add_option("--bandwidth-gbps", flags.bandwidth_gbps, "link bandwidth, Gbit/s")
      ->required()
      ->transform(checks.number("--bandwidth-gbps"));
  app.add_option("--latency-us", flags.latency_us, "per-step latency of a collective, us")
      ->transform(checks.number("--latency-us", /*zero_allowed=*/true));
  // The model's sizes: GptConfig::check() says what does not go together.
  for (auto [name, size] :
       {std::pair{"--layers", &flags.model.layers}, std::pair{"--width", &flags.model.width},
        std::pair{"--heads", &flags.model.heads}, std::pair{"--kv-heads", &flags.model.kv_heads},
        std::pair{"--vocab", &flags.model.vocab}, std::pair{"--seq-len", &flags.model.seq_len}}) {
    app.add_option(name, *size)->transform(checks.integer_in(name, 1, kMany));
  }
  app.add_option("--mlp-width", flags.model.mlp_width, "SwiGLU's hidden width (0: 8/3 x width)")
      ->transform(checks.integer_in("--mlp-width", 0, kMany));
  app.add_option("--batch-size", flags.batch_size, "windows per data-parallel rank and step")
      ->transform(checks.integer_in("--batch-size", 1, kMany));
  app.add_option("--global-batch", flags.global_batch,
                 "windows per step, split over the data-parallel ranks (instead of --batch-size)")
      ->transform(checks.integer_in("--global-batch", 0, kMany));
  app.add_option("--threads", flags.threads, "threads the block is timed with (per rank)")
      ->transform(checks.integer_in("--threads", 1, 4096));
  app.add_option("--repeats", flags.repeats, "timed iterations per measurement")
      ->transform(checks.integer_in("--repeats", 1, 1 << 20));
  app.add_option("--top", flags.top, "layouts listed")
      ->transform(checks.integer_in("--top", 1, 1 << 20));
  app.add_flag("--all", flags.all, "list every layout, the ones that do not fit as well");
  app.add_flag("--json", flags.json, "one JSON document instead of the table");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw dtrain::UsageError(std::string("gpt_advise: ") + e.what() + " (see --help)");
  }
  try {
    flags.model.check();
  } catch (const dtrain::UsageError& e) {
    throw dtrain::UsageError(std::string("gpt_advise: ") + e.what());
  }
  return flags;
}

std::string gb(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g", bytes / 1e9);
  return text;
}

nlohmann::ordered_json to_json(const gpt::Prediction& p) {
  nlohmann::ordered_json terms = nlohmann::ordered_json::object();
  for (const auto& [name, s] : p.terms) terms[name] = s;
  return {{"flags", p.layout.flags()},
          {"memory_bytes", p.memory.total()},
          {"activation_bytes", p.memory.activations},
          {"step_s", p.step_s},
          {"tokens_per_s", p.tokens_per_s},
          {"reason", p.reason()},
          {"terms_s", terms}};
}

int advise(const Flags& flags) {
  at::set_num_threads(flags.threads);
  gpt::Machine machine;
  machine.devices = flags.devices;
  machine.memory_bytes = flags.memory_gb * 1e9;
  machine.bandwidth = flags.bandwidth_gbps * 1e9 / 8;
  machine.latency_s = flags.latency_us * 1e-6;
  // Every micro-batch size a candidate uses, timed once.
  std::set<int64_t> rows;
  const int64_t probe = flags.global_batch > 0 ? flags.global_batch : flags.batch_size;
  for (const gpt::Layout& layout : gpt::candidate_layouts(flags.model, flags.devices, probe)) {
    int64_t r = flags.batch_size;
    if (flags.global_batch > 0) {
      if (flags.global_batch % layout.dp != 0) continue;
      r = flags.global_batch / layout.dp;
    }
    rows.insert((r + (layout.pp > 1 ? layout.micro_batches : 1) - 1) /
                (layout.pp > 1 ? layout.micro_batches : 1));
  }
  if (rows.empty()) {
    throw dtrain::UsageError("gpt_advise: --global-batch " + std::to_string(flags.global_batch) +
                             " divides over no data-parallel degree of --devices " +
                             std::to_string(flags.devices) + "; give a multiple of the devices");
  }
  std::cerr << "gpt_advise: timing one block (" << gpt::parameter_count(flags.model)
            << " parameters in the model) at " << rows.size() << " micro-batch size(s), "
            << flags.threads << " thread(s)..." << std::endl;
  const gpt::Costs costs =
      gpt::measure_costs(flags.model, {rows.begin(), rows.end()}, flags.repeats);
  const gpt::Advice advice =
      gpt::advise(flags.model, machine, flags.batch_size, costs, flags.global_batch);
  if (flags.json) {
    nlohmann::ordered_json out = {{"devices", flags.devices},
                                  {"memory_bytes", machine.memory_bytes},
                                  {"bandwidth_gbps", flags.bandwidth_gbps},
                                  {"parameters", gpt::parameter_count(flags.model)},
                                  {"fitting", nlohmann::ordered_json::array()},
                                  {"too_big", nlohmann::ordered_json::array()}};
    for (const auto& p : advice.fitting) out["fitting"].push_back(to_json(p));
    for (const auto& p : advice.too_big) out["too_big"].push_back(to_json(p));
    std::cout << out.dump() << std::endl;
    return advice.fitting.empty() ? 1 : 0;
  }
  std::printf("%zu layouts of %d devices fit in %s GB each (%zu do not); fastest first:\n",
              advice.fitting.size(), flags.devices, gb(machine.memory_bytes).c_str(),
              advice.too_big.size());
  std::printf("%-52s %9s %10s %12s  %s\n", "layout (train_gpt flags)", "GB/rank", "step ms",
              "tokens/s", "why");
  int listed = 0;
  for (const auto& p : advice.fitting) {
    if (!flags.all && listed++ >= flags.top) break;
    std::printf("%-52s %9s %10.2f %12.0f  %s\n", p.layout.flags().c_str(),
                gb(p.memory.total()).c_str(), p.step_s * 1e3, p.tokens_per_s, p.reason().c_str());
  }
  if (flags.all) {
    for (const auto& p : advice.too_big) {
      std::printf("%-52s %9s %10s %12s  does not fit (activations %s GB)\n",
                  p.layout.flags().c_str(), gb(p.memory.total()).c_str(), "-", "-",
                  gb(p.memory.activations).c_str());
    }
  }
  const std::string batch =
      flags.global_batch > 0
          ? std::to_string(flags.global_batch) + " windows per step split over the replicas"
          : std::to_string(flags.batch_size) + " windows per data-parallel rank";
  std::printf(
      "assumptions: float32; %s, %lld tokens each; one block timed here (%d thread(s)), divided "
      "by tp; ring collectives at %g Gbit/s and %g us per step, none overlapped; 1F1B; see "
      "doc/gpt.md\n",
      batch.c_str(), static_cast<long long>(flags.model.seq_len), flags.threads,
      flags.bandwidth_gbps, flags.latency_us);
  if (advice.fitting.empty()) {
    const auto& smallest = advice.too_big.front();
    std::printf("no layout fits: the smallest, %s, needs %s GB per rank\n",
                smallest.layout.flags().c_str(), gb(smallest.memory.total()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] { return advise(parse(argc, argv)); });
}
