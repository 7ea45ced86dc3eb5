// What the DCP tests (dcp_test.cpp, dcp_interop_test.cpp) share: the model, its training as a ZeRO
// run on thread ranks, and the whole state of that run (parameters, buffers, Adam's moments) taken
// through dtrain's own sharded checkpoint, to compare a DCP export or import against.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

#include "dtrain/comm.h"
#include "dtrain/dcp.h"
#include "dtrain/sharded.h"
#include "dtrain/sharded_checkpoint.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain::testing {

// 53 parameters (no world size here divides them) in 2-D and 1-D tensors, and BatchNorm's buffers
// (num_batches_tracked is int64). tests/python/dcp_interop.py builds the same model.
inline torch::nn::Sequential make_dcp_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 5), torch::nn::BatchNorm1d(5),
                               torch::nn::Tanh(), torch::nn::Linear(5, 3));
}

using DcpSdp = ShardedDataParallel<torch::nn::SequentialImpl>;

inline std::unique_ptr<torch::optim::Adam> make_dcp_adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// Runs body on `world` thread-ranks, each with a ZeRO stage-`stage` ShardedDataParallel over a
// copy of `initial` and an Adam over its shards.
inline void run_dcp_sharded(
    int world, int stage, const torch::nn::Sequential& initial,
    const std::function<void(int rank, DcpSdp& sdp, torch::optim::Adam& adam)>& body) {
  run_group(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    torch::nn::Sequential model(
        std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone()));
    ShardedDataParallelOptions options;
    options.stage = stage;
    DcpSdp sdp(model.ptr(), group, options);
    auto adam = make_dcp_adam(sdp->parameters());
    body(rank, sdp, *adam);
  });
}

// `steps` steps on this rank's share of 12 fixed samples.
inline void train_dcp_steps(DcpSdp& sdp, torch::optim::Optimizer& optimizer, int steps) {
  const int world = sdp->group()->size(), rank = sdp->group()->rank();
  const int64_t share = 12 / world;
  torch::manual_seed(21);
  for (int step = 0; step < steps; ++step) {
    auto x = torch::randn({12, 4}), y = torch::randn({12, 3});
    optimizer.zero_grad();
    (sdp->forward(x.narrow(0, rank * share, share)) - y.narrow(0, rank * share, share))
        .pow(2)
        .mean()
        .backward();
    optimizer.step();
  }
}

inline DcpShards dcp_shards(DcpSdp& sdp, torch::optim::Optimizer* optimizer) {
  return DcpShards{sdp->flat_shards(), optimizer, sdp->module()->named_buffers()};
}

// A ZeRO run's whole state under the names of a DCP folder: parameters and buffers by name, Adam's
// state as optim.state.<name>.exp_avg, .exp_avg_sq and .step (float32, 0-dim).
inline TensorTable state_table(torch::nn::Module& module, torch::optim::Adam* adam) {
  TensorTable table;
  for (const auto& item : module.named_parameters()) table.insert(item.key(), item.value().clone());
  for (const auto& item : module.named_buffers()) table.insert(item.key(), item.value().clone());
  if (!adam) return table;
  for (const auto& item : module.named_parameters()) {
    auto it = adam->state().find(item.value().unsafeGetTensorImpl());
    if (it == adam->state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    table.insert("optim.state." + item.key() + ".exp_avg", s.exp_avg().clone());
    table.insert("optim.state." + item.key() + ".exp_avg_sq", s.exp_avg_sq().clone());
    table.insert("optim.state." + item.key() + ".step",
                 at::scalar_tensor(static_cast<double>(s.step()), at::kFloat));
  }
  return table;
}

// The whole state of a ZeRO run, collectively (every rank calls it): rank 0's buffers, the full
// parameters, and Adam's state through dtrain's sharded checkpoint (ShardedCheckpointer, then
// load_sharded_as_full into a plain model): another path than the DCP export's. Returned on rank
// 0; empty on the others.
inline TensorTable whole_state(int rank, DcpSdp& sdp, torch::optim::Adam& adam,
                               const std::string& checkpoint_dir) {
  CheckpointOptions options;
  options.dir = checkpoint_dir;
  ShardedTrainingState state{sdp->flat_shards(), sdp->stage(), &adam, nullptr, 1, false};
  ShardedCheckpointer(options, sdp->group()).save(state);
  sdp->group()->barrier();
  if (rank != 0) return TensorTable();  // OrderedDict's default constructor is explicit
  auto plain = make_dcp_model();
  auto plain_adam = make_dcp_adam(plain->parameters());
  TrainingState full{plain.get(), plain_adam.get()};
  full.rng = false;
  EXPECT_TRUE(load_sharded_as_full(options, full).has_value());
  // Sharded checkpoints hold no buffers: rank 0's own.
  for (const auto& item : sdp->module()->named_buffers())
    plain->named_buffers()[item.key()].copy_(item.value());
  return state_table(*plain, plain_adam.get());
}

// Every tensor of `actual` equals the one of `expected` of the same name, exactly, and the names
// are the same.
inline void expect_same_tables(const TensorTable& expected, const TensorTable& actual,
                               const std::string& what) {
  EXPECT_EQ(expected.size(), actual.size()) << what;
  for (const auto& item : expected) {
    const at::Tensor* found = actual.find(item.key());
    if (!found) {
      ADD_FAILURE() << what << ": no tensor '" << item.key() << "'";
      continue;
    }
    EXPECT_EQ(found->sizes(), item.value().sizes()) << what << ": " << item.key();
    if (found->sizes() == item.value().sizes()) {
      EXPECT_TRUE(torch::equal(found->to(item.value().scalar_type()), item.value()))
          << what << ": tensor '" << item.key() << "' differs";
    }
  }
}

}  // namespace dtrain::testing
