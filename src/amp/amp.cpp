// dtrain::amp: the autocast scope and the GradScaler (see dtrain/amp.h). The scaler follows
// PyTorch's torch/cuda/amp/grad_scaler.py and its _amp_update_scale_ kernel rule for rule; it keeps
// the scale on the host (float32, as PyTorch's scale tensor), since deciding whether to step reads
// the inf/NaN flag on the host anyway, and LibTorch 1.13 has the fused unscale and update kernels
// for CUDA only.
#include "dtrain/amp.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/cuda.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "amp/autocast_state.h"
#include "common/format.h"
#include "dtrain/comm.h"

namespace dtrain::amp {

namespace detail {

AutocastState current_autocast_state() {
  AutocastState state;
  state.cpu_enabled = at::autocast::is_autocast_enabled(c10::DeviceType::CPU);
  state.cpu_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
  state.cuda_enabled = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
  state.cuda_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
  return state;
}

namespace {
void set_autocast_state(const AutocastState& state) {
  at::autocast::set_autocast_enabled(c10::DeviceType::CPU, state.cpu_enabled);
  at::autocast::set_autocast_dtype(c10::DeviceType::CPU, state.cpu_dtype);
  at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, state.cuda_enabled);
  at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, state.cuda_dtype);
}
}  // namespace

AutocastStateGuard::AutocastStateGuard(const AutocastState& state) {
  previous_ = current_autocast_state();
  if (!state.any_enabled() && !previous_.any_enabled()) return;
  active_ = true;
  set_autocast_state(state);
  at::autocast::increment_nesting();
}

AutocastStateGuard::~AutocastStateGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast_state(previous_);
}

}  // namespace detail

// ---- Autocast ----

namespace {
const char* dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    default:
      return c10::toString(dtype);
  }
}
}  // namespace

Autocast::Autocast(c10::DeviceType device_type, c10::ScalarType dtype) : device_type_(device_type) {
  const bool half = dtype == c10::ScalarType::Half, bf16 = dtype == c10::ScalarType::BFloat16;
  if (device_type == c10::DeviceType::CPU) {
    if (half) {
      throw UsageError(
          "amp::Autocast: float16 on the CPU: LibTorch's CPU autocast computes in bfloat16 only; "
          "use bfloat16 on the CPU (--amp bf16), or float16 on a CUDA device");
    }
    if (!bf16) {
      throw UsageError(
          std::string("amp::Autocast: ") + dtype_name(dtype) +
          " on the CPU: expected bfloat16 (CPU autocast lowers matmuls to bfloat16 only)");
    }
  } else if (device_type == c10::DeviceType::CUDA) {
    if (!half && !bf16) {
      throw UsageError(std::string("amp::Autocast: ") + dtype_name(dtype) +
                       " on CUDA: expected float16 or bfloat16");
    }
    if (!torch::cuda::is_available()) {
      throw UsageError(
          "amp::Autocast: CUDA autocast, but this process sees no CUDA device (LibTorch without "
          "CUDA, or no GPU visible); autocast the device your tensors are on (the CPU: bfloat16)");
    }
  } else {
    throw UsageError(std::string("amp::Autocast: device type ") + c10::DeviceTypeName(device_type) +
                     ": expected CPU or CUDA");
  }
  was_enabled_ = at::autocast::is_autocast_enabled(device_type);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type);
  at::autocast::set_autocast_enabled(device_type, true);
  at::autocast::set_autocast_dtype(device_type, dtype);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  // As PyTorch's autocast.__exit__: the cache of casted weights lives as long as the outermost
  // scope (the weights may change before the next one).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, was_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
}

// ---- GradScaler ----

namespace {

void check_options(const GradScalerState& state, const std::string& where) {
  auto fail = [&](const std::string& what) {
    throw UsageError("amp::GradScaler: " + where + ": " + what);
  };
  if (!(state.scale > 0) || !std::isfinite(static_cast<float>(state.scale))) {
    fail("scale " + std::to_string(state.scale) +
         ": expected a positive number that fits a float32");
  }
  if (!(state.growth_factor > 1) || !std::isfinite(state.growth_factor)) {
    fail("growth_factor " + std::to_string(state.growth_factor) + ": expected a finite number > 1");
  }
  if (!(state.backoff_factor > 0 && state.backoff_factor < 1)) {
    fail("backoff_factor " + std::to_string(state.backoff_factor) +
         ": expected a number in (0, 1)");
  }
  if (state.growth_interval < 1) {
    fail("growth_interval " + std::to_string(state.growth_interval) + ": expected at least 1");
  }
  if (state.growth_tracker < 0) {
    fail("growth_tracker " + std::to_string(state.growth_tracker) + ": expected at least 0");
  }
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options, std::shared_ptr<ProcessGroup> group)
    : options_(options), group_(std::move(group)) {
  GradScalerState state;
  state.scale = options.init_scale;
  state.growth_factor = options.growth_factor;
  state.backoff_factor = options.backoff_factor;
  state.growth_interval = options.growth_interval;
  if (options.enabled) check_options(state, "options");
  scale_ = static_cast<float>(options.init_scale);
}

std::string GradScaler::where() const {
  if (group_ == nullptr) return "";
  return dtrain::detail::rank_text(*group_) + ": ";
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  // In float32 at least, as PyTorch (which multiplies by its float32 scale tensor): 2^16 times a
  // float16 loss would overflow float16.
  const bool low_precision = loss.scalar_type() == at::kHalf || loss.scalar_type() == at::kBFloat16;
  return (low_precision ? loss.to(at::kFloat) : loss) * static_cast<double>(scale_);
}

GradScaler::OptimizerStep& GradScaler::step_of(const torch::optim::Optimizer& optimizer) {
  for (auto& step : steps_) {
    if (step.optimizer == &optimizer) return step;
  }
  steps_.emplace_back();
  steps_.back().optimizer = &optimizer;
  return steps_.back();
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  OptimizerStep& step = step_of(optimizer);
  if (step.unscaled) {
    throw UsageError(
        "amp::GradScaler: " + where() +
        "unscale_() was already called for this optimizer since the last update(); call it "
        "once per step, after the step's last backward");
  }
  if (step.stepped) {
    throw UsageError(
        "amp::GradScaler: " + where() +
        "unscale_() after step(): step() has already unscaled this step's gradients; call "
        "unscale_() before step(), or update() first");
  }
  // As PyTorch: the reciprocal in float64, then float32 (float32 division can be imprecise).
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  // Gradients grouped by device and dtype, as the fused CUDA kernel wants them.
  struct Group {
    c10::Device device;
    c10::ScalarType dtype;
    std::vector<at::Tensor> grads;
  };
  std::vector<Group> groups;
  for (auto& param_group : optimizer.param_groups()) {
    for (auto& param : param_group.params()) {
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      if (grad.scalar_type() == at::kHalf) {
        throw UsageError("amp::GradScaler: " + where() +
                         "unscale_(): a float16 gradient (a parameter of shape " +
                         c10::str(param.sizes()) +
                         "): keep the parameters in float32 and let autocast lower the computation "
                         "(PyTorch's GradScaler refuses float16 gradients too)");
      }
      at::Tensor to_unscale = grad.is_sparse() ? grad._values() : grad;
      auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
        return g.device == to_unscale.device() && g.dtype == to_unscale.scalar_type();
      });
      if (it == groups.end()) {
        groups.push_back({to_unscale.device(), to_unscale.scalar_type(), {}});
        it = groups.end() - 1;
      }
      it->grads.push_back(to_unscale);
    }
  }
  at::NoGradGuard no_grad;
  step.found_inf.clear();
  for (auto& group : groups) {
    auto options = at::TensorOptions().dtype(at::kFloat).device(group.device);
    at::Tensor found_inf = at::zeros({1}, options);
    if (group.device.is_cuda()) {
      // PyTorch's own kernel: one launch for the whole list, no host sync.
      at::Tensor inv = at::full({1}, inv_scale, options);
      at::_amp_foreach_non_finite_check_and_unscale_(group.grads, found_inf, inv);
    } else {
      // The same rule with ordinary ops: check each gradient as it is (scaled), then multiply.
      at::Tensor any_bad = at::zeros({}, at::TensorOptions().dtype(at::kBool).device(group.device));
      for (auto& grad : group.grads) {
        any_bad.logical_or_(at::isfinite(grad).logical_not().any());
        grad.mul_(static_cast<double>(inv_scale));
      }
      found_inf.copy_(any_bad.view({1}));
    }
    step.found_inf.push_back(found_inf);
  }
  step.unscaled = true;
}

bool GradScaler::agree_on_found_inf(OptimizerStep& step) {
  if (step.agreed) return step.found_inf_agreed;
  float local = 0;
  for (const auto& flag : step.found_inf) local = std::max(local, flag.item<float>());
  if (group_ != nullptr) {
    // Every rank must reach the same verdict (dtrain/amp.h, the GradScaler constructor).
    at::Tensor flag = at::full({1}, local > 0 ? 1.0f : 0.0f, at::kFloat);
    group_->all_reduce(flag, ReduceOp::kMax);
    local = flag.item<float>();
  }
  step.agreed = true;
  step.found_inf_agreed = local > 0;
  return step.found_inf_agreed;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  if (step_of(optimizer).stepped) {
    throw UsageError("amp::GradScaler: " + where() +
                     "step() was already called for this optimizer since the last update(); call "
                     "update() once after each step");
  }
  if (!step_of(optimizer).unscaled) unscale_(optimizer);
  OptimizerStep& step = step_of(optimizer);
  const bool skip = agree_on_found_inf(step);
  if (!skip) optimizer.step();
  step.stepped = true;
  return !skip;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  if (steps_.empty()) {
    throw UsageError("amp::GradScaler: " + where() +
                     "update() with no step() or unscale_() since the last update(): nothing says "
                     "whether this step's gradients were finite; call step(optimizer) first");
  }
  bool found_inf = false;
  for (auto& step : steps_)
    found_inf = agree_on_found_inf(step) || found_inf;  // every one, in order
  // PyTorch's _amp_update_scale_ rule, in the same float32/float64 arithmetic.
  if (found_inf) {
    scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
    growth_tracker_ = 0;
  } else {
    const int64_t successful = growth_tracker_ + 1;
    if (successful == options_.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
      if (std::isfinite(grown)) scale_ = grown;  // never grow past float32 into inf
      growth_tracker_ = 0;
    } else {
      growth_tracker_ = successful;
    }
  }
  steps_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  if (!(new_scale > 0) || !std::isfinite(static_cast<float>(new_scale))) {
    throw UsageError("amp::GradScaler: " + where() + "update(" + std::to_string(new_scale) +
                     "): expected a positive scale that fits a float32");
  }
  scale_ = static_cast<float>(new_scale);
  steps_.clear();
}

double GradScaler::get_scale() const {
  return options_.enabled ? static_cast<double>(scale_) : 1.0;
}

GradScalerState GradScaler::state_dict() const {
  GradScalerState state;
  state.scale = get_scale();
  state.growth_factor = options_.growth_factor;
  state.backoff_factor = options_.backoff_factor;
  state.growth_interval = options_.growth_interval;
  state.growth_tracker = growth_tracker_;
  return state;
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  check_options(state, "load_state_dict");
  scale_ = static_cast<float>(state.scale);
  options_.growth_factor = state.growth_factor;
  options_.backoff_factor = state.backoff_factor;
  options_.growth_interval = state.growth_interval;
  growth_tracker_ = state.growth_tracker;
}

}  // namespace dtrain::amp
