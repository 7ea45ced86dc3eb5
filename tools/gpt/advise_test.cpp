// The layout advisor's model (advise.h): its parameter counts per rank against the real model in
// the real layout (exact), memory that excludes what cannot fit, and rankings whose reasons follow
// from the costs. Timing claims are not here: bench/gpt_advise_check.sh holds the predictions
// against train_gpt's measured tokens/s.
#include "gpt/advise.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "dtrain/errors.h"
#include "gpt/parallelize.h"
#include "support/thread_ranks.h"

namespace gpt {
namespace {

GptConfig tiny() {
  GptConfig config;
  config.seq_len = 16;
  config.layers = 3;  // odd: the pipeline's stages differ
  config.width = 32;
  config.heads = 4;
  config.kv_heads = 2;
  config.mlp_width = 37;  // odd: tensor rank 0 of 2 holds the larger shard of the MLP
  return config;
}

Layout make(int dp, int tp, int pp, int zero = 0) {
  Layout layout;
  layout.dp = dp;
  layout.tp = tp;
  layout.pp = pp;
  layout.zero = zero;
  layout.micro_batches = pp > 1 ? 2 : 1;
  return layout;
}

TEST(GptAdvise, OneRankHoldsTheWholeModel) {
  const GptConfig config = tiny();
  int64_t shapes = 0;
  for (const auto& [name, shape] : parameter_shapes(config)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    shapes += n;
  }
  EXPECT_EQ(parameters_per_rank(config, make(1, 1, 1)), parameter_count(config));
  EXPECT_EQ(parameters_per_rank(config, make(1, 1, 1)), shapes);
  // DDP: 4 bytes each of parameters and gradients, 8 of AdamW's moments.
  const Memory memory = memory_per_rank(config, make(2, 1, 1), 1);
  EXPECT_EQ(memory.parameters, 4.0 * parameter_count(config));
  EXPECT_EQ(memory.gradients, 4.0 * parameter_count(config));
  EXPECT_EQ(memory.optimizer, 8.0 * parameter_count(config));
}

// Every layout's count is what train_gpt's layout (parallelize.h) puts on its fullest rank: the
// numel of Parallel::parameters(), maximised over thread-ranks.
void expect_counts_match_the_real_layout(const Layout& want, int world) {
  const GptConfig config = tiny();
  LayoutOptions options;
  options.dp = want.dp;
  options.tp = want.tp;
  options.pp = want.pp;
  options.zero = want.zero;
  options.micro_batches = want.micro_batches;
  std::mutex mutex;
  int64_t most = 0;
  dtrain::testing::run_group(world, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    dtrain::RankMesh mesh = make_mesh(options, pg);
    Gpt model{nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(3);
      model = make_model(config, options, mesh);
    }
    Parallel layout(model, options, mesh, pg, c10::Device(c10::kCPU));
    int64_t count = 0;
    for (const auto& p : layout.parameters()) count += p.numel();
    std::lock_guard<std::mutex> lock(mutex);
    most = std::max(most, count);
  });
  EXPECT_EQ(parameters_per_rank(config, want), most) << want.flags() << " at " << world;
}

TEST(GptAdvise, ParametersPerRankEqualTheRealLayouts) {
  expect_counts_match_the_real_layout(make(2, 1, 1), 2);     // DDP
  expect_counts_match_the_real_layout(make(2, 1, 1, 3), 2);  // ZeRO-3: padded flat shards
  expect_counts_match_the_real_layout(make(3, 1, 1, 3), 3);  // shards that do not divide
  expect_counts_match_the_real_layout(make(1, 2, 1), 2);     // tensor-parallel shards
  expect_counts_match_the_real_layout(make(1, 1, 2), 2);     // the fuller stage
  expect_counts_match_the_real_layout(make(1, 1, 3), 3);     // a stage per block
  expect_counts_match_the_real_layout(make(1, 2, 2), 4);     // both
  expect_counts_match_the_real_layout(make(2, 2, 1, 3), 4);  // ZeRO-3 of tensor shards
  expect_counts_match_the_real_layout(make(2, 1, 2, 3), 4);  // ZeRO-3 of each stage's
}

TEST(GptAdvise, MemoryFallsWithShardingAndRecomputation) {
  GptConfig config = tiny();
  const Memory ddp = memory_per_rank(config, make(4, 1, 1), 8);
  const Memory zero1 = memory_per_rank(config, make(4, 1, 1, 1), 8);
  const Memory zero3 = memory_per_rank(config, make(4, 1, 1, 3), 8);
  EXPECT_LT(zero1.optimizer, ddp.optimizer);
  EXPECT_EQ(zero1.parameters, ddp.parameters);
  EXPECT_LT(zero3.parameters + zero3.gradients, zero1.parameters + zero1.gradients);
  Layout recompute = make(4, 1, 1);
  recompute.recompute = true;
  EXPECT_LT(memory_per_rank(config, recompute, 8).activations, ddp.activations);
  Layout tp = make(1, 2, 1), sp = make(1, 2, 1);
  sp.sp = true;
  EXPECT_LT(memory_per_rank(config, sp, 8).activations, memory_per_rank(config, tp, 8).activations);
}

// Under --sp a block keeps 1/tp of what lies outside the attention and MLP cores: the norms'
// tensors (2 x (2 width + 1) floats per token) and the normalized input the projections read
// (2 x width), which the sequence-parallel column layers keep as this rank's slice only (they
// all-gather it again in backward).
TEST(GptAdvise, SequenceParallelismSplitsEverythingOutsideTheCores) {
  const GptConfig config = tiny();
  const int64_t rows = 8;
  Layout tp = make(1, 2, 1), sp = make(1, 2, 1);
  sp.sp = true;
  const double tokens = static_cast<double>(rows * config.seq_len);
  const double outside = (2 * (2.0 * config.width + 1) + 2.0 * config.width) * 4 * tokens;
  EXPECT_DOUBLE_EQ(
      memory_per_rank(config, tp, rows).activations - memory_per_rank(config, sp, rows).activations,
      static_cast<double>(config.layers) * outside / 2);
}

Costs flat_costs(double block_s_per_row) {
  Costs costs;
  costs.block_s[1] = block_s_per_row;
  costs.block_forward_s[1] = block_s_per_row / 3;
  costs.ends_s[1] = block_s_per_row / 10;
  costs.optimizer_s_per_parameter = 1e-9;
  return costs;
}

TEST(GptAdvise, LayoutsThatCannotFitAreNotListed) {
  const GptConfig config = tiny();
  Machine machine;
  machine.devices = 4;
  machine.bandwidth = 1e9;
  // Room for DDP's 16 bytes per parameter only with recomputation's activations, or sharding.
  const double ddp = memory_per_rank(config, make(4, 1, 1), 8).total();
  machine.memory_bytes = ddp - 1;
  const Advice advice = advise(config, machine, 8, flat_costs(1e-3));
  ASSERT_FALSE(advice.fitting.empty());
  ASSERT_FALSE(advice.too_big.empty());
  for (const Prediction& p : advice.fitting) {
    EXPECT_LE(p.memory.total(), machine.memory_bytes) << p.layout.flags();
    EXPECT_FALSE(p.layout.flags() == "--dp 4") << "plain DDP needs " << ddp << " bytes";
  }
  for (const Prediction& p : advice.too_big) EXPECT_GT(p.memory.total(), machine.memory_bytes);
  // Nothing fits in a byte.
  machine.memory_bytes = 1;
  EXPECT_TRUE(advise(config, machine, 8, flat_costs(1e-3)).fitting.empty());
}

TEST(GptAdvise, TheRankingsReasonsFollowTheCosts) {
  const GptConfig config = tiny();
  Machine machine;
  machine.devices = 2;
  machine.memory_bytes = 1e12;
  // A fast link and slow compute: compute-bound, and DDP (no bubble, no per-block all-reduces)
  // first.
  machine.bandwidth = 1e15;
  machine.latency_s = 0;
  Advice advice = advise(config, machine, 8, flat_costs(1.0));
  ASSERT_FALSE(advice.fitting.empty());
  EXPECT_EQ(advice.fitting[0].layout.dp, 2);
  EXPECT_EQ(advice.fitting[0].layout.recompute, false);
  EXPECT_EQ(advice.fitting[0].reason().rfind("compute-bound", 0), 0u) << advice.fitting[0].reason();
  for (size_t i = 1; i < advice.fitting.size(); ++i)
    EXPECT_GE(advice.fitting[i - 1].tokens_per_s, advice.fitting[i].tokens_per_s);
  // The same layouts over a slow link: tensor parallelism's per-block all-reduces dominate --tp 2.
  machine.bandwidth = 1e6;
  advice = advise(config, machine, 8, flat_costs(1e-4));
  bool seen_tp = false;
  for (const Prediction& p : advice.fitting) {
    if (p.layout.tp == 2 && !p.layout.recompute) {
      seen_tp = true;
      EXPECT_EQ(p.reason().rfind("tensor-parallel all-reduces", 0), 0u) << p.reason();
    }
    if (p.layout.dp == 2 && p.layout.zero == 0) {
      EXPECT_EQ(p.reason().rfind("gradient all-reduce", 0), 0u) << p.reason();
    }
  }
  EXPECT_TRUE(seen_tp);
  // Recomputation costs one more forward: never faster than the same layout without it.
  for (const Prediction& p : advice.fitting) {
    if (!p.layout.recompute) continue;
    Layout plain = p.layout;
    plain.recompute = false;
    EXPECT_GT(p.step_s, predict(config, plain, 8, machine, flat_costs(1e-4)).step_s);
  }
}

// The tensor-parallel term counts the collectives that
// GptTensorParallel.ABlockAllReducesOnceEachWayPerSubLayer and
// GptSequenceParallel.ABlocksCollectivesAreTheAdvisorsCount (gpt_test.cpp) count. Without latency
// a ring all-reduce over 2 ranks moves the activation's bytes once per rank, an all-gather or a
// reduce-scatter half of them: 4 all-reduces per block (6 with recomputation); under --sp 10
// halves per block (14) and the norms' 2 small all-reduces, plus the embedding's and the final
// norm's all-gathers and the final norm's all-reduce.
TEST(GptAdvise, TensorParallelTrafficIsTheBlocksCollectives) {
  const GptConfig config = tiny();
  const int64_t rows = 8;
  Machine machine;
  machine.devices = 2;
  machine.bandwidth = 1e9;
  machine.latency_s = 0;
  auto term = [&](bool sp, bool recompute) {
    Layout layout = make(1, 2, 1);
    layout.sp = sp;
    layout.recompute = recompute;
    for (const auto& [name, s] : predict(config, layout, rows, machine, flat_costs(1e-3)).terms)
      if (name == "tensor-parallel all-reduces") return s;
    return -1.0;
  };
  const double layers = static_cast<double>(config.layers);
  const double all_reduce = rows * config.seq_len * config.width * 4 / machine.bandwidth;
  const double norm = config.width * 4 / machine.bandwidth;
  double want = layers * 4 * all_reduce;
  EXPECT_NEAR(term(false, false), want, 1e-9 * want) << "--tp 2";
  want = layers * 6 * all_reduce;
  EXPECT_NEAR(term(false, true), want, 1e-9 * want) << "--tp 2 --recompute";
  want = layers * (10 * all_reduce / 2 + 2 * norm) + all_reduce + norm;
  EXPECT_NEAR(term(true, false), want, 1e-9 * want) << "--tp 2 --sp";
  want = layers * (14 * all_reduce / 2 + 2 * norm) + all_reduce + norm;
  EXPECT_NEAR(term(true, true), want, 1e-9 * want) << "--tp 2 --sp --recompute";
}

TEST(GptAdvise, PipelineBubbleShrinksWithMoreMicroBatches) {
  GptConfig config = tiny();
  config.layers = 4;
  Machine machine;
  machine.devices = 2;
  machine.bandwidth = 1e15;
  machine.latency_s = 0;
  Layout two = make(1, 1, 2), eight = make(1, 1, 2);
  eight.micro_batches = 8;
  auto bubble = [&](const Layout& layout) {
    for (const auto& [name, s] : predict(config, layout, 8, machine, flat_costs(1e-3)).terms)
      if (name == "pipeline bubble") return s;
    return -1.0;
  };
  EXPECT_GT(bubble(two), bubble(eight));
  EXPECT_GT(bubble(eight), 0);
}

TEST(GptAdvise, MeasuredCostsArePositiveAndScaleWithRows) {
  const Costs costs = measure_costs(tiny(), {1, 4}, 1);
  EXPECT_GT(Costs::at(costs.block_s, 1), 0);
  EXPECT_GT(Costs::at(costs.block_forward_s, 4), 0);
  EXPECT_GT(costs.optimizer_s_per_parameter, 0);
  // A row count not measured is scaled per token from the nearest one.
  EXPECT_DOUBLE_EQ(Costs::at(costs.block_s, 8), 2 * costs.block_s.at(4));
}

}  // namespace
}  // namespace gpt
