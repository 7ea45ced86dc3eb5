// Sequence parallelism (Note [Sequence parallelism] in dtrain/tensor_parallel.h) on 1..4
// thread-ranks, through shared memory and through Gloo: each of the five autograd functions against
// what it means on the whole sequence (forward values and the gradients backward must deliver),
// and ColumnParallelLinear -> ReLU -> RowParallelLinear with sequence_parallel, each rank on its
// slice of the sequence, against the unsplit MLP after k SGD-with-momentum steps (outputs, input
// gradients, parameters within a relative 1e-5 in float32). A sequence that does not divide by the
// degree is one UsageError naming the length and the degree.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/tensor_parallel.h"
#include "support/equivalence.h"
#include "support/thread_ranks.h"
#include "tensor_parallel/mlp.h"

namespace dtrain {
namespace {

using testing::detached;
using testing::expected_shards;
using testing::kInputs;
using testing::kOutputs;
using testing::make_reference_mlp;
using testing::relative_error;
using testing::run_group;

constexpr double kTolerance = 1e-5;
constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 12;  // divides by 1, 2, 3 and 4

// Rank r's slice of the sequence (dimension -2) of a tensor the same on every rank.
torch::Tensor slice_of(const torch::Tensor& full, int rank, int ranks) {
  const int64_t size = full.size(-2) / ranks;
  return full.narrow(-2, rank * size, size);
}

// Deterministic per-rank values, drawn without the shared generator (thread-ranks share it).
torch::Tensor values(std::vector<int64_t> shape, double offset) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return torch::sin(torch::arange(numel, torch::kDouble) * 0.37 + offset)
      .to(torch::kFloat)
      .reshape(shape);
}

void expect_mappings_match_the_whole_sequence(int world, bool shared_memory) {
  SCOPED_TRACE("world " + std::to_string(world) + (shared_memory ? ", shared memory" : ", Gloo"));
  const std::vector<int64_t> shape{kBatch, kSeq, 5};
  run_group(
      world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        if (world > 1) EXPECT_EQ(group->uses_shared_memory(), shared_memory);
        const torch::Tensor whole = values(shape, 0.0), weights = values(shape, 1.0);

        // scatter: forward this rank's slice; backward all-gathers, so the whole input gets the
        // gradient of sum_r <slice_r, weights_r> = weights.
        torch::Tensor x = whole.clone().requires_grad_(true);
        torch::Tensor y = scatter_to_sequence_parallel(x, group);
        EXPECT_TRUE(torch::equal(y, slice_of(whole, rank, world)));
        (y * slice_of(weights, rank, world)).sum().backward();
        EXPECT_LT(relative_error({x.grad()}, {weights}), kTolerance) << "scatter's backward";

        // gather to replicated work: forward the whole sequence; the same loss on every rank gives
        // each slice its share of the gradient, with no sum over ranks.
        torch::Tensor s = slice_of(whole, rank, world).clone().requires_grad_(true);
        torch::Tensor g = gather_from_sequence_parallel(s, group);
        EXPECT_TRUE(torch::equal(g, whole));
        (g * weights).sum().backward();
        EXPECT_LT(relative_error({s.grad()}, {slice_of(weights, rank, world)}), kTolerance);

        // reduce-scatter: rank r's partials (whole + r); the slice of their sum; backward
        // all-gathers every rank's slice gradient.
        torch::Tensor partial = (whole + rank).requires_grad_(true);
        torch::Tensor reduced = reduce_scatter_to_sequence_parallel(partial, group);
        const double ranks_sum = world * (world - 1) / 2.0;
        EXPECT_LT(relative_error({reduced}, {slice_of(whole * world + ranks_sum, rank, world)}),
                  kTolerance);
        (reduced * slice_of(weights, rank, world)).sum().backward();
        EXPECT_LT(relative_error({partial.grad()}, {weights}), kTolerance) << "reduce-scatter";

        // column linear: y_i = gathered W_i^T for two weights, one all-gather; the loss on rank r
        // weighs the outputs by (r + 1), as column-parallel shards contribute differently, so x's
        // true gradient sums over ranks and each weight's is this rank's own.
        const torch::Tensor w1 = values({4, 5}, 2.0), w2 = values({3, 5}, 3.0);
        torch::Tensor xs = slice_of(whole, rank, world).clone().requires_grad_(true);
        torch::Tensor v1 = w1.clone().requires_grad_(true), v2 = w2.clone().requires_grad_(true);
        std::vector<torch::Tensor> outs = sequence_parallel_column_linear(xs, {v1, v2}, group);
        EXPECT_LT(relative_error({outs[0], outs[1]},
                                 {torch::matmul(whole, w1.t()), torch::matmul(whole, w2.t())}),
                  kTolerance);
        const torch::Tensor g1 = values({kBatch, kSeq, 4}, 4.0),
                            g2 = values({kBatch, kSeq, 3}, 5.0);
        ((outs[0] * g1).sum() * (rank + 1) + (outs[1] * g2).sum() * (rank + 1)).backward();
        const double all = world * (world + 1) / 2.0;  // sum over ranks of (r + 1)
        torch::Tensor want_x = (torch::matmul(g1, w1) + torch::matmul(g2, w2)) * all;
        EXPECT_LT(relative_error({xs.grad()}, {slice_of(want_x, rank, world)}), kTolerance)
            << "the input's gradient: the reduce-scatter of every rank's";
        auto flat = [](const torch::Tensor& t) { return t.reshape({-1, t.size(-1)}); };
        EXPECT_LT(
            relative_error({v1.grad(), v2.grad()}, {flat(g1).t().mm(flat(whole)) * (rank + 1),
                                                    flat(g2).t().mm(flat(whole)) * (rank + 1)}),
            kTolerance)
            << "the weights' gradients: the whole sequence, gathered again in backward";

        // a parameter on a slice: its gradient summed over the ranks' slices.
        torch::Tensor p = torch::ones({5}).requires_grad_(true);
        (sequence_parallel_parameter(p, group) * slice_of(weights, rank, world)).sum().backward();
        // (named first: LibTorch 2.11 cannot deduce sum({0, 1}) inside a braced list)
        const torch::Tensor summed = weights.sum(at::IntArrayRef{0, 1});
        EXPECT_LT(relative_error({p.grad()}, {summed}), kTolerance);
      },
      std::chrono::seconds(60), shared_memory);
}

TEST(SequenceParallel, MappingsMatchTheWholeSequence) {
  torch::set_num_threads(1);
  for (int world : {1, 2, 3, 4}) expect_mappings_match_the_whole_sequence(world, true);
}

TEST(SequenceParallel, MappingsMatchTheWholeSequenceThroughGloo) {
  torch::set_num_threads(1);
  expect_mappings_match_the_whole_sequence(3, false);
}

// Reduced precision through shared memory: sent as float32 (the transport's type), returned in
// the caller's type.
TEST(SequenceParallel, Bfloat16TravelsThroughSharedMemory) {
  torch::set_num_threads(1);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    torch::Tensor partial = (values({kBatch, kSeq, 5}, 0.0) + rank).to(torch::kBFloat16);
    const uint64_t before = group->stats().ops;
    torch::Tensor reduced = reduce_scatter_to_sequence_parallel(partial, group);
    EXPECT_EQ(reduced.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(group->stats().ops, before + 1) << "one collective";
    torch::Tensor want = slice_of(values({kBatch, kSeq, 5}, 0.0) * 2 + 1, rank, 2);
    EXPECT_LT(relative_error({reduced.to(torch::kFloat)}, {want}), 1e-2);
  });
}

TEST(SequenceParallel, ASequenceThatDoesNotDivideIsOneErrorNamingTheLengthAndTheDegree) {
  torch::set_num_threads(1);
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    for (auto* op : {&scatter_to_sequence_parallel, &reduce_scatter_to_sequence_parallel}) {
      try {
        (*op)(torch::zeros({2, 10, 4}), group);
        ADD_FAILURE() << "expected a UsageError";
      } catch (const UsageError& e) {
        const std::string text = e.what();
        EXPECT_NE(text.find("rank " + std::to_string(rank) + "/3"), std::string::npos) << text;
        EXPECT_NE(text.find("the sequence length 10 does not divide by the tensor-parallel "
                            "degree 3"),
                  std::string::npos)
            << text;
      }
    }
    // Nothing was half-issued: the group still works.
    EXPECT_EQ(scatter_to_sequence_parallel(torch::zeros({2, 9, 4}), group).size(1), 3);
  });
}

// The MLP of tensor_parallel_test.cpp, sequence-parallel: input and output are this rank's slice
// of [batch, seq, features]; the row-parallel bias is added to the slice.
torch::nn::Sequential make_sequence_parallel_mlp(const std::shared_ptr<ProcessGroup>& group) {
  ColumnParallelLinearOptions column;
  column.sequence_parallel = true;
  RowParallelLinearOptions row;
  row.sequence_parallel = true;
  std::lock_guard<std::mutex> lock(testing::seed_mutex());
  torch::manual_seed(testing::kSeed);
  return torch::nn::Sequential(ColumnParallelLinear(kInputs, testing::kHidden, group, column),
                               torch::nn::ReLU(),
                               RowParallelLinear(testing::kHidden, kOutputs, group, row));
}

struct Trace {
  std::vector<torch::Tensor> outputs, input_grads, params;
};

// k SGD-with-momentum steps on the mean squared error over the whole sequence; a rank's loss is
// its slice's share of it (the sum of its squared errors over the whole count), so the ranks'
// gradients together are the whole loss's.
Trace train(torch::nn::Sequential& net, int rank, int ranks) {
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Trace trace;
  for (int step = 0; step < 3; ++step) {
    torch::Tensor x = values({kBatch, kSeq, kInputs}, step);
    torch::Tensor y = values({kBatch, kSeq, kOutputs}, 10.0 + step);
    torch::Tensor mine = slice_of(x, rank, ranks).clone().requires_grad_(true);
    optimizer.zero_grad();
    torch::Tensor out = net->forward(mine);
    ((out - slice_of(y, rank, ranks)).pow(2).sum() / y.numel()).backward();
    optimizer.step();
    trace.outputs.push_back(out.detach().clone());
    trace.input_grads.push_back(mine.grad().clone());
  }
  trace.params = detached(net->parameters());
  return trace;
}

void expect_sequence_parallel_mlp_matches(int world, bool shared_memory) {
  SCOPED_TRACE("world " + std::to_string(world) + (shared_memory ? ", shared memory" : ", Gloo"));
  auto reference = make_reference_mlp();
  Trace want = train(reference, 0, 1);
  std::vector<Trace> got(world);
  std::vector<std::vector<torch::Tensor>> want_params(world);
  run_group(
      world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto net = make_sequence_parallel_mlp(group);
        got[rank] = train(net, rank, world);
        want_params[rank] = expected_shards(reference, net);
      },
      std::chrono::seconds(60), shared_memory);
  for (int rank = 0; rank < world; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    std::vector<torch::Tensor> outputs, grads;
    for (size_t i = 0; i < want.outputs.size(); ++i) {
      outputs.push_back(slice_of(want.outputs[i], rank, world));
      grads.push_back(slice_of(want.input_grads[i], rank, world));
    }
    EXPECT_LT(relative_error(got[rank].outputs, outputs), kTolerance) << "forward outputs";
    EXPECT_LT(relative_error(got[rank].input_grads, grads), kTolerance) << "input gradients";
    EXPECT_LT(relative_error(got[rank].params, want_params[rank]), kTolerance) << "parameters";
  }
}

TEST(SequenceParallel, ColumnReluRowMatchesTheUnsplitMlp) {
  torch::set_num_threads(1);
  for (int world : {1, 2, 3, 4}) expect_sequence_parallel_mlp_matches(world, true);
  expect_sequence_parallel_mlp_matches(3, false);
}

}  // namespace
}  // namespace dtrain
