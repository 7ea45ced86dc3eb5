// dtrain::ShardedDataParallel: data parallelism that splits the training state over the ranks
// instead of replicating it (ZeRO stages 1-3; PyTorch's FSDP and ZeroRedundancyOptimizer). A
// torch::nn::Module whose parameters are this rank's shards.
//
//   auto pg = dtrain::init_process_group();
//   torch::nn::Sequential net(torch::nn::Linear(784, 512), torch::nn::ReLU(), ...);
//   dtrain::ShardedDataParallelOptions options;
//   options.stage = 3;
//   dtrain::ShardedDataParallel sdp(net, pg, options);
//   torch::optim::Adam opt(sdp->parameters(), 1e-3);  // this rank's shards, NOT net->parameters()
//   auto loss = loss_fn(sdp(x), y);                    // x: this rank's share of the batch
//   loss.backward();                                   // reductions overlap with backward
//   opt.step();                                        // updates this rank's shards only
//   sdp->gather_full_parameters();                     // to evaluate or save the full module now
//   if (rank == 0) evaluate(sdp->module());            // the module itself: sdp(x) is collective
//
// Note [Sharded parameter names]
// As FSDP's sharded state dict, the module's parameters are this rank's shards: sdp->parameters()
// returns one flat 1-D shard per unit (the tensors the optimizer must be built over), and
// sdp->named_parameters() names them by their unit ("unit0", "unit1", ...: FlatShard::key). The
// wrapped module is not a child (its full parameters only mirror the shards; ZeRO's point is that
// the optimizer never sees them), so torch::save(sdp, path) writes this rank's shards, and
// torch::load(sdp, path) copies a file saved at the same world size and layout back into them;
// buffers are not included (as in sharded checkpoints). For checkpoints that reshard, see
// dtrain/sharded_checkpoint.h. sdp->module() is the module; sdp->train() and eval() reach it.
//
// Note [Sharded data parallelism]
// Parameters are grouped into units. A unit's parameters lie end to end in one flat buffer of
// full_numel elements, padded to a multiple of the world size N; rank r owns the slice
// [r*S, (r+1)*S), S = padded / N. That slice is a leaf tensor, the "shard parameter"; the user's
// optimizer is built over the shards (parameters()), so each rank holds optimizer state for 1/N of
// the model. The module's own parameters become views into their unit's flat buffer.
// Bytes per rank by stage (Ψ parameters, fp32, Adam's two moments; the ZeRO paper's formulas):
//   stage 1  Full parameters and full gradients stay. Gradients are all-reduced in buckets (the
//            units) during backward, as DDP does; a rank's shard gradient is its slice of the
//            averaged flat gradient (an alias, no copy). After the step the updated slices are
//            all-gathered into the full parameters, lazily before the next forward.
//            4Ψ + 4Ψ + 8Ψ/N = 8Ψ + 8Ψ/N.
//   stage 2  As stage 1, but each unit's gradients are reduce-scattered as soon as backward has
//            produced them, and the full gradients are dropped: only the shard gradient stays.
//            4Ψ + 12Ψ/N.
//   stage 3  Parameters are sharded too. Units come from a wrapping policy over a Sequential's
//            children (any other module is one unit). A unit's full parameters exist only while it
//            computes: all-gathered just before its forward (the next unit's gather starts
//            meanwhile, so it overlaps), freed after it; gathered again before its backward (the
//            unit before it prefetched) and freed once its gradients are reduce-scattered. Freeing
//            empties the flat buffer's storage itself, so views autograd saved hold no memory
//            either. 16Ψ/N + the units gathered at the time (one, two while prefetching).
// Communication per step, against DDP's one all-reduce of the gradients: stage 1 all-reduces (as
// specified: every rank keeps the full averaged gradient, e.g. for clipping by global norm) and
// all-gathers, 1.5x; stage 2 reduce-scatters and all-gathers, 1x; stage 3 gathers twice, 1.5x.
// Between steps the module's parameters are views of the flat buffers (stages 1-2) or empty
// tensors of shape {0} (stage 3, outside its forward and backward). Forward must go through
// ShardedDataParallel; gradient accumulation goes through no_sync(). Parameters that do not
// require gradients (frozen) are in no unit: every rank keeps them whole at every stage, starting
// from rank 0's values as the buffers do.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/comm.h"

namespace torch::nn {
class SequentialImpl;
}  // namespace torch::nn

namespace dtrain {

// How stage 3 groups a Sequential's children into units (stages 1-2: see bucket_cap_bytes).
enum class WrapPolicy {
  // Consecutive children are joined until the unit holds at least min_unit_params parameters;
  // children without parameters (activations) join the unit before them.
  kMinParams,
  // Every child is its own unit; a child without parameters is an error.
  kEveryChild,
};

struct ShardedDataParallelOptions {
  // 1: shard optimizer state; 2: and gradients; 3: and parameters. Note [Sharded data parallelism].
  int stage = 1;
  // Stages 1-2: a unit (a bucket of gradients reduced together, and of parameters gathered
  // together) holds at most this many bytes of parameters, in reverse registration order as DDP's
  // buckets.
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  // Stage 3: how a Sequential's children become units.
  WrapPolicy wrap_policy = WrapPolicy::kMinParams;
  int64_t min_unit_params = 1;  // kMinParams: 1 = every child with parameters is a unit
  // Stage 3: start the next unit's all-gather while the current one computes (both directions).
  bool prefetch = true;
};

// Where one named parameter of the module lives in its unit's flat buffer.
struct ParamExtent {
  std::string name;  // as module->named_parameters() names it
  std::vector<int64_t> shape;
  int64_t offset = 0;  // first element in the unit's flat buffer
};

// One unit's shard on this rank, for sharded checkpoints.
struct FlatShard {
  std::string key;     // "unit0", "unit1", ...: unique per unit, stable across world sizes
  at::Tensor shard;    // the shard parameter itself (1-D, S elements; the padding is at the end of
                       // the last ranks' shards); writing into it in place changes the model
  int64_t offset = 0;  // first element of the shard in the flat buffer (= rank * S)
  int64_t full_numel = 0;  // unpadded length of the flat buffer
  std::vector<ParamExtent> params;
};

// What ShardedDataParallel sent through collectives since it was built: payload bytes per kind (the
// full, padded flat buffers). Per rank on the wire each transport moves (N-1)/N of an all-gather's
// or reduce-scatter's payload and twice that of an all-reduce's (over Gloo the reduce-scatter is an
// all-to-all, which moves the same: Note [Reduce-scatter over Gloo] in src/comm/process_group.cpp).
struct ShardedCommStats {
  int64_t all_reduce_bytes = 0;      // stage 1 gradients
  int64_t reduce_scatter_bytes = 0;  // stages 2-3 gradients
  int64_t all_gather_bytes = 0;      // parameters
  int64_t broadcast_bytes = 0;       // rank 0's initial parameters, frozen ones included
};

namespace detail {
class ShardedState;
struct ShardedPipelineSteps;  // src/sharded/pipeline_steps.h: DistributedPipeline's ZeRO
}  // namespace detail

// The type-independent part of ShardedDataParallelImpl<M>: a module whose parameters are this
// rank's shards (Note [Sharded parameter names]).
class ShardedDataParallelBase : public torch::nn::Module {
 public:
  // Checks every rank has the same parameters (names, shapes, dtypes; frozen ones too), broadcasts
  // rank 0's parameters (frozen ones included) and buffers, builds the units and the shards. Blocks
  // until every rank of `group` has constructed it (up to the timeout). Throws UsageError for a
  // module that cannot be sharded as asked (a parameter shared between two units, a stage-3 unit
  // without parameters, a stage outside 1..3).
  ShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                          std::shared_ptr<ProcessGroup> group,
                          ShardedDataParallelOptions options = {});
  ~ShardedDataParallelBase() override;
  ShardedDataParallelBase(const ShardedDataParallelBase&) = delete;
  ShardedDataParallelBase& operator=(const ShardedDataParallelBase&) = delete;

  // parameters() (torch::nn::Module's) are the shard parameters of this rank, one per unit: build
  // the optimizer over these.
  int stage() const;
  const std::shared_ptr<ProcessGroup>& group() const;

  // While the returned guard lives, backward passes only accumulate local full gradients; the first
  // backward after it ends reduces everything accumulated (costs the memory of full gradients
  // meanwhile).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(ShardedDataParallelBase& sdp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    ShardedDataParallelBase& sdp_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Makes the module's full parameters hold the current shards now (always all-gathers; collective:
  // every rank calls it). Stages 1-2 do this lazily before the next forward anyway; call it to
  // evaluate or save the full module right after a step. Any time is safe, between backward and
  // step too: the forward after a reduction gathers again whether or not this was called (dtrain
  // cannot see the optimizer's step), so that step costs one all-gather more. Stage 3: the full
  // parameters stay materialized (the whole model's memory), holding the shards as of this call,
  // until release_full_parameters() or the next forward, which gathers afresh. To evaluate on some
  // ranks only, run sdp->module()'s forward there: a forward through the wrapper may gather, which
  // every rank must join.
  void gather_full_parameters();
  // Stage 3: frees what gather_full_parameters() materialized (no communication). Else a no-op.
  void release_full_parameters();

  // For sharded checkpoints: every unit's shard on this rank, in unit order.
  std::vector<FlatShard> flat_shards() const;
  // After the shard parameters were overwritten in place (a checkpoint load), make the full
  // parameters (stages 1-2) or the next gathers (stage 3) reflect them. Local; the gather happens
  // lazily. Stages 1-2's next forward also notices writes through the shard tensors by their
  // version counters, not writes through .data() or other tensors over their memory; stage 3 frees
  // the full parameters gathered before the write.
  void shards_changed();

  // Collective payload bytes issued so far (for measuring communication per step).
  ShardedCommStats comm_stats() const;

  // Stage 3 on a Sequential: runs the units' forwards one after another, gathering, prefetching and
  // freeing; for another module (or stages 1-2) call prepare_forward(), run the module, then
  // finish_forward() on its output. ShardedDataParallel<M>::forward does this for you.
  at::Tensor forward_units(const at::Tensor& input);
  void prepare_forward();
  at::Tensor finish_forward(const at::Tensor& output);
  bool drives_units() const;  // true: forward goes through forward_units()

  // torch::nn::Module's, extended to the wrapped module (not a child): train/eval mode reaches it.
  void train(bool on = true) override;
  // Reads this rank's shards by their keys and copies them into the shard parameters in place (the
  // default load would replace the shards' storage, which the flat buffers share), then
  // shards_changed(). Throws UsageError naming the unit whose saved shard has another size.
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  std::unique_ptr<detail::ShardedState> state_;

 private:
  friend struct detail::ShardedPipelineSteps;
};

// ShardedDataParallel around a module of type ModuleType; held by
// ShardedDataParallel<ModuleType>.
template <typename ModuleType>
class ShardedDataParallelImpl : public ShardedDataParallelBase {
 public:
  ShardedDataParallelImpl(std::shared_ptr<ModuleType> module, std::shared_ptr<ProcessGroup> group,
                          ShardedDataParallelOptions options = {})
      : ShardedDataParallelBase(module, std::move(group), options), module_(std::move(module)) {}
  // The module a holder holds (TORCH_MODULE(Net)'s Net, torch::nn::Sequential, ...).
  ShardedDataParallelImpl(const torch::nn::ModuleHolder<ModuleType>& module,
                          std::shared_ptr<ProcessGroup> group,
                          ShardedDataParallelOptions options = {})
      : ShardedDataParallelImpl(module.ptr(), std::move(group), options) {}

  // Runs the module's forward on this rank's inputs. Stage 3 on a Sequential gathers each unit's
  // parameters in turn (one tensor in, one out); otherwise the whole module runs between
  // prepare_forward() and finish_forward().
  template <typename... Args>
  at::Tensor forward(Args&&... args) {
    // Any Sequential, a class derived from SequentialImpl too (its own forward() is not used).
    if constexpr (std::is_base_of_v<torch::nn::SequentialImpl, ModuleType> &&
                  sizeof...(Args) == 1) {
      if (drives_units()) return forward_units(std::forward<Args>(args)...);
    }
    prepare_forward();
    return finish_forward(module_->forward(std::forward<Args>(args)...));
  }

  // The wrapped module (not a child: see Note [Sharded parameter names]).
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 private:
  std::shared_ptr<ModuleType> module_;
};

// The holder: sdp->forward(x) or sdp(x), sdp->parameters() (the shards), sdp->module(),
// torch::save(sdp, path). ShardedDataParallel sdp(net, pg, options) picks the module's type from
// `net` (a std::shared_ptr or a holder).
template <typename ModuleType>
class ShardedDataParallel : public torch::nn::ModuleHolder<ShardedDataParallelImpl<ModuleType>> {
 public:
  using torch::nn::ModuleHolder<ShardedDataParallelImpl<ModuleType>>::ModuleHolder;
  using Impl = ShardedDataParallelImpl<ModuleType>;

  // sdp(x), as sdp->forward(x). (ModuleHolder's own operator() does not see a forward() that is a
  // template.)
  template <typename... Args>
  at::Tensor operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

template <typename ModuleType, typename... Rest>
ShardedDataParallel(std::shared_ptr<ModuleType>, Rest&&...) -> ShardedDataParallel<ModuleType>;
template <typename ModuleType, typename... Rest>
ShardedDataParallel(const torch::nn::ModuleHolder<ModuleType>&, Rest&&...)
    -> ShardedDataParallel<ModuleType>;

}  // namespace dtrain
