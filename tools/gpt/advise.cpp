// The layout advisor's model (advise.h): memory per rank per layout, step time per layout, and the
// measurement of the per-layer costs it starts from.
#include "gpt/advise.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>

#include "dtrain/errors.h"
#include "dtrain/pipeline.h"

namespace gpt {
namespace {

constexpr double kFloat = 4;  // bytes of a float32

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The parameters of one block as tensor rank 0 holds them (rank 0's shards are the largest: a
// split of n features gives the first n % T ranks one more).
int64_t block_parameters(const GptConfig& c, int tp) {
  const int64_t q = c.heads * c.head_dim() / tp, kv = c.kv_heads * c.head_dim() / tp;
  const int64_t hidden = ceil_div(c.hidden(), tp);
  return 2 * c.width + c.width * (q + 2 * kv) + q * c.width + 3 * c.width * hidden;
}

// The model's children in order (embedding, blocks, final norm, head), their parameters on tensor
// rank 0.
std::vector<int64_t> children(const GptConfig& c, int tp) {
  std::vector<int64_t> counts{c.vocab * c.width};
  for (int64_t i = 0; i < c.layers; ++i) counts.push_back(block_parameters(c, tp));
  counts.push_back(c.width);
  counts.push_back(c.vocab * c.width);
  return counts;
}

// dtrain::balance_by_parameters' cut, by the counts given: the first child of each of `parts`
// contiguous runs, and the end.
std::vector<int64_t> stage_starts(const std::vector<int64_t>& weights, int parts) {
  const std::vector<int64_t> boundaries =
      dtrain::balance_by_weights(std::vector<double>(weights.begin(), weights.end()), parts);
  std::vector<int64_t> starts{0};
  starts.insert(starts.end(), boundaries.begin(), boundaries.end());
  starts.push_back(static_cast<int64_t>(weights.size()));
  return starts;  // stage s holds children [starts[s], starts[s + 1])
}

// What one pipeline stage (the whole model when pp = 1) holds.
struct Stage {
  int64_t parameters = 0;  // on tensor rank 0
  int64_t zero_shard = 0;  // ZeRO's flat shards of them: every child a unit, padded to dp
  int64_t blocks = 0;
  bool first = false, last = false;
  int64_t largest_child = 0;
};

std::vector<Stage> stages(const GptConfig& c, const Layout& layout) {
  const std::vector<int64_t> counts = children(c, layout.tp);
  const std::vector<int64_t> starts = stage_starts(counts, layout.pp);
  std::vector<Stage> result;
  const int64_t n = static_cast<int64_t>(counts.size());
  for (int s = 0; s < layout.pp; ++s) {
    Stage stage;
    for (int64_t i = starts[s]; i < starts[s + 1]; ++i) {
      stage.parameters += counts[i];
      stage.zero_shard += ceil_div(counts[i], layout.dp);
      stage.largest_child = std::max(stage.largest_child, counts[i]);
      if (i >= 1 && i <= c.layers) ++stage.blocks;
      if (i == 0) stage.first = true;
      if (i == n - 1) stage.last = true;
    }
    result.push_back(stage);
  }
  return result;
}

// ZeRO's flat shards on the fullest stage: every child a unit (of tensor rank 0's shards with
// tp > 1), padded to a multiple of dp.
int64_t zero_shard(const GptConfig& c, const Layout& layout) {
  int64_t shard = 0;
  for (const Stage& stage : stages(c, layout)) shard = std::max(shard, stage.zero_shard);
  return shard;
}

// Windows per micro-batch and micro-batches in flight on stage s (1F1B keeps pp - s of them).
int64_t micro_rows(const Layout& layout, int64_t rows) {
  return ceil_div(rows, layout.pp > 1 ? layout.micro_batches : 1);
}
int64_t in_flight(const Layout& layout, int s) {
  return layout.pp > 1 ? std::min<int64_t>(layout.micro_batches, layout.pp - s) : 1;
}

// Floats autograd saves per token of one block (Note [What the advisor's model leaves out]):
// each RMSNorm's input and normalized input before the weight (2 x width + 1, twice), and the
// normalized input every projection of a sub-layer reads (width, twice), whole on every rank, or
// 1/tp of them under sequence parallelism: the norms work on this rank's slice of the sequence,
// and the column-parallel projections keep only that slice, all-gathering it again in backward
// (SequenceParallelColumnLinear in src/tensor_parallel/parallel_ops.cpp). Split over tp: queries
// and keys after the rotation, keys and values repeated to the query heads, the attention's output
// (4 x heads x head_dim) and its log-sum-exp (heads); SwiGLU's w1 x, w3 x, silu(w1 x) and the
// product (4 x hidden).
double block_floats_per_token(const GptConfig& c, const Layout& layout) {
  const double norms = 2 * (2.0 * c.width + 1), inputs = 2.0 * c.width;
  const double split = 4.0 * c.heads * c.head_dim() + c.heads + 4.0 * c.hidden();
  return (norms + inputs) / (layout.sp ? layout.tp : 1) + split / layout.tp;
}

// The final norm (2 x width + 1), the head's input (width), the logits and their log-softmax.
double ends_floats_per_token(const GptConfig& c) { return 3.0 * c.width + 1 + 2.0 * c.vocab; }

// A ring collective over n ranks moving `fraction` x bytes per rank in `steps` x (n - 1) steps:
// all-reduce fraction 2 (reduce-scatter then all-gather), reduce-scatter or all-gather 1.
double ring_s(double bytes, int n, double fraction, const Machine& m, int64_t ops = 1) {
  if (n <= 1) return 0;
  return static_cast<double>(ops) * fraction * (n - 1) * m.latency_s +
         fraction * (n - 1) / n * bytes / m.bandwidth;
}

// Seconds of one block's tensor-parallel collectives per micro-batch, counted as
// GptTensorParallel.ABlockAllReducesOnceEachWayPerSubLayer and
// GptSequenceParallel.ABlocksCollectivesAreTheAdvisorsCount (gpt_test.cpp) count them; `bytes`:
// the whole [tokens, width] activation.
//   plain tensor parallelism (Note [Tensor-parallel blocks] in gpt.h): 2 all-reduces forward
//     (wo's and w2's output), 2 backward (each sub-layer's input gradient: q, k, v share one, w1
//     and w3 another, through dtrain::column_parallel_forward); recomputation runs the forward's 2
//     again: 4, or 6.
//   sequence parallelism (Note [Sequence-parallel blocks]): forward, an all-gather in and a
//     reduce-scatter out of each sub-layer (4); backward, per sub-layer, a reduce-scatter of the
//     input's gradient, the input all-gathered again for the weights' gradients, and the output's
//     gradient all-gathered (6), each a ring moving half an all-reduce's bytes: 10 halves, 5
//     all-reduces' worth (7 with recomputation's 4 more halves), where plain tensor parallelism
//     moves 4. And the 2 norms' weight gradients, all-reduced over the group: `width` floats each,
//     mostly latency.
double block_tensor_s(const GptConfig& c, const Layout& layout, double bytes, const Machine& m) {
  if (!layout.sp) return (layout.recompute ? 6 : 4) * ring_s(bytes, layout.tp, 2, m);
  const double halves = layout.recompute ? 14 : 10;
  return halves * ring_s(bytes, layout.tp, 1, m) + 2 * ring_s(c.width * kFloat, layout.tp, 2, m);
}

// The sequence-parallel collectives outside the blocks, per micro-batch (Note [Sequence-parallel
// blocks]): the first stage's embedding output is scattered without communication, its gradient
// all-gathered in backward; the last stage's final norm all-gathers its output for the whole head
// and all-reduces its weight's gradient. Plain tensor parallelism has none there.
double ends_tensor_s(const GptConfig& c, const Layout& layout, bool first, bool last, double bytes,
                     const Machine& m) {
  if (!layout.sp) return 0;
  return (first ? ring_s(bytes, layout.tp, 1, m) : 0) +
         (last ? ring_s(bytes, layout.tp, 1, m) + ring_s(c.width * kFloat, layout.tp, 2, m) : 0);
}

}  // namespace

std::string Layout::flags() const {
  std::ostringstream out;
  out << "--dp " << dp;
  if (tp > 1) out << " --tp " << tp;
  if (pp > 1) out << " --pp " << pp << " --micro-batches " << micro_batches;
  if (zero > 0) out << " --zero " << zero;
  if (sp) out << " --sp";
  if (recompute) out << " --recompute";
  return out.str();
}

double Costs::at(const std::map<int64_t, double>& table, int64_t rows) {
  if (table.empty()) return 0;
  auto it = table.lower_bound(rows);
  if (it == table.end()) it = std::prev(it);
  if (it->first != rows && it != table.begin()) {
    auto below = std::prev(it);
    if (rows - below->first < it->first - rows) it = below;
  }
  return it->second * static_cast<double>(rows) / static_cast<double>(it->first);
}

int64_t parameters_per_rank(const GptConfig& config, const Layout& layout) {
  if (layout.zero == 3) return zero_shard(config, layout);
  int64_t most = 0;
  for (const Stage& stage : stages(config, layout)) most = std::max(most, stage.parameters);
  return most;
}

Memory memory_per_rank(const GptConfig& config, const Layout& layout, int64_t rows) {
  const std::vector<Stage> all = stages(config, layout);
  const double tokens = static_cast<double>(micro_rows(layout, rows) * config.seq_len);
  const double block = block_floats_per_token(config, layout) * kFloat * tokens;
  const double kept = config.width * kFloat * tokens / (layout.sp ? layout.tp : 1);
  Memory worst;
  for (int s = 0; s < layout.pp; ++s) {
    const Stage& stage = all[s];
    Memory m;
    const double held = static_cast<double>(stage.parameters) * kFloat;
    const double shard = static_cast<double>(stage.zero_shard) * kFloat;
    const double largest = static_cast<double>(stage.largest_child) * kFloat;
    if (layout.pp > 1 && layout.zero > 0) {
      // A pipeline holds its stage's parameters and gradients through the step (Note [ZeRO in a
      // pipeline]): ZeRO saves the optimizer's state at the peak, stage 3 the parameters between
      // steps only. Stage 1 keeps its flat all-reduce buffer beside the accumulated gradients.
      m.parameters = held + (layout.zero == 3 ? shard : 0);
      m.gradients = layout.zero == 1 ? 2 * held : held;
      m.optimizer = 2 * shard;
    } else {
      switch (layout.zero) {
        case 0:
          m.parameters = m.gradients = held;
          m.optimizer = 2 * held;
          break;
        case 1:  // 4 + 4 + 8/N bytes per parameter (dtrain/sharded.h)
          m.parameters = m.gradients = held;
          m.optimizer = 2 * shard;
          break;
        case 2:  // 4 + 12/N, and one unit's full gradient before it is reduce-scattered
          m.parameters = held;
          m.gradients = shard;
          m.optimizer = 2 * shard;
          m.gathered = largest;
          break;
        default:  // 16/N, and two units' full parameters (one prefetched) and one's gradient
          m.parameters = m.gradients = shard;
          m.optimizer = 2 * shard;
          m.gathered = 3 * largest;
      }
    }
    const double micro = static_cast<double>(in_flight(layout, s));
    double activations = 0;
    if (layout.recompute) {
      // Every block keeps its input; the one in backward rebuilds all of its own.
      activations = micro * static_cast<double>(stage.blocks) * kept + (stage.blocks ? block : 0);
    } else {
      activations = micro * static_cast<double>(stage.blocks) * block;
    }
    if (stage.last) activations += micro * ends_floats_per_token(config) * kFloat * tokens;
    m.activations = activations;
    if (m.total() > worst.total()) worst = m;
  }
  return worst;
}

Prediction predict(const GptConfig& config, const Layout& layout, int64_t rows,
                   const Machine& machine, const Costs& costs) {
  Prediction p;
  p.layout = layout;
  p.rows = rows;
  p.memory = memory_per_rank(config, layout, rows);
  const int64_t micro = micro_rows(layout, rows);
  const int64_t m = layout.pp > 1 ? layout.micro_batches : 1;
  const double tokens = static_cast<double>(micro * config.seq_len);
  const double activation_bytes = tokens * config.width * kFloat;
  // Per micro-batch on the slowest stage.
  double compute = 0, recompute = 0, tensor = 0, sends = 0, slowest = 0;
  for (const Stage& stage : stages(config, layout)) {
    const double blocks = static_cast<double>(stage.blocks);
    const double c = blocks * Costs::at(costs.block_s, micro) / layout.tp +
                     (stage.last ? Costs::at(costs.ends_s, micro) : 0);
    const double r =
        layout.recompute ? blocks * Costs::at(costs.block_forward_s, micro) / layout.tp : 0;
    const double t =
        blocks * block_tensor_s(config, layout, activation_bytes, machine) +
        ends_tensor_s(config, layout, stage.first, stage.last, activation_bytes, machine);
    const double s = layout.pp > 1 ? (stage.first || stage.last ? 1 : 2) *
                                         (machine.latency_s + activation_bytes / machine.bandwidth)
                                   : 0;
    if (c + r + t + s > slowest) {
      slowest = c + r + t + s;
      compute = c;
      recompute = r;
      tensor = t;
      sends = s;
    }
  }
  p.terms.emplace_back("compute", m * compute);
  p.terms.emplace_back("recomputation", m * recompute);
  p.terms.emplace_back("tensor-parallel all-reduces", m * tensor);
  p.terms.emplace_back("pipeline sends", m * sends);
  p.terms.emplace_back("pipeline bubble", (layout.pp - 1) * slowest);
  const double gradient_bytes = static_cast<double>(parameters_per_rank(config, layout)) * kFloat;
  // What ZeRO reduces and gathers over the data group: a tensor rank's shards of its stage (of the
  // whole model without a pipeline), a unit per child; the stages' data groups work side by side.
  double whole_bytes = 0;
  int64_t units = 0;
  for (const Stage& stage : stages(config, layout)) {
    whole_bytes = std::max(whole_bytes, static_cast<double>(stage.parameters) * kFloat);
    units = std::max(units, stage.blocks + stage.first + 2 * stage.last);
  }
  switch (layout.zero) {
    case 0:
      p.terms.emplace_back(
          "gradient all-reduce",
          ring_s(gradient_bytes, layout.dp, 2, machine,
                 std::max<int64_t>(
                     1, static_cast<int64_t>(std::ceil(gradient_bytes / machine.bucket_bytes)))));
      break;
    case 1:
      p.terms.emplace_back("ZeRO-1 all-reduce + all-gather",
                           ring_s(whole_bytes, layout.dp, 3, machine, units));
      break;
    case 2:
      p.terms.emplace_back("ZeRO-2 reduce-scatter + all-gather",
                           ring_s(whole_bytes, layout.dp, 2, machine, units));
      break;
    default:  // under a pipeline one gather per step, not one per pass (Note [ZeRO in a pipeline])
      p.terms.emplace_back("ZeRO-3 gathers + reduce-scatter",
                           ring_s(whole_bytes, layout.dp, layout.pp > 1 ? 2 : 3, machine, units));
  }
  const int64_t stepped =
      layout.zero > 0 ? zero_shard(config, layout) : parameters_per_rank(config, layout);
  p.terms.emplace_back("optimizer", static_cast<double>(stepped) * costs.optimizer_s_per_parameter);
  std::stable_sort(p.terms.begin(), p.terms.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& term : p.terms) p.step_s += term.second;
  p.tokens_per_s =
      p.step_s > 0 ? static_cast<double>(layout.dp * rows * config.seq_len) / p.step_s : 0;
  return p;
}

std::string Prediction::reason() const {
  if (terms.empty() || step_s <= 0) return "no cost measured";
  auto percent = [&](double s) { return std::to_string(std::lround(100 * s / step_s)) + "%"; };
  const auto& [name, seconds] = terms[0];
  if (name == "compute") return "compute-bound: compute " + percent(seconds) + " of the step";
  std::string why = name + ": " + percent(seconds) + " of the step";
  for (const auto& term : terms) {
    if (term.first == "compute") why += " (compute " + percent(term.second) + ")";
  }
  return why;
}

std::vector<Layout> candidate_layouts(const GptConfig& config, int devices, int64_t rows) {
  std::vector<Layout> result;
  for (int tp = 1; tp <= devices; ++tp) {
    if (devices % tp != 0 || config.kv_heads % tp != 0) continue;
    for (int pp = 1; pp * tp <= devices; ++pp) {
      if ((devices / tp) % pp != 0 || pp > config.layers) continue;
      const int dp = devices / (tp * pp);
      std::vector<int> micro{1};
      if (pp > 1) {
        micro.clear();
        for (int64_t m = pp; m <= std::max<int64_t>(rows, pp); m *= 2) {
          micro.push_back(static_cast<int>(std::min<int64_t>(m, std::max<int64_t>(rows, 1))));
          if (m >= rows) break;
        }
      }
      std::vector<int> zeros{0};
      if (dp > 1) zeros = {0, 1, 2, 3};
      std::vector<bool> sps{false};
      if (tp > 1 && config.seq_len % tp == 0) sps.push_back(true);
      for (int zero : zeros) {
        for (int m : micro) {
          for (bool sp : sps) {
            for (bool recompute : {false, true}) {
              Layout layout;
              layout.dp = dp;
              layout.tp = tp;
              layout.pp = pp;
              layout.zero = zero;
              layout.micro_batches = m;
              layout.sp = sp;
              layout.recompute = recompute;
              result.push_back(layout);
            }
          }
        }
      }
    }
  }
  return result;
}

Advice advise(const GptConfig& config, const Machine& machine, int64_t batch_size,
              const Costs& costs, int64_t global_batch) {
  Advice advice;
  const int64_t probe = global_batch > 0 ? global_batch : batch_size;
  for (const Layout& layout : candidate_layouts(config, machine.devices, probe)) {
    int64_t rows = batch_size;
    if (global_batch > 0) {
      if (global_batch % layout.dp != 0) continue;
      rows = global_batch / layout.dp;
      if (layout.pp > 1 && layout.micro_batches > rows) continue;
    }
    Prediction p = predict(config, layout, rows, machine, costs);
    (p.memory.total() <= machine.memory_bytes ? advice.fitting : advice.too_big).push_back(p);
  }
  std::stable_sort(advice.fitting.begin(), advice.fitting.end(),
                   [](const Prediction& a, const Prediction& b) {
                     if (a.tokens_per_s != b.tokens_per_s) return a.tokens_per_s > b.tokens_per_s;
                     return a.memory.total() < b.memory.total();
                   });
  std::stable_sort(
      advice.too_big.begin(), advice.too_big.end(),
      [](const Prediction& a, const Prediction& b) { return a.memory.total() < b.memory.total(); });
  return advice;
}

Costs measure_costs(const GptConfig& config, const std::vector<int64_t>& rows, int repeats) {
  config.check();
  if (repeats < 1) throw dtrain::UsageError("measure_costs: repeats must be at least 1");
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point since) {
    return std::chrono::duration<double>(Clock::now() - since).count();
  };
  // The fastest of the repeats: the cost on a device of its own, which is what the prediction is
  // for (on a shared, loaded host the median still carries other processes' time slices).
  auto fastest = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  torch::manual_seed(0);
  Block block(config, nullptr);
  torch::nn::Embedding embedding(config.vocab, config.width);
  RMSNorm norm(config.width, config.norm_eps);
  torch::nn::Linear head(torch::nn::LinearOptions(config.width, config.vocab).bias(false));
  Costs costs;
  for (int64_t r : rows) {
    std::vector<double> step, forward, ends;
    at::Tensor x = torch::randn({r, config.seq_len, config.width});
    at::Tensor tokens = torch::randint(config.vocab, {r, config.seq_len});
    for (int i = 0; i <= repeats; ++i) {  // the first is a warm-up
      at::Tensor input = x.detach().requires_grad_(true);
      auto start = Clock::now();
      at::Tensor y = block->forward(input);
      const double f = seconds(start);
      y.backward(torch::ones_like(y));
      const double fb = seconds(start);
      start = Clock::now();
      at::Tensor loss = next_token_loss(head(norm(embedding(tokens))), tokens);
      loss.backward();
      const double e = seconds(start);
      if (i > 0) {
        step.push_back(fb);
        forward.push_back(f);
        ends.push_back(e);
      }
    }
    costs.block_s[r] = fastest(step);
    costs.block_forward_s[r] = fastest(forward);
    costs.ends_s[r] = fastest(ends);
  }
  torch::optim::AdamW optimizer(block->parameters(), 1e-3);
  int64_t count = 0;
  for (const auto& p : block->parameters()) count += p.numel();
  std::vector<double> steps;
  for (int i = 0; i <= repeats; ++i) {
    auto start = Clock::now();
    optimizer.step();
    if (i > 0) steps.push_back(seconds(start));
  }
  costs.optimizer_s_per_parameter = fastest(steps) / static_cast<double>(count);
  return costs;
}

}  // namespace gpt
