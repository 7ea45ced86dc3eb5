// Data x tensor parallelism: 4 thread-ranks as 2 replicas x 2 tensor shards (make_rank_mesh(group,
// 1, 2)), DistributedDataParallel over each data group wrapping the tensor-parallel MLP, against
// single-process training of the unsplit MLP on the whole batch: after k SGD-with-momentum steps
// every rank's shards must equal the reference's, and every step's input gradient its rows of the
// reference's (relative error < 1e-5, float32).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "dtrain/ddp.h"
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
using testing::relative_error;

constexpr int64_t kGlobalBatch = 9;  // odd: the two replicas get 5 and 4 samples
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;

struct Batch {
  torch::Tensor x, y;
};

torch::optim::SGD make_optimizer(torch::nn::Sequential& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

TEST(DataTensorParallel, DdpOverTheDataGroupMatchesSingleProcessTraining) {
  torch::set_num_threads(1);
  torch::manual_seed(200);
  std::vector<Batch> batches;
  for (int step = 0; step < kSteps; ++step) {
    batches.push_back(
        {torch::randn({kGlobalBatch, kInputs}), torch::randn({kGlobalBatch, kOutputs})});
  }
  auto reference = testing::make_reference_mlp();
  auto reference_optimizer = make_optimizer(reference);
  std::vector<torch::Tensor> reference_input_grads;
  for (const Batch& batch : batches) {
    torch::Tensor x = batch.x.clone().requires_grad_(true);
    reference_optimizer.zero_grad();
    torch::mse_loss(reference->forward(x), batch.y).backward();
    reference_optimizer.step();
    reference_input_grads.push_back(x.grad());
  }

  constexpr int kData = 2, kTensor = 2;
  std::vector<std::vector<torch::Tensor>> got(kData * kTensor), want(kData * kTensor);
  std::vector<std::vector<torch::Tensor>> got_input_grads(kData * kTensor),
      want_input_grads(kData * kTensor);
  testing::run_group(kData * kTensor, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    RankMesh mesh = make_rank_mesh(group, /*pipeline_size=*/1, /*tensor_size=*/kTensor);
    auto net = testing::make_parallel_mlp(mesh.tensor_group);
    if (mesh.data_index != 0) {
      // A different start on the second replica: DDP's broadcast from the first replica's rank with
      // the same tensor index (the same shard) must erase it.
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.add_(0.5);
    }
    DistributedDataParallel ddp(net.ptr(), mesh.data_group);
    auto optimizer = make_optimizer(net);
    // This replica's contiguous share of the batch; both shards of a replica see the same samples.
    int64_t begin = mesh.data_index == 0 ? 0 : (kGlobalBatch + 1) / 2;
    int64_t count = mesh.data_index == 0 ? (kGlobalBatch + 1) / 2 : kGlobalBatch / 2;
    for (int step = 0; step < kSteps; ++step) {
      const Batch& batch = batches[step];
      // The input requires grad, so backward runs the tensor group's all-reduce (for x's gradient)
      // while DDP's bucket all-reduces on the data group are in flight.
      torch::Tensor x = batch.x.narrow(0, begin, count).clone().requires_grad_(true);
      optimizer.zero_grad();
      torch::Tensor out = ddp->forward(x);
      // The whole batch's mean loss, split so DDP's average over replicas restores it: this
      // replica's summed squared error times replicas / (global batch * outputs).
      torch::Tensor loss =
          torch::mse_loss(out, batch.y.narrow(0, begin, count), at::Reduction::Sum) *
          (static_cast<double>(kData) / (kGlobalBatch * kOutputs));
      loss.backward();
      optimizer.step();
      // DDP averages parameter gradients only: x's gradient still carries the replicas factor.
      got_input_grads[rank].push_back(x.grad() / kData);
      want_input_grads[rank].push_back(reference_input_grads[step].narrow(0, begin, count));
    }
    got[rank] = detached(net->parameters());
    want[rank] = expected_shards(reference, net);
  });
  for (int rank = 0; rank < kData * kTensor; ++rank) {
    EXPECT_LT(relative_error(got[rank], want[rank]), kTolerance) << "parameters, rank " << rank;
    EXPECT_LT(relative_error(got_input_grads[rank], want_input_grads[rank]), kTolerance)
        << "input gradients, rank " << rank;
  }
}

}  // namespace
}  // namespace dtrain
