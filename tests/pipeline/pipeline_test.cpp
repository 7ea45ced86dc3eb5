// Pipelines against single-process training of the same model on the same data: after k optimizer
// steps the parameters must be equal (relative error < 1e-5, float32), for every schedule, 2..4
// stages and 1..8 micro-batches (13 rows: most counts do not divide it). Single-process pipelines
// run stages on threads; distributed ones run ranks as threads over an in-memory store, data
// replicas other than the first starting from other parameters. The zero-bubble schedule, whose
// backward is split in two passes, must also equal 1F1B within 1e-6. Recompute with dropout must
// equal no recompute within 1e-6. Also the pre-flight's errors, on every rank.
#include "dtrain/pipeline.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/sharded.h"
#include "pipeline/split_backward.h"
#include "support/equivalence.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::relative_error;
using testing::run_group;

constexpr int64_t kInputs = 10;
constexpr int64_t kClasses = 4;
constexpr int64_t kBatch = 13;
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;
// ZB-H1 against 1F1B: the same products on the same values, only split into two passes.
constexpr double kSplitTolerance = 1e-6;

// Thread-ranks build their models and batches from torch's one global generator: one at a time.
std::mutex rng_mutex;

// Eight layers, so that 4 stages x 2 virtual stages still get one layer each.
torch::nn::Sequential make_model() {
  std::lock_guard<std::mutex> lock(rng_mutex);
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(kInputs, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 12), torch::nn::Tanh(),
                               torch::nn::Linear(12, 8), torch::nn::Linear(8, kClasses));
}

struct Batch {
  torch::Tensor x, y;
};
Batch make_batch(int step, int64_t rows = kBatch) {
  std::lock_guard<std::mutex> lock(rng_mutex);
  torch::manual_seed(500 + step);
  return {torch::randn({rows, kInputs}), torch::randint(kClasses, {rows})};
}

torch::Tensor mean_loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> copy;
  for (auto& p : params) copy.push_back(p.detach().clone());
  return copy;
}

std::vector<torch::Tensor> train_single(int steps = kSteps) {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    Batch b = make_batch(step);
    opt.zero_grad();
    mean_loss(model->forward(b.x), b.y).backward();
    opt.step();
  }
  return snapshot(model->parameters());
}

// Boundaries that cut the 8 layers into `parts` chunks as evenly as the layer count allows.
std::vector<int64_t> even_cut(int parts) {
  std::vector<int64_t> cut;
  for (int i = 1; i < parts; ++i) cut.push_back(i * 8 / parts);
  return cut;
}

std::vector<torch::Tensor> train_pipeline(ScheduleKind kind, int stages, int micro_batches,
                                          int virtual_stages = 1, bool recompute = false) {
  auto model = make_model();
  PipelineOptions options;
  options.schedule = kind;
  options.micro_batches = micro_batches;
  options.virtual_stages = virtual_stages;
  options.recompute = recompute;
  Pipeline pipe(split_sequential(model, even_cut(stages * virtual_stages)), {}, options, stages);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    Batch b = make_batch(step);
    opt.zero_grad();
    auto loss = pipe.forward_backward(b.x, b.y, mean_loss);
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    opt.step();
  }
  return snapshot(model->parameters());
}

TEST(Pipeline, SingleProcessEqualsSingleDeviceForEverySchedule) {
  const auto want = train_single();
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p = 2; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        SCOPED_TRACE(std::string(to_string(kind)) + " P=" + std::to_string(p) +
                     " M=" + std::to_string(m));
        EXPECT_LT(relative_error(train_pipeline(kind, p, m), want), kTolerance);
      }
    }
  }
  for (int p = 2; p <= 4; ++p) {
    for (int m : {1, 3, 4, 8}) {
      SCOPED_TRACE("interleaved P=" + std::to_string(p) + " M=" + std::to_string(m));
      EXPECT_LT(relative_error(train_pipeline(ScheduleKind::kInterleaved1F1B, p, m, 2), want),
                kTolerance);
    }
  }
}

TEST(Pipeline, RecomputeGivesTheSameGradients) {
  const auto want = train_single();
  EXPECT_LT(relative_error(train_pipeline(ScheduleKind::k1F1B, 3, 5, 1, true), want), kTolerance);
  EXPECT_LT(relative_error(train_pipeline(ScheduleKind::kGPipe, 2, 4, 1, true), want), kTolerance);
}

// ---- Recompute and random draws (Note [Recompute and random draws] in stage_runner.cpp) ----

// make_model's layers with dropout after the second and the third Linear.
torch::nn::Sequential make_dropout_model() {
  std::lock_guard<std::mutex> lock(rng_mutex);
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(kInputs, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 16), torch::nn::Dropout(0.5),
                               torch::nn::Linear(16, 12), torch::nn::Tanh(),
                               torch::nn::Dropout(0.5), torch::nn::Linear(12, kClasses));
}

struct DropoutLayout {
  std::string name;
  ScheduleKind kind;
  int stages;
  int virtual_stages;
  std::vector<int64_t> cut;  // every chunk with a dropout on the same stage: one stage draws
};

// Trains the dropout model in a training-mode pipeline; the masks are drawn from a stream seeded
// with `seed` once, after the batches were made.
std::vector<torch::Tensor> train_with_dropout(const DropoutLayout& layout, bool recompute,
                                              uint64_t seed) {
  auto model = make_dropout_model();
  PipelineOptions options;
  options.schedule = layout.kind;
  options.micro_batches = 5;
  options.virtual_stages = layout.virtual_stages;
  options.recompute = recompute;
  Pipeline pipe(split_sequential(model, layout.cut), {}, options, layout.stages);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<Batch> batches;
  for (int step = 0; step < kSteps; ++step) batches.push_back(make_batch(step));
  torch::manual_seed(seed);
  for (const Batch& b : batches) {
    opt.zero_grad();
    auto loss = pipe.forward_backward(b.x, b.y, mean_loss);
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    opt.step();
  }
  return snapshot(model->parameters());
}

// The recomputed forward draws the masks the first drew, and the stream of draws goes on as
// without recompute: in layouts where one stage draws (so the order of draws is fixed), recompute
// trains the same numbers as no recompute under the same seed. Before the recompute kept the
// generators' states, it drew new masks: gradients of masks other than the loss's.
TEST(Pipeline, RecomputeWithDropoutEqualsNoRecompute) {
  const std::vector<DropoutLayout> layouts = {
      {"1 stage 1F1B", ScheduleKind::k1F1B, 1, 1, {}},
      {"2 stages 1F1B", ScheduleKind::k1F1B, 2, 1, {2}},
      {"2 stages GPipe", ScheduleKind::kGPipe, 2, 1, {2}},
      {"3 stages ZB-H1", ScheduleKind::kZeroBubbleH1, 3, 1, {2, 3}},
      // Chunks 1 and 3 (stage 1) hold the dropouts; stage 0 draws nothing.
      {"2 stages interleaved", ScheduleKind::kInterleaved1F1B, 2, 2, {2, 4, 6}},
  };
  for (const auto& layout : layouts) {
    SCOPED_TRACE(layout.name);
    EXPECT_LT(
        relative_error(train_with_dropout(layout, true, 7), train_with_dropout(layout, false, 7)),
        kSplitTolerance);
  }
  // Other masks train other numbers: the comparison above sees a mask that differs.
  EXPECT_GT(relative_error(train_with_dropout(layouts[1], false, 7),
                           train_with_dropout(layouts[1], false, 8)),
            100 * kTolerance);
}

// Dropout that records each call's input, mask and whether gradients were on (the recomputed
// forward runs with them, the first without).
struct RecordingDropoutImpl : torch::nn::Module {
  struct Call {
    torch::Tensor input, mask;
    bool grad = false;
  };
  torch::Tensor forward(const torch::Tensor& x) {
    auto mask = torch::bernoulli(torch::full_like(x, 0.5));  // the default generator, as Dropout
    std::lock_guard<std::mutex> lock(mutex);
    calls.push_back({x.detach().clone(), mask, torch::GradMode::is_enabled()});
    return x * mask * 2;
  }
  std::mutex mutex;
  std::vector<Call> calls;
};
TORCH_MODULE(RecordingDropout);

// Every stage draws, on its own thread, from the one CPU generator: each recomputed forward must
// still draw the mask of its first forward (matched by the input, the same in both), whatever the
// other stages drew in between.
TEST(Pipeline, RecomputeDrawsEachFirstForwardsMasksWhileEveryStageDraws) {
  constexpr int kMicroBatches = 6;
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe, ScheduleKind::kZeroBubbleH1}) {
    SCOPED_TRACE(to_string(kind));
    std::vector<RecordingDropout> dropouts = {RecordingDropout(), RecordingDropout(),
                                              RecordingDropout()};
    torch::nn::Sequential model;
    {
      std::lock_guard<std::mutex> lock(rng_mutex);
      torch::manual_seed(3);
      model = torch::nn::Sequential(torch::nn::Linear(kInputs, 16), dropouts[0],
                                    torch::nn::Linear(16, 16), dropouts[1],
                                    torch::nn::Linear(16, kClasses), dropouts[2]);
    }
    PipelineOptions options;
    options.schedule = kind;
    options.micro_batches = kMicroBatches;
    options.recompute = true;
    Pipeline pipe(split_sequential(model, {2, 4}), {}, options, 3);
    for (int step = 0; step < 2; ++step) {
      Batch b = make_batch(step);
      pipe.forward_backward(b.x, b.y, mean_loss);
    }
    for (size_t d = 0; d < dropouts.size(); ++d) {
      const auto& calls = dropouts[d]->calls;
      ASSERT_EQ(calls.size(), 2u * 2 * kMicroBatches) << "dropout " << d;
      int matched = 0;
      for (const auto& again : calls) {
        if (!again.grad) continue;
        for (const auto& first : calls) {
          if (!first.grad && torch::equal(first.input, again.input)) {
            EXPECT_TRUE(torch::equal(first.mask, again.mask)) << "dropout " << d;
            ++matched;
            break;
          }
        }
      }
      EXPECT_EQ(matched, 2 * kMicroBatches) << "dropout " << d << ": recomputed on other inputs";
    }
  }
}

TEST(Pipeline, ZeroBubbleEqualsOneF1BAndSingleDevice) {
  const auto want = train_single();
  for (int p = 2; p <= 4; ++p) {
    for (int m : {1, 2, 3, 5, 8}) {
      SCOPED_TRACE("zbh1 P=" + std::to_string(p) + " M=" + std::to_string(m));
      auto zb = train_pipeline(ScheduleKind::kZeroBubbleH1, p, m);
      EXPECT_LT(relative_error(zb, train_pipeline(ScheduleKind::k1F1B, p, m)), kSplitTolerance);
      EXPECT_LT(relative_error(zb, want), kTolerance);
    }
  }
  EXPECT_LT(relative_error(train_pipeline(ScheduleKind::kZeroBubbleH1, 3, 5, 1, true), want),
            kTolerance);
}

TEST(Pipeline, ZeroBubbleHoldsWhatTheScheduleSays) {
  // Activations are held from F to W: P on every stage once M >= P, 1F1B's stage-0 peak.
  auto model = make_model();
  PipelineOptions options;
  options.schedule = ScheduleKind::kZeroBubbleH1;
  options.micro_batches = 6;
  Pipeline pipe(split_sequential(model, even_cut(4)), {}, options, 4);
  Batch b = make_batch(0);
  pipe.forward_backward(b.x, b.y, mean_loss);
  EXPECT_EQ(pipe.peak_micro_batches_held(), simulate_schedule(pipe.schedule()).peak_in_flight);
  EXPECT_EQ(pipe.peak_micro_batches_held(), (std::vector<int>{4, 4, 4, 4}));
}

// y = x * w through a custom function that records which gradients autograd asked it for.
std::vector<std::pair<bool, bool>> probe_requests;  // (input, weight) per backward call

struct Probe : torch::autograd::Function<Probe> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               torch::Tensor w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    probe_requests.emplace_back(ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    auto saved = ctx->get_saved_variables();
    return {grads[0] * saved[1], (grads[0] * saved[0]).sum(0)};
  }
};

TEST(SplitBackward, BComputesOnlyInputGradientsWOnlyWeightGradientsTogetherOneBackward) {
  torch::manual_seed(2);
  torch::nn::Linear linear(5, 3);
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({3}));
  auto w = torch::randn({3}, torch::requires_grad());
  auto x = torch::randn({4, 5});
  auto forward = [&](const torch::Tensor& input) {
    return Probe::apply(norm->forward(torch::tanh(linear->forward(input))), w);
  };
  auto g = torch::randn({4, 3});
  std::vector<torch::Tensor> params = {linear->weight, linear->bias, norm->weight, norm->bias, w};

  // Reference: one whole backward.
  auto input = x.clone().requires_grad_(true);
  probe_requests.clear();
  torch::autograd::backward({forward(input)}, {g});
  std::vector<torch::Tensor> want;
  for (auto& p : params) want.push_back(p.grad().clone()), p.mutable_grad() = torch::Tensor();
  want.push_back(input.grad().clone());
  ASSERT_EQ(probe_requests, (std::vector<std::pair<bool, bool>>{{true, true}}));

  // B, then W: B asks for the input's gradient only and accumulates into no parameter; W the
  // reverse.
  input = x.clone().requires_grad_(true);
  detail::WeightGradStore store;
  probe_requests.clear();
  auto grad_input = detail::backward_input(forward(input), g, input, store);
  EXPECT_EQ(probe_requests, (std::vector<std::pair<bool, bool>>{{true, false}}));
  for (auto& p : params) EXPECT_FALSE(p.grad().defined());
  EXPECT_FALSE(store.empty());
  probe_requests.clear();
  detail::backward_weight(store);
  EXPECT_EQ(probe_requests, (std::vector<std::pair<bool, bool>>{{false, true}}));
  EXPECT_TRUE(store.empty());
  std::vector<torch::Tensor> got;
  for (auto& p : params) got.push_back(p.grad());
  got.push_back(grad_input);
  EXPECT_LT(relative_error(got, want), kSplitTolerance);

  // An input that needs no gradient (the first chunk): B does nothing, W the whole backward.
  for (auto& p : params) p.mutable_grad() = torch::Tensor();
  EXPECT_FALSE(detail::backward_input(forward(x), g, torch::Tensor(), store).defined());
  for (auto& p : params) EXPECT_FALSE(p.grad().defined());
  detail::backward_weight(store);
  got.clear();
  for (auto& p : params) got.push_back(p.grad());
  want.pop_back();
  EXPECT_LT(relative_error(got, want), kSplitTolerance);
}

TEST(Pipeline, TheTestCanFail) {
  // One optimizer step fewer is far outside the tolerance: the comparison above can see a wrong
  // step.
  EXPECT_GT(relative_error(train_single(kSteps - 1), train_single()), 100 * kTolerance);
}

TEST(Pipeline, ForwardEqualsTheModel) {
  auto model = make_model();
  PipelineOptions options;
  options.micro_batches = 3;
  Pipeline pipe(split_sequential(model, even_cut(3)), {}, options);
  Batch b = make_batch(0);
  torch::NoGradGuard no_grad;
  EXPECT_LT(relative_error({pipe.forward(b.x)}, {model->forward(b.x)}), kTolerance);
}

TEST(Pipeline, StagesOnCudaAndCpuEqualSingleDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // Activations and gradients cross from the CPU to the GPU and back; a GPU has float32 matmuls
  // within the same tolerance here (TF32 is off by default in LibTorch for matmul).
  const auto want = train_single();
  auto model = make_model();
  PipelineOptions options;
  options.micro_batches = 3;
  std::vector<c10::Device> devices = {c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 0),
                                      c10::Device(c10::kCUDA, 0)};
  Pipeline pipe(split_sequential(model, even_cut(3)), devices, options);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    Batch b = make_batch(step);
    opt.zero_grad();
    pipe.forward_backward(b.x, b.y, mean_loss);
    opt.step();
  }
  std::vector<torch::Tensor> got;
  for (auto& p : model->parameters()) got.push_back(p.detach().cpu());
  EXPECT_LT(relative_error(got, want), kTolerance);
}

TEST(Pipeline, BadInputIsAUsageErrorNamingTheStage) {
  auto model = make_model();
  PipelineOptions options;
  options.micro_batches = 20;
  Pipeline too_many(split_sequential(model, even_cut(2)), {}, options);
  Batch b = make_batch(0);
  EXPECT_THROW(too_many.forward_backward(b.x, b.y, mean_loss), UsageError);

  options.micro_batches = 2;
  EXPECT_THROW(Pipeline(split_sequential(model, even_cut(3)), {}, options, 2),
               UsageError);  // 3 chunks, 2 stages
  options.zero_stage = 3;    // one process has no replicas to shard over
  EXPECT_THROW(Pipeline(split_sequential(model, even_cut(2)), {}, options), UsageError);
  options.zero_stage = 0;

  // A chunk that cannot take its predecessor's output: the error names the stage, the others stop.
  torch::nn::Sequential a(torch::nn::Linear(kInputs, 6)), b2(torch::nn::Linear(7, kClasses));
  Pipeline mismatched({a, b2}, {}, options);
  try {
    mismatched.forward_backward(b.x, b.y, mean_loss);
    FAIL() << "a shape mismatch between stages went unnoticed";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline stage 1"), std::string::npos) << e.what();
  }
}

// ---- Distributed: one stage per thread-rank ----

struct DistributedRun {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int stages = 2;
  int data = 1;
  int micro_batches = 4;
  int virtual_stages = 1;
  bool shared_memory = true;
  int zero_stage = 0;  // with data > 1: ZeRO over each stage's replicas instead of DDP
};

// Each data replica takes its own contiguous half of every batch, so the replicas' mean losses
// average to the whole batch's mean (kBatchDp divides evenly).
constexpr int64_t kBatchDp = 12;

std::vector<torch::Tensor> train_single_on(int64_t rows) {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    Batch b = make_batch(step, rows);
    opt.zero_grad();
    mean_loss(model->forward(b.x), b.y).backward();
    opt.step();
  }
  return snapshot(model->parameters());
}

// Returns every rank's final parameters in the order of the whole model's parameters (each rank
// fills in its own stage's), gathered per data replica.
std::vector<std::vector<torch::Tensor>> train_distributed(const DistributedRun& run) {
  const int world = run.stages * run.data;
  const int64_t rows = run.data > 1 ? kBatchDp : kBatch;
  std::vector<std::vector<torch::Tensor>> per_replica(
      run.data, std::vector<torch::Tensor>(make_model()->parameters().size()));
  std::mutex mutex;
  run_group(
      world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto mesh = make_rank_mesh(group, run.stages);
        auto model = make_model();
        if (mesh.data_index > 0) {
          // Replicas other than the first start from other parameters, which the set-up's
          // broadcast of replica 0's (DDP's, or ZeRO's) must replace.
          torch::NoGradGuard no_grad;
          for (auto& p : model->parameters()) p.add_(0.5 * mesh.data_index);
        }
        // Which of the model's parameters this stage holds (by identity, before the split hands
        // them out).
        auto all_params = model->parameters();
        PipelineOptions options;
        options.schedule = run.kind;
        options.micro_batches = run.micro_batches;
        options.virtual_stages = run.virtual_stages;
        options.zero_stage = run.zero_stage;
        auto chunks = split_sequential(model, even_cut(run.stages * run.virtual_stages));
        DistributedPipeline pipe(chunks, mesh, options);
        torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        for (int step = 0; step < kSteps; ++step) {
          Batch b = make_batch(step, rows);
          int64_t share = rows / run.data;
          auto x = b.x.narrow(0, mesh.data_index * share, share),
               y = b.y.narrow(0, mesh.data_index * share, share);
          opt.zero_grad();
          auto loss = pipe.forward_backward(x, y, mean_loss);
          EXPECT_TRUE(std::isfinite(loss.item<double>()));
          opt.step();
        }
        // The chunks' own parameters (with ZeRO, gathered from the shards the optimizer stepped).
        // A ZeRO run that trained through DDP instead would train the same numbers: the list of
        // sharded chunks tells them apart.
        EXPECT_EQ(pipe.sharded_chunks().empty(), run.zero_stage == 0);
        for (const auto& sharded : pipe.sharded_chunks()) sharded->gather_full_parameters();
        std::vector<torch::Tensor> mine;
        for (size_t c = mesh.pipeline_index; c < chunks.size(); c += run.stages) {
          for (const auto& p : chunks[c]->parameters()) mine.push_back(p);
        }
        std::lock_guard<std::mutex> lock(mutex);
        for (size_t i = 0; i < all_params.size(); ++i) {
          for (auto& p : mine) {
            if (p.is_same(all_params[i])) per_replica[mesh.data_index][i] = p.detach().clone();
          }
        }
      },
      std::chrono::seconds(60), run.shared_memory);
  return per_replica;
}

TEST(DistributedPipeline, EqualsSingleProcessForEveryScheduleStagesAndMicroBatches) {
  const auto want = train_single();
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p = 2; p <= 4; ++p) {
      for (int m : {1, 2, 3, 5, 8}) {
        SCOPED_TRACE(std::string(to_string(kind)) + " P=" + std::to_string(p) +
                     " M=" + std::to_string(m));
        DistributedRun run;
        run.kind = kind;
        run.stages = p;
        run.micro_batches = m;
        EXPECT_LT(relative_error(train_distributed(run)[0], want), kTolerance);
      }
    }
  }
}

TEST(DistributedPipeline, ZeroBubbleEqualsOneF1BAndSingleProcess) {
  const auto want = train_single();
  for (int p : {2, 3, 4}) {
    for (int m : {1, 4, 7}) {
      SCOPED_TRACE("zbh1 P=" + std::to_string(p) + " M=" + std::to_string(m));
      DistributedRun run;
      run.stages = p;
      run.micro_batches = m;
      auto one_f_one_b = train_distributed(run)[0];
      run.kind = ScheduleKind::kZeroBubbleH1;
      auto zb = train_distributed(run)[0];
      EXPECT_LT(relative_error(zb, one_f_one_b), kSplitTolerance);
      EXPECT_LT(relative_error(zb, want), kTolerance);
    }
  }
}

TEST(DistributedPipeline, InterleavedEqualsSingleProcess) {
  const auto want = train_single();
  for (int p : {2, 3}) {
    for (int m : {2, 4, 7}) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      DistributedRun run;
      run.kind = ScheduleKind::kInterleaved1F1B;
      run.stages = p;
      run.micro_batches = m;
      run.virtual_stages = 2;
      EXPECT_LT(relative_error(train_distributed(run)[0], want), kTolerance);
    }
  }
}

TEST(DistributedPipeline, OverGlooWithoutSharedMemory) {
  DistributedRun run;
  run.stages = 3;
  run.micro_batches = 5;
  run.shared_memory = false;
  EXPECT_LT(relative_error(train_distributed(run)[0], train_single()), kTolerance);
}

TEST(DistributedPipeline, TwoDataReplicasTimesTwoStagesEqualSingleProcess) {
  const auto want = train_single_on(kBatchDp);
  // ZB-H1: the gradients become ready in W, where the reducer must learn of them.
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1}) {
    SCOPED_TRACE(to_string(kind));
    DistributedRun run;
    run.kind = kind;
    run.stages = 2;
    run.data = 2;
    run.micro_batches = 3;
    auto replicas = train_distributed(run);
    EXPECT_LT(relative_error(replicas[0], want), kTolerance);
    EXPECT_LT(relative_error(replicas[1], want), kTolerance);
  }
}

// ZeRO over each stage's replicas (Note [ZeRO in a pipeline]): the micro-batches' gradients
// accumulate and the chunk's last backward reduces them (its last W under ZB-H1), stage 3's
// parameters gathered for the step; SGD with momentum steps the shards. Interleaved: two sharded
// chunks per rank.
TEST(DistributedPipeline, ZeroOverTheDataReplicasEqualsSingleProcess) {
  const auto want = train_single_on(kBatchDp);
  for (int zero : {1, 2, 3}) {
    for (auto kind :
         {ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1, ScheduleKind::kInterleaved1F1B}) {
      SCOPED_TRACE("zero " + std::to_string(zero) + ", " + to_string(kind));
      DistributedRun run;
      run.kind = kind;
      run.stages = 2;
      run.data = 2;
      run.micro_batches = 3;
      run.virtual_stages = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
      run.zero_stage = zero;
      auto replicas = train_distributed(run);
      EXPECT_LT(relative_error(replicas[0], want), kTolerance);
      EXPECT_LT(relative_error(replicas[1], want), kTolerance);
    }
  }
}

// What makes ZeRO in a pipeline cheap, counted by the bytes each wrapper's collectives carried
// (comm_stats): one reduce-scatter of a chunk's units per step whatever the micro-batches, one
// all-gather per step at stage 3, and none for a forward_backward under no_sync (gradient
// accumulation: the next one reduces both). Reducing every micro-batch trains the same numbers
// (the average is linear), which only this count tells apart.
TEST(DistributedPipeline, ZeroReducesAndGathersOncePerStep) {
  constexpr int kAccumulatedSteps = 2;  // each: a pass under no_sync, then one that reduces
  for (int zero : {2, 3}) {
    for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1}) {
      SCOPED_TRACE("zero " + std::to_string(zero) + ", " + to_string(kind));
      run_group(4, [&](int, const std::shared_ptr<ProcessGroup>& group) {
        auto mesh = make_rank_mesh(group, 2);
        PipelineOptions options;
        options.schedule = kind;
        options.micro_batches = 3;
        options.zero_stage = zero;
        DistributedPipeline pipe(split_sequential(make_model(), even_cut(2)), mesh, options);
        torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.1));
        const int64_t share = kBatchDp / 2;
        auto pass = [&](int step) {
          Batch b = make_batch(step, kBatchDp);
          pipe.forward_backward(b.x.narrow(0, mesh.data_index * share, share),
                                b.y.narrow(0, mesh.data_index * share, share), mean_loss);
        };
        for (int step = 0; step < kAccumulatedSteps; ++step) {
          opt.zero_grad();
          {
            auto accumulating = pipe.no_sync();
            pass(step);
          }
          pass(step);
          opt.step();
        }
        // One chunk per rank (no virtual stages), sharded: a pipeline that fell back to DDP would
        // leave the list empty and the loop below checking nothing.
        ASSERT_EQ(pipe.sharded_chunks().size(), 1u);
        for (const auto& sharded : pipe.sharded_chunks()) {
          int64_t padded_bytes = 0;
          for (const auto& unit : sharded->flat_shards())
            padded_bytes += unit.shard.numel() * sharded->group()->size() * 4;
          const ShardedCommStats stats = sharded->comm_stats();
          EXPECT_EQ(stats.reduce_scatter_bytes, kAccumulatedSteps * padded_bytes);
          // Stage 3 gathers at each forward_backward, accumulating or not.
          if (zero == 3) EXPECT_EQ(stats.all_gather_bytes, 2 * kAccumulatedSteps * padded_bytes);
        }
      });
    }
  }
}

// Runs `body` on `world` thread-ranks and expects every rank to throw a UsageError containing
// `expected`.
void expect_error_on_every_rank(
    int world, const std::string& expected,
    const std::function<void(int rank, const std::shared_ptr<ProcessGroup>& group)>& body) {
  std::atomic<int> raised{0};
  run_group(
      world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        try {
          body(rank, group);
          ADD_FAILURE() << "rank " << rank << " did not throw";
        } catch (const UsageError& e) {
          EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
              << "rank " << rank << ": " << e.what();
          ++raised;
        }
      },
      std::chrono::seconds(20));
  EXPECT_EQ(raised.load(), world);
}

TEST(DistributedPipeline, PreflightShapeMismatchFailsOnEveryRank) {
  expect_error_on_every_rank(3,
                             "stage 2 (rank 2): chunk 2 cannot take chunk 1's output [4, 6] Float",
                             [](int rank, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 3);
                               std::vector<torch::nn::Sequential> chunks = {
                                   torch::nn::Sequential(torch::nn::Linear(kInputs, 8)),
                                   torch::nn::Sequential(torch::nn::Linear(8, 6)),
                                   torch::nn::Sequential(torch::nn::Linear(5, kClasses))};
                               PipelineOptions options;
                               options.micro_batches = 2;
                               DistributedPipeline pipe(chunks, mesh, options);
                               Batch b = make_batch(0, 8);
                               pipe.forward_backward(b.x, b.y, mean_loss);
                             });
}

TEST(DistributedPipeline, PreflightDtypeMismatchFailsOnEveryRank) {
  expect_error_on_every_rank(2, "chunk 1 cannot take chunk 0's output [3, 8] Float",
                             [](int, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 2);
                               torch::nn::Sequential second(torch::nn::Linear(8, kClasses));
                               second->to(torch::kDouble);
                               std::vector<torch::nn::Sequential> chunks = {
                                   torch::nn::Sequential(torch::nn::Linear(kInputs, 8)), second};
                               PipelineOptions options;
                               options.micro_batches = 3;
                               DistributedPipeline pipe(chunks, mesh, options);
                               Batch b = make_batch(0, 9);
                               pipe.forward_backward(b.x, b.y, mean_loss);
                             });
}

TEST(DistributedPipeline, PreflightCatchesLossThatRejectsTheOutput) {
  expect_error_on_every_rank(2, "the loss function rejects the last chunk's output",
                             [](int, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 2);
                               auto model = make_model();
                               PipelineOptions options;
                               options.micro_batches = 2;
                               DistributedPipeline pipe(split_sequential(model, even_cut(2)), mesh,
                                                        options);
                               Batch b = make_batch(0, 6);
                               pipe.forward_backward(b.x, torch::randn({6, 3, 2}), mean_loss);
                             });
}

TEST(DistributedPipeline, MoreMicroBatchesThanRowsFailsOnEveryRank) {
  expect_error_on_every_rank(2, "a batch of 3 rows cannot be cut into 4 micro-batches",
                             [](int, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 2);
                               auto model = make_model();
                               PipelineOptions options;
                               options.micro_batches = 4;
                               DistributedPipeline pipe(split_sequential(model, even_cut(2)), mesh,
                                                        options);
                               Batch b = make_batch(0, 3);
                               pipe.forward_backward(b.x, b.y, mean_loss);
                             });
}

TEST(DistributedPipeline, TargetRowsMustMatchTheBatch) {
  expect_error_on_every_rank(2, "the last stage's target has 5 rows but stage 0's batch has 6",
                             [](int, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 2);
                               auto model = make_model();
                               PipelineOptions options;
                               options.micro_batches = 2;
                               DistributedPipeline pipe(split_sequential(model, even_cut(2)), mesh,
                                                        options);
                               Batch b = make_batch(0, 6);
                               pipe.forward_backward(b.x, b.y.narrow(0, 0, 5), mean_loss);
                             });
}

TEST(DistributedPipeline, OptionsThatDifferBetweenRanksFailOnEveryRank) {
  expect_error_on_every_rank(
      2, "stage 1 (rank 1) runs with micro_batches=3 but stage 0 (rank 0) with 2",
      [](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto mesh = make_rank_mesh(group, 2);
        auto model = make_model();
        PipelineOptions options;
        options.micro_batches = 2 + rank;
        DistributedPipeline pipe(split_sequential(model, even_cut(2)), mesh, options);
      });
}

TEST(DistributedPipeline, WrongChunkCountOrDeviceFailsOnEveryRank) {
  expect_error_on_every_rank(2, "stage 0 (rank 0): was given 3 chunks",
                             [](int, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 2);
                               auto model = make_model();
                               DistributedPipeline pipe(split_sequential(model, even_cut(3)), mesh,
                                                        PipelineOptions{});
                             });
  expect_error_on_every_rank(
      2, "is on cpu, expected cuda:0", [](int, const std::shared_ptr<ProcessGroup>& group) {
        auto mesh = make_rank_mesh(group, 2);
        auto model = make_model();
        DistributedPipeline pipe(split_sequential(model, even_cut(2)), mesh, PipelineOptions{},
                                 c10::Device(c10::kCUDA, 0));
      });
  expect_error_on_every_rank(2,
                             "zero_stage=4: expected 0 (DDP over the data replicas) or a ZeRO "
                             "stage 1-3",
                             [](int, const std::shared_ptr<ProcessGroup>& group) {
                               auto mesh = make_rank_mesh(group, 2);
                               PipelineOptions options;
                               options.zero_stage = 4;
                               DistributedPipeline pipe(split_sequential(make_model(), even_cut(2)),
                                                        mesh, options);
                             });
}

}  // namespace
}  // namespace dtrain
