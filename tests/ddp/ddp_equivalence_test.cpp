// DistributedDataParallel against single-process training of the same model on the same data: after
// k optimizer steps every rank's parameters must equal the single process's (relative error < 1e-5
// in float32). Ranks are threads over an in-memory store; local batches are of unequal size where
// the global batch does not divide by the world size.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "dtrain/ddp.h"
#include "support/equivalence.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::relative_error;

using testing::run_group;

constexpr int64_t kInputs = 12;
constexpr int64_t kClasses = 5;
constexpr int64_t kGlobalBatch = 13;  // prime: uneven local batches for every world size > 1
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;

torch::nn::Sequential make_mlp() {
  torch::manual_seed(7);
  torch::nn::Sequential net(torch::nn::Linear(kInputs, 32), torch::nn::ReLU(),
                            torch::nn::Linear(32, 24), torch::nn::Tanh(),
                            torch::nn::Linear(24, kClasses));
  return net;
}

struct Data {
  torch::Tensor x, y;
};

Data make_data(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({kGlobalBatch, kInputs}), torch::randint(kClasses, {kGlobalBatch})};
}

// This rank's contiguous share of a batch of `total`: the first `total % world` ranks get one more.
std::pair<int64_t, int64_t> shard(int64_t total, int world, int rank) {
  int64_t base = total / world, extra = total % world;
  int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, base + (rank < extra ? 1 : 0)};
}

enum class Optim { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == Optim::kSgd) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// Global-batch mean loss, written so each rank's share contributes exactly its part: the sum of the
// shard's losses times world/global, averaged over ranks by DDP.
torch::Tensor shard_loss(const torch::Tensor& logits, const torch::Tensor& y, int world) {
  return torch::nn::functional::cross_entropy(
             logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) *
         (static_cast<double>(world) / kGlobalBatch);
}

std::vector<torch::Tensor> train_single(Optim kind, int steps = kSteps) {
  auto net = make_mlp();
  auto optimizer = make_optimizer(kind, net->parameters());
  for (int step = 0; step < steps; ++step) {
    Data d = make_data(step);
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(d.x), d.y).backward();
    optimizer->step();
  }
  std::vector<torch::Tensor> result;
  for (auto& p : net->parameters()) result.push_back(p.detach().clone());
  return result;
}

// Trains on `world` thread-ranks and returns each rank's final parameters.
std::vector<std::vector<torch::Tensor>> train_ddp(int world, Optim kind,
                                                  DistributedDataParallelOptions options,
                                                  int steps = kSteps, bool shared_memory = true) {
  std::vector<std::vector<torch::Tensor>> results(world);
  auto initial = make_mlp();
  // Drawn here, not in the rank threads: the global generator is not for concurrent use.
  std::vector<Data> data;
  for (int step = 0; step < steps; ++step) data.push_back(make_data(step));
  run_group(
      world,
      [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
        auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
        if (rank != 0) {
          // Different starting points on the other ranks: DDP's broadcast must erase them.
          torch::NoGradGuard no_grad;
          for (auto& p : net->parameters()) p.add_(0.5 * rank);
        }
        DistributedDataParallel ddp(net, group, options);
        auto optimizer = make_optimizer(kind, net->parameters());
        for (int step = 0; step < steps; ++step) {
          const Data& d = data[step];
          auto [begin, count] = shard(kGlobalBatch, world, rank);
          optimizer->zero_grad();
          shard_loss(ddp->forward(d.x.narrow(0, begin, count)), d.y.narrow(0, begin, count), world)
              .backward();
          optimizer->step();
        }
        for (auto& p : net->parameters()) results[rank].push_back(p.detach().clone());
      },
      std::chrono::seconds(60), shared_memory);
  return results;
}

void expect_equivalent(int world, Optim kind, const DistributedDataParallelOptions& options,
                       bool shared_memory = true) {
  auto want = train_single(kind);
  auto got = train_ddp(world, kind, options, kSteps, shared_memory);
  for (int rank = 0; rank < world; ++rank) {
    double error = relative_error(got[rank], want);
    EXPECT_LT(error, kTolerance) << "world " << world << " rank " << rank;
  }
}

class DdpEquivalence : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }
};

TEST_P(DdpEquivalence, SgdWithMomentum) { expect_equivalent(GetParam(), Optim::kSgd, {}); }

TEST_P(DdpEquivalence, Adam) { expect_equivalent(GetParam(), Optim::kAdam, {}); }

TEST_P(DdpEquivalence, ManySmallBucketsAndGradientViews) {
  DistributedDataParallelOptions options;
  options.bucket_cap_bytes = 600;  // a few parameters per bucket: many buckets in flight at once
  options.first_bucket_cap_bytes = 100;
  options.gradient_as_bucket_view = true;
  expect_equivalent(GetParam(), Optim::kAdam, options);
}

TEST_P(DdpEquivalence, SeparateGradientsAndBuckets) {
  DistributedDataParallelOptions options;
  options.gradient_as_bucket_view = false;
  expect_equivalent(GetParam(), Optim::kSgd, options);
}

TEST_P(DdpEquivalence, ThroughGlooWithAndWithoutGradientViews) {
  // Without shared memory the buckets are private and Gloo all-reduces them.
  for (bool views : {true, false}) {
    SCOPED_TRACE(views ? "gradient views" : "separate gradients");
    DistributedDataParallelOptions options;
    options.gradient_as_bucket_view = views;
    expect_equivalent(GetParam(), Optim::kAdam, options, /*shared_memory=*/false);
  }
}

TEST_P(DdpEquivalence, WithoutOverlap) {
  DistributedDataParallelOptions options;
  options.overlap = false;
  expect_equivalent(GetParam(), Optim::kSgd, options);
}

// The file this process has mapped at `address` (/proc/self/maps), or "" if anonymous or unmapped.
std::string mapping_of(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(address);
  while (std::getline(maps, line)) {
    unsigned long long begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx", &begin, &end) != 2 || at < begin || at >= end)
      continue;
    auto slash = line.find('/');
    return slash == std::string::npos ? "" : line.substr(slash);
  }
  return "";
}

// Gradient accumulation as many training loops write it: zero_grad(false) zeroes the gradients in
// place, then several micro-batches, all but the last under no_sync(), add to them. With gradient
// views backward then adds straight into the bucket's slices (the tests above set the gradients
// to undefined, so backward always starts a new tensor that DDP copies in). Each micro-batch is a
// global batch of its own; the loss is divided by their number.
constexpr int kMicroBatches = 3;

std::vector<torch::Tensor> train_single_accumulating() {
  auto net = make_mlp();
  auto optimizer = make_optimizer(Optim::kSgd, net->parameters());
  for (int step = 0; step < kSteps; ++step) {
    optimizer->zero_grad(/*set_to_none=*/false);
    for (int micro = 0; micro < kMicroBatches; ++micro) {
      Data d = make_data(step * kMicroBatches + micro);
      (torch::nn::functional::cross_entropy(net->forward(d.x), d.y) / kMicroBatches).backward();
    }
    optimizer->step();
  }
  std::vector<torch::Tensor> result;
  for (auto& p : net->parameters()) result.push_back(p.detach().clone());
  return result;
}

TEST_P(DdpEquivalence, ZeroGradInPlaceAndAccumulationUnderNoSync) {
  const int world = GetParam();
  auto want = train_single_accumulating();
  auto initial = make_mlp();
  std::vector<Data> data;  // drawn here: the global generator is not for concurrent use
  for (int i = 0; i < kSteps * kMicroBatches; ++i) data.push_back(make_data(i));
  for (bool views : {true, false}) {
    for (bool shared_memory : {true, false}) {
      DistributedDataParallelOptions options;
      options.gradient_as_bucket_view = views;
      options.first_bucket_cap_bytes = 100;  // several buckets, so several slices of each
      options.bucket_cap_bytes = 600;
      run_group(
          world,
          [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
            auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
            DistributedDataParallel ddp(net, group, options);
            auto optimizer = make_optimizer(Optim::kSgd, net->parameters());
            auto [begin, count] = shard(kGlobalBatch, world, rank);
            for (int step = 0; step < kSteps; ++step) {
              optimizer->zero_grad(/*set_to_none=*/false);
              for (int micro = 0; micro < kMicroBatches; ++micro) {
                const Data& d = data[step * kMicroBatches + micro];
                auto backward = [&] {
                  (shard_loss(ddp->forward(d.x.narrow(0, begin, count)),
                              d.y.narrow(0, begin, count), world) /
                   kMicroBatches)
                      .backward();
                };
                if (micro + 1 < kMicroBatches) {
                  auto guard = ddp->no_sync();
                  backward();
                } else {
                  backward();
                }
              }
              optimizer->step();
            }
            if (views && world > 1) {
              // The gradients kept across zero_grad(false) are still the buckets' slices: what
              // this test is about.
              const std::string file = mapping_of(net->parameters()[0].grad().data_ptr());
              EXPECT_EQ(file.rfind("/dev/shm/dtrain-", 0) == 0, shared_memory)
                  << "rank " << rank << ": gradient mapped from '" << file << "'";
            }
            std::vector<torch::Tensor> got;
            for (auto& p : net->parameters()) got.push_back(p.detach().clone());
            EXPECT_LT(relative_error(got, want), kTolerance)
                << "world " << world << " rank " << rank << ", gradient_as_bucket_view " << views
                << ", shared_memory " << shared_memory;
          },
          std::chrono::seconds(60), shared_memory);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DdpEquivalence, ::testing::Values(1, 2, 3, 4));

TEST(Ddp, RanksOnOneHostReduceGradientsWhereTheyLieInSharedMemory) {
  // Note [Gradient buckets in shared memory]: each rank's gradients are its slice of a segment
  // every rank
  // maps, and they stay valid after DDP (and its segment handle) is gone.
  torch::set_num_threads(1);
  for (bool views : {true, false}) {
    SCOPED_TRACE(views ? "gradient views" : "separate gradients");
    run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      auto net = make_mlp();
      at::Tensor expected_grad;
      {
        DistributedDataParallelOptions options;
        options.gradient_as_bucket_view = views;
        DistributedDataParallel ddp(net.ptr(), group, options);
        auto d = make_data(0);
        shard_loss(ddp->forward(d.x.narrow(0, rank, 1)), d.y.narrow(0, rank, 1), 2).backward();
        const at::Tensor& grad = net->parameters()[0].grad();
        std::string file = mapping_of(grad.data_ptr());
        if (views) {
          EXPECT_EQ(file.rfind("/dev/shm/dtrain-", 0), 0u)
              << "gradient mapped from '" << file << "'";
        } else {
          EXPECT_EQ(file, "") << "separate gradients are private memory";
        }
        expected_grad = grad.clone();
      }
      EXPECT_TRUE(torch::equal(net->parameters()[0].grad(), expected_grad))
          << "gradient changed after DDP died";
    });
  }
}

TEST(Ddp, SharedBucketsCanBeTurnedOffAndABadValueIsNamed) {
  torch::set_num_threads(1);
  struct RestoreEnv {
    ~RestoreEnv() { unsetenv("DTRAIN_SHM_BUCKETS"); }
  } restore;
  setenv("DTRAIN_SHM_BUCKETS", "0", 1);
  DistributedDataParallelOptions options;  // gradient views, the default
  expect_equivalent(2, Optim::kSgd, options);
  run_group(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    auto net = make_mlp();
    DistributedDataParallel ddp(net.ptr(), group);
    auto d = make_data(0);
    ddp->forward(d.x).sum().backward();
    EXPECT_EQ(mapping_of(net->parameters()[0].grad().data_ptr()), "")
        << "DTRAIN_SHM_BUCKETS=0 was ignored";
  });
  setenv("DTRAIN_SHM_BUCKETS", "no", 1);
  run_group(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    auto net = make_mlp();
    try {
      DistributedDataParallel ddp(net.ptr(), group);
      ADD_FAILURE() << "DTRAIN_SHM_BUCKETS=no was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(
          std::string(e.what()).find("environment variable DTRAIN_SHM_BUCKETS='no': expected 0"),
          std::string::npos)
          << e.what();
    }
  });
}

TEST(Ddp, BucketsFallBackToPrivateMemoryWithAWarningWhereDevShmLacksTheRoom) {
  // Shared buckets take /dev/shm room for every rank's gradients (Docker's default /dev/shm is 64
  // MB). Where rank 0 cannot reserve it, rank 0 must say so and every rank average through the
  // transport instead, not fail or hang. A file size limit makes the reservation fail as a full
  // /dev/shm would, without filling one; it is set once the group's own segment exists, so only the
  // buckets' segment meets it.
  torch::set_num_threads(1);
  auto initial = make_mlp();
  const Data d = make_data(0);
  std::vector<at::Tensor> want;
  {
    auto single = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
    torch::nn::functional::cross_entropy(single->forward(d.x), d.y).backward();
    for (auto& p : single->parameters()) want.push_back(p.grad().clone());
  }
  struct RestoreLimit {
    rlimit saved{};
    void (*handler)(int) = nullptr;
    RestoreLimit() {
      getrlimit(RLIMIT_FSIZE, &saved);
      handler =
          std::signal(SIGXFSZ, SIG_IGN);  // a failed ftruncate returns EFBIG instead of killing us
    }
    void restore() const { setrlimit(RLIMIT_FSIZE, &saved); }
    ~RestoreLimit() {
      restore();
      std::signal(SIGXFSZ, handler);
    }
  } limit;
  ::testing::internal::CaptureStderr();
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    group->barrier();  // every rank has its group (and the group its segment) before the limit
    if (rank == 0) {
      rlimit tiny = limit.saved;
      // Below the buckets' segment (at least a page per rank), above what stderr (captured to a
      // file, which the limit binds too) receives meanwhile.
      tiny.rlim_cur = 4096;
      setrlimit(RLIMIT_FSIZE, &tiny);
    }
    group->barrier();
    auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(initial->clone());
    DistributedDataParallel ddp(net, group);
    group->barrier();  // every rank has built its buckets
    if (rank == 0) limit.restore();
    auto [begin, count] = shard(kGlobalBatch, 2, rank);
    shard_loss(ddp->forward(d.x.narrow(0, begin, count)), d.y.narrow(0, begin, count), 2)
        .backward();
    std::vector<at::Tensor> got;
    for (auto& p : net->parameters()) got.push_back(p.grad());
    EXPECT_EQ(mapping_of(got[0].data_ptr()), "")
        << "rank " << rank << ": the gradient is still in shared memory";
    EXPECT_LT(relative_error(got, want), kTolerance) << "rank " << rank;
  });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("shared memory unavailable for DDP's gradient buckets (sizing the segment: "
                     "File too large"),
            std::string::npos)
      << log;
}

TEST(Ddp, TheTestCanFail) {
  // The tolerance is tight enough to see one step of difference: a guard against a vacuous
  // comparison.
  auto want = train_single(Optim::kSgd, kSteps);
  auto other = train_single(Optim::kSgd, kSteps - 1);
  EXPECT_GT(relative_error(other, want), 100 * kTolerance);
}

TEST(Ddp, TheComparisonFailsANaNAMissingTensorAndAWrongShape) {
  // Every equivalence test compares through relative_error: a diverged run (NaN parameters), a
  // parameter missing and one of another shape must each read as failing, never as equal.
  const std::vector<torch::Tensor> want{torch::ones({2, 3}), torch::ones({4})};
  EXPECT_EQ(relative_error(want, want), 0);
  EXPECT_GT(relative_error({torch::full({2, 3}, NAN), torch::ones({4})}, want), 1);
  EXPECT_GT(relative_error({torch::ones({2, 3}), torch::full({4}, INFINITY)}, want), 1);
  EXPECT_GT(relative_error({torch::ones({2, 3})}, want), 1);
  EXPECT_GT(relative_error({torch::ones({3, 2}), torch::ones({4})}, want), 1);
}

TEST(Ddp, BucketsRunInReverseRegistrationOrderWithASmallFirstBucket) {
  torch::set_num_threads(1);
  run_group(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    auto net = make_mlp();
    DistributedDataParallelOptions options;
    options.first_bucket_cap_bytes =
        480;  // the last layer's bias (20 B) fits, its weight (480 B) then not
    options.bucket_cap_bytes = 1 << 20;
    DistributedDataParallel ddp(net.ptr(), group, options);
    auto layout = ddp->bucket_layout();
    ASSERT_EQ(layout.size(), 2u);
    EXPECT_EQ(layout[0], (std::vector<size_t>{5}));
    EXPECT_EQ(layout[1], (std::vector<size_t>{4, 3, 2, 1, 0}));
  });
}

}  // namespace
}  // namespace dtrain
