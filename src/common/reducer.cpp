// DistributedDataParallel's gradient reducer; see Note [DDP gradient buckets] in dtrain/ddp.h.
#include "common/reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <map>

#include "comm/group_state.h"
#include "common/format.h"

namespace dtrain::detail {

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
                 DistributedDataParallelOptions options, Finalize finalize)
    : module_(std::move(module)),
      group_(std::move(group)),
      options_(std::move(options)),
      explicit_finalize_(finalize == Finalize::kByOwner) {
  if (!module_) throw UsageError(who() + ": DistributedDataParallel: the module is null");
  if (!group_) throw UsageError("DistributedDataParallel: the process group is null");
  if (options_.bucket_cap_bytes <= 0 || options_.first_bucket_cap_bytes <= 0) {
    throw UsageError(who() +
                     ": DistributedDataParallel: bucket_cap_bytes and first_bucket_cap_bytes must "
                     "be positive");
  }
  // Every parameter, frozen ones included, is checked and broadcast, as PyTorch's
  // _sync_module_states broadcasts them: a frozen layer initialised differently on each rank would
  // otherwise make the replicas compute different functions for the whole run. Only trainable
  // parameters get buckets and hooks. The " (frozen)" suffix puts requires_grad into the check:
  // a parameter trainable on one rank and frozen on another would give the ranks different buckets.
  std::vector<NamedParameter> named;
  std::vector<at::Tensor> state;
  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& tensor = item.value();
    named.emplace_back(tensor.requires_grad() ? item.key() : item.key() + " (frozen)", tensor);
    state.push_back(tensor);
    if (!tensor.requires_grad()) continue;
    Param p;
    p.tensor = tensor;
    p.name = item.key();
    params_.push_back(std::move(p));
  }
  // Before the broadcast: it packs the tensors by dtype, and a shape that differs on one rank
  // would pair different elements across ranks instead of failing.
  check_same_parameters(*group_, named, "DistributedDataParallel");
  for (auto& buffer : module_->buffers(/*recurse=*/true)) state.push_back(buffer);
  broadcast_from_rank0(state);

  inverse_world_size_ = at::scalar_tensor(1.0 / group_->size(), at::kDouble);
  local_only_ = group_->size() == 1;
  if (!local_only_) build_buckets();

  recorder_ = StepRecorder::create_if_enabled("ddp", group_);

  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].hook =
        std::make_unique<GradientReadyHook>(params_[i].tensor, [this, i] { on_gradient_ready(i); });
  }
}

// The hooks (removed with params_) point at this reducer.
Reducer::~Reducer() = default;

std::string Reducer::who() const { return group_ ? rank_text(*group_) : "rank ?"; }

void Reducer::broadcast_from_rank0(const std::vector<at::Tensor>& tensors) {
  if (group_->size() == 1) return;
  torch::autograd::AutoGradMode no_grad(false);
  // One broadcast per dtype and device: many small tensors cost one round trip, not one each.
  std::map<std::pair<at::ScalarType, std::string>, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[{t.scalar_type(), t.device().str()}].push_back(t);
  for (auto& entry : by_dtype) {
    std::vector<at::Tensor> flat;
    for (auto& t : entry.second) flat.push_back(t.reshape({-1}));
    at::Tensor packed = at::cat(flat);
    group_->broadcast(packed, 0);
    int64_t offset = 0;
    for (auto& t : entry.second) {
      t.copy_(packed.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void Reducer::build_buckets() {
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  for (auto& indices :
       assign_buckets(tensors, options_.first_bucket_cap_bytes, options_.bucket_cap_bytes)) {
    buckets_.emplace_back();
    for (size_t k : indices) params_[k].bucket = buckets_.size() - 1;
    buckets_.back().params = std::move(indices);
  }
  auto full_precision_cpu = [](const at::Tensor& t) {
    return t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
  };
  // Note [A number riding on the gradients]: one element after the last-launched bucket's
  // gradients. Only a CPU bucket: reading it back from a device would wait for the all-reduce.
  riding_ = GroupInternals::state(*group_)->riding_number;
  if (riding_ && (options_.comm_hook || buckets_.empty() ||
                  !full_precision_cpu(params_[buckets_.back().params.front()].tensor))) {
    riding_.reset();
  }
  // Ranks on one host keep the buckets in shared memory, each at a 64-byte (cache-line) boundary.
  std::vector<int64_t> numels;
  int64_t shared_bytes = 0;
  bool shareable = !options_.comm_hook && group_->uses_shared_memory();
  for (auto& bucket : buckets_) {
    const at::Tensor& first = params_[bucket.params.front()].tensor;
    shareable = shareable && full_precision_cpu(first);
    int64_t numel = riding_ && &bucket == &buckets_.back() ? 1 : 0;
    for (size_t k : bucket.params) numel += params_[k].tensor.numel();
    numels.push_back(numel);
    bucket.offset = shared_bytes;
    shared_bytes += (numel * static_cast<int64_t>(first.element_size()) + 63) / 64 * 64;
  }
  if (shareable) shared_ = SharedBuckets::create(*group_, shared_bytes);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    const int64_t numel = numels[b];
    const at::Tensor& first = params_[bucket.params.front()].tensor;
    if (shared_) {
      bucket.buffer = shared_->tensor(bucket.offset, numel, first.scalar_type());
      bucket.buffer.zero_();
    } else {
      bucket.buffer = at::zeros({numel}, first.options().requires_grad(false));
    }
    int64_t offset = 0;
    for (size_t k : bucket.params) {
      Param& p = params_[k];
      // An alias of the bucket's memory that autograd does not track as a view: LibTorch's
      // zero_grad() calls detach_() on gradients, which a view would refuse.
      std::vector<int64_t> strides(p.tensor.dim(), 1);
      for (int64_t d = p.tensor.dim() - 1; d > 0; --d)
        strides[d - 1] = strides[d] * p.tensor.size(d);
      p.slot = at::empty({0}, bucket.buffer.options());
      p.slot.set_(bucket.buffer.storage(), bucket.buffer.storage_offset() + offset,
                  p.tensor.sizes(), strides);
      offset += p.tensor.numel();
      // A parameter without a gradient gets its slot when backward first produces one (mark_ready).
      if (options_.gradient_as_bucket_view && p.tensor.grad().defined()) {
        p.slot.copy_(p.tensor.grad());
        p.tensor.mutable_grad() = p.slot;
      }
    }
    bucket.pending = bucket.params.size();
  }
}

std::vector<std::vector<size_t>> Reducer::bucket_layout() const {
  std::vector<std::vector<size_t>> layout;
  for (const auto& bucket : buckets_) layout.push_back(bucket.params);
  return layout;
}

void Reducer::prepare_forward(int64_t samples) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A pipeline stage runs several forwards per step; its steps are not recorded (yet).
  if (recorder_ && !explicit_finalize_) recorder_->begin_step(samples);
  if (backward_started_) {
    // The previous backward stopped (an exception) before its end-of-backward callback.
    size_t launched = next_to_launch_;
    if (launched > 0 && !options_.comm_hook) {
      for (size_t b = 0; b < launched; ++b) {
        try {
          buckets_[b].work.wait();  // their buffers must outlive them
        } catch (const std::exception&) {
        }
      }
    }
    reset_iteration();
    if (launched > 0) {
      // This rank already started some of its buckets' all-reduces; the other ranks may have
      // started others. Going on would pair different buckets across ranks.
      throw CommError(
          who() + ": DistributedDataParallel: the previous backward failed after starting " +
          std::to_string(launched) + " of " + std::to_string(buckets_.size()) +
          " bucket all-reduces, so the ranks are out of step. Catching an exception from "
          "backward() and going on is not supported; restart the job (an elastic restart "
          "does this) or skip a batch only before backward().");
    }
  }
  sync_this_iteration_ = no_sync_depth_.load() == 0;
  if (options_.broadcast_buffers && group_->size() > 1) {
    auto buffers = module_->buffers(/*recurse=*/true);
    if (!buffers.empty()) {
      StepRecorder::Blocked blocked(recorder_.get());
      broadcast_from_rank0(buffers);
    }
  }
}

void Reducer::set_sync_next_backward(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_this_iteration_ = sync;
}

void Reducer::finalize() {
  bool started;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    started = backward_started_;
  }
  if (started) finalize_backward();
}

void Reducer::on_gradient_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Noted before the no_sync() return below, as PyTorch's autograd_hook marks local_used_map_: a
  // parameter this rank used in any backward since the last averaging one holds a gradient the
  // average must include, even when the averaging backward itself does not use it
  // (finalize_backward()). Only a defined gradient counts (a hook may run for an output the loss
  // does not use).
  if (params_[index].tensor.grad().defined()) params_[index].used_since_sync = true;
  if (!sync_this_iteration_) return;  // inside no_sync(): gradients just accumulate locally
  if (!backward_started_) {
    backward_started_ = true;
    if (!explicit_finalize_) {
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    }
  }
  if (params_[index].ready) {
    throw UsageError(
        who() + ": DistributedDataParallel: parameter '" + params_[index].name +
        "' received its gradient twice in one backward. Likely cause: reentrant activation "
        "checkpointing or a second backward through the same graph; DDP supports one "
        "gradient per parameter per backward.");
  }
  mark_ready(index);
  if (options_.overlap) launch_ready_buckets();
}

void Reducer::mark_ready(size_t index) {
  Param& p = params_[index];
  if (local_only_) {
    p.ready = true;
    return;
  }
  const at::Tensor& grad = p.tensor.grad();
  if (options_.gradient_as_bucket_view) {
    // The gradient normally already is the slot; re-point it if the optimizer replaced or reset it.
    p.had_no_gradient = !grad.defined();
    if (!grad.defined()) {
      p.slot.zero_();
    } else if (!grad.is_same(p.slot)) {
      p.slot.copy_(grad);
    }
    if (!grad.is_same(p.slot)) p.tensor.mutable_grad() = p.slot;
  } else if (grad.defined()) {
    at::mul_out(p.slot, grad, inverse_world_size_);  // copy and pre-divide in one pass
  } else {
    p.slot.zero_();
  }
  p.ready = true;
  --buckets_[p.bucket].pending;
}

void Reducer::launch_ready_buckets() {
  while (!local_only_ && next_to_launch_ < buckets_.size() &&
         buckets_[next_to_launch_].pending == 0) {
    launch(next_to_launch_++);
  }
}

double Reducer::shared_reduction_scale() const {
  // mark_ready() already divided copied gradients; gradients that are the bucket get divided by the
  // reduction itself, in the same pass.
  return options_.gradient_as_bucket_view ? 1.0 / group_->size() : 1.0;
}

namespace {
// The riding number's element, the last of a float or double CPU bucket (build_buckets): read and
// written in place, as one scalar, without a tensor operation on the step's path.
double* riding_double(const at::Tensor& buffer) {
  return buffer.scalar_type() == at::kDouble ? buffer.data_ptr<double>() + buffer.numel() - 1
                                             : nullptr;
}
float* riding_float(const at::Tensor& buffer) {
  return buffer.scalar_type() == at::kFloat ? buffer.data_ptr<float>() + buffer.numel() - 1
                                            : nullptr;
}
}  // namespace

void Reducer::launch(size_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  // The riding number goes in after any division of the gradients below (finalize_backward()
  // undoes the division that shared buckets apply in the reduction).
  auto load_riding_number = [&] {
    if (!riding_ || bucket_index + 1 != buckets_.size()) return;
    const double contribution = riding_->contribution.load();
    if (float* element = riding_float(bucket.buffer)) *element = static_cast<float>(contribution);
    if (double* element = riding_double(bucket.buffer)) *element = contribution;
  };
  if (shared_) {
    load_riding_number();
    StepRecorder::Blocked blocked(recorder_.get());
    bucket.work = shared_->all_reduce_async(bucket.offset, bucket.buffer.numel(),
                                            bucket.buffer.scalar_type(), shared_reduction_scale());
    return;
  }
  if (options_.gradient_as_bucket_view) bucket.buffer.mul_(inverse_world_size_);
  load_riding_number();
  // Starting is meant not to block, but a hook or a full transport queue may: whatever it takes
  // here, backward is not computing.
  StepRecorder::Blocked blocked(recorder_.get());
  if (options_.comm_hook) {
    GradBucket view{static_cast<int>(bucket_index), &bucket.buffer};
    options_.comm_hook->start(*group_, view);
  } else {
    bucket.work = group_->all_reduce_async(bucket.buffer);
  }
}

void Reducer::finalize_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  // Whatever happens below, the next iteration starts clean.
  struct ResetOnExit {
    Reducer* reducer;
    ~ResetOnExit() {
      reducer->reset_iteration();
      for (auto& p : reducer->params_) p.used_since_sync = false;
    }
  } reset{this};

  std::vector<size_t> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].ready) missing.push_back(i);
  }
  at::Tensor used;
  if (!missing.empty()) {
    if (!options_.find_unused_parameters) {
      // Let the plain all-reduces already in flight finish: their buffers must outlive them.
      if (!options_.comm_hook) {
        for (size_t b = 0; b < next_to_launch_; ++b) {
          try {
            buckets_[b].work.wait();
          } catch (const std::exception&) {
            // The unused-parameter error below is the one to report.
          }
        }
      }
      std::vector<std::string> names;
      for (size_t i : missing) names.push_back(params_[i].name);
      throw UsageError(
          who() +
          ": DistributedDataParallel: these parameters received no gradient in this backward: " +
          list_text(names) +
          ". Every parameter must take part in computing the loss, or DDP cannot know when its "
          "gradients "
          "are complete. Fix: construct DDP with options.find_unused_parameters = true, or remove "
          "the "
          "unused parameters from the module (or set requires_grad(false) on them).");
    }
    for (size_t i : missing) mark_ready(i);
  }
  if (local_only_) {
    if (recorder_ && !explicit_finalize_) recorder_->end_backward();
    return;
  }
  if (options_.find_unused_parameters) {
    // Which parameters any rank used since the last averaging backward, no_sync() backwards
    // included: those get the average on every rank (a rank that did not use one contributes its
    // gradient as it stands, or zeros), so the replicas' optimizers see the same gradients. A
    // parameter no rank used keeps its .grad as it was.
    used = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    auto flags = used.accessor<int, 1>();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].used_since_sync) flags[static_cast<int64_t>(i)] = 1;
    }
  }
  launch_ready_buckets();
  {
    StepRecorder::Blocked blocked(recorder_.get());  // the communication backward could not hide
    if (used.defined()) group_->all_reduce(used);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (options_.comm_hook) {
        GradBucket view{static_cast<int>(b), &buckets_[b].buffer};
        options_.comm_hook->finish(*group_, view);
      } else {
        buckets_[b].work.wait();
      }
    }
  }
  if (riding_) {
    const at::Tensor& buffer = buckets_.back().buffer;
    const float* as_float = riding_float(buffer);
    const double reduced = as_float ? static_cast<double>(*as_float) : *riding_double(buffer);
    riding_->sum.store(reduced / (shared_ ? shared_reduction_scale() : 1.0));
    riding_->carried.fetch_add(1);
  }
  torch::autograd::AutoGradMode no_grad(false);
  const int* used_anywhere = used.defined() ? used.data_ptr<int>() : nullptr;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (used_anywhere && used_anywhere[i] == 0) {
      // Unused on every rank since the last averaging backward: .grad stays as it was. An
      // optimizer skips a parameter without a gradient but would apply weight decay or momentum
      // to a zero one.
      if (options_.gradient_as_bucket_view && p.had_no_gradient)
        p.tensor.mutable_grad() = at::Tensor();
      continue;
    }
    if (options_.gradient_as_bucket_view) continue;  // the gradient is the slot
    if (p.tensor.grad().defined()) {
      p.tensor.mutable_grad().copy_(p.slot);
    } else {
      p.tensor.mutable_grad() = p.slot.clone();
    }
  }
  if (recorder_ && !explicit_finalize_) recorder_->end_backward();
}

void Reducer::reset_iteration() {
  for (auto& p : params_) p.ready = false;
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.work = Work();
  }
  next_to_launch_ = 0;
  backward_started_ = false;
}

}  // namespace dtrain::detail
