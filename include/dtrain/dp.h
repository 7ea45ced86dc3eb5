// dtrain::DataParallel: one process drives several replicas of a model, one thread each, each on
// its own slice of the batch. Unlike LibTorch's torch::nn::parallel::data_parallel, the replicas
// are created once and kept (only their parameters are refreshed from the module before each
// step), and C++ has no GIL, so the replicas' forward and backward passes really run at the same
// time. A torch::nn::Module, as PyTorch's DataParallel is an nn.Module.
//
//   struct NetImpl : torch::nn::Cloneable<NetImpl> { ... };   // replicas are made with clone()
//   TORCH_MODULE(Net);
//   Net net;                                                   // or std::make_shared<NetImpl>()
//   dtrain::DataParallelOptions options;
//   options.num_replicas = 4;                                  // or options.devices = {...}
//   dtrain::DataParallel dp(net, options);
//   torch::optim::SGD opt(dp->parameters(), 0.1);              // the module's own parameters
//   opt.zero_grad();
//   auto loss = dp->forward_backward(x, y, loss_fn);           // fastest: a loss per replica
//   opt.step();
//
// Parameter names: the module is DataParallel's one child, registered as "module", so
// dp->named_parameters() and torch::save(dp, path) say "module.<name>", as PyTorch's DataParallel's
// state_dict() does (Note [DDP parameter names] in dtrain/ddp.h). dp->parameters() are the module's
// own, in its order; dp->train() and eval() reach the module, and the replicas follow it.
//
// Two ways to run a step:
//   forward_backward(x, y, loss_fn): each replica computes its own loss and runs its own backward
//     on its thread; the module's gradients become the gradient of the whole batch's mean loss.
//   forward(x), or dp(x): the replicas' outputs are gathered on the first device for the caller's
//     loss; the caller's backward() then runs through every replica. On CPU that backward runs on
//     the caller's thread alone (LibTorch's autograd engine has one CPU worker: the caller), so
//     forward_backward is the faster mode on CPU; on CUDA each device's part of the backward runs
//     on that device's engine thread.
// Either way the module's .grad holds the full-batch gradient afterwards and the module's optimizer
// steps.
//
// On GPUs (options.devices = {cuda:0, cuda:1, ...}; one GPU may be listed twice) each replica
// thread binds its device and queues its work on a stream of its own; the calls return without
// waiting for the GPUs, ordered with the caller's current streams by events (see Note [Replica
// devices and streams] in src/dp/replica_set.cpp), so the results are used on the caller's streams
// as any other tensor. Pass the batch in pinned host memory (or on the first device): it is
// scattered with non-blocking copies. Mixed precision: a dtrain::amp::Autocast scope around
// forward() or forward_backward() applies in every replica thread (forward and loss; the backward
// runs outside it), and the gradients end on the module, where one GradScaler unscales and checks
// them (no process group needed).
//
// Buffers (e.g. BatchNorm running statistics) follow the module: before every step the replicas
// copy the module's parameters and buffers; the module itself is replica 0, so its buffers are
// updated from the first slice of the batch, and the other replicas' updates are discarded
// (PyTorch's DataParallel rule too). The replicas also follow the module's train()/eval() mode and
// each parameter's requires_grad.
//
// forward() details: parameters are copied at the first forward() after each backward, so several
// forwards feeding one loss (a siamese step) share one copy, and a backward repeated with
// retain_graph adds only its own gradients. The other replicas' gradients reach the module through
// DataParallel's reduction when backward() ends, so torch::autograd::grad() with respect to the
// module's parameters sees only replica 0's share. Keep the DataParallel alive until backward()
// returns. Not for concurrent use from several threads (a second concurrent call is a UsageError).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "dtrain/errors.h"

namespace dtrain {

struct DataParallelOptions {
  // The replicas' devices, the module's own first (it is replica 0 and must already live there).
  // Empty: `num_replicas` replicas on the CPU.
  std::vector<c10::Device> devices;
  // CPU replicas when `devices` is empty: one thread each.
  int num_replicas = 2;
  // Intra-op threads per replica thread: 1 keeps the replicas from competing for cores.
  int intra_op_threads = 1;
};

namespace detail {
class ReplicaSet;
}

// The type-independent part of DataParallelImpl<M>: a module whose one child is the wrapped
// module, registered as "module".
class DataParallelBase : public torch::nn::Module {
 public:
  using Forward = std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>;
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  // Clones the module (it must derive from torch::nn::Cloneable) onto every other device and starts
  // one worker thread per replica. Throws UsageError for an empty device list or a module that
  // cannot clone.
  DataParallelBase(std::shared_ptr<torch::nn::Module> module, Forward forward,
                   DataParallelOptions options);
  ~DataParallelBase() override;
  DataParallelBase(const DataParallelBase&) = delete;
  DataParallelBase& operator=(const DataParallelBase&) = delete;

  // Splits `input` (and `target`) along dimension 0 over the replicas (the first `size % n` get one
  // more row; replicas with no rows sit out), runs forward, loss and backward on each replica's
  // thread, and leaves the whole batch's mean-loss gradient in the module's .grad (accumulated onto
  // what is there, as backward() does). `loss_fn` must return the mean loss over its slice. Returns
  // that whole-batch loss, detached (a float64 scalar on the first device). An exception in a
  // replica is rethrown here, naming the replica; the others finish first.
  at::Tensor forward_backward(const at::Tensor& input, const at::Tensor& target,
                              const LossFn& loss_fn);

  // Splits `input`, runs the replicas' forwards in parallel and returns their outputs concatenated
  // on the first device. The backward through it adds the replicas' gradients into the module's
  // .grad when it ends.
  at::Tensor forward(const at::Tensor& input);

  int num_replicas() const;
  const std::vector<c10::Device>& devices() const;

 private:
  std::unique_ptr<detail::ReplicaSet> replicas_;
};

// DataParallel around a module of type ModuleType (Cloneable, with forward(Tensor)); held by
// DataParallel<ModuleType>.
template <typename ModuleType>
class DataParallelImpl : public DataParallelBase {
 public:
  explicit DataParallelImpl(std::shared_ptr<ModuleType> module, DataParallelOptions options = {})
      : DataParallelBase(
            module,
            [](torch::nn::Module& replica, const at::Tensor& x) {
              // A replica is a clone of the module, of its type: only a cast is needed.
              return dynamic_cast<ModuleType&>(replica).forward(x);
            },
            std::move(options)),
        module_(std::move(module)) {}
  // The module a holder holds (TORCH_MODULE(Net)'s Net, torch::nn::Sequential, ...).
  explicit DataParallelImpl(const torch::nn::ModuleHolder<ModuleType>& module,
                            DataParallelOptions options = {})
      : DataParallelImpl(module.ptr(), std::move(options)) {}

  // The wrapped module (registered as the child "module"; it is replica 0).
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 private:
  std::shared_ptr<ModuleType> module_;
};

// The holder: dp->forward_backward(x, y, loss_fn), dp->forward(x) or dp(x), dp->parameters(),
// dp->module(), torch::save(dp, path). DataParallel dp(net, options) picks the module's type from
// `net` (a std::shared_ptr or a holder).
template <typename ModuleType>
class DataParallel : public torch::nn::ModuleHolder<DataParallelImpl<ModuleType>> {
 public:
  using torch::nn::ModuleHolder<DataParallelImpl<ModuleType>>::ModuleHolder;
  using Impl = DataParallelImpl<ModuleType>;
};

template <typename ModuleType, typename... Rest>
DataParallel(std::shared_ptr<ModuleType>, Rest&&...) -> DataParallel<ModuleType>;
template <typename ModuleType, typename... Rest>
DataParallel(const torch::nn::ModuleHolder<ModuleType>&, Rest&&...) -> DataParallel<ModuleType>;

}  // namespace dtrain
