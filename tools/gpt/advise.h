// Which layout should I use? (issue 20's starred item; gpt_advise is its program.) Given the
// transformer of gpt.h, a number of devices, the memory of each and the bandwidth of the links
// between them, lists the layouts train_gpt can run (data x tensor x pipeline degrees, ZeRO stage,
// micro-batches, sequence parallelism, recomputation) whose worst rank fits in memory, ranked by
// predicted tokens/s, each with the cost that dominates its step. It extends `dtrain scale`'s "will
// more devices help" (doc/scale.md) to model parallelism, and models time the same way: measured
// compute (here one block's forward and backward, timed on this machine with LibTorch), plus a
// ring of 2(N-1) alpha + 2(N-1)/N bytes / bandwidth for every all-reduce, half of that for an
// all-gather or a reduce-scatter, none of it overlapped.
//
//   gpt::Costs costs = gpt::measure_costs(config, {8});           // rows per micro-batch timed
//   gpt::Machine machine{/*devices=*/8, /*memory_bytes=*/16e9, /*bandwidth=*/12.5e9};
//   auto ranked = gpt::advise(config, machine, /*batch_size=*/8, costs);
//   ranked.fitting[0].layout.flags();   // "--dp 2 --tp 2 --pp 2 --micro-batches 4"
//   ranked.fitting[0].reason();         // "compute-bound: compute 81% of the step"
//
// Note [What the advisor's model leaves out]
// Float32 everywhere (train_gpt's parameters, gradients and AdamW's moments; --amp bf16 is not
// modelled). Activation memory is counted from the tensors autograd saves in gpt.cpp's block (an
// estimate; the parameter, gradient and optimizer terms are exact, tested against the real model).
// Tensor parallelism divides a block's measured time by T (small matrices split less well than
// that). Every collective is exposed: DDP's overlap of the gradient all-reduce with backward and
// ZeRO-3's prefetch are not credited (as `dtrain scale` found at 2 workers here: "no overlap").
// Only the 1F1B schedule is listed (GPipe has the same bubble and more activations in flight; the
// interleaved and zero-bubble schedules are not modelled yet). ZeRO with tp > 1 shards each tensor
// rank's shards, with pp > 1 each stage's; a pipeline keeps its stage's full parameters and
// gradients through the step (Note [ZeRO in a pipeline] in dtrain/pipeline.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gpt/gpt.h"

namespace gpt {

// The devices a job would get.
struct Machine {
  int devices = 1;
  double memory_bytes = 0;         // per device
  double bandwidth = 0;            // bytes/s of every link (one direction)
  double latency_s = 20e-6;        // per collective step (alpha of the ring)
  double bucket_bytes = 25 << 20;  // DDP's gradient bucket (one all-reduce each)
};

// One layout, as train_gpt's flags name it.
struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int zero = 0;           // ZeRO stage over dp
  int micro_batches = 1;  // with pp > 1
  bool sp = false;        // sequence parallelism (tp > 1)
  bool recompute = false;
  // train_gpt's flags for it: "--dp 2 --tp 2 --pp 2 --micro-batches 4 --recompute".
  std::string flags() const;
};

// Measured per-layer costs, keyed by rows (windows of seq_len tokens) per micro-batch. A row count
// that was not measured is scaled per token from the nearest one that was.
struct Costs {
  std::map<int64_t, double> block_s;          // one whole block's forward + backward
  std::map<int64_t, double> block_forward_s;  // its forward alone (what recomputation repeats)
  std::map<int64_t, double> ends_s;      // embedding + final norm + head + loss, forward + backward
  double optimizer_s_per_parameter = 0;  // one AdamW step, per parameter
  static double at(const std::map<int64_t, double>& table, int64_t rows);
};

// Bytes one rank holds at its peak, the worst rank of the layout (the pipeline stage that needs
// most).
struct Memory {
  double parameters = 0, gradients = 0, optimizer = 0;  // AdamW: two float32 moments
  double gathered = 0;     // ZeRO: units' full parameters and gradients alive during a step
  double activations = 0;  // saved for backward, over the micro-batches in flight
  double total() const { return parameters + gradients + optimizer + gathered + activations; }
};

struct Prediction {
  Layout layout;
  Memory memory;
  int64_t rows = 0;  // windows per data-parallel rank and step
  double step_s = 0, tokens_per_s = 0;
  // The step's parts, seconds, largest first: "compute", "recomputation", "pipeline bubble",
  // "tensor-parallel all-reduces", "pipeline sends", "gradient all-reduce" (DDP), "ZeRO-1
  // all-reduce + all-gather", "ZeRO-2 reduce-scatter + all-gather", "ZeRO-3 gathers +
  // reduce-scatter", "optimizer".
  std::vector<std::pair<std::string, double>> terms;
  // The dominant cost: "compute-bound: compute 81% of the step" or "tensor-parallel all-reduces:
  // 46% of the step (compute 40%)".
  std::string reason() const;
};

// Parameters the worst rank holds between steps, exactly as train_gpt's layout builds them: a
// stage's children (balanced by parameters as dtrain::balance_by_parameters cuts), each block's
// projections split over tp (rank 0's shard, the largest), ZeRO's padded flat shards.
int64_t parameters_per_rank(const GptConfig& config, const Layout& layout);

// The worst rank's memory in `layout` with `rows` windows per data-parallel rank and step.
Memory memory_per_rank(const GptConfig& config, const Layout& layout, int64_t rows);

// The predicted step of `layout` (Note [What the advisor's model leaves out]).
Prediction predict(const GptConfig& config, const Layout& layout, int64_t rows,
                   const Machine& machine, const Costs& costs);

// Every layout train_gpt can run on machine.devices ranks for this config: degrees multiplying to
// the devices (tp dividing kv_heads, pp at most layers), ZeRO 1-3 with dp > 1, sp with tp > 1
// where seq_len divides, micro-batches pp, 2pp, 4pp .. up to the rows, recomputation off and on.
std::vector<Layout> candidate_layouts(const GptConfig& config, int devices, int64_t rows);

struct Advice {
  std::vector<Prediction> fitting;  // fastest first
  std::vector<Prediction> too_big;  // smallest memory first
};
// batch_size: windows per data-parallel rank and step (train_gpt's --batch-size); global_batch > 0
// instead fixes the windows per step, split over dp (layouts whose dp does not divide it are
// skipped).
Advice advise(const GptConfig& config, const Machine& machine, int64_t batch_size,
              const Costs& costs, int64_t global_batch = 0);

// Times one block, the ends and AdamW on this machine (CPU, torch's current thread count) at each
// row count: `repeats` timed iterations after one warm-up, the fastest.
Costs measure_costs(const GptConfig& config, const std::vector<int64_t>& rows, int repeats = 3);

}  // namespace gpt
