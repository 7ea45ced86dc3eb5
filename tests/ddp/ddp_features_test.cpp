// DistributedDataParallel's features beyond the plain step: gradient accumulation with no_sync(),
// unused parameters (the error and find_unused_parameters, with and without no_sync()), frozen
// parameters, the parameter check across ranks, compression hooks, buffer broadcasting, and the
// number that rides on the gradients' all-reduce.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/group_state.h"
#include "dtrain/ddp.h"
#include "support/equivalence.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::relative_error;

using testing::run_group;

struct Branchy : torch::nn::Module {
  explicit Branchy(int64_t out = 4) {
    torch::manual_seed(3);
    used = register_module("used", torch::nn::Linear(6, out));
    unused = register_module("unused", torch::nn::Linear(6, out));
  }
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

torch::nn::Sequential make_mlp() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 3));
}

class DdpFeatures : public ::testing::Test {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_F(DdpFeatures, NoSyncAccumulationEqualsOneLargeStep) {
  const int world = 2, micro = 3;
  const int64_t per_rank = 4;  // each micro-batch: 4 samples per rank, 8 in all
  torch::manual_seed(5);
  auto x = torch::randn({micro, world * per_rank, 10});
  auto y = torch::randint(3, {micro, world * per_rank});

  // One step on all 24 samples in one process.
  auto single = make_mlp();
  torch::optim::SGD single_opt(single->parameters(), 0.5);
  single_opt.zero_grad();
  torch::nn::functional::cross_entropy(single->forward(x.reshape({-1, 10})), y.reshape({-1}))
      .backward();
  single_opt.step();
  auto want = snapshot(*single);

  auto initial = make_mlp();
  std::vector<std::vector<torch::Tensor>> got(world);
  run_group(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
    DistributedDataParallel ddp(net, group);
    torch::optim::SGD opt(net->parameters(), 0.5);
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto xs = x[m].narrow(0, rank * per_rank, per_rank);
      auto ys = y[m].narrow(0, rank * per_rank, per_rank);
      auto step = [&] {
        (torch::nn::functional::cross_entropy(ddp->forward(xs), ys) / micro).backward();
      };
      // Whether the ranks' gradients agree right now: they must not under no_sync (their data
      // differs), and must after the synchronizing step. Averaging is linear, so only this shows
      // no_sync did anything.
      auto ranks_agree = [&] {
        at::Tensor grad = net->parameters()[0].grad().clone();
        std::vector<at::Tensor> all(world);
        for (auto& t : all) t = torch::empty_like(grad);
        group->all_gather(all, grad);
        return torch::equal(all[0], all[1]);
      };
      if (m + 1 < micro) {
        auto guard = ddp->no_sync();
        step();
        EXPECT_FALSE(ranks_agree()) << "no_sync() still averaged the gradients";
      } else {
        step();
        EXPECT_TRUE(ranks_agree());
      }
    }
    opt.step();
    got[rank] = snapshot(*net);
  });
  for (int rank = 0; rank < world; ++rank) EXPECT_LT(relative_error(got[rank], want), 1e-5) << rank;
}

TEST_F(DdpFeatures, UnusedParameterErrorNamesItAndTheFix) {
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = std::make_shared<Branchy>();
    DistributedDataParallel ddp(net, group);
    try {
      ddp->forward(torch::randn({3, 6})).sum().backward();
      ADD_FAILURE() << "backward with an unused parameter did not fail";
    } catch (const std::exception& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("received no gradient in this backward: unused.weight, unused.bias"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("find_unused_parameters = true"), std::string::npos) << what;
    }
  });
}

TEST_F(DdpFeatures, FindUnusedParametersTrainsLikeOneProcess) {
  torch::manual_seed(9);
  auto x = torch::randn({6, 6});
  Branchy single;
  torch::optim::SGD single_opt(single.parameters(), 0.3);
  for (int step = 0; step < 2; ++step) {
    single_opt.zero_grad();
    single.forward(x).pow(2).mean().backward();
    single_opt.step();
  }
  auto want = snapshot(single);

  // Built here, not in the rank threads: the global generator is not for concurrent use.
  std::vector<std::shared_ptr<Branchy>> nets;
  for (int rank = 0; rank < 3; ++rank) nets.push_back(std::make_shared<Branchy>());
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = nets[rank];
    DistributedDataParallelOptions options;
    options.find_unused_parameters = true;
    DistributedDataParallel ddp(net, group, options);
    torch::optim::SGD opt(net->parameters(), 0.3);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      ddp->forward(x.narrow(0, rank * 2, 2)).pow(2).mean().backward();
      opt.step();
    }
    EXPECT_LT(relative_error(snapshot(*net), want), 1e-5);
    EXPECT_FALSE(net->unused->weight.grad().defined())
        << "a parameter unused everywhere keeps no gradient";
  });
}

// A branch each call uses or not, as the caller says: a parameter some ranks use and others do not.
struct Switchy : torch::nn::Module {
  Switchy() {
    torch::manual_seed(4);
    trunk = register_module("trunk", torch::nn::Linear(6, 4));
    branch = register_module("branch", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_branch) {
    torch::Tensor out = trunk->forward(x);
    return use_branch ? out + branch->forward(x) : out;
  }
  torch::nn::Linear trunk{nullptr}, branch{nullptr};
};

// find_unused_parameters with no_sync(): a parameter counts as used in a step when any rank used
// it in any of the step's backwards, no_sync() ones included (PyTorch's local_used_map_), and every
// rank then holds the average of what the ranks accumulated. Each step is a no_sync() micro-batch
// and an averaging one; which ranks use the branch in each, kUses[step][micro][rank]:
//   step 0: rank 0 only under no_sync(), no rank in the averaging micro-batch: rank 0's gradient
//           must be averaged with rank 1's nothing, on both ranks, not kept on rank 0 alone;
//   step 1: every rank, but only under no_sync(): the gradients must be averaged, not kept local;
//   step 2: rank 1 under no_sync(), rank 0 in the averaging micro-batch.
// SGD with momentum keeps any difference in a later step.
TEST_F(DdpFeatures, BranchUsedOnSomeRanksOnlyUnderNoSyncTrainsLikeOneProcess) {
  constexpr int kWorld = 2, kSteps = 3, kMicro = 2;
  constexpr int64_t kRows = 3;  // per rank and micro-batch
  constexpr bool kUses[kSteps][kMicro][kWorld] = {{{true, false}, {false, false}},
                                                  {{true, true}, {false, false}},
                                                  {{false, true}, {true, false}}};
  torch::manual_seed(17);
  auto x = torch::randn({kSteps, kMicro, kWorld * kRows, 6});
  auto rows = [&](int step, int micro, int rank) {
    return x[step][micro].narrow(0, rank * kRows, kRows);
  };
  auto make_optimizer = [](Switchy& net) {
    return torch::optim::SGD(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  };

  // One process: every rank's micro-batches, each loss weighted as DDP's averaging weighs it.
  Switchy single;
  auto single_opt = make_optimizer(single);
  for (int step = 0; step < kSteps; ++step) {
    single_opt.zero_grad();
    for (int micro = 0; micro < kMicro; ++micro) {
      for (int rank = 0; rank < kWorld; ++rank) {
        (single.forward(rows(step, micro, rank), kUses[step][micro][rank]).pow(2).mean() /
         (kMicro * kWorld))
            .backward();
      }
    }
    single_opt.step();
  }
  auto want = snapshot(single);

  for (bool bucket_view : {true, false}) {
    for (bool shared_memory : {true, false}) {
      SCOPED_TRACE("gradient_as_bucket_view " + std::to_string(bucket_view) + ", shared_memory " +
                   std::to_string(shared_memory));
      // Built here, not in the rank threads: the global generator is not for concurrent use.
      std::vector<std::shared_ptr<Switchy>> nets;
      for (int rank = 0; rank < kWorld; ++rank) nets.push_back(std::make_shared<Switchy>());
      run_group(
          kWorld,
          [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
            auto net = nets[rank];
            DistributedDataParallelOptions options;
            options.find_unused_parameters = true;
            options.gradient_as_bucket_view = bucket_view;
            DistributedDataParallel ddp(net, group, options);
            auto opt = make_optimizer(*net);
            for (int step = 0; step < kSteps; ++step) {
              opt.zero_grad();  // to undefined: LibTorch 2.x's default
              for (int micro = 0; micro < kMicro; ++micro) {
                auto backward = [&] {
                  (ddp->forward(rows(step, micro, rank), kUses[step][micro][rank]).pow(2).mean() /
                   kMicro)
                      .backward();
                };
                if (micro + 1 < kMicro) {
                  auto guard = ddp->no_sync();
                  backward();
                } else {
                  backward();
                }
              }
              opt.step();
            }
            EXPECT_LT(relative_error(snapshot(*net), want), 1e-5)
                << "rank " << rank << ", gradient_as_bucket_view " << bucket_view
                << ", shared_memory " << shared_memory;
          },
          std::chrono::seconds(60), shared_memory);
    }
  }
}

// Frozen parameters (requires_grad false) get no gradient, so nothing averaging could ever make
// them agree: the constructor must broadcast them with the rest, as PyTorch's DDP does.
TEST_F(DdpFeatures, FrozenParametersFollowRankZeroAndTrainLikeOneProcess) {
  constexpr int kWorld = 3, kSteps = 2;
  constexpr int64_t kRows = 2;  // per rank
  auto make = [](int seed) {
    torch::manual_seed(seed);
    torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::Linear(8, 2));
    net[0]->as<torch::nn::LinearImpl>()->weight.requires_grad_(false);
    return net;
  };
  torch::manual_seed(12);
  auto x = torch::randn({kSteps, kWorld * kRows, 8});

  auto single = make(0);  // rank 0's model: the one DDP must give every rank
  torch::optim::SGD single_opt(single->parameters(), 0.2);
  for (int step = 0; step < kSteps; ++step) {
    single_opt.zero_grad();
    single->forward(x[step]).pow(2).mean().backward();
    single_opt.step();
  }
  auto want = snapshot(*single);
  const torch::Tensor frozen_on_rank0 = make(0)[0]->as<torch::nn::LinearImpl>()->weight.clone();

  std::vector<torch::nn::Sequential> nets;  // each rank seeded with its rank: all tensors differ
  for (int rank = 0; rank < kWorld; ++rank) nets.push_back(make(rank));
  ASSERT_FALSE(torch::equal(nets[1][0]->as<torch::nn::LinearImpl>()->weight, frozen_on_rank0));
  run_group(kWorld, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = nets[rank];
    DistributedDataParallel ddp(net, group);
    const torch::Tensor& frozen = net[0]->as<torch::nn::LinearImpl>()->weight;
    EXPECT_FALSE(frozen.requires_grad()) << "DDP unfroze the parameter";
    EXPECT_TRUE(torch::equal(frozen, frozen_on_rank0))
        << "rank " << rank << ": the frozen weight is not rank 0's after construction";
    torch::optim::SGD opt(net->parameters(), 0.2);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      ddp->forward(x[step].narrow(0, rank * kRows, kRows)).pow(2).mean().backward();
      opt.step();
    }
    EXPECT_LT(relative_error(snapshot(*net), want), 1e-5) << "rank " << rank;
  });
}

TEST_F(DdpFeatures, AFrozenParameterThatDiffersBetweenRanksIsNamed) {
  // Another shape on one rank: the broadcast would pair different elements across ranks.
  std::vector<std::shared_ptr<torch::nn::Module>> nets;
  for (int rank = 0; rank < 3; ++rank) {
    nets.push_back(std::make_shared<Branchy>());
    nets.back()->register_parameter("scale", torch::ones({rank == 1 ? 5 : 4}),
                                    /*requires_grad=*/false);
  }
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    try {
      DistributedDataParallelBase ddp(nets[rank], group);
      ADD_FAILURE() << "a frozen parameter of another shape on rank 1 was accepted";
    } catch (const UsageError& e) {
      std::string what = e.what();
      // The module's own parameters come before its children's: 'scale' is #0.
      EXPECT_NE(what.find("parameter #0 differs between ranks: ranks {1} do not match rank 0"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("rank 0 has 'scale (frozen)' [4] Float, rank 1 has 'scale (frozen)' [5] "
                          "Float"),
                std::string::npos)
          << what;
    }
  });
  // Frozen on one rank, trained on the others: the ranks' buckets would differ.
  nets.clear();
  for (int rank = 0; rank < 2; ++rank) {
    auto net = std::make_shared<Branchy>();
    if (rank == 1) net->used->weight.requires_grad_(false);
    nets.push_back(net);
  }
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    try {
      DistributedDataParallelBase ddp(nets[rank], group);
      ADD_FAILURE() << "a parameter frozen on rank 1 only was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 has 'used.weight' [4, 6] Float, rank 1 has "
                                           "'used.weight (frozen)' [4, 6] Float"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST_F(DdpFeatures, DifferentModelsAreNamed) {
  std::vector<std::shared_ptr<Branchy>> nets;
  for (int rank = 0; rank < 3; ++rank) nets.push_back(std::make_shared<Branchy>(rank == 1 ? 5 : 4));
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = nets[rank];
    try {
      DistributedDataParallel ddp(net, group);
      ADD_FAILURE() << "mismatched models were accepted";
    } catch (const UsageError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("parameter #0 differs between ranks: ranks {1} do not match rank 0"),
                std::string::npos)
          << what;
      // Every rank names what each side has, not only what it has itself.
      EXPECT_NE(
          what.find(
              "rank 0 has 'used.weight' [4, 6] Float, rank 1 has 'used.weight' [5, 6] Float."),
          std::string::npos)
          << what;
    }
  });
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    std::shared_ptr<torch::nn::Module> net = std::make_shared<Branchy>();
    if (rank == 2) net->register_module("extra", torch::nn::Linear(2, 2));
    try {
      DistributedDataParallelBase ddp(net, group);
      ADD_FAILURE() << "a rank with an extra layer was accepted";
    } catch (const UsageError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("parameter #4 differs between ranks: ranks {2} do not match rank 0"),
                std::string::npos)
          << what;
      EXPECT_NE(
          what.find(
              "rank 0 has no parameter #4 (4 in all), rank 2 has 'extra.weight' [2, 2] Float"),
          std::string::npos)
          << what;
    }
  });
}

void expect_compression_within(std::shared_ptr<CommHook> (*make_hook)(), double max_error) {
  torch::manual_seed(21);
  auto x = torch::randn({3, 8, 10});
  auto y = torch::randint(3, {3, 8});
  auto single = make_mlp();
  torch::optim::SGD single_opt(single->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    single_opt.zero_grad();
    torch::nn::functional::cross_entropy(single->forward(x[step]), y[step]).backward();
    single_opt.step();
  }
  auto want = snapshot(*single);
  auto initial = make_mlp();
  std::vector<double> errors(2);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
    DistributedDataParallelOptions options;
    options.comm_hook = make_hook();
    DistributedDataParallel ddp(net, group, options);
    torch::optim::SGD opt(net->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto xs = x[step].narrow(0, rank * 4, 4);
      auto ys = y[step].narrow(0, rank * 4, 4);
      torch::nn::functional::cross_entropy(ddp->forward(xs), ys).backward();
      opt.step();
    }
    errors[rank] = relative_error(snapshot(*net), want);
  });
  for (double error : errors) {
    EXPECT_LT(error, max_error);
    EXPECT_GT(error, 0.0) << "no rounding at all: the hook did not run";
  }
}

TEST_F(DdpFeatures, Fp16CompressionStaysWithinItsRounding) {
  expect_compression_within(fp16_compress_hook, 2e-3);
}

TEST_F(DdpFeatures, Bf16CompressionStaysWithinItsRounding) {
  expect_compression_within(bf16_compress_hook, 2e-2);
}

TEST_F(DdpFeatures, BuffersFollowRankZero) {
  run_group(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    torch::manual_seed(1);
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
    DistributedDataParallel ddp(net.ptr(), group);
    auto bn = net[1]->as<torch::nn::BatchNorm1dImpl>();
    ddp->forward(torch::randn({5, 4}) + rank).sum().backward();  // running stats now differ by rank
    ddp->prepare_forward();  // the next forward starts from rank 0's
    std::vector<torch::Tensor> all(3);
    for (auto& t : all) t = torch::empty({4});
    group->all_gather(all, bn->running_mean);
    EXPECT_TRUE(torch::equal(all[rank], all[0]));
  });
}

// Note [A number riding on the gradients] (src/comm/group_state.h): a DDP on a group that has a
// riding number sums the ranks' contributions with each synchronised backward's gradients, in
// every bucket layout and transport, and leaves the gradients what they would be without it.
TEST_F(DdpFeatures, ANumberRidesOnTheGradientsAndChangesNone) {
  const int world = 3;
  const int64_t per_rank = 4;
  torch::manual_seed(8);
  auto x = torch::randn({world * per_rank, 10});
  auto y = torch::randint(3, {world * per_rank});
  auto initial = make_mlp();  // not in the rank threads: the global generator is shared
  auto single = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
  torch::nn::functional::cross_entropy(single->forward(x), y).backward();
  std::vector<torch::Tensor> want;
  for (auto& p : single->parameters()) want.push_back(p.grad().clone());

  for (bool shared_memory : {true, false}) {
    for (bool bucket_view : {true, false}) {
      SCOPED_TRACE("shared_memory " + std::to_string(shared_memory) + ", gradient_as_bucket_view " +
                   std::to_string(bucket_view));
      run_group(
          world,
          [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
            auto rider = std::make_shared<detail::RidingNumber>();
            detail::GroupInternals::state(*group)->riding_number = rider;
            auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
            DistributedDataParallelOptions options;
            options.gradient_as_bucket_view = bucket_view;
            options.first_bucket_cap_bytes = 64;  // several buckets: it rides on the last
            options.bucket_cap_bytes = 256;
            DistributedDataParallel ddp(net, group, options);
            ASSERT_GT(ddp->bucket_layout().size(), 2u);
            auto xs = x.narrow(0, rank * per_rank, per_rank);
            auto ys = y.narrow(0, rank * per_rank, per_rank);
            auto backward = [&] {
              for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
              torch::nn::functional::cross_entropy(ddp->forward(xs), ys).backward();
            };

            rider->contribution = rank + 1;
            backward();
            EXPECT_EQ(rider->carried.load(), 1);
            // Shared buckets divide the sum by the world size in the reduction, and the reducer
            // multiplies it back: exact to float's rounding, not to the bit.
            EXPECT_NEAR(rider->sum.load(), 1 + 2 + 3, 1e-5);
            std::vector<torch::Tensor> got;
            for (auto& p : net->parameters()) got.push_back(p.grad().clone());
            EXPECT_LT(relative_error(got, want), 1e-5);

            {
              auto guard = ddp->no_sync();  // nothing is all-reduced, nothing rides
              rider->contribution = 100;
              backward();
            }
            EXPECT_EQ(rider->carried.load(), 1);

            rider->contribution = rank == 0 ? 7 : 0;  // in-place recovery's use: rank 0's count
            backward();
            EXPECT_EQ(rider->carried.load(), 2);
            EXPECT_NEAR(rider->sum.load(), 7, 1e-5);
          },
          std::chrono::seconds(60), shared_memory);
    }
  }

  // A comm hook owns the bucket's contents: nothing rides, and the owner agrees by other means.
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto rider = std::make_shared<detail::RidingNumber>();
    detail::GroupInternals::state(*group)->riding_number = rider;
    auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
    DistributedDataParallelOptions options;
    options.comm_hook = fp16_compress_hook();
    DistributedDataParallel ddp(net, group, options);
    rider->contribution = 1;
    torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, rank * 4, 4)),
                                         y.narrow(0, rank * 4, 4))
        .backward();
    EXPECT_EQ(rider->carried.load(), 0);
  });
}

}  // namespace
}  // namespace dtrain
