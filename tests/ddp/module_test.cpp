// DistributedDataParallel as a torch::nn::Module (Note [DDP parameter names] in dtrain/ddp.h): its
// parameters are the module's own under the prefix "module.", train() and eval() reach the module,
// torch::save and torch::load go through it, and it takes the module in each form LibTorch programs
// hold one (a std::shared_ptr, a TORCH_MODULE holder, a Sequential). Two thread-ranks over a
// memory:// store.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "dtrain/ddp.h"
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

// Made on the calling thread: the thread-ranks share torch's generator, which is not for concurrent
// use.
std::vector<Net> make_nets() { return {Net(), Net()}; }

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// Whether both ranks hold equal copies of `t`.
bool ranks_agree(ProcessGroup& group, const torch::Tensor& t) {
  std::vector<torch::Tensor> all(group.size());
  for (auto& a : all) a = torch::empty_like(t);
  group.all_gather(all, t.detach().contiguous());
  return torch::equal(all[0], all[1]);
}

TEST(DdpModule, ParametersAreTheModulesOwnUnderTheModulePrefix) {
  auto nets = make_nets();
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    std::shared_ptr<NetImpl> net = nets[rank].ptr();
    DistributedDataParallel ddp(net, group);
    static_assert(std::is_same_v<decltype(ddp), DistributedDataParallel<NetImpl>>);
    EXPECT_EQ(ddp->module(), net);

    std::vector<std::string> names;
    for (const auto& item : ddp->named_parameters()) names.push_back(item.key());
    EXPECT_EQ(names, (std::vector<std::string>{"module.fc1.weight", "module.fc1.bias",
                                               "module.fc2.weight", "module.fc2.bias"}));
    // The same tensors in the same order, none doubled: an optimizer over either is the same.
    auto wrapped = ddp->parameters(), own = net->parameters();
    ASSERT_EQ(wrapped.size(), own.size());
    for (size_t i = 0; i < own.size(); ++i) EXPECT_TRUE(wrapped[i].is_same(own[i])) << i;
  });
}

TEST(DdpModule, TrainAndEvalReachTheModule) {
  auto nets = make_nets();
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Net net = nets[rank];
    DistributedDataParallel ddp(net, group);
    ddp->eval();
    EXPECT_FALSE(ddp->is_training());
    EXPECT_FALSE(net->is_training());
    EXPECT_FALSE(net->drop->is_training());
    auto x = torch::ones({4, 6});
    EXPECT_TRUE(torch::equal(ddp(x), net->forward(x))) << "dropout still on after ddp->eval()";
    ddp->train();
    EXPECT_TRUE(net->drop->is_training());
  });
}

TEST(DdpModule, TakesAHolderAndASequentialAndTrainsThroughOperatorCall) {
  auto nets = make_nets();
  std::vector<torch::nn::Sequential> sequentials;
  for (int rank = 0; rank < 2; ++rank) {
    sequentials.emplace_back(torch::nn::Linear(6, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
  }
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Net net = nets[rank];
    DistributedDataParallel held(net, group);
    static_assert(std::is_same_v<decltype(held), DistributedDataParallel<NetImpl>>);
    EXPECT_EQ(held->module(), net.ptr());

    torch::nn::Sequential sequential = sequentials[rank];
    DistributedDataParallel ddp(sequential, group);
    static_assert(
        std::is_same_v<decltype(ddp), DistributedDataParallel<torch::nn::SequentialImpl>>);
    EXPECT_EQ(ddp->module(), sequential.ptr());
    EXPECT_EQ(ddp->named_parameters().keys().front(), "module.0.weight");
    // Each rank its own data: only DDP's averaging makes the gradients agree.
    ddp(torch::full({3, 6}, 1.0 + rank)).sum().backward();
    EXPECT_TRUE(ranks_agree(*group, sequential->parameters()[0].grad()));
  });
}

TEST(DdpModule, SaveAndLoadGoThroughTheWrapperUnderPyTorchsNames) {
  auto nets = make_nets();
  const std::string dir = testing::temp_dir("dtrain-ddp-module");
  std::filesystem::create_directories(dir);
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Net net = nets[rank];
    DistributedDataParallel ddp(net, group);
    const std::string path = dir + "/rank" + std::to_string(rank) + ".pt";
    torch::save(ddp, path);
    auto saved = copies(net->parameters());
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.add_(1.0);
    }
    torch::load(ddp, path);
    auto loaded = net->parameters();
    for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << i;

    // The file holds the module under "module", as PyTorch's DistributedDataParallel names it.
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    // "module.fc1.weight": an archive per module on the path.
    torch::serialize::InputArchive module, fc1;
    ASSERT_TRUE(archive.try_read("module", module));
    ASSERT_TRUE(module.try_read("fc1", fc1));
    torch::Tensor weight;
    ASSERT_TRUE(fc1.try_read("weight", weight));
    EXPECT_TRUE(torch::equal(weight, saved[0]));

    // Training goes on after the load: the gradients are still averaged.
    ddp(torch::full({2, 6}, 1.0 + rank)).sum().backward();
    EXPECT_TRUE(ranks_agree(*group, net->fc1->weight.grad()));
  });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
