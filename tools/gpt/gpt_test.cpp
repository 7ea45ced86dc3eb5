// The transformer of gpt.h: its shape and its causality, the config's errors, and the first layouts
// of issue 20: DDP and ZeRO stages 1-3 over 2 and 3 thread-ranks, each on its share of the batch,
// end with the same parameters as one process trained on the whole batch; a single-process pipeline
// over its blocks gives the whole batch's gradients under every schedule; tensor parallelism inside
// the blocks equals one process, with one all-reduce each way per sub-layer, and so does sequence
// parallelism on top of it, whose blocks keep 1/T of their activations outside the tensor-parallel
// matmuls.
#include "gpt/gpt.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <map>
#include <mutex>
#include <string>

#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/pipeline.h"
#include "dtrain/sharded.h"
#include "support/thread_ranks.h"

namespace gpt {
namespace {

GptConfig tiny() {
  GptConfig config;
  config.seq_len = 16;
  config.layers = 2;
  config.width = 32;
  config.heads = 4;
  config.kv_heads = 2;
  return config;
}

TEST(Gpt, LogitsHaveTheVocabularyAndNamedParameters) {
  torch::manual_seed(0);
  Gpt model(tiny());
  at::Tensor tokens = torch::randint(256, {3, 16});
  EXPECT_EQ(model(tokens).sizes(), (std::vector<int64_t>{3, 16, 256}));
  auto names = model->named_parameters().keys();
  for (const char* name : {"embedding.weight", "block0.attention.wq.weight", "block1.mlp.w3.weight",
                           "norm.weight", "head.weight"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  // Grouped heads: keys and values have kv_heads x head_dim = 16 outputs, queries 32.
  auto block = model->block(0).named_parameters();
  EXPECT_EQ(block["attention.wk.weight"].size(0), 16);
  EXPECT_EQ(block["attention.wq.weight"].size(0), 32);
  EXPECT_EQ(block["mlp.w1.weight"].size(0), 88);  // 8/3 x 32 = 85.3, up to a multiple of 8
}

// The count behind model_flops_per_token is the model's own, grouped heads and an explicit MLP
// width included (a term left out of the formula shows here).
TEST(Gpt, ParameterCountIsTheModelsAndFlopsFollowIt) {
  for (int64_t mlp_width : {0, 40}) {
    GptConfig config = tiny();
    config.mlp_width = mlp_width;
    Gpt model(config);
    int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    EXPECT_EQ(parameter_count(config), numel) << "mlp_width " << mlp_width;
    EXPECT_DOUBLE_EQ(model_flops_per_token(config),
                     6.0 * numel + 12.0 * config.layers * config.width * config.seq_len);
  }
}

TEST(Gpt, APositionSeesNoLaterToken) {
  torch::manual_seed(1);
  Gpt model(tiny());
  at::Tensor tokens = torch::randint(256, {2, 16});
  at::Tensor changed = tokens.clone();
  changed.index_put_({torch::indexing::Slice(), 9}, (tokens.select(1, 9) + 1) % 256);
  torch::NoGradGuard no_grad;
  at::Tensor before = model(tokens), after = model(changed);
  // Positions 0..8 do not see token 9; position 9 and later do.
  EXPECT_TRUE(torch::equal(before.narrow(1, 0, 9), after.narrow(1, 0, 9)));
  EXPECT_FALSE(torch::allclose(before.narrow(1, 9, 1), after.narrow(1, 9, 1)));
}

TEST(Gpt, AConfigThatDoesNotFitIsOneLineNamingTheSize) {
  auto message = [](GptConfig config) {
    try {
      Gpt model(config);
    } catch (const dtrain::UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  GptConfig config = tiny();
  config.width = 30;
  EXPECT_NE(message(config).find("width 30 does not divide by heads 4"), std::string::npos)
      << message(config);
  config = tiny();
  config.heads = 4;
  config.kv_heads = 3;
  EXPECT_NE(message(config).find("heads 4 does not divide by kv_heads 3"), std::string::npos)
      << message(config);
  config = tiny();
  config.width = 36;  // head dimension 9
  EXPECT_NE(message(config).find("is odd"), std::string::npos) << message(config);
  Gpt model(tiny());
  EXPECT_THROW(model(torch::zeros({1, 17}, torch::kLong)), dtrain::UsageError);
}

// k SGD steps over `world` thread-ranks, each on its rows of one batch, against one process on the
// whole batch: every parameter within a relative 1e-5 (float32; the ranks' mean of per-rank mean
// losses is the whole batch's mean because every rank has as many rows). zero_stage 0: DDP;
// 1-3: ShardedDataParallel at that stage.
void expect_equal_to_one_process(int world, int zero_stage = 0) {
  const GptConfig config = tiny();
  const int64_t rows_per_rank = 2, steps = 3;
  torch::manual_seed(7);
  at::Tensor data = torch::randint(256, {steps, world * rows_per_rank, config.seq_len + 1});

  torch::manual_seed(3);
  Gpt reference(config);
  std::vector<at::Tensor> initial;
  for (const auto& p : reference->parameters()) initial.push_back(p.detach().clone());
  torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor batch = data[s];
    reference_optimizer.zero_grad();
    next_token_loss(reference(batch.narrow(1, 0, config.seq_len)),
                    batch.narrow(1, 1, config.seq_len))
        .backward();
    reference_optimizer.step();
  }

  std::vector<std::vector<at::Tensor>> trained(world);
  dtrain::testing::run_group(world, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    // The ranks' threads draw from one generator, so their fresh models differ: rank 0 takes the
    // reference's start and DDP's constructor gives it to every rank.
    Gpt model(config);
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      auto mine = model->parameters();
      for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(initial[i]);
    }
    dtrain::DistributedDataParallel<GptImpl> ddp{nullptr};
    dtrain::ShardedDataParallel<GptImpl> sdp{nullptr};
    std::vector<at::Tensor> stepped;
    if (zero_stage == 0) {
      ddp = dtrain::DistributedDataParallel(model, pg);
      stepped = ddp->parameters();
    } else {
      dtrain::ShardedDataParallelOptions options;
      options.stage = zero_stage;
      sdp = dtrain::ShardedDataParallel(model, pg, options);
      stepped = sdp->parameters();  // this rank's shards
      // Stage 3 drives the Sequential's children (Note [The model is a Sequential]): a unit, and
      // a shard, per block, plus the embedding, the norm and the head.
      if (zero_stage == 3) EXPECT_EQ(stepped.size(), static_cast<size_t>(config.layers + 3));
    }
    torch::optim::SGD optimizer(stepped, 0.1);
    for (int64_t s = 0; s < steps; ++s) {
      at::Tensor mine = data[s].narrow(0, rank * rows_per_rank, rows_per_rank);
      at::Tensor input = mine.narrow(1, 0, config.seq_len);
      optimizer.zero_grad();
      next_token_loss(ddp ? ddp(input) : sdp(input), mine.narrow(1, 1, config.seq_len)).backward();
      optimizer.step();
    }
    if (sdp) sdp->gather_full_parameters();  // the whole model, to compare
    for (const auto& p : model->parameters()) trained[rank].push_back(p.detach().clone());
  });

  auto expected = reference->named_parameters();
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(trained[rank].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const at::Tensor& want = expected[i].value();
      double error = (trained[rank][i] - want).norm().item<double>() /
                     std::max(want.norm().item<double>(), 1e-12);
      EXPECT_LT(error, 1e-5) << "rank " << rank << "/" << world << ", " << expected[i].key();
    }
  }
  // The steps moved the parameters: a test of equal starting points alone would pass too.
  EXPECT_GT((initial.back() - reference->head->weight).abs().max().item<double>(), 1e-4);
}

TEST(GptDdp, TwoRanksEqualOneProcess) { expect_equal_to_one_process(2); }
TEST(GptDdp, ThreeRanksEqualOneProcess) { expect_equal_to_one_process(3); }
TEST(GptZero, EveryStageAtTwoRanksEqualsOneProcess) {
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    expect_equal_to_one_process(2, stage);
  }
}
TEST(GptZero, Stage3AtThreeRanksEqualsOneProcess) { expect_equal_to_one_process(3, 3); }

// Model parallelism: the model cut between blocks into 2 stages (4 chunks for the interleaved
// schedule), 4 micro-batches on one process, gives the whole batch's gradients under every
// schedule, with and without recomputation.
TEST(GptPipeline, EveryScheduleGivesTheWholeBatchGradients) {
  GptConfig config = tiny();
  config.layers = 4;
  torch::manual_seed(5);
  Gpt model(config);
  at::Tensor data = torch::randint(256, {8, config.seq_len + 1});
  at::Tensor input = data.narrow(1, 0, config.seq_len), target = data.narrow(1, 1, config.seq_len);
  model->zero_grad();
  next_token_loss(model(input), target).backward();
  std::vector<at::Tensor> expected;
  for (const auto& p : model->parameters()) expected.push_back(p.grad().clone());

  torch::nn::Sequential whole = model->sequential();
  for (auto [kind, virtual_stages] :
       {std::pair{dtrain::ScheduleKind::kGPipe, 1}, std::pair{dtrain::ScheduleKind::k1F1B, 1},
        std::pair{dtrain::ScheduleKind::kInterleaved1F1B, 2}}) {
    for (bool recompute : {false, true}) {
      SCOPED_TRACE("schedule " + std::to_string(static_cast<int>(kind)) + ", recompute " +
                   std::to_string(recompute));
      dtrain::PipelineOptions options;
      options.micro_batches = 4;
      options.schedule = kind;
      options.virtual_stages = virtual_stages;
      options.recompute = recompute;
      auto chunks =
          dtrain::split_sequential(whole, dtrain::balance_by_parameters(whole, 2 * virtual_stages));
      dtrain::Pipeline pipe(chunks, /*devices=*/{}, options);
      model->zero_grad();
      pipe.forward_backward(input, target, next_token_loss);
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        double error = (params[i].grad() - expected[i]).norm().item<double>() /
                       std::max(expected[i].norm().item<double>(), 1e-12);
        EXPECT_LT(error, 1e-5) << model->named_parameters()[i].key();
      }
    }
  }
}

// Tensor parallelism inside the blocks (Note [Tensor-parallel blocks]): T ranks, every one on the
// whole batch, each holding its heads and hidden features; after k SGD steps every rank's whole
// tensors (embedding, norms, head) and shards equal the single-process model's, within a relative
// 1e-5.
void expect_tensor_parallel_equals_one_process(int tensor_size, GptConfig config) {
  const int64_t steps = 3;
  torch::manual_seed(11);
  at::Tensor data = torch::randint(256, {steps, 4, config.seq_len + 1});
  torch::manual_seed(3);
  Gpt reference(config);
  torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
  for (int64_t s = 0; s < steps; ++s) {
    reference_optimizer.zero_grad();
    next_token_loss(reference(data[s].narrow(1, 0, config.seq_len)),
                    data[s].narrow(1, 1, config.seq_len))
        .backward();
    reference_optimizer.step();
  }
  auto expected = reference->named_parameters();

  std::mutex seed_mutex;  // the thread-ranks share one generator: one draws the model at a time
  dtrain::testing::run_group(
      tensor_size, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
        Gpt model{nullptr};
        {
          std::lock_guard<std::mutex> lock(seed_mutex);
          torch::manual_seed(3);
          model = Gpt(config, pg);
        }
        torch::optim::SGD optimizer(model->parameters(), 0.1);
        for (int64_t s = 0; s < steps; ++s) {
          optimizer.zero_grad();
          next_token_loss(model(data[s].narrow(1, 0, config.seq_len)),
                          data[s].narrow(1, 1, config.seq_len))
              .backward();
          optimizer.step();
        }
        for (const auto& item : model->named_parameters()) {
          at::Tensor want = expected[item.key()];
          const at::Tensor& mine = item.value();
          // A shard: the rows (column-parallel) or columns (row-parallel) this rank holds, found
          // by where its slice matches in size; whole tensors compare whole.
          if (!mine.sizes().equals(want.sizes())) {
            const int64_t dim = mine.size(0) != want.size(0) ? 0 : 1;
            const int64_t size = mine.size(dim), total = want.size(dim);
            // Even splits here (the test's sizes divide), so rank r holds [r*size, (r+1)*size).
            ASSERT_EQ(total % tensor_size, 0) << item.key();
            want = want.narrow(dim, rank * size, size);
          }
          double error =
              (mine - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
          EXPECT_LT(error, 1e-5) << "rank " << rank << ", " << item.key();
        }
      });
}

TEST(GptTensorParallel, TwoRanksEqualOneProcess) {
  expect_tensor_parallel_equals_one_process(2, tiny());  // 4 heads, 2 key/value heads
}

TEST(GptTensorParallel, PlainMultiHeadAttentionAndAnOddHiddenWidthPerRank) {
  GptConfig config = tiny();
  config.kv_heads = 4;    // plain multi-head attention: 2 query and 2 key/value heads per rank
  config.mlp_width = 90;  // 45 hidden features per rank
  expect_tensor_parallel_equals_one_process(2, config);
}

TEST(GptTensorParallel, SeveralKeyValueHeadsPerRank) {
  GptConfig config = tiny();
  config.heads = 8;     // head dimension 4
  config.kv_heads = 4;  // 4 query and 2 key/value heads per rank: each rank's query heads must
                        // map to its own key/value heads, 2 each, as the unsplit model maps them
  expect_tensor_parallel_equals_one_process(2, config);
}

// The collectives one block starts on each of `tensor_size` ranks: in its forward, and in the
// backward of the sum of its output with its input requiring a gradient (as every block's does in
// the model: the embedding's output needs one). Every rank counts the same.
struct BlockCollectives {
  uint64_t forward = 0, backward = 0;              // operations
  uint64_t forward_bytes = 0, backward_bytes = 0;  // CommStats::bytes
};

BlockCollectives block_collectives(int tensor_size, bool sequence_parallel, bool recompute) {
  const GptConfig config = tiny();
  torch::manual_seed(5);
  const at::Tensor input = torch::randn({4, config.seq_len, config.width});
  std::vector<BlockCollectives> counted(tensor_size);
  std::mutex seed_mutex;  // the thread-ranks share one generator: one draws at a time
  dtrain::testing::run_group(
      tensor_size, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
        Block block{nullptr};
        {
          std::lock_guard<std::mutex> lock(seed_mutex);
          block = Block(config, pg, sequence_parallel);
        }
        block->recompute = recompute;
        const int64_t size = config.seq_len / tensor_size;
        const at::Tensor x = (sequence_parallel ? input.narrow(1, rank * size, size) : input)
                                 .clone()
                                 .requires_grad_(true);
        const dtrain::CommStats start = pg->stats();
        at::Tensor y = block(x);
        const dtrain::CommStats forward = pg->stats();
        y.sum().backward();
        const dtrain::CommStats end = pg->stats();
        counted[rank] = {forward.ops - start.ops, end.ops - forward.ops,
                         forward.bytes - start.bytes, end.bytes - forward.bytes};
      });
  for (int rank = 1; rank < tensor_size; ++rank) {
    EXPECT_EQ(counted[rank].forward, counted[0].forward) << "rank " << rank;
    EXPECT_EQ(counted[rank].backward, counted[0].backward) << "rank " << rank;
  }
  return counted[0];
}

// Note [Tensor-parallel blocks]: 2 all-reduces of [batch, seq, width] forward (wo's and w2's) and
// 2 backward (the attention's and the MLP's input gradient; q, k, v share one, w1 and w3 another,
// where each projection's own all-reduce made it 5, 7 per block in all). Recomputation runs the
// forward's 2 again in backward. The advisor's model (advise.cpp, predict) counts these.
TEST(GptTensorParallel, ABlockAllReducesOnceEachWayPerSubLayer) {
  const GptConfig config = tiny();
  const uint64_t activation = 4 * config.seq_len * config.width * sizeof(float);
  const BlockCollectives plain = block_collectives(2, false, false);
  EXPECT_EQ(plain.forward, 2u);
  EXPECT_EQ(plain.backward, 2u) << "one all-reduce of the input's gradient per sub-layer";
  EXPECT_EQ(plain.forward_bytes, 2 * activation) << "all of them activation-sized";
  EXPECT_EQ(plain.backward_bytes, 2 * activation);
  const BlockCollectives recomputed = block_collectives(2, false, true);
  EXPECT_EQ(recomputed.forward, 2u);
  EXPECT_EQ(recomputed.backward, 4u) << "the forward's 2 again, then the backward's 2";
}

// Note [Sequence-parallel blocks]: forward, an all-gather into and a reduce-scatter out of each
// sub-layer (4); backward, per sub-layer, a reduce-scatter of the input's gradient, the input
// all-gathered again, the output's gradient all-gathered and the norm's weight gradient
// all-reduced (8). Recomputation adds the forward's 4. The advisor counts these too.
TEST(GptSequenceParallel, ABlocksCollectivesAreTheAdvisorsCount) {
  const BlockCollectives plain = block_collectives(2, true, false);
  EXPECT_EQ(plain.forward, 4u);
  EXPECT_EQ(plain.backward, 8u);
  const BlockCollectives recomputed = block_collectives(2, true, true);
  EXPECT_EQ(recomputed.forward, 4u);
  EXPECT_EQ(recomputed.backward, 12u);
}

TEST(GptTensorParallel, ADegreeThatDoesNotDivideTheKeyValueHeadsIsNamed) {
  GptConfig config = tiny();  // kv_heads 2
  dtrain::testing::run_group(3, [&](int, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    try {
      Gpt model(config, pg);
      ADD_FAILURE() << "expected a UsageError";
    } catch (const dtrain::UsageError& e) {
      EXPECT_NE(
          std::string(e.what()).find("kv_heads 2 does not divide by the tensor-parallel degree 3"),
          std::string::npos)
          << e.what();
    }
  });
}

// ---- Sequence parallelism (Note [Sequence-parallel blocks]) ----

// Every rank's parameters by name after `steps` SGD steps on `data` [steps, batch, seq + 1] of the
// model split over `tensor_size` thread-ranks (each on the whole batch), with or without sequence
// parallelism.
std::vector<std::map<std::string, at::Tensor>> train_split(int tensor_size, const GptConfig& config,
                                                           bool sequence_parallel,
                                                           const at::Tensor& data) {
  std::vector<std::map<std::string, at::Tensor>> trained(tensor_size);
  std::mutex seed_mutex;  // the thread-ranks share one generator: one draws the model at a time
  dtrain::testing::run_group(tensor_size,
                             [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
                               Gpt model{nullptr};
                               {
                                 std::lock_guard<std::mutex> lock(seed_mutex);
                                 torch::manual_seed(3);
                                 model = Gpt(config, pg, sequence_parallel);
                               }
                               torch::optim::SGD optimizer(model->parameters(), 0.1);
                               for (int64_t s = 0; s < data.size(0); ++s) {
                                 optimizer.zero_grad();
                                 next_token_loss(model(data[s].narrow(1, 0, config.seq_len)),
                                                 data[s].narrow(1, 1, config.seq_len))
                                     .backward();
                                 optimizer.step();
                               }
                               for (const auto& item : model->named_parameters())
                                 trained[rank][item.key()] = item.value().detach().clone();
                             });
  return trained;
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
}

// The reference's tensor cut as rank `rank` of `ranks` holds it: whole, or the rows
// (column-parallel) or columns (row-parallel) of its shard, uneven shards as
// ColumnParallelLinear assigns them (the first size % ranks ranks hold one more).
at::Tensor shard_of(const at::Tensor& whole, const at::Tensor& mine, int rank, int ranks) {
  if (mine.sizes().equals(whole.sizes())) return whole;
  const int64_t dim = mine.size(0) != whole.size(0) ? 0 : 1;
  const int64_t total = whole.size(dim), base = total / ranks, extra = total % ranks;
  return whole.narrow(dim, rank * base + std::min<int64_t>(rank, extra), mine.size(dim));
}

// Sequence parallel equals tensor parallel equals one process: after k SGD steps every rank's
// tensors, whole or shards, within a relative 1e-5 of the single-process model's and of tensor
// parallelism's.
void expect_sequence_parallel_equals_tensor_parallel_and_one_process(int tensor_size,
                                                                     GptConfig config) {
  const int64_t steps = 3;
  torch::manual_seed(11);
  at::Tensor data = torch::randint(256, {steps, 4, config.seq_len + 1});
  torch::manual_seed(3);
  Gpt reference(config);
  std::vector<at::Tensor> initial;
  for (const auto& p : reference->parameters()) initial.push_back(p.detach().clone());
  torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
  for (int64_t s = 0; s < steps; ++s) {
    reference_optimizer.zero_grad();
    next_token_loss(reference(data[s].narrow(1, 0, config.seq_len)),
                    data[s].narrow(1, 1, config.seq_len))
        .backward();
    reference_optimizer.step();
  }
  auto expected = reference->named_parameters();
  auto tensor_parallel = train_split(tensor_size, config, false, data);
  auto sequence_parallel = train_split(tensor_size, config, true, data);
  for (int rank = 0; rank < tensor_size; ++rank) {
    ASSERT_EQ(sequence_parallel[rank].size(), expected.size());
    for (const auto& [name, mine] : sequence_parallel[rank]) {
      SCOPED_TRACE("rank " + std::to_string(rank) + "/" + std::to_string(tensor_size) + ", " +
                   name);
      const at::Tensor want = shard_of(expected[name], mine, rank, tensor_size);
      EXPECT_LT(relative(mine, want), 1e-5) << "sequence parallel against one process";
      EXPECT_LT(relative(tensor_parallel[rank].at(name), want), 1e-5)
          << "tensor parallel against one process";
      EXPECT_LT(relative(mine, tensor_parallel[rank].at(name)), 1e-5)
          << "sequence parallel against tensor parallel";
    }
  }
  // The steps moved every norm's weight (whose gradient sequence parallelism all-reduces): a test
  // of equal starting points alone would pass too.
  auto start = initial.begin();
  for (const auto& item : expected) {
    if (item.key().find("norm") != std::string::npos) {
      EXPECT_GT((*start - item.value()).abs().max().item<double>(), 1e-6) << item.key();
    }
    ++start;
  }
}

TEST(GptSequenceParallel, TwoRanksEqualTensorParallelAndOneProcess) {
  expect_sequence_parallel_equals_tensor_parallel_and_one_process(2, tiny());
}

TEST(GptSequenceParallel, ThreeRanksOddSlicesAndAnUnevenHiddenWidth) {
  GptConfig config = tiny();
  config.heads = 6;
  config.kv_heads = 3;
  config.width = 48;       // head dimension 8
  config.seq_len = 15;     // 5 positions per rank
  config.mlp_width = 100;  // 34, 33, 33 hidden features
  expect_sequence_parallel_equals_tensor_parallel_and_one_process(3, config);
}

TEST(GptSequenceParallel, ASequenceThatDoesNotDivideIsOneErrorNamingTheDegree) {
  GptConfig config = tiny();
  config.heads = 6;
  config.kv_heads = 3;
  config.width = 48;
  EXPECT_THROW(Gpt(config, nullptr, /*sequence_parallel=*/true), dtrain::UsageError);
  dtrain::testing::run_group(3, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    Gpt model(config, pg, /*sequence_parallel=*/true);
    try {
      model(torch::zeros({2, 16}, torch::kLong));
      ADD_FAILURE() << "expected a UsageError";
    } catch (const dtrain::UsageError& e) {
      const std::string text = e.what();
      EXPECT_NE(text.find("rank " + std::to_string(rank) + "/3"), std::string::npos) << text;
      EXPECT_NE(text.find("the sequence length 16 does not divide by the tensor-parallel degree 3"),
                std::string::npos)
          << text;
    }
    torch::NoGradGuard no_grad;  // a length that divides runs, on the same group
    EXPECT_EQ(model(torch::zeros({2, 15}, torch::kLong)).sizes(),
              (std::vector<int64_t>{2, 15, 256}));
  });
}

// Counts the CPU bytes allocated, and not yet freed, by threads that hold an account: what a
// forward pass leaves alive for backward (its saved activations and its output), per rank thread.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  static std::atomic<int64_t>*& account() {
    thread_local std::atomic<int64_t>* current = nullptr;
    return current;
  }
  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    const c10::Device device = inner.device();
    std::atomic<int64_t>* charged = account();
    if (charged) *charged += static_cast<int64_t>(bytes);
    auto* context = new Context{std::move(inner), charged, static_cast<int64_t>(bytes)};
    return {data, context, &CountingAllocator::release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Context {
    c10::DataPtr inner;
    std::atomic<int64_t>* account;
    int64_t bytes;
  };
  static void release(void* pointer) {
    auto* context = static_cast<Context*>(pointer);
    if (context->account) *context->account -= context->bytes;
    delete context;
  }
  c10::Allocator* base_;
};

// Bytes one block's forward leaves alive on rank 0 of `tensor_size`: the input [4, 16, 32] whole
// (tensor parallel) or its slice (sequence parallel).
int64_t block_activation_bytes(int tensor_size, bool sequence_parallel) {
  const GptConfig config = tiny();
  torch::manual_seed(5);
  const at::Tensor input = torch::randn({4, config.seq_len, config.width});
  static std::atomic<int64_t> accounts[8];  // outlive every tensor they count
  std::vector<int64_t> kept(tensor_size);
  std::mutex seed_mutex;  // the thread-ranks share one generator: one draws at a time
  dtrain::testing::run_group(
      tensor_size, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
        Block block{nullptr};
        {
          std::lock_guard<std::mutex> lock(seed_mutex);
          block = Block(config, pg, sequence_parallel);
        }
        const int64_t size = config.seq_len / tensor_size;
        at::Tensor x = sequence_parallel ? input.narrow(1, rank * size, size).clone() : input;
        x = x.clone().requires_grad_(true);
        {
          torch::NoGradGuard no_grad;  // builds the rotary tables, which the block keeps
          block(x);
        }
        CountingAllocator::account() = &accounts[rank];
        const int64_t before = accounts[rank];
        at::Tensor y = block(x);
        kept[rank] = accounts[rank] - before;
        CountingAllocator::account() = nullptr;
        EXPECT_EQ(y.sizes(), x.sizes());  // the residual stream: a slice, or the whole
        EXPECT_EQ(y.size(1), sequence_parallel ? size : config.seq_len);
      });
  return kept[0];
}

// Activation memory per rank falls: outside the tensor-parallel matmuls a block keeps two norms'
// normalized and scaled tensors (2 x 2 [b, s, w]), the residual sum and its output ([b, s, w]
// each), 6 b s w floats in all, whole on every rank under tensor parallelism and 1/T of them under
// sequence parallelism, whose all-gathered inputs of q/k/v and w1/w3 are not kept either (they are
// gathered again in backward). Measured with a counting allocator: what a forward leaves alive.
TEST(GptSequenceParallel, ABlockKeepsOneTthOfItsActivationsOutsideTheMatmuls) {
  c10::Allocator* original = c10::GetCPUAllocator();
  static auto* counting = new CountingAllocator(original);  // never freed: tensors point at it
  c10::SetCPUAllocator(counting, /*priority=*/100);
  struct Restore {
    c10::Allocator* original;
    ~Restore() { c10::SetCPUAllocator(original, /*priority=*/100); }
  } restore{original};
  const GptConfig config = tiny();
  const int tensor_size = 2;
  // The least of three forwards: a few buffers of the collectives are sometimes counted (12288
  // bytes more under sequence parallelism, 8192 under tensor parallelism, in some processes for
  // all three forwards; why is not found yet), so the bound below leaves room for them.
  auto least = [&](bool sequence_parallel) {
    int64_t bytes = block_activation_bytes(tensor_size, sequence_parallel);
    for (int i = 0; i < 2; ++i)
      bytes = std::min(bytes, block_activation_bytes(tensor_size, sequence_parallel));
    return bytes;
  };
  const int64_t tensor_parallel = least(false);
  const int64_t sequence_parallel = least(true);
  const double outside = 6.0 * 4 * config.seq_len * config.width * sizeof(float);
  const double saved = outside * (1 - 1.0 / tensor_size);
  std::cout << "block activations per rank: tensor parallel " << tensor_parallel
            << " bytes, sequence parallel " << sequence_parallel << " bytes; expected saving "
            << saved << " bytes" << std::endl;
  EXPECT_GT(tensor_parallel, 0) << "the counting allocator saw nothing";
  // Measured: 111616 (or 119808) -> 86784 (or 99072) bytes, a saving of 12544 to 33024 against
  // the 24576 counted here. Keeping the all-gathered inputs (16384 bytes more) fails it when the
  // stray buffers are not counted, not always: the bound is loose until they are explained.
  EXPECT_GE(static_cast<double>(tensor_parallel - sequence_parallel), 0.4 * saved);
}

}  // namespace
}  // namespace gpt
