// dtrain::DistributedDataParallel: one process per device, each with a full replica of the model;
// after every backward the replicas' gradients are averaged, so identical optimizer steps keep them
// identical. A torch::nn::Module, as PyTorch's DistributedDataParallel is an nn.Module.
//
//   auto pg = dtrain::init_process_group();
//   Net net;                                        // TORCH_MODULE(Net); or make_shared<NetImpl>()
//   dtrain::DistributedDataParallel ddp(net, pg);  // broadcasts rank 0's parameters and buffers
//   torch::optim::SGD optimizer(ddp->parameters(), 0.1);  // the module's own parameters
//   auto loss = loss_fn(ddp(x), y);                 // x: this rank's share of the batch
//   loss.backward();                                // gradient all-reduces overlap with backward
//   optimizer.step();
//
// Note [DDP parameter names]
// The wrapped module is DDP's one child, registered as "module", so ddp->named_parameters() and
// torch::save(ddp, path) name every parameter and buffer "module.<its name in the module>", exactly
// as PyTorch's DistributedDataParallel's state_dict() does: checkpoints read and written by the two
// use the same names. ddp->parameters() are the module's parameters themselves, in the module's
// order (DDP adds none); ddp->train() and eval() reach the module; torch::save(ddp->module(), path)
// saves without the prefix. torch::load(ddp, path) copies into the module's tensors in place (see
// load() below).
//
// Note [DDP gradient buckets]
// Parameters are grouped into flat buckets (in reverse registration order, roughly the order
// backward produces gradients; a small first bucket so communication starts early). Each
// parameter's gradient is an alias of its slice of the bucket (gradient_as_bucket_view, the
// default), so backward accumulates straight into it; a hook on the gradient accumulator notes its
// arrival (or copies a gradient that is not the slice, already divided by the world size). When a
// bucket's last gradient arrives its asynchronous all-reduce starts while backward continues on
// earlier layers. Buckets are launched strictly in index order so every rank issues the same
// collectives in the same order. At the end of backward (an autograd engine callback) dtrain waits
// for the buckets; the gradients then hold the average (copied back when gradient_as_bucket_view is
// off). When all ranks share one host the buckets live in shared memory and are reduced where they
// lie, without copies (Note [Gradient buckets in shared memory], src/comm/shared_buckets.h).
//
// Unequal local batches: the averaged gradient is the mean of the ranks' gradients. To get the
// gradient of the whole batch when ranks hold different numbers of samples, scale each rank's
// summed loss by world_size / global_batch (see tools/trainer/strategies.cpp).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/comm.h"

namespace dtrain {

// One bucket's gradients as a communication hook sees them.
struct GradBucket {
  int index = 0;  // 0 = the bucket launched first (the last layers' gradients)
  // Flat gradients of this rank, already divided by the world size; the hook must leave the sum
  // over ranks in it.
  at::Tensor* buffer;
};

// Replaces the plain all-reduce of each bucket, e.g. to compress it. start() is called from
// backward as soon as the bucket is ready and must not block; finish() is called at the end of
// backward, in bucket order, and must leave the reduced gradients in bucket.buffer. `group` is
// DDP's group, lent for the call: a hook runs collectives on it and does not keep it (DDP holds the
// group), which is why it is a reference here and a std::shared_ptr wherever a class keeps a group.
class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual void start(ProcessGroup& group, GradBucket& bucket) = 0;
  virtual void finish(ProcessGroup& group, GradBucket& bucket) = 0;
};

// Built-in compression hooks: all-reduce the bucket in half precision (fp16) or bfloat16, halving
// the bytes on the wire at the cost of rounding each gradient to ~3 (fp16) or ~2 (bf16) significant
// digits.
std::shared_ptr<CommHook> fp16_compress_hook();
std::shared_ptr<CommHook> bf16_compress_hook();

struct DistributedDataParallelOptions {
  // Bucket size cap. Larger buckets mean fewer, more efficient all-reduces but later overlap.
  // PyTorch's default, 25 MiB.
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  // Cap of the first bucket launched (the last layers' gradients): small, so the first all-reduce
  // starts as early as possible in backward (PyTorch uses 1 MiB too).
  int64_t first_bucket_cap_bytes = int64_t{1} << 20;
  // Allow parameters that get no gradient in a step (unused branches). Costs one small extra
  // all-reduce per step and the overlap of buckets that wait for such parameters. As in PyTorch, a
  // parameter that any rank used in any backward since the last averaging one (no_sync() ones
  // included) gets the average on every rank, a rank that did not use it counting its .grad as it
  // stands (zeros if undefined); one no rank used keeps its .grad as it was.
  bool find_unused_parameters = false;
  // Broadcast rank 0's buffers (e.g. BatchNorm running statistics) before every forward.
  bool broadcast_buffers = true;
  // Each parameter's .grad is an alias of its slice of the bucket, so backward accumulates straight
  // into the bucket and the averaged result needs no copy back: saves two passes over every
  // gradient and the memory of a second copy (on one host, 2 ranks: ~10% of a step; see
  // doc/benchmarks.md). On by default, unlike PyTorch's, whose Python-level views can break
  // detach_(); these aliases cannot. Gradients behave as usual: zero_grad() zeroes them in place,
  // one set to undefined (zero_grad(set_to_none), LibTorch 2.x's default) is re-pointed at the
  // bucket in the next backward at the cost of one copy, and a parameter unused on every rank
  // (find_unused_parameters) keeps its .grad as it was. false: gradients and buckets are separate,
  // copied into the bucket during backward and back after the all-reduce.
  bool gradient_as_bucket_view = true;
  // Start each bucket's all-reduce during backward (true) or all of them after backward (false,
  // only for measuring what overlap buys).
  bool overlap = true;
  // Replaces the plain all-reduce of each bucket (nullptr: all-reduce in the gradients' own
  // precision). A hook keeps per-bucket state: give each DDP instance its own.
  std::shared_ptr<CommHook> comm_hook;
};

namespace detail {
class Reducer;
}

// The type-independent part of DistributedDataParallelImpl<M>: a module whose one child is the
// wrapped module, registered as "module" (Note [DDP parameter names]).
class DistributedDataParallelBase : public torch::nn::Module {
 public:
  // Broadcasts parameters (frozen ones, requires_grad false, included, as PyTorch does) and
  // buffers from rank 0 and checks that every rank has the same parameters (names, shapes, dtypes,
  // which are frozen); a mismatch is a UsageError naming the first differing parameter and the
  // ranks that differ. Blocks until every rank of `group` has constructed its DDP (up to the
  // timeout).
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                              std::shared_ptr<ProcessGroup> group,
                              DistributedDataParallelOptions options = {});
  ~DistributedDataParallelBase() override;
  DistributedDataParallelBase(const DistributedDataParallelBase&) = delete;
  DistributedDataParallelBase& operator=(const DistributedDataParallelBase&) = delete;

  // While the returned guard lives, forward/backward passes only accumulate local gradients
  // (gradient accumulation); the first backward after it ends averages everything accumulated.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallelBase& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallelBase& ddp_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  const std::shared_ptr<ProcessGroup>& group() const;
  // The buckets as built: for each bucket, the indices of its parameters in module->parameters()
  // order.
  std::vector<std::vector<size_t>> bucket_layout() const;

  // Call before running the module's forward yourself (forward() does it). `samples`: rows of this
  // rank's input, for DTRAIN_PROFILE's record (0: unknown).
  void prepare_forward(int64_t samples = 0);
  // Call after the module's forward, when running it yourself (only DTRAIN_PROFILE's record needs
  // it).
  void forward_done();

  // torch::load(ddp, path): copies every saved parameter and buffer into the module's own
  // tensors in place. (torch::nn::Module's load would set_() each tensor to the one read, and
  // set_() gives a parameter a new gradient accumulator: DDP's hooks stay on the old one and
  // gradients would silently stop being averaged. The same holds for torch::load(module, path)
  // after wrapping it: load the module before wrapping it, or through the DDP.) Throws
  // UsageError naming a tensor whose saved shape differs.
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  std::unique_ptr<detail::Reducer> reducer_;
};

// DDP around a module of type ModuleType (anything with a forward()); held by
// DistributedDataParallel<ModuleType>, as LibTorch's modules are held by their TORCH_MODULE
// holders.
template <typename ModuleType>
class DistributedDataParallelImpl : public DistributedDataParallelBase {
 public:
  DistributedDataParallelImpl(std::shared_ptr<ModuleType> module,
                              std::shared_ptr<ProcessGroup> group,
                              DistributedDataParallelOptions options = {})
      : DistributedDataParallelBase(module, std::move(group), std::move(options)),
        module_(std::move(module)) {}
  // The module a holder holds (TORCH_MODULE(Net)'s Net, torch::nn::Sequential, ...).
  DistributedDataParallelImpl(const torch::nn::ModuleHolder<ModuleType>& module,
                              std::shared_ptr<ProcessGroup> group,
                              DistributedDataParallelOptions options = {})
      : DistributedDataParallelImpl(module.ptr(), std::move(group), std::move(options)) {}

  // Runs the wrapped module's forward on this rank's inputs (see prepare_forward()).
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    prepare_forward(rows_of_first(args...));
    decltype(auto) output = module_->forward(std::forward<Args>(args)...);
    forward_done();
    return output;
  }

  // The wrapped module (registered as the child "module").
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 private:
  // The batch size, when the first argument is a tensor (the usual forward(x)).
  template <typename First, typename... Rest>
  static int64_t rows_of_first(const First& first, const Rest&...) {
    if constexpr (std::is_same_v<std::decay_t<First>, at::Tensor>) {
      return first.dim() > 0 ? first.size(0) : 0;
    } else {
      return 0;
    }
  }
  static int64_t rows_of_first() { return 0; }

  std::shared_ptr<ModuleType> module_;
};

// The holder: ddp->forward(x) or ddp(x), ddp->parameters(), ddp->module(), torch::save(ddp, path).
// Constructed from the module as a std::shared_ptr or in its holder, the group, the options; the
// deduction guides below make DistributedDataParallel ddp(net, pg) pick the module's type.
template <typename ModuleType>
class DistributedDataParallel
    : public torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleType>> {
 public:
  using torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleType>>::ModuleHolder;
  using Impl = DistributedDataParallelImpl<ModuleType>;

  // ddp(x), as ddp->forward(x). (ModuleHolder's own operator() does not see a forward() that is a
  // template, as this one is to take whatever the module's forward takes.)
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

template <typename ModuleType, typename... Rest>
DistributedDataParallel(std::shared_ptr<ModuleType>, Rest&&...)
    -> DistributedDataParallel<ModuleType>;
template <typename ModuleType, typename... Rest>
DistributedDataParallel(const torch::nn::ModuleHolder<ModuleType>&, Rest&&...)
    -> DistributedDataParallel<ModuleType>;

}  // namespace dtrain
