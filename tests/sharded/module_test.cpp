// ShardedDataParallel as a torch::nn::Module (Note [Sharded parameter names] in dtrain/sharded.h):
// its parameters are this rank's shards, named by unit; train() and eval() reach the module; a
// torch::save / torch::load round trip restores the shards; it takes a std::shared_ptr, a
// TORCH_MODULE holder and a Sequential. Two thread-ranks over a memory:// store.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "dtrain/sharded.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::run_group;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 5));
    drop = register_module("drop", torch::nn::Dropout(0.5));
    fc2 = register_module("fc2", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Net);

torch::nn::Sequential make_sequential() {
  return torch::nn::Sequential(torch::nn::Linear(6, 7), torch::nn::ReLU(), torch::nn::Linear(7, 2));
}

ShardedDataParallelOptions stage(int s) {
  ShardedDataParallelOptions options;
  options.stage = s;
  options.bucket_cap_bytes = 64;  // stages 1-2: several units even for these small layers
  return options;
}

TEST(ShardedModule, ParametersAreThisRanksShardsNamedByUnit) {
  for (int s : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(s));
    std::vector<torch::nn::Sequential> nets{make_sequential(), make_sequential()};
    run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      ShardedDataParallel sdp(nets[rank], group, stage(s));
      static_assert(std::is_same_v<decltype(sdp), ShardedDataParallel<torch::nn::SequentialImpl>>);
      EXPECT_EQ(sdp->module(), nets[rank].ptr());
      auto shards = sdp->flat_shards();
      auto named = sdp->named_parameters();
      ASSERT_GT(shards.size(), 1u);
      ASSERT_EQ(named.size(), shards.size()) << "the module's full parameters are not the shards";
      for (size_t u = 0; u < shards.size(); ++u) {
        EXPECT_EQ(named[u].key(), "unit" + std::to_string(u));
        EXPECT_EQ(shards[u].key, named[u].key());
        EXPECT_TRUE(named[u].value().is_same(shards[u].shard));
        EXPECT_TRUE(sdp->parameters()[u].is_same(shards[u].shard));
      }
    });
  }
}

TEST(ShardedModule, TakesAHolderAndTrainAndEvalReachTheModule) {
  std::vector<Net> nets{Net(), Net()};
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Net net = nets[rank];
    ShardedDataParallel sdp(net, group, stage(2));
    static_assert(std::is_same_v<decltype(sdp), ShardedDataParallel<NetImpl>>);
    EXPECT_EQ(sdp->module(), net.ptr());
    sdp->eval();
    EXPECT_FALSE(sdp->is_training());
    EXPECT_FALSE(net->drop->is_training());
    {
      torch::NoGradGuard no_grad;
      auto x = torch::ones({4, 6});
      EXPECT_TRUE(torch::equal(sdp(x), sdp(x))) << "dropout still on after sdp->eval()";
    }
    sdp->train();
    EXPECT_TRUE(net->drop->is_training());
    // A step through operator() and an optimizer over sdp->parameters() moves the shards.
    torch::optim::SGD optimizer(sdp->parameters(), 0.1);
    auto before = sdp->parameters()[0].detach().clone();
    sdp(torch::full({3, 6}, 1.0 + rank)).sum().backward();
    optimizer.step();
    EXPECT_FALSE(torch::equal(sdp->parameters()[0], before));
  });
}

TEST(ShardedModule, SaveAndLoadRestoreTheShardsAndTheFullParameters) {
  for (int s : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(s));
    std::vector<torch::nn::Sequential> nets{make_sequential(), make_sequential()};
    const std::string dir = testing::temp_dir("dtrain-sharded-module");
    std::filesystem::create_directories(dir);
    run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      ShardedDataParallel sdp(nets[rank], group, stage(s));
      const std::string path = dir + "/rank" + std::to_string(rank) + ".pt";
      torch::save(sdp, path);
      sdp->gather_full_parameters();
      std::vector<torch::Tensor> full;
      for (const auto& p : nets[rank]->parameters()) full.push_back(p.detach().clone());
      sdp->release_full_parameters();
      std::vector<torch::Tensor> saved;
      for (const auto& p : sdp->parameters()) saved.push_back(p.detach().clone());
      {
        torch::NoGradGuard no_grad;
        for (auto& shard : sdp->parameters()) shard.add_(1.0);
      }
      sdp->shards_changed();
      sdp->gather_full_parameters();  // the full parameters now hold the changed shards

      torch::load(sdp, path);
      auto shards = sdp->parameters();
      for (size_t u = 0; u < saved.size(); ++u) {
        EXPECT_TRUE(torch::equal(shards[u], saved[u])) << "unit " << u;
        EXPECT_TRUE(shards[u].is_same(sdp->flat_shards()[u].shard)) << "the shard was replaced";
      }
      sdp->gather_full_parameters();  // and follow the loaded shards: load() said they changed
      auto params = nets[rank]->parameters();
      for (size_t i = 0; i < full.size(); ++i) EXPECT_TRUE(torch::equal(params[i], full[i])) << i;
      sdp->release_full_parameters();
    });
    std::filesystem::remove_all(dir);
  }
}

TEST(ShardedModule, LoadingAnotherLayoutNamesTheUnit) {
  const std::string dir = testing::temp_dir("dtrain-sharded-module-layout");
  std::filesystem::create_directories(dir);
  std::vector<torch::nn::Sequential> nets{make_sequential(), make_sequential()};
  std::vector<torch::nn::Sequential> others{make_sequential(), make_sequential()};
  std::vector<std::string> errors(2);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    const std::string path = dir + "/rank" + std::to_string(rank) + ".pt";
    ShardedDataParallelOptions one_unit = stage(1);
    one_unit.bucket_cap_bytes = int64_t{1} << 20;  // the whole model in unit0
    {
      ShardedDataParallel sdp(nets[rank], group, one_unit);
      torch::save(sdp, path);
    }
    ShardedDataParallel sdp(others[rank], group, stage(1));
    try {
      torch::load(sdp, path);
    } catch (const UsageError& e) {
      errors[rank] = e.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find("rank " + std::to_string(rank) +
                                "/2: ShardedDataParallel: load: the saved shard of unit0 has"),
              std::string::npos)
        << errors[rank];
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
