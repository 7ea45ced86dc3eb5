// ShardedDataParallel (ZeRO stages 1-3): units and their flat buffers, the shard parameters, the
// gradient hooks that reduce each unit as soon as backward has produced it, and the stage-3
// schedule that gathers, prefetches and frees units around their forward and backward. See Note
// [Sharded data parallelism] in dtrain/sharded.h. Over 600 lines on purpose: every part reads
// and changes ShardedState's per-unit state (which unit is gathered, whose gradients are in
// flight), and its invariants are easier to check with all their writers in one file.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/serialize/input-archive.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "common/format.h"
#include "common/gradient_sync.h"
#include "dtrain/sharded.h"
#include "sharded/flat_storage.h"
#include "sharded/pipeline_steps.h"

namespace dtrain {
namespace detail {
namespace {

// Calls back before AccumulateGrad runs (LibTorch 1.13 cannot remove such a hook: it checks that
// its ShardedDataParallel still exists).
class BeforeAccumulateHook : public torch::autograd::FunctionPreHook {
 public:
  BeforeAccumulateHook(std::weak_ptr<int> alive, std::function<void()> before)
      : alive_(std::move(alive)), before_(std::move(before)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (alive_.lock()) before_();
    return grads;
  }

 private:
  std::weak_ptr<int> alive_;
  std::function<void()> before_;
};

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

class ShardedState;

// Marks the point in backward where a stage-3 unit's output gradient arrives, i.e. just before the
// unit's own backward runs: there its parameters are gathered again (and the unit before it
// prefetched).
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor output, int64_t unit,
                            int64_t state) {
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["state"] = state;
    return output.view_as(output);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

struct ShardedParam {
  at::Tensor tensor;  // the module's parameter
  std::string name;   // as module->named_parameters() names it
  size_t unit = 0;
  int64_t offset = 0;    // first element in the unit's flat buffer
  at::Tensor full_view;  // its place in the unit's flat buffer, shaped like the parameter
  at::Tensor parked;     // stage 3: what the parameter holds while its unit is freed (shape {0})
  at::Tensor
      sentinel;  // the placeholder gradient left after a reduction (see check_full_parameters)
  std::unique_ptr<GradientReadyHook> hook;  // calls on_gradient_ready
  int64_t version = 0;                      // tensor._version() when dtrain last looked
  bool placeholder = false;                 // its .grad is `sentinel`, set after the last reduction
  int64_t sentinel_version = 0;
  bool ready = false;  // its gradient arrived in this backward
};

struct Unit {
  std::string key;
  std::vector<size_t> params;  // indices into params_, in flat-buffer order
  int64_t full_numel = 0;
  int64_t padded_numel = 0;  // full_numel rounded up to a multiple of the world size
  int64_t shard_numel = 0;   // S = padded_numel / world size
  at::Tensor flat;           // the full parameters (stage 3: its storage is freed between uses)
  at::Tensor shard;          // the shard parameter: a leaf the user's optimizer updates
  at::Tensor
      flat_grad;  // stage 1: kept (the shard gradient aliases it); stages 2-3: while reducing
  at::Tensor grad_alias;  // stage 1: this rank's slice of flat_grad, the shard parameter's gradient
  at::Tensor incoming;    // stages 2-3: this rank's reduced shard gradient
  at::Tensor carried;     // stage 1: a shard gradient the user left to accumulate into
  size_t pending = 0;     // parameters whose gradient has not arrived in this backward
  bool launched = false;
  Work reduction;
  Work gather;  // stage 3: the all-gather in flight
  bool gathering = false;
  bool gathered = true;  // the flat buffer holds the full parameters
  // shard._version() when the flat buffer last took every rank's shard (stages 1-2): an in-place
  // change since (the optimizer's step, a load) makes the next forward gather again.
  int64_t gathered_version = 0;
  size_t first_child = 0, end_child = 0;  // stage 3 over a Sequential: its children [first, end)
};

class ShardedState {
 public:
  ShardedState(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
               ShardedDataParallelOptions options);
  ~ShardedState();

  std::string who() const { return rank_text(*group_) + ": ShardedDataParallel"; }

  void prepare_forward();
  at::Tensor finish_forward(const at::Tensor& output);
  at::Tensor forward_units(const at::Tensor& input);
  void before_unit_backward(size_t unit);
  void gather_full_parameters();
  void release_full_parameters();
  void shards_changed();
  void begin_pipeline_step();
  void set_sync_next_backward(bool sync);
  void finish_pipeline_step();
  void end_pipeline_step(bool completed) noexcept;

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<torch::nn::SequentialImpl>
      sequential_;  // stage 3 drives its children unit by unit
  std::shared_ptr<ProcessGroup> group_;
  ShardedDataParallelOptions options_;
  std::vector<ShardedParam> params_;
  // Parameters that do not require gradients: never sharded or reduced, but every rank must hold
  // rank 0's values (as PyTorch's DDP and FSDP's sync_module_states), so they are broadcast with
  // the buffers. Stage 3 keeps them whole on every rank.
  std::vector<NamedParameter> frozen_;
  std::vector<Unit> units_;
  std::atomic<int> no_sync_depth_{0};
  ShardedCommStats stats_;

 private:
  void collect_parameters();
  void check_same_parameters_everywhere();
  void broadcast_unsharded_state();
  void build_buckets();
  void build_wrapped_units();
  void build_flat_buffers();
  void register_hooks();
  void check_full_parameters();
  void record_versions();
  bool shards_moved() const;
  void all_gather_units();
  void start_gather(size_t unit);
  void materialize(size_t unit);
  void park(size_t unit);
  void start_backward();
  void on_gradient_ready(size_t index);
  void on_unit_complete(size_t unit);
  void launch_reduction(size_t unit);
  void finalize_backward();
  void complete_reductions();
  void reset_iteration();

  int rank_ = 0;
  int world_ = 1;
  std::shared_ptr<int> alive_ =
      std::make_shared<int>(0);  // expires with this object (see BeforeAccumulateHook)
  std::recursive_mutex mutex_;   // hooks of a CUDA backward may run on several device threads
  at::Tensor
      inverse_world_size_;  // 0-dim: gradients are divided on their way into the flat buffers
  at::Tensor zero_scalar_;  // 0-dim: the memory behind stages 1-2's placeholder gradients
  bool sync_this_backward_ = true;
  bool backward_started_ = false;
  size_t next_to_launch_ = 0;  // stages 1-2 launch reductions in unit order, as DDP does buckets
  // Stages 1-2: a reduction (which the optimizer's step follows) or shards_changed() since the
  // last all-gather before a forward. Only that gather clears it, not gather_full_parameters(): the
  // library cannot see opt.step(), so a gather between backward and step must not count as the
  // gather after the step (Note [When stages 1-2 gather]).
  bool shards_may_have_changed_ = false;
  // Inside a pipeline step (pipeline_steps.h): stage 3's units stay gathered until it ends, and the
  // reductions its last backward launched are waited for by finish_pipeline_step, not by that
  // backward's end (reductions_to_finish_).
  bool in_pipeline_step_ = false;
  bool reductions_to_finish_ = false;
  // A pipeline step failed after launching reductions: the ranks are out of step, which the next
  // forward reports (as prepare_forward does for a backward that stopped partway).
  bool out_of_step_ = false;
};

ShardedState::ShardedState(std::shared_ptr<torch::nn::Module> module,
                           std::shared_ptr<ProcessGroup> group, ShardedDataParallelOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  if (!group_) throw UsageError("ShardedDataParallel: the process group is null");
  if (!module_) throw UsageError(who() + ": the module is null");
  rank_ = group_->rank();
  world_ = group_->size();
  if (options_.stage < 1 || options_.stage > 3) {
    throw UsageError(
        who() + ": stage " + std::to_string(options_.stage) +
        " does not exist; expected 1 (optimizer state sharded), 2 (and gradients) or 3 (and "
        "parameters)");
  }
  if (options_.bucket_cap_bytes <= 0 || options_.min_unit_params < 1) {
    throw UsageError(who() + ": bucket_cap_bytes and min_unit_params must be positive");
  }
  collect_parameters();
  check_same_parameters_everywhere();
  if (options_.stage == 3) {
    sequential_ = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_);
    build_wrapped_units();
  } else {
    build_buckets();
  }
  inverse_world_size_ = at::scalar_tensor(1.0 / world_, at::kDouble);
  zero_scalar_ = at::zeros({}, params_.front().tensor.options().requires_grad(false));
  build_flat_buffers();
  // While the parameters still have their full shapes: autograd's accumulators record them.
  register_hooks();
  if (options_.stage == 3) {
    for (size_t u = 0; u < units_.size(); ++u) park(u);
  }
  record_versions();
}

ShardedState::~ShardedState() {
  for (auto& unit : units_) {
    // Collectives still in flight write into buffers this object owns.
    for (Work* work : {&unit.reduction, &unit.gather}) {
      try {
        if (unit.launched || unit.gathering) work->wait();
      } catch (const std::exception&) {
      }
    }
  }
  alive_.reset();
  // The post hooks go with params_.
}

void ShardedState::collect_parameters() {
  std::unordered_set<const void*> seen;  // a parameter registered twice (tied) is one parameter
  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    if (!item.value().requires_grad()) {
      frozen_.emplace_back(item.key(), item.value());
      continue;
    }
    ShardedParam p;
    p.tensor = item.value();
    p.name = item.key();
    params_.push_back(std::move(p));
  }
  if (params_.empty()) {
    throw UsageError(who() +
                     ": the module has no trainable parameters; there is nothing to shard. Wrap a "
                     "module with parameters that require gradients.");
  }
}

void ShardedState::check_same_parameters_everywhere() {
  std::vector<NamedParameter> named;
  for (const auto& p : params_) named.emplace_back(p.name, p.tensor);
  // The frozen ones after them (a trainable parameter keeps its number in the message): their
  // shapes must agree too, or the broadcast of rank 0's values could not fill them.
  named.insert(named.end(), frozen_.begin(), frozen_.end());
  check_same_parameters(*group_, named, "ShardedDataParallel");
}

void ShardedState::build_buckets() {
  // As DDP's buckets (without its small first bucket): see assign_buckets.
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  for (auto& indices :
       assign_buckets(tensors, options_.bucket_cap_bytes, options_.bucket_cap_bytes)) {
    units_.emplace_back();
    units_.back().params = std::move(indices);
  }
}

void ShardedState::build_wrapped_units() {
  std::unordered_map<const void*, size_t> index_of;
  for (size_t i = 0; i < params_.size(); ++i) index_of[params_[i].tensor.unsafeGetTensorImpl()] = i;
  if (!sequential_) {  // no children to drive: the whole module is one unit
    units_.emplace_back();
    for (size_t i = 0; i < params_.size(); ++i) units_[0].params.push_back(i);
    return;
  }
  std::vector<int> unit_of(params_.size(), -1);
  std::vector<size_t> child_of(params_.size(), 0);
  const size_t children = sequential_->size();
  std::vector<int64_t> unit_numel;
  for (size_t c = 0; c < children; ++c) {
    std::vector<size_t> own;  // the child's parameters, in registration order
    for (auto& t : sequential_->ptr(c)->parameters(/*recurse=*/true)) {
      auto found = index_of.find(t.unsafeGetTensorImpl());
      if (found != index_of.end()) own.push_back(found->second);
    }
    int64_t numel = 0;
    for (size_t i : own) numel += params_[i].tensor.numel();
    bool new_unit = units_.empty();
    if (options_.wrap_policy == WrapPolicy::kEveryChild) {
      if (own.empty()) {
        throw UsageError(
            who() + ": stage 3 unit for child " + std::to_string(c) + " ('" +
            sequential_->ptr(c)->name() +
            "') would have no parameters; with WrapPolicy::kEveryChild every child of the "
            "Sequential must have trainable parameters. Use WrapPolicy::kMinParams (it folds "
            "parameterless children such as activations into the unit before them).");
      }
      new_unit = true;
    } else if (!units_.empty() && numel > 0 && unit_numel.back() >= options_.min_unit_params) {
      new_unit = true;
    }
    if (new_unit) {
      units_.emplace_back();
      units_.back().first_child = c;
      unit_numel.push_back(0);
    }
    Unit& unit = units_.back();
    unit.end_child = c + 1;
    const int u = static_cast<int>(units_.size() - 1);
    for (size_t i : own) {
      if (unit_of[i] >= 0 && unit_of[i] != u) {
        throw UsageError(
            who() + ": parameter '" + params_[i].name + "' is used by child " +
            std::to_string(child_of[i]) + " (stage 3 unit " + std::to_string(unit_of[i]) +
            ") and by child " + std::to_string(c) + " (unit " + std::to_string(u) +
            "); a parameter can be gathered and freed with one unit only. Put the children "
            "that share it into one unit (a larger min_unit_params, or one child module "
            "holding both), or untie the parameter.");
      }
      if (unit_of[i] == u) continue;
      unit_of[i] = u;
      child_of[i] = c;
      unit.params.push_back(i);
      unit_numel.back() += params_[i].tensor.numel();
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (unit_of[i] < 0) {
      throw UsageError(
          who() + ": parameter '" + params_[i].name +
          "' belongs to no child of the Sequential, so no stage 3 unit would gather it. Register "
          "it in a child module.");
    }
  }
  if (units_.back().params.empty()) {
    throw UsageError(who() +
                     ": the Sequential has no children with parameters to make stage 3 units of");
  }
}

void ShardedState::build_flat_buffers() {
  torch::autograd::AutoGradMode no_grad(false);
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    unit.key = "unit" + std::to_string(u);
    const at::Tensor& first = params_[unit.params.front()].tensor;
    for (size_t i : unit.params) {
      ShardedParam& p = params_[i];
      if (p.tensor.scalar_type() != first.scalar_type() || p.tensor.device() != first.device()) {
        throw UsageError(
            who() + ": stage 3 unit " + std::to_string(u) + " mixes dtypes or devices ('" +
            params_[unit.params.front()].name + "' and '" + p.name +
            "'); a unit is one flat buffer. Give such parameters their own child module.");
      }
      p.unit = u;
      p.offset = unit.full_numel;
      unit.full_numel += p.tensor.numel();
    }
    unit.padded_numel = round_up(unit.full_numel, world_);
    unit.shard_numel = unit.padded_numel / world_;
    auto options = first.options().requires_grad(false);
    unit.flat = at::zeros({unit.padded_numel}, options);
    for (size_t i : unit.params) {
      ShardedParam& p = params_[i];
      p.full_view = unit.flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
      p.full_view.copy_(p.tensor.detach());
    }
    // Every rank starts from rank 0's parameters, as with DDP.
    if (world_ > 1) group_->broadcast(unit.flat, 0);
    stats_.broadcast_bytes += unit.padded_numel * static_cast<int64_t>(unit.flat.element_size());
    const int64_t begin = static_cast<int64_t>(rank_) * unit.shard_numel;
    if (options_.stage == 3) {
      unit.shard = unit.flat.narrow(0, begin, unit.shard_numel).clone();
    } else {
      // An alias of this rank's slice of the flat buffer: the optimizer's in-place update is the
      // full parameters' update too, and only the other ranks' slices need gathering.
      unit.shard = at::empty({0}, options);
      unit.shard.set_(unit.flat.storage(), begin, {unit.shard_numel}, {1});
    }
    unit.shard.requires_grad_(true);
    for (size_t i : unit.params) {
      ShardedParam& p = params_[i];
      p.tensor.set_data(p.full_view);
      if (options_.stage == 3) {
        p.parked = at::empty({0}, options);
        p.sentinel = at::empty({0}, options);
      } else {
        // Stands in for the gradient after a reduction: 4 bytes, not a full gradient, yet an
        // optimizer wrongly built over the full parameters still updates them in place, which
        // check_full_parameters then notices. Not an expand(): LibTorch 1.13's zero_grad() calls
        // detach_() on gradients, which views refuse.
        p.sentinel = at::empty({0}, options);
        p.sentinel.set_(zero_scalar_.storage(), 0, p.tensor.sizes(),
                        std::vector<int64_t>(p.tensor.dim(), 0));
      }
      p.tensor.mutable_grad() = at::Tensor();
    }
    if (options_.stage == 1) {
      unit.flat_grad = at::zeros({unit.padded_numel}, options);
      unit.grad_alias = at::empty({0}, options);
      unit.grad_alias.set_(unit.flat_grad.storage(), begin, {unit.shard_numel}, {1});
    }
    unit.pending = unit.params.size();
  }
  for (auto& unit : units_) unit.gathered_version = unit.shard._version();
  broadcast_unsharded_state();
}

// Frozen parameters and buffers (e.g. BatchNorm statistics) start from rank 0's too: a frozen
// layer that differed per rank would give each rank another model, whose gradients the
// reductions would then average.
void ShardedState::broadcast_unsharded_state() {
  if (world_ == 1) return;
  torch::autograd::AutoGradMode no_grad(false);
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : frozen_) tensors.push_back(tensor);
  for (auto& buffer : module_->buffers(/*recurse=*/true)) tensors.push_back(buffer);
  for (auto& tensor : tensors) {
    at::Tensor staged = tensor.contiguous();  // the collectives take dense tensors
    group_->broadcast(staged, 0);
    if (!staged.is_same(tensor)) tensor.copy_(staged);
  }
  for (const auto& [name, tensor] : frozen_) {
    stats_.broadcast_bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
  }
}

void ShardedState::register_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParam& p = params_[i];
    p.hook = std::make_unique<GradientReadyHook>(p.tensor, [this, i] { on_gradient_ready(i); });
    // A placeholder gradient must not be accumulated into: AccumulateGrad then starts a fresh one.
    p.hook->accumulator()->add_pre_hook(std::make_unique<BeforeAccumulateHook>(alive_, [this, i] {
      ShardedParam& param = params_[i];
      if (param.tensor.grad().defined() && param.tensor.grad().is_same(param.sentinel)) {
        param.tensor.mutable_grad() = at::Tensor();
      }
      param.placeholder = false;
    }));
  }
}

void ShardedState::record_versions() {
  for (auto& p : params_) p.version = p.tensor._version();
}

void ShardedState::check_full_parameters() {
  // dtrain never writes through the module's parameter tensors themselves (gathers write into the
  // flat buffers, stage 3 swaps their data), so their version counters move only when someone else
  // updates them in place: almost always an optimizer built over module->parameters().
  // Likewise, after a reduction each full parameter's .grad is a placeholder (the gradient lives on
  // the shard): zeroing it (LibTorch 1.13's zero_grad) bumps its version, and 2.x's zero_grad
  // replaces it with none. That also catches optimizers that update through .data() (plain SGD in
  // 1.13, which leaves the parameter's version alone), and a module->zero_grad() that would leave
  // the shards' gradients to pile up.
  for (auto& p : params_) {
    if (p.tensor._version() != p.version) {
      throw UsageError(
          who() + ": the module's full parameter '" + p.name +
          "' was changed in place since the last step; the full parameters only mirror the shards "
          "and are overwritten by the next gather. Likely cause: the optimizer was built over "
          "module->parameters(). Build it over sdp->parameters() (this rank's shards); to load "
          "values, write them into flat_shards() and call shards_changed().");
    }
    if (p.placeholder &&
        (!p.tensor.grad().is_same(p.sentinel) || p.sentinel._version() != p.sentinel_version)) {
      throw UsageError(
          who() + ": the gradient of the module's full parameter '" + p.name +
          "' was zeroed or replaced since the last backward, but it is only a placeholder: this "
          "rank's gradients live on the shards. Likely cause: the optimizer was built over "
          "module->parameters(), or module->zero_grad() was called. Build the optimizer over "
          "sdp->parameters() and call its zero_grad().");
    }
  }
}

// ---- forward ----

void ShardedState::prepare_forward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (out_of_step_) {
    out_of_step_ = false;
    throw CommError(
        who() +
        ": the previous pipeline step failed after starting some gradient reductions, "
        "so the ranks are out of step. Restart the job (an elastic restart does this).");
  }
  if (backward_started_) {
    // The previous backward stopped (an exception) before its end-of-backward callback.
    bool launched = false;
    for (auto& unit : units_) {
      if (!unit.launched) continue;
      launched = true;
      try {
        unit.reduction.wait();
      } catch (const std::exception&) {
      }
    }
    reset_iteration();
    if (launched) {
      throw CommError(who() +
                      ": the previous backward failed after starting some gradient reductions, so "
                      "the ranks are out of step. Restart the job (an elastic restart does this).");
    }
  }
  check_full_parameters();
  sync_this_backward_ = no_sync_depth_.load() == 0;
  if (options_.stage < 3) {
    if (shards_may_have_changed_ || shards_moved()) {
      shards_may_have_changed_ = false;
      all_gather_units();
    }
    return;
  }
  if (!in_pipeline_step_) {
    // Every forward and backward frees the units it gathered, so a unit still gathered here was
    // gathered by gather_full_parameters(), maybe before the optimizer's step: gather it again
    // (as that forward would have, had it not been called).
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].gathered || units_[u].gathering) park(u);
    }
  }
  if (!sequential_) materialize(0);
}

at::Tensor ShardedState::finish_forward(const at::Tensor& output) {
  if (options_.stage < 3) return output;
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  at::Tensor result = output;
  if (torch::autograd::GradMode::is_enabled() && output.requires_grad()) {
    result = PreBackward::apply(output, 0, reinterpret_cast<int64_t>(this));
  }
  park(0);
  return result;
}

at::Tensor ShardedState::forward_units(const at::Tensor& input) {
  prepare_forward();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  at::Tensor x = input;
  for (size_t u = 0; u < units_.size(); ++u) {
    materialize(u);
    // Overlap: the next unit's parameters travel while this one computes.
    if (options_.prefetch && u + 1 < units_.size()) start_gather(u + 1);
    for (size_t c = units_[u].first_child; c < units_[u].end_child; ++c) {
      x = (sequential_->begin() + static_cast<std::ptrdiff_t>(c))->forward(x);
    }
    if (torch::autograd::GradMode::is_enabled() && x.requires_grad()) {
      x = PreBackward::apply(x, static_cast<int64_t>(u), reinterpret_cast<int64_t>(this));
    }
    park(u);
  }
  return x;
}

torch::autograd::variable_list PreBackward::backward(torch::autograd::AutogradContext* ctx,
                                                     torch::autograd::variable_list grads) {
  auto* state = reinterpret_cast<ShardedState*>(ctx->saved_data["state"].toInt());
  state->before_unit_backward(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
  return {grads[0], at::Tensor(), at::Tensor()};
}

void ShardedState::before_unit_backward(size_t unit) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  start_backward();
  materialize(unit);
  if (options_.prefetch && unit > 0) start_gather(unit - 1);
}

// ---- gathering ----

// Note [When stages 1-2 gather]
// The optimizer updates this rank's slice of each flat buffer in place (the shard aliases it); the
// other ranks' slices must be all-gathered before the next forward. dtrain cannot see opt.step(),
// so the forward gathers on either of two signals: shards_may_have_changed_ (a reduction, after
// which the optimizer steps, or shards_changed(), since the last gather before a forward) and the
// shards' version counters (moved since the last gather: a step, a load, any in-place write).
// gather_full_parameters() may run between backward and step, so it does not clear the first
// signal: it always gathers, and the next forward after a reduction gathers again. That costs one
// all-gather more on the steps where the user gathered; version counters alone would save it, but
// an optimizer that writes through .data() does not move them. Both signals move alike
// on every rank (the reductions are collective; every rank's optimizer steps its own shard), so
// every rank takes part in the same gathers.
bool ShardedState::shards_moved() const {
  for (const auto& unit : units_) {
    if (unit.shard._version() != unit.gathered_version) return true;
  }
  return false;
}

void ShardedState::all_gather_units() {
  if (world_ == 1) {  // the shard is the whole flat buffer: nothing to gather
    for (auto& unit : units_) unit.gathered_version = unit.shard._version();
    return;
  }
  torch::autograd::AutoGradMode no_grad(false);
  std::vector<Work> works;
  for (auto& unit : units_) {
    std::vector<at::Tensor> outputs;
    for (int r = 0; r < world_; ++r)
      outputs.push_back(unit.flat.narrow(0, r * unit.shard_numel, unit.shard_numel));
    works.push_back(group_->all_gather_async(outputs, unit.shard.detach()));
    stats_.all_gather_bytes += unit.padded_numel * static_cast<int64_t>(unit.flat.element_size());
  }
  for (auto& work : works) work.wait();
  for (auto& unit : units_) unit.gathered_version = unit.shard._version();
}

void ShardedState::start_gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered || unit.gathering) return;
  allocate_storage(unit.flat, static_cast<size_t>(unit.padded_numel) * unit.flat.element_size());
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < world_; ++r)
    outputs.push_back(unit.flat.narrow(0, r * unit.shard_numel, unit.shard_numel));
  unit.gather = group_->all_gather_async(outputs, unit.shard.detach());
  unit.gathering = true;
  stats_.all_gather_bytes += unit.padded_numel * static_cast<int64_t>(unit.flat.element_size());
}

void ShardedState::materialize(size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered) return;
  start_gather(u);
  unit.gather.wait();
  unit.gathering = false;
  unit.gathered = true;
  for (size_t i : unit.params) params_[i].tensor.set_data(params_[i].full_view);
}

void ShardedState::park(size_t u) {
  Unit& unit = units_[u];
  if (unit.gathering) {
    unit.gather.wait();
    unit.gathering = false;
  }
  for (size_t i : unit.params) params_[i].tensor.set_data(params_[i].parked);
  free_storage(unit.flat);
  unit.gathered = false;
}

void ShardedState::gather_full_parameters() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // Always gathers: whether the optimizer stepped since the last gather is not visible here
  // (Note [When stages 1-2 gather]); the caller asked for the current shards.
  if (options_.stage < 3) {
    all_gather_units();
    return;
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].gathered || units_[u].gathering) park(u);  // maybe from before a step
  }
  for (size_t u = 0; u < units_.size(); ++u) start_gather(u);
  for (size_t u = 0; u < units_.size(); ++u) materialize(u);
}

void ShardedState::release_full_parameters() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (options_.stage < 3) return;
  for (size_t u = 0; u < units_.size(); ++u) park(u);
}

void ShardedState::shards_changed() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (options_.stage < 3) {
    shards_may_have_changed_ = true;
  } else {
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].gathered) park(u);
    }
  }
}

// ---- inside a pipeline (pipeline_steps.h) ----

void ShardedState::begin_pipeline_step() {
  prepare_forward();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  in_pipeline_step_ = true;
  if (options_.stage < 3) return;
  for (size_t u = 0; u < units_.size(); ++u) start_gather(u);  // all in flight at once
  for (size_t u = 0; u < units_.size(); ++u) materialize(u);
}

void ShardedState::set_sync_next_backward(bool sync) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  sync_this_backward_ = sync && no_sync_depth_.load() == 0;
}

void ShardedState::finish_pipeline_step() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!reductions_to_finish_) return;
  reductions_to_finish_ = false;
  struct ForgetOnExit {  // also when a reduction threw: the others are waited out first
    ShardedState* state;
    ~ForgetOnExit() {
      for (auto& unit : state->units_) {
        try {
          if (unit.launched) unit.reduction.wait();
        } catch (const std::exception&) {
        }
        unit.launched = false;
        unit.reduction = Work();
      }
    }
  } forget{this};
  complete_reductions();
}

void ShardedState::end_pipeline_step(bool completed) noexcept {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!in_pipeline_step_) return;
  in_pipeline_step_ = false;
  if (!completed) {
    // A failed step: its reductions may still write into their buffers, and the gradients its
    // passes left on the full parameters (which the optimizer over the shards never zeroes) must
    // not be added to the next step's.
    for (auto& unit : units_) out_of_step_ = out_of_step_ || unit.launched;
    out_of_step_ = out_of_step_ || reductions_to_finish_;
    for (auto& unit : units_) {
      try {
        if (unit.launched) unit.reduction.wait();
      } catch (const std::exception&) {
      }
      unit.launched = false;
      unit.reduction = Work();
    }
    reductions_to_finish_ = false;
    for (auto& p : params_) {
      if (!p.placeholder) p.tensor.mutable_grad() = at::Tensor();
    }
  }
  if (options_.stage < 3) return;
  for (size_t u = 0; u < units_.size(); ++u) {
    try {
      park(u);  // waits for a gather still in flight after a failed step
    } catch (const std::exception&) {
    }
  }
}

// ---- backward ----

void ShardedState::start_backward() {
  if (backward_started_) return;
  backward_started_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  if (options_.stage != 1 || !sync_this_backward_) return;
  // Stage 1's shard gradient aliases the flat gradient buffer this backward overwrites; keep what
  // the user left there to accumulate into (nothing, after the usual zero_grad()).
  torch::autograd::AutoGradMode no_grad(false);
  for (auto& unit : units_) {
    const at::Tensor& grad = unit.shard.grad();
    if (!grad.defined()) continue;
    if (!grad.is_same(unit.grad_alias)) {
      unit.carried = grad;  // the user replaced it: its memory is not overwritten
    } else if (grad.count_nonzero().item<int64_t>() > 0) {
      unit.carried = grad.clone();
    }
  }
}

void ShardedState::on_gradient_ready(size_t index) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  start_backward();
  ShardedParam& p = params_[index];
  if (p.ready) {
    throw UsageError(
        who() + ": parameter '" + p.name +
        "' received its gradient twice in one backward. Likely cause: reentrant activation "
        "checkpointing or a second backward through the same graph; sharding supports one "
        "gradient per parameter per backward.");
  }
  p.ready = true;
  Unit& unit = units_[p.unit];
  if (sync_this_backward_) {
    torch::autograd::AutoGradMode no_grad(false);
    if (!unit.flat_grad.defined()) {
      unit.flat_grad = at::empty({unit.padded_numel}, unit.shard.options().requires_grad(false));
      unit.flat_grad.narrow(0, unit.full_numel, unit.padded_numel - unit.full_numel).zero_();
    }
    at::Tensor slot = unit.flat_grad.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
    const at::Tensor& grad = p.tensor.grad();
    if (grad.defined()) {
      at::mul_out(slot, grad, inverse_world_size_);  // copy and pre-divide in one pass
    } else {
      slot.zero_();
    }
    p.tensor.mutable_grad() = p.sentinel;  // the full gradient's memory goes back now
    p.placeholder = true;
    p.sentinel_version = p.sentinel._version();
  }
  if (--unit.pending == 0) on_unit_complete(p.unit);
}

void ShardedState::on_unit_complete(size_t u) {
  if (sync_this_backward_) {
    if (options_.stage == 3) {
      launch_reduction(u);  // the backward's unit order is the same on every rank
    } else {
      while (next_to_launch_ < units_.size() && units_[next_to_launch_].pending == 0) {
        launch_reduction(next_to_launch_++);
      }
    }
  }
  if (options_.stage == 3 && !in_pipeline_step_) park(u);
}

void ShardedState::launch_reduction(size_t u) {
  Unit& unit = units_[u];
  const int64_t bytes = unit.padded_numel * static_cast<int64_t>(unit.flat_grad.element_size());
  if (options_.stage == 1) {
    unit.reduction = group_->all_reduce_async(unit.flat_grad);
    stats_.all_reduce_bytes += bytes;
  } else {
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < world_; ++r)
      pieces.push_back(unit.flat_grad.narrow(0, r * unit.shard_numel, unit.shard_numel));
    unit.incoming = at::empty({unit.shard_numel}, unit.flat_grad.options());
    unit.reduction = group_->reduce_scatter_async(unit.incoming, pieces);
    stats_.reduce_scatter_bytes += bytes;
  }
  unit.launched = true;
}

void ShardedState::finalize_backward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  struct ResetOnExit {
    ShardedState* state;
    ~ResetOnExit() { state->reset_iteration(); }
  } reset{this};

  std::vector<std::string> missing;
  for (auto& p : params_) {
    if (!p.ready) missing.push_back(p.name);
  }
  if (!missing.empty()) {
    for (auto& unit : units_) {
      try {
        if (unit.launched) unit.reduction.wait();  // their buffers must outlive them
      } catch (const std::exception&) {
      }
    }
    throw UsageError(
        who() + ": these parameters received no gradient in this backward: " + list_text(missing) +
        ". Every parameter must take part in computing the loss, or its unit's gradients are "
        "never complete. Remove the unused parameters (or set requires_grad(false) on them).");
  }
  if (!sync_this_backward_) return;
  if (in_pipeline_step_) {
    // The pipeline sends this chunk's input gradient upstream when this backward returns: waiting
    // here would hold the stages before it back. finish_pipeline_step waits after the step.
    reductions_to_finish_ = true;
    return;
  }
  complete_reductions();
}

// After a synchronizing backward: each unit's reduced gradient onto its shard.
void ShardedState::complete_reductions() {
  torch::autograd::AutoGradMode no_grad(false);
  for (auto& unit : units_) {
    unit.reduction.wait();
    if (options_.stage == 1) {
      if (unit.carried.defined()) unit.grad_alias.add_(unit.carried);
      unit.carried = at::Tensor();
      if (!unit.shard.grad().is_same(unit.grad_alias)) unit.shard.mutable_grad() = unit.grad_alias;
    } else {
      if (unit.shard.grad().defined()) {
        unit.shard.mutable_grad().add_(unit.incoming);
      } else {
        unit.shard.mutable_grad() = unit.incoming;
      }
      unit.incoming = at::Tensor();
      unit.flat_grad = at::Tensor();
    }
  }
  if (options_.stage < 3) shards_may_have_changed_ = true;
  record_versions();
}

void ShardedState::reset_iteration() {
  for (auto& p : params_) p.ready = false;
  for (auto& unit : units_) {
    unit.pending = unit.params.size();
    if (reductions_to_finish_) continue;  // finish_pipeline_step waits for them
    unit.launched = false;
    unit.reduction = Work();
  }
  if (options_.stage == 3 && !in_pipeline_step_) {
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].gathered || units_[u].gathering) park(u);
    }
  }
  next_to_launch_ = 0;
  backward_started_ = false;
}

}  // namespace detail

void detail::ShardedPipelineSteps::begin_step(ShardedDataParallelBase& sdp) {
  sdp.state_->begin_pipeline_step();
}
void detail::ShardedPipelineSteps::sync_next_backward(ShardedDataParallelBase& sdp, bool sync) {
  sdp.state_->set_sync_next_backward(sync);
}
void detail::ShardedPipelineSteps::finish_step(ShardedDataParallelBase& sdp) {
  sdp.state_->finish_pipeline_step();
}
void detail::ShardedPipelineSteps::end_step(ShardedDataParallelBase& sdp, bool completed) noexcept {
  sdp.state_->end_pipeline_step(completed);
}

// ---- the public face ----

ShardedDataParallelBase::ShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 ShardedDataParallelOptions options)
    : torch::nn::Module("dtrain::ShardedDataParallel"),
      state_(std::make_unique<detail::ShardedState>(std::move(module), std::move(group), options)) {
  // Note [Sharded parameter names]: the shards are the parameters, by unit.
  for (auto& unit : state_->units_) register_parameter(unit.key, unit.shard);
}

ShardedDataParallelBase::~ShardedDataParallelBase() = default;

int ShardedDataParallelBase::stage() const { return state_->options_.stage; }
const std::shared_ptr<ProcessGroup>& ShardedDataParallelBase::group() const {
  return state_->group_;
}

ShardedDataParallelBase::NoSyncGuard::NoSyncGuard(ShardedDataParallelBase& sdp) : sdp_(sdp) {
  ++sdp_.state_->no_sync_depth_;
}
ShardedDataParallelBase::NoSyncGuard::~NoSyncGuard() { --sdp_.state_->no_sync_depth_; }

void ShardedDataParallelBase::gather_full_parameters() { state_->gather_full_parameters(); }
void ShardedDataParallelBase::release_full_parameters() { state_->release_full_parameters(); }
void ShardedDataParallelBase::shards_changed() { state_->shards_changed(); }

std::vector<FlatShard> ShardedDataParallelBase::flat_shards() const {
  std::vector<FlatShard> shards;
  const int rank = state_->group_->rank();
  for (const auto& unit : state_->units_) {
    FlatShard shard;
    shard.key = unit.key;
    shard.shard = unit.shard;
    shard.offset = static_cast<int64_t>(rank) * unit.shard_numel;
    shard.full_numel = unit.full_numel;
    for (size_t i : unit.params) {
      const auto& p = state_->params_[i];
      shard.params.push_back({p.name, p.full_view.sizes().vec(), p.offset});
    }
    shards.push_back(std::move(shard));
  }
  return shards;
}

ShardedCommStats ShardedDataParallelBase::comm_stats() const { return state_->stats_; }

at::Tensor ShardedDataParallelBase::forward_units(const at::Tensor& input) {
  return state_->forward_units(input);
}
void ShardedDataParallelBase::prepare_forward() { state_->prepare_forward(); }
at::Tensor ShardedDataParallelBase::finish_forward(const at::Tensor& output) {
  return state_->finish_forward(output);
}
bool ShardedDataParallelBase::drives_units() const {
  return state_->options_.stage == 3 && state_->sequential_ != nullptr;
}

void ShardedDataParallelBase::train(bool on) {
  torch::nn::Module::train(on);
  state_->module_->train(on);
}

void ShardedDataParallelBase::load(torch::serialize::InputArchive& archive) {
  torch::autograd::AutoGradMode no_grad(false);
  for (auto& unit : state_->units_) {
    at::Tensor saved;
    archive.read(unit.key, saved);
    if (saved.numel() != unit.shard.numel()) {
      throw UsageError(state_->who() + ": load: the saved shard of " + unit.key + " has " +
                       std::to_string(saved.numel()) + " elements, this rank's has " +
                       std::to_string(unit.shard.numel()) +
                       ". Likely cause: it was saved at another world size or with other units "
                       "(stage, bucket_cap_bytes). Reshard through dtrain::ShardedCheckpointer.");
    }
    unit.shard.copy_(saved.view_as(unit.shard));
  }
  state_->shards_changed();
}

}  // namespace dtrain
