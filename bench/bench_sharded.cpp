// What sharding buys: bytes held per rank for parameters, gradients and Adam's state (each tensor
// storage counted once), the process's peak resident memory, step time and communication per step,
// for DDP and ZeRO stages 1-3, against the ZeRO paper's formulas (Ψ parameters, fp32, Adam):
//   DDP 16Ψ · stage 1 8Ψ + 8Ψ/N · stage 2 4Ψ + 12Ψ/N · stage 3 16Ψ/N
//   (+ the units gathered at the time)
// Model: an MLP 784-H-...-H-10 with --layers hidden layers, Adam, a fixed synthetic batch per rank,
// one intra-op thread per rank. Every rank prints one JSON line (bytes differ by rank only through
// padding).
//   dtrain run --nproc-per-node 4 -- build/bin/bench_sharded --mode 3 --hidden 1024 --layers 4
//   --steps 20
// --budget-mb M: instead, find the widest such MLP (H in steps of 64) whose training state stays
// within M MiB per rank at its sampled peak (during forward, backward and after the step), training
// 2 steps each. bench/sharded_memory.sh runs every mode at N = 1, 2, 4.
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <set>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/sharded.h"
#include "flags.h"
#include "json_line.h"

namespace {

// Bytes of distinct storages, by what they hold.
struct Census {
  std::set<const void*> seen;
  int64_t params = 0, grads = 0, optimizer = 0;
  void add(const at::Tensor& t, int64_t& into) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second)
      into += static_cast<int64_t>(t.storage().nbytes());
  }
  int64_t total() const { return params + grads + optimizer; }
};

struct Probe;

// One configuration: model, wrapper, optimizer, and the sampling of the state's bytes.
struct Run {
  std::string mode;  // "ddp", "1", "2", "3"
  std::shared_ptr<dtrain::ProcessGroup> pg;
  torch::nn::Sequential model{nullptr};
  dtrain::DistributedDataParallel<torch::nn::SequentialImpl> ddp{nullptr};
  dtrain::ShardedDataParallel<torch::nn::SequentialImpl> sdp{nullptr};
  std::unique_ptr<torch::optim::Adam> optimizer;
  int64_t psi = 0;           // parameters of the model
  int64_t largest_unit = 0;  // stage 3: parameters of the largest unit
  Census peak;               // the largest census sampled
  at::Tensor x, y;

  Census census() const {
    Census c;
    for (auto& p : model->parameters()) c.add(p, c.params);
    if (sdp) {
      for (auto& s : sdp->parameters()) c.add(s, c.params);
    }
    for (auto& p : model->parameters()) c.add(p.grad(), c.grads);
    if (sdp) {
      for (auto& s : sdp->parameters()) c.add(s.grad(), c.grads);
    }
    for (auto& entry : optimizer->state()) {
      auto& state = static_cast<torch::optim::AdamParamState&>(*entry.second);
      c.add(state.exp_avg(), c.optimizer);
      c.add(state.exp_avg_sq(), c.optimizer);
      c.add(state.max_exp_avg_sq(), c.optimizer);
    }
    return c;
  }
  void sample() {
    Census c = census();
    if (c.total() > peak.total()) peak = c;
  }
  void step() {
    optimizer->zero_grad();
    at::Tensor logits = ddp ? ddp->forward(x) : sdp->forward(x);
    torch::nn::functional::cross_entropy(logits, y).backward();
    sample();
    optimizer->step();
    sample();
  }
};

// Samples the state's bytes during forward (after its unit) and, through a gradient hook, during
// backward.
struct ProbeImpl : torch::nn::Module {
  Run* run = nullptr;
  torch::Tensor forward(torch::Tensor x) {
    if (run) run->sample();
    if (x.requires_grad()) {
      Run* r = run;
      x.register_hook([r](torch::Tensor g) {
        if (r) r->sample();
        return g;
      });
    }
    return x;
  }
};
TORCH_MODULE(Probe);

std::unique_ptr<Run> build(const std::string& mode, std::shared_ptr<dtrain::ProcessGroup> pg,
                           int64_t hidden, int64_t layers, int64_t batch) {
  auto run = std::make_unique<Run>();
  run->mode = mode;
  run->pg = pg;
  torch::manual_seed(0);
  std::vector<Probe> probes;
  torch::nn::Sequential model;
  int64_t in = 784;
  for (int64_t l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(in, hidden));
    model->push_back(torch::nn::ReLU());
    probes.emplace_back();
    model->push_back(probes.back());
    in = hidden;
  }
  model->push_back(torch::nn::Linear(in, 10));
  run->model = model;
  for (auto& p : model->parameters()) run->psi += p.numel();
  run->largest_unit = std::max(784 * hidden + hidden, hidden * hidden + hidden);
  if (mode == "ddp") {
    dtrain::DistributedDataParallelOptions options;
    options.gradient_as_bucket_view = true;  // gradients are the buckets: 4Ψ, not 8Ψ
    run->ddp = dtrain::DistributedDataParallel<torch::nn::SequentialImpl>(model.ptr(), pg, options);
    run->optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), 1e-4);
  } else {
    dtrain::ShardedDataParallelOptions options;
    options.stage = std::stoi(mode);
    run->sdp = dtrain::ShardedDataParallel<torch::nn::SequentialImpl>(model.ptr(), pg, options);
    run->optimizer = std::make_unique<torch::optim::Adam>(run->sdp->parameters(), 1e-4);
  }
  for (auto& probe : probes) probe->run = run.get();
  run->x = torch::randn({batch, 784});
  run->y = torch::randint(0, 10, {batch});
  return run;
}

// The ZeRO paper's bytes per rank for Ψ parameters at N ranks (steady state, between steps).
double formula(const std::string& mode, double psi, double n) {
  if (mode == "ddp") return 16 * psi;
  if (mode == "1") return 8 * psi + 8 * psi / n;
  if (mode == "2") return 4 * psi + 12 * psi / n;
  return 16 * psi / n;
}

long peak_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    std::string mode = "ddp";
    int64_t hidden = 1024, layers = 4, batch = 32, steps = 20, budget_mb = 0;
    bench::Flags("bench_sharded",
                 "memory and step time of DDP against ShardedDataParallel stages 1-3")
        .text("--mode", mode, "ddp, or the ZeRO stage", {"ddp", "1", "2", "3"})
        .integer("--hidden", hidden, "hidden width")
        .integer("--layers", layers, "hidden layers")
        .integer("--batch", batch, "samples per rank per step")
        .integer("--steps", steps, "timed steps")
        .integer("--budget-mb", budget_mb,
                 "instead, the widest MLP whose training state fits M MiB per rank (0: off)", 0)
        .parse(argc, argv);
    torch::set_num_threads(1);
    auto pg = dtrain::init_process_group();
    const int n = pg->size();

    if (budget_mb > 0) {
      // Widest H whose sampled peak fits: double, then bisect in steps of 64. Every rank decides
      // the same (the peak is all-reduced with max), so all ranks build the same candidates.
      const int64_t budget = budget_mb << 20;
      auto fits = [&](int64_t h) {
        auto run = build(mode, pg, h, layers, batch);
        for (int s = 0; s < 2; ++s) run->step();
        // Stage 3 also holds the next unit's prefetched parameters, which no module parameter shows
        // yet.
        double held =
            static_cast<double>(run->peak.total()) + (mode == "3" ? 4.0 * run->largest_unit : 0.0);
        at::Tensor peak = at::full({1}, held, at::kDouble);
        pg->all_reduce(peak, dtrain::ReduceOp::kMax);
        return peak.item<double>() <= static_cast<double>(budget);
      };
      int64_t good = 0, bad = 64;
      while (fits(bad)) {
        good = bad;
        bad *= 2;
      }
      while (bad - good > 64) {
        int64_t mid = (good + bad) / 2 / 64 * 64;
        if (fits(mid)) {
          good = mid;
        } else {
          bad = mid;
        }
      }
      int64_t psi =
          good > 0 ? 784 * good + good + (layers - 1) * (good * good + good) + good * 10 + 10 : 0;
      if (pg->rank() == 0) {
        bench::print_line({{"bench", "sharded-budget"},
                           {"mode", mode},
                           {"world", n},
                           {"budget_mb", budget_mb},
                           {"layers", layers},
                           {"widest_hidden", good},
                           {"params", psi},
                           {"peak_rss_mb", bench::rounded(peak_rss_kib() / 1024.0, 1)}});
      }
      return 0;
    }

    auto run = build(mode, pg, hidden, layers, batch);
    for (int i = 0; i < 3; ++i) run->step();  // warm-up: optimizer state exists from the first step
    dtrain::ShardedCommStats before;
    if (run->sdp) before = run->sdp->comm_stats();
    pg->barrier();
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) run->step();
    pg->barrier();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                    .count() /
                steps;
    Census steady = run->census();  // between steps: what the formulas describe
    // Payload per step (full flat buffers); a ring moves (N-1)/N of it per rank for an all-gather
    // or a reduce-scatter, 2(N-1)/N for an all-reduce. DDP all-reduces every gradient once.
    double wire = 0, payload = 0;
    const double ring = n > 1 ? static_cast<double>(n - 1) / n : 0;
    if (run->sdp) {
      auto after = run->sdp->comm_stats();
      double ar = static_cast<double>(after.all_reduce_bytes - before.all_reduce_bytes) / steps;
      double rs =
          static_cast<double>(after.reduce_scatter_bytes - before.reduce_scatter_bytes) / steps;
      double ag = static_cast<double>(after.all_gather_bytes - before.all_gather_bytes) / steps;
      payload = ar + rs + ag;
      wire = ring * (2 * ar + rs + ag);
    } else {
      payload = 4.0 * run->psi;
      wire = ring * 2 * payload;
    }
    const double ddp_wire = ring * 2 * 4.0 * run->psi;
    const double expected = formula(mode, static_cast<double>(run->psi), n);
    bench::print_line({{"bench", "sharded"},
                       {"mode", mode},
                       {"world", n},
                       {"rank", pg->rank()},
                       {"params", run->psi},
                       {"param_bytes", steady.params},
                       {"grad_bytes", steady.grads},
                       {"optimizer_bytes", steady.optimizer},
                       {"total_bytes", steady.total()},
                       {"formula_bytes", std::llround(expected)},
                       {"vs_formula", bench::rounded(steady.total() / expected, 4)},
                       {"peak_sampled_bytes", run->peak.total()},
                       {"largest_unit_bytes", 4 * run->largest_unit},
                       {"peak_rss_mb", bench::rounded(peak_rss_kib() / 1024.0, 1)},
                       {"ms_per_step", bench::rounded(ms, 2)},
                       {"comm_payload_bytes_per_step", std::llround(payload)},
                       {"comm_wire_bytes_per_step", std::llround(wire)},
                       {"wire_vs_ddp", bench::rounded(ddp_wire > 0 ? wire / ddp_wire : 0.0, 3)}});
    return 0;
  });
}
