// ColumnParallelLinear -> ReLU -> RowParallelLinear on 1..4 thread-ranks against the unsplit
// Linear -> ReLU -> Linear built under the same seed and trained on the same data: forward outputs,
// input gradients and (after k SGD-with-momentum steps) parameters must agree within a relative
// error of 1e-5 in float32. 10 hidden features split unevenly over 3 and 4 ranks. Several column
// layers on one input (column_parallel_forward) enter the tensor-parallel region once.
#include "dtrain/tensor_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "support/equivalence.h"
#include "support/thread_ranks.h"
#include "tensor_parallel/mlp.h"

namespace dtrain {
namespace {

using testing::detached;
using testing::expected_shards;
using testing::kHidden;
using testing::kInputs;
using testing::kOutputs;
using testing::make_parallel_mlp;
using testing::make_reference_mlp;
using testing::relative_error;
using testing::run_group;
using testing::Wiring;

constexpr int64_t kBatch = 7;
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;

struct Batch {
  torch::Tensor x, y;
};

std::vector<Batch> make_batches() {
  torch::manual_seed(100);
  std::vector<Batch> batches;
  for (int step = 0; step < kSteps; ++step) {
    batches.push_back({torch::randn({kBatch, kInputs}), torch::randn({kBatch, kOutputs})});
  }
  return batches;
}

// What one training run records: every step's output and input gradient, and the final parameters.
struct Trace {
  std::vector<torch::Tensor> outputs, input_grads, params;
};

using Forward = std::function<torch::Tensor(const torch::Tensor& x)>;

// k steps of SGD with momentum on the mean squared error; x requires grad so its gradient is
// recorded.
Trace train(torch::nn::Sequential& net, const std::vector<Batch>& batches, const Forward& forward) {
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Trace trace;
  for (const Batch& batch : batches) {
    torch::Tensor x = batch.x.clone().requires_grad_(true);
    optimizer.zero_grad();
    torch::Tensor out = forward(x);
    torch::mse_loss(out, batch.y).backward();
    optimizer.step();
    trace.outputs.push_back(out.detach().clone());
    trace.input_grads.push_back(x.grad().clone());
  }
  trace.params = detached(net->parameters());
  return trace;
}

Trace train(torch::nn::Sequential& net, const std::vector<Batch>& batches) {
  return train(net, batches, [&](const torch::Tensor& x) { return net->forward(x); });
}

struct RankResult {
  Trace trace;
  std::vector<torch::Tensor>
      want_params;  // the reference's final parameters, cut as this rank holds them
};

void expect_equivalent(int world, Wiring wiring, bool shared_memory = true) {
  torch::set_num_threads(1);
  auto batches = make_batches();
  auto reference = make_reference_mlp();
  Trace want = train(reference, batches);

  std::vector<RankResult> results(world);
  run_group(
      world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto net = make_parallel_mlp(group, wiring);
        results[rank].trace = train(net, batches);
        results[rank].want_params = expected_shards(reference, net);
      },
      std::chrono::seconds(60), shared_memory);

  for (int rank = 0; rank < world; ++rank) {
    SCOPED_TRACE("world " + std::to_string(world) + " rank " + std::to_string(rank));
    const Trace& got = results[rank].trace;
    EXPECT_LT(relative_error(got.outputs, want.outputs), kTolerance) << "forward outputs";
    EXPECT_LT(relative_error(got.input_grads, want.input_grads), kTolerance) << "input gradients";
    EXPECT_LT(relative_error(got.params, results[rank].want_params), kTolerance) << "parameters";
  }
}

class TensorParallelEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelEquivalence, ColumnReluRowMatchesTheUnsplitMlp) {
  expect_equivalent(GetParam(), Wiring::kSplitHidden);
}

TEST_P(TensorParallelEquivalence, GatheredOutputAndFullInputMatchTheUnsplitMlp) {
  expect_equivalent(GetParam(), Wiring::kGatheredHidden);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TensorParallelEquivalence, ::testing::Values(1, 2, 3, 4));

TEST(TensorParallel, MatchesTheUnsplitMlpThroughGloo) {
  // The all-reduces above go through shared memory; these through Gloo, which reads raw memory.
  expect_equivalent(3, Wiring::kSplitHidden, /*shared_memory=*/false);
  expect_equivalent(3, Wiring::kGatheredHidden, /*shared_memory=*/false);
}

TEST(TensorParallel, TheTestCanFail) {
  // The column-parallel layer's weights used without its backward all-reduce: each rank's input
  // gradient is then only its own shard's share, which the tolerance must see.
  torch::set_num_threads(1);
  auto batches = make_batches();
  auto reference = make_reference_mlp();
  Trace want = train(reference, batches);
  std::vector<Trace> got(2);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = make_parallel_mlp(group);
    auto column = net->ptr<ColumnParallelLinearImpl>(0);
    got[rank] = train(net, batches, [&](const torch::Tensor& x) {
      torch::Tensor hidden =
          torch::relu(torch::nn::functional::linear(x, column->weight, column->bias));
      return net[2]->as<RowParallelLinear>()->forward(hidden);
    });
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_LT(relative_error(got[rank].outputs, want.outputs), kTolerance)
        << "the forward is unaffected";
    EXPECT_GT(relative_error(got[rank].input_grads, want.input_grads), 100 * kTolerance)
        << "rank " << rank;
  }
}

TEST(TensorParallel, ShardingAnExistingLinearKeepsItsWeights) {
  // Layers split from existing Linears hold what the seeded constructors draw, bit for bit; the
  // bias follows the Linear, and the split layers clone and print like any module.
  torch::set_num_threads(1);
  auto reference = make_reference_mlp();
  torch::nn::Linear no_bias(torch::nn::LinearOptions(kInputs, kHidden).bias(false));
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto seeded = make_parallel_mlp(group);
    torch::nn::Linear first(reference->ptr<torch::nn::LinearImpl>(0));
    torch::nn::Linear second(reference->ptr<torch::nn::LinearImpl>(2));
    ColumnParallelLinear column = column_parallel_from(first, group);
    RowParallelLinear row = row_parallel_from(second, group);
    torch::nn::Sequential split(column, torch::nn::ReLU(), row);
    auto want = seeded->parameters();
    auto have = split->parameters();
    ASSERT_EQ(have.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(torch::equal(have[i], want[i])) << "parameter " << i;
    EXPECT_EQ(column->local_size(), rank == 0 ? 4 : 3);
    EXPECT_EQ(row->local_begin(), rank == 0 ? 0 : 4 + 3 * (rank - 1));

    ColumnParallelLinearOptions options;  // options.bias = true is overridden by the Linear's
    auto unbiased = column_parallel_from(no_bias, group, options);
    EXPECT_FALSE(unbiased->bias.defined());
    EXPECT_EQ(unbiased->parameters().size(), 1u);

    // clone() calls reset(), which draws from the global generator: under the seed lock, or it
    // would move the draws of another rank's seeded construction running at the same time.
    std::shared_ptr<torch::nn::SequentialImpl> copy;
    {
      std::lock_guard<std::mutex> lock(testing::seed_mutex());
      copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(split->clone());
    }
    ASSERT_TRUE(copy);
    auto copied = copy->parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::equal(copied[i], want[i]));
      EXPECT_NE(copied[i].data_ptr(), want[i].data_ptr()) << "a clone owns its parameters";
    }
    std::ostringstream printed;
    printed << *column;
    EXPECT_NE(printed.str().find("ColumnParallelLinear(in_features=12, out_features=10"),
              std::string::npos)
        << printed.str();
  });
}

// The UsageError's message, or "" if none was thrown.
std::string usage_error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

void expect_contains(const std::string& text, const std::vector<std::string>& parts) {
  ASSERT_FALSE(text.empty()) << "expected a UsageError";
  for (const auto& part : parts)
    EXPECT_NE(text.find(part), std::string::npos) << part << " in: " << text;
}

TEST(TensorParallel, BadArgumentsAreUsageErrorsNamingRankLayerAndSizes) {
  expect_contains(
      usage_error_of([] { ColumnParallelLinear(12, 10, nullptr); }),
      {"ColumnParallelLinear(in_features=12, out_features=10)", "null", "tensor_group"});
  expect_contains(usage_error_of([] { RowParallelLinear(12, 10, nullptr); }),
                  {"RowParallelLinear", "null"});
  expect_contains(usage_error_of([] { column_parallel_from(torch::nn::Linear(nullptr), nullptr); }),
                  {"column_parallel_from", "empty"});

  torch::set_num_threads(1);
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    std::string me = "rank " + std::to_string(rank) + "/3";
    // Fewer features than ranks along the split dimension: some rank would hold nothing.
    expect_contains(usage_error_of([&] { ColumnParallelLinear(12, 2, group); }),
                    {me, "out_features=2 cannot be split over the 3 ranks"});
    expect_contains(usage_error_of([&] { RowParallelLinear(2, 12, group); }),
                    {me, "in_features=2 cannot be split over the 3 ranks"});
    expect_contains(usage_error_of([&] { ColumnParallelLinear(0, 12, group); }),
                    {me, "at least 1"});

    // A wrong input width fails before any collective, on every rank alike: none is left waiting.
    // (The layers' initial values do not matter here: they are drawn without the seed lock.)
    ColumnParallelLinear column(12, 10, group);
    std::string error = usage_error_of([&] { column->forward(torch::randn({4, 11})); });
    expect_contains(error, {me, "ColumnParallelLinear(in_features=12, out_features=10) forward",
                            "tensor rank " + std::to_string(rank) + "/3", "last dimension 11",
                            "expected last dimension 12 (in_features)"});
    expect_contains(usage_error_of([&] { column->forward(torch::tensor(1.0f)); }),
                    {me, "0-dimensional"});
    RowParallelLinear row(10, 5, group);
    int64_t slice = rank == 0 ? 4 : 3;  // 10 features over 3 ranks
    error = usage_error_of([&] { row->forward(torch::randn({4, 10})); });
    expect_contains(error, {me, "RowParallelLinear(in_features=10, out_features=5) forward",
                            "expected last dimension " + std::to_string(slice),
                            "input_is_parallel=true", "input_is_parallel=false"});
    RowParallelLinearOptions full_input;
    full_input.input_is_parallel = false;
    RowParallelLinear row_full(10, 5, group, full_input);
    error = usage_error_of([&] { row_full->forward(torch::randn({4, slice})); });
    expect_contains(error, {me, "expected last dimension 10"});

    // The group still works: the layers' checks left no collective half-issued.
    torch::Tensor y = row(torch::relu(column(torch::ones({2, 12}))));
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 5}));
  });
}

// column_parallel_forward: k layers on one input enter the tensor-parallel region once. Against
// the same layers' own forwards on the same x: equal outputs, the same gradients (x's within 1e-6:
// only the order of the additions differs), and backward's collectives fall from k to 1 (from 2k
// to 2 under sequence parallelism: a reduce-scatter of x's gradient and an all-gather of x). Three
// ranks, uneven shards (10 and 7 features), a bias, and a gathered output.
void expect_one_entry_for_several_layers(bool sequence_parallel) {
  torch::set_num_threads(1);
  constexpr int kWorld = 3;
  torch::manual_seed(21);
  const torch::Tensor input = torch::randn({2, 6, 12});  // [batch, seq, features]
  run_group(kWorld, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    std::vector<ColumnParallelLinear> layers;
    {
      std::lock_guard<std::mutex> lock(testing::seed_mutex());
      torch::manual_seed(22);
      for (int64_t out : {10, 6, 7}) {
        ColumnParallelLinearOptions options;
        options.sequence_parallel = sequence_parallel;
        options.gather_output = out == 7 && !sequence_parallel;
        layers.push_back(ColumnParallelLinear(12, out, group, options));
      }
    }
    const torch::Tensor mine = sequence_parallel ? input.narrow(1, 2 * rank, 2) : input;
    struct Pass {
      std::vector<torch::Tensor> outputs, grads;  // grads: x's, then every parameter's
      uint64_t backward_ops = 0;
    };
    auto pass = [&](bool shared) {
      for (auto& layer : layers) layer->zero_grad();
      torch::Tensor x = mine.clone().requires_grad_(true);
      std::vector<torch::Tensor> outputs;
      if (shared) {
        outputs = column_parallel_forward(x, layers);
      } else {
        for (auto& layer : layers) outputs.push_back(layer->forward(x));
      }
      torch::Tensor loss = torch::zeros({});
      for (size_t i = 0; i < outputs.size(); ++i)
        loss = loss + outputs[i].pow(2).sum() * static_cast<double>(i + 1);
      const uint64_t before = group->stats().ops;
      loss.backward();
      Pass result;
      result.backward_ops = group->stats().ops - before;
      result.outputs = detached(outputs);
      result.grads.push_back(x.grad().clone());
      for (auto& layer : layers)
        for (const auto& p : layer->parameters()) result.grads.push_back(p.grad().clone());
      return result;
    };
    const Pass separate = pass(false);
    const Pass shared = pass(true);
    ASSERT_EQ(shared.outputs.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_TRUE(torch::equal(shared.outputs[i], separate.outputs[i])) << "output " << i;
    EXPECT_EQ(shared.outputs[2].size(-1), sequence_parallel ? layers[2]->local_size() : 7)
        << "gather_output holds";
    EXPECT_LT(relative_error(shared.grads, separate.grads), 1e-6);
    EXPECT_EQ(separate.backward_ops, sequence_parallel ? 6u : 3u) << "each layer its own";
    EXPECT_EQ(shared.backward_ops, sequence_parallel ? 2u : 1u) << "one for the three";
  });
}

TEST(TensorParallel, SeveralColumnLayersOnOneInputAllReduceItsGradientOnce) {
  expect_one_entry_for_several_layers(/*sequence_parallel=*/false);
}

TEST(TensorParallel, SeveralSequenceParallelColumnLayersOnOneInputGatherItOnce) {
  expect_one_entry_for_several_layers(/*sequence_parallel=*/true);
}

TEST(TensorParallel, ColumnLayersThatCannotShareAnInputAreNamed) {
  expect_contains(usage_error_of([] {
                    column_parallel_forward(torch::ones({2, 4}), {});
                  }),
                  {"column_parallel_forward", "no layers"});
  expect_contains(usage_error_of([] {
                    column_parallel_forward(torch::ones({2, 4}), {ColumnParallelLinear(nullptr)});
                  }),
                  {"column_parallel_forward", "layer 0", "empty"});
  torch::set_num_threads(1);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    const std::string me = "rank " + std::to_string(rank) + "/2";
    ColumnParallelLinear a(12, 10, group), b(12, 6, group), narrow(8, 6, group);
    ColumnParallelLinearOptions sequence;
    sequence.sequence_parallel = true;
    ColumnParallelLinear c(12, 6, group, sequence);
    const torch::Tensor x = torch::ones({2, 4, 12});
    expect_contains(usage_error_of([&] {
                      column_parallel_forward(x, {a, b, narrow});
                    }),
                    {me, "layer 2", "ColumnParallelLinear(in_features=8, out_features=6)",
                     "does not match layer 0", "in_features"});
    expect_contains(usage_error_of([&] {
                      column_parallel_forward(x, {a, c});
                    }),
                    {me, "layer 1", "with sequence_parallel", "sequence_parallel"});
    expect_contains(usage_error_of([&] {
                      column_parallel_forward(torch::ones({2, 11}), {a, b});
                    }),
                    {me, "last dimension 11", "expected last dimension 12"});
    // Every rank threw before any collective: the group still works.
    EXPECT_EQ(column_parallel_forward(x, {a, b})[1].sizes(), (std::vector<int64_t>{2, 4, 3}));
  });
}

// Two ranks on their own GPUs over NCCL, or, on a machine with one GPU, rank 0 on it and rank 1 on
// the CPU, their collectives through Gloo (DTRAIN_CUDA_BACKEND=gloo). Not both thread ranks on the
// one GPU: LibTorch's autograd runs a device's backward work on one thread per process, so rank
// 0's backward all-reduce would wait forever for rank 1's backward queued behind it (seen on an
// H200: the test timed out).
TEST(TensorParallel, CudaTensorsUseTheirOwnDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus < 2) setenv("DTRAIN_CUDA_BACKEND", "gloo", 1);
  struct Unset {
    ~Unset() { unsetenv("DTRAIN_CUDA_BACKEND"); }
  } unset;
  torch::set_num_threads(1);
  auto batches = make_batches();
  auto reference = make_reference_mlp();
  Trace want = train(reference, batches);
  std::vector<Trace> got(2);
  run_group(
      2,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        torch::Device device =
            gpus >= 2   ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank))
            : rank == 0 ? torch::Device(torch::kCUDA, 0)
                        : torch::Device(torch::kCPU);
        auto net = make_parallel_mlp(group);
        net->to(device);
        std::vector<Batch> on_device;
        for (const auto& b : batches) on_device.push_back({b.x.to(device), b.y.to(device)});
        got[rank] = train(net, on_device);
      },
      std::chrono::seconds(60), /*shared_memory=*/gpus >= 2);  // mixed devices: all through Gloo
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<torch::Tensor> outputs, grads;
    for (auto& t : got[rank].outputs) outputs.push_back(t.cpu());
    for (auto& t : got[rank].input_grads) grads.push_back(t.cpu());
    // CUDA matmuls (TF32 where enabled) round differently from the CPU reference.
    EXPECT_LT(relative_error(outputs, want.outputs), 1e-3) << "rank " << rank;
    EXPECT_LT(relative_error(grads, want.input_grads), 1e-3) << "rank " << rank;
  }
}

}  // namespace
}  // namespace dtrain
