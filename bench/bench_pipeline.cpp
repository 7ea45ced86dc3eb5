// Pipeline benchmarks; results go to doc/benchmarks.md.
//
// Bubble fraction with stages of controlled duration: every chunk is a "sleep" layer whose forward
// sleeps F ms and backward B ms (per micro-batch, divided by V for interleaved chunks), so two
// cores cannot blur the schedule; half of B sleeps on the input's gradient path and half on the
// weight's, so that the zero-bubble schedule's B and W passes take B/2 each. A stage is busy about
// M·(F+B) per step; the bubble is 1 - busy/step_time with busy as measured around each sleep (a
// loaded machine stretches sleeps), printed beside theory. In one process it also prints each
// stage's peak of micro-batches whose activations it held at once (GPipe: M; 1F1B: at most P -
// stage; zbh1: at most P).
//   bench_pipeline --mode sleep --stages 4 --micro-batches 8 --schedule 1f1b [--virtual-stages 2]
//   dtrain run --nproc-per-node 4 -- bench_pipeline --mode sleep --distributed --micro-batches 8
//   (--schedule gpipe, 1f1b, zbh1, or interleaved with --virtual-stages V)
// Single-process model parallel on a real MLP (784-H-H-H-10, 4 Linear layers cut into --stages
// chunks by parameters): pipelined with --micro-batches M against naive placement (M = 1: one stage
// works at a time).
//   bench_pipeline --mode mlp --stages 2 --micro-batches 4 --hidden 2048 --batch 256
// The same MLP across processes, one stage per rank (P·V chunks by parameters; the cut is printed
// as "boundaries" so that bench/pipelining_peer.py can run PyTorch's schedules on the same chunks):
//   dtrain run --nproc-per-node 2 -- bench_pipeline --mode mlp --distributed --schedule 1f1b
// Each prints one JSON line per measurement.
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>

#include "dtrain/comm.h"
#include "dtrain/pipeline.h"
#include "flags.h"
#include "json_line.h"

namespace {

using Clock = std::chrono::steady_clock;

// Time spent inside the sleep layers of this process, as measured around each sleep: on a loaded
// machine a 10 ms sleep can last 15 ms, so the bubble is computed from what the stages really
// spent, not from the nominal durations.
std::atomic<int64_t> g_busy_ns{0};

void timed_sleep(double ms) {
  if (ms <= 0) return;
  auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  g_busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

// Sleeps in forward and in backward: a stage of known duration that leaves the cores to the others.
struct SleepFunction : torch::autograd::Function<SleepFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               double forward_ms, double backward_ms) {
    ctx->saved_data["backward_ms"] = backward_ms;
    timed_sleep(forward_ms);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    timed_sleep(ctx->saved_data["backward_ms"].toDouble());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

struct SleepImpl : torch::nn::Module {
  SleepImpl(double forward_ms, double backward_ms)
      : forward_ms(forward_ms), backward_ms(backward_ms) {
    weight = register_parameter("weight", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // The weight makes the chunk trainable (and its gradient real); the sleeps make it slow. The
    // backward sleeps half on x's path and half on the weight's: a split backward's B and W.
    // Chunk 0's input needs no gradient, but its half must still sleep in backward.
    torch::Tensor in = x.requires_grad() ? x : x.detach().requires_grad_(true);
    return SleepFunction::apply(in, forward_ms, backward_ms / 2) *
           SleepFunction::apply(weight, 0.0, backward_ms / 2);
  }
  double forward_ms, backward_ms;
  torch::Tensor weight;
};
TORCH_MODULE(Sleep);

struct Args {
  std::string mode = "sleep";
  int stages = 4, micro_batches = 8, virtual_stages = 1, steps = 10;
  std::string schedule = "1f1b";
  double forward_ms = 10, backward_ms = 20;
  bool distributed = false;
  int64_t hidden = 2048, batch = 256;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::Flags("bench_pipeline",
               "pipeline bubble with sleeping stages, or model parallelism on a real MLP")
      .text("--mode", a.mode, "sleep: stages of controlled duration; mlp: a real MLP",
            {"sleep", "mlp"})
      .on("--distributed", a.distributed, "across processes: one stage per rank, under dtrain run")
      .integer("--stages", a.stages, "pipeline stages, in one process")
      .integer("--micro-batches", a.micro_batches, "micro-batches per step")
      .integer("--virtual-stages", a.virtual_stages,
               "chunks per stage, for the interleaved schedule")
      .text("--schedule", a.schedule, "schedule", {"gpipe", "1f1b", "interleaved", "zbh1"})
      .integer("--steps", a.steps, "timed steps")
      .number("--forward-ms", a.forward_ms, "sleep per micro-batch forward", /*zero_allowed=*/true)
      .number("--backward-ms", a.backward_ms, "sleep per micro-batch backward",
              /*zero_allowed=*/true)
      .integer("--hidden", a.hidden, "mlp mode: hidden width")
      .integer("--batch", a.batch, "mlp mode: samples per step")
      .parse(argc, argv);
  return a;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) {
  return (out - y).pow(2).mean();
}

// Median of the steps after one warm-up step.
template <typename Step>
double median_step_ms(int steps, Step&& step) {
  step();
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    auto start = Clock::now();
    step();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void sleep_mode(const Args& a) {
  std::shared_ptr<dtrain::ProcessGroup> pg;
  dtrain::RankMesh mesh;
  int stages = a.stages;
  if (a.distributed) {
    pg = dtrain::init_process_group();
    stages = pg->size();
    mesh = dtrain::make_rank_mesh(pg, stages);
  }
  const int chunks = stages * a.virtual_stages;
  std::vector<torch::nn::Sequential> parts;
  for (int c = 0; c < chunks; ++c) {
    parts.push_back(torch::nn::Sequential(
        Sleep(a.forward_ms / a.virtual_stages, a.backward_ms / a.virtual_stages)));
  }
  dtrain::PipelineOptions options;
  options.micro_batches = a.micro_batches;
  options.schedule = dtrain::parse_schedule_kind(a.schedule);
  options.virtual_stages = a.virtual_stages;
  auto x = torch::randn({a.micro_batches * 4, 16}), y = torch::randn({a.micro_batches * 4, 16});
  // Mean step and mean busy time of one stage over the timed steps (after one warm-up step).
  double step_ms = 0, busy_ms = 0;
  std::vector<int> held;
  auto measure = [&](auto&& step, int stages_here) {
    step();
    g_busy_ns = 0;
    auto start = Clock::now();
    for (int i = 0; i < a.steps; ++i) step();
    step_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count() / a.steps;
    busy_ms = g_busy_ns.load() / 1e6 / a.steps / stages_here;
  };
  if (a.distributed) {
    dtrain::DistributedPipeline pipe(parts, mesh, options);
    measure([&] { pipe.forward_backward(x, y, mse); }, 1);
    if (pg->rank() != 0) return;
  } else {
    dtrain::Pipeline pipe(parts, {}, options, stages);
    measure([&] { pipe.forward_backward(x, y, mse); }, stages);
    held = pipe.peak_micro_batches_held();
  }
  double nominal_busy = a.micro_batches * (a.forward_ms + a.backward_ms);
  double theory = dtrain::theoretical_bubble_fraction(options.schedule, stages, a.micro_batches,
                                                      a.virtual_stages);
  // bubble: the share of a step a stage sat idle, from its measured busy time (rank 0's stage in
  // the distributed run, the mean of the stages in one process).
  bench::JsonLine line = {{"mode", "sleep"},
                          {"distributed", a.distributed},
                          {"schedule", a.schedule},
                          {"stages", stages},
                          {"micro_batches", a.micro_batches},
                          {"virtual_stages", a.virtual_stages},
                          {"step_ms", bench::rounded(step_ms, 1)},
                          {"busy_ms", bench::rounded(busy_ms, 1)},
                          {"nominal_busy_ms", bench::rounded(nominal_busy, 1)},
                          {"bubble", bench::rounded(1 - busy_ms / step_ms, 4)},
                          {"bubble_theory", bench::rounded(theory, 4)}};
  if (!held.empty()) line["peak_micro_batches_held"] = held;
  bench::print_line(line);
}

torch::nn::Sequential make_mlp(int64_t hidden) {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, 10));
}

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& t) {
  return torch::nn::functional::cross_entropy(out, t);
}

// One stage per rank; rank 0 prints its median step (one warm-up step first). The step is what
// bench/pipelining_peer.py times on PyTorch's side: gradients set to None, then forward + backward
// of every micro-batch through the schedule (here also the loss's return to every rank).
void mlp_distributed(const Args& a) {
  auto pg = dtrain::init_process_group();
  const int stages = pg->size();
  auto mesh = dtrain::make_rank_mesh(pg, stages);
  auto model = make_mlp(a.hidden);
  auto boundaries = dtrain::balance_by_parameters(model, stages * a.virtual_stages);
  dtrain::PipelineOptions options;
  options.micro_batches = a.micro_batches;
  options.schedule = dtrain::parse_schedule_kind(a.schedule);
  options.virtual_stages = a.virtual_stages;
  torch::set_num_threads(1);
  dtrain::DistributedPipeline pipe(dtrain::split_sequential(model, boundaries), mesh, options);
  auto params = pipe.parameters();
  auto x = torch::randn({a.batch, 784}), y = torch::randint(10, {a.batch});
  double ms = median_step_ms(a.steps, [&] {
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    pipe.forward_backward(x, y, cross_entropy);
  });
  if (pg->rank() != 0) return;
  bench::print_line({{"mode", "mlp"},
                     {"distributed", true},
                     {"hidden", a.hidden},
                     {"batch", a.batch},
                     {"stages", stages},
                     {"virtual_stages", a.virtual_stages},
                     {"micro_batches", a.micro_batches},
                     {"schedule", a.schedule},
                     {"boundaries", boundaries},
                     {"step_ms", bench::rounded(ms, 2)}});
}

void mlp_mode(const Args& a) {
  auto model = make_mlp(a.hidden);
  auto x = torch::randn({a.batch, 784}), y = torch::randint(10, {a.batch});
  auto loss_fn = cross_entropy;
  auto chunks = dtrain::split_sequential(model, dtrain::balance_by_parameters(model, a.stages));
  torch::set_num_threads(1);
  double single = median_step_ms(a.steps, [&] {
    model->zero_grad();
    loss_fn(model->forward(x), y).backward();
  });
  for (int m : {1, a.micro_batches}) {
    dtrain::PipelineOptions options;
    options.micro_batches = m;
    options.schedule = dtrain::parse_schedule_kind(a.schedule);
    dtrain::Pipeline pipe(chunks, {}, options, a.stages);
    double ms = median_step_ms(a.steps, [&] {
      model->zero_grad();
      pipe.forward_backward(x, y, loss_fn);
    });
    bench::print_line({{"mode", "mlp"},
                       {"hidden", a.hidden},
                       {"batch", a.batch},
                       {"stages", a.stages},
                       {"micro_batches", m},
                       {"schedule", a.schedule},
                       {"step_ms", bench::rounded(ms, 2)},
                       {"one_thread_unsplit_ms", bench::rounded(single, 2)}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] {
    Args a = parse(argc, argv);
    if (a.mode == "sleep") {
      sleep_mode(a);
    } else if (a.distributed) {
      mlp_distributed(a);
    } else {
      mlp_mode(a);
    }
    return 0;
  });
}
