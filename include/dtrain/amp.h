// dtrain::amp: mixed precision. An autocast scope runs the matmuls and convolutions of a forward
// pass in float16 or bfloat16 (LibTorch picks the ops; the parameters stay float32), and a
// GradScaler keeps float16 gradients from underflowing by scaling the loss, with PyTorch's
// torch.cuda.amp.GradScaler rules, and skips the optimizer step when a gradient came out inf or
// NaN.
//
//   dtrain::amp::GradScaler scaler({}, pg);            // DDP: every rank skips the same steps
//   for (...) {
//     optimizer.zero_grad();
//     at::Tensor loss;
//     {
//       dtrain::amp::Autocast autocast(torch::kCUDA, torch::kHalf);   // CPU: torch::kBFloat16
//       loss = loss_fn(ddp(x), y);
//     }
//     scaler.scale(loss).backward();                  // backward outside the scope, as in PyTorch
//     scaler.unscale_(optimizer);                     // optional: only to clip the true gradients
//     torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
//     scaler.step(optimizer);                         // skipped (on every rank) on inf/NaN
//     scaler.update();
//   }
//
// bfloat16 has float32's range: it needs no GradScaler (a disabled one passes everything through,
// so a loop can be written once for both). dtrain::DataParallel carries the caller's autocast scope
// into its replica threads, and its gradients are reduced onto the module before the scaler sees
// them, so a DataParallel step needs no group.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/errors.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

class ProcessGroup;

namespace amp {

// Runs the ops of this thread inside the scope under autocast for `device_type`, in `dtype`:
// CUDA: torch::kHalf or torch::kBFloat16; CPU: torch::kBFloat16 only (LibTorch's CPU autocast has
// no float16). Scopes nest; leaving one restores the enclosing state, and leaving the outermost one
// empties autocast's cache of casted weights. The state is per thread, as in PyTorch. Throws
// UsageError for float16 on the CPU, another dtype or device type, or CUDA when this process has
// none.
class Autocast {
 public:
  Autocast(c10::DeviceType device_type, c10::ScalarType dtype);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  bool was_enabled_;
  c10::ScalarType previous_dtype_;
};

struct GradScalerOptions {
  // The first scale (PyTorch's 2^16): large, so that small float16 gradients do not underflow; the
  // first few steps back it off until no gradient overflows.
  double init_scale = 65536.0;
  // After growth_interval consecutive steps without inf/NaN, the scale is multiplied by
  // growth_factor (> 1), unless that would overflow float32.
  double growth_factor = 2.0;
  // A step with an inf/NaN gradient is skipped and the scale multiplied by backoff_factor, in
  // (0, 1).
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  // false: scale() returns the loss unchanged, step() just steps, update() does nothing.
  bool enabled = true;
};

// The scaler's state as PyTorch's GradScaler.state_dict() has it.
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;  // consecutive steps without inf/NaN since the last growth or backoff
};

// Dynamic loss scaling, step by step as PyTorch's GradScaler: scale(loss).backward(), optionally
// unscale_(optimizer) (once, before clipping), step(optimizer), update(). Works on gradients on any
// device (CPU and CUDA, several devices at once). scale() may be called from several threads at
// once (DataParallel's replicas); the other calls from one thread.
class GradScaler {
 public:
  // With a group, step() takes the maximum of the ranks' inf/NaN flags (one all-reduce of one
  // float), so every rank skips the same steps and keeps the same scale: a rank that skipped alone
  // would leave its replica behind the others'. Pass the group of every rank whose optimizer must
  // step in lockstep: DDP's group; for a pipeline or tensor-parallel layout, the whole job (stages
  // and shards hold different parameters). Every rank of the group must call step() (and update())
  // equally often. Null: decide from this process's gradients alone. Throws UsageError for options
  // outside the ranges above.
  explicit GradScaler(GradScalerOptions options = {},
                      std::shared_ptr<ProcessGroup> group = nullptr);

  // The loss multiplied by the current scale (a float16 or bfloat16 loss in float32, which does not
  // overflow). The loss itself when disabled.
  at::Tensor scale(const at::Tensor& loss) const;

  // Divides the optimizer's gradients by the scale and records whether any is inf or NaN. Call it
  // at most once per optimizer between update()s, after the last backward of the step; step() calls
  // it when it was not called. Throws UsageError when called twice or after step(). float16
  // gradients are refused (as in PyTorch): keep float32 parameters and let autocast cast them.
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales (unless unscale_ ran) and steps the optimizer unless a gradient was inf or NaN (on any
  // rank of the group: this blocks on the group's all-reduce, up to its timeout). Returns whether
  // it stepped. Throws UsageError when called twice for one optimizer without update() in between.
  bool step(torch::optim::Optimizer& optimizer);

  // Ends the step: backs the scale off if any step() since the last update() found inf/NaN, grows
  // it after growth_interval clean steps in a row. Throws UsageError when no step() or unscale_()
  // ran since the last update().
  void update();
  // Ends the step with the given scale instead (PyTorch's update(new_scale)); keeps the count.
  void update(double new_scale);

  // The current scale (1 when disabled).
  double get_scale() const;
  bool is_enabled() const { return options_.enabled; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  // Consecutive clean steps counted towards the next growth.
  int64_t growth_tracker() const { return growth_tracker_; }

  GradScalerState state_dict() const;
  // Throws UsageError for a state outside the option ranges.
  void load_state_dict(const GradScalerState& state);

  // Checkpoints: point TrainingState::grad_scaler at the scaler (dtrain/checkpoint.h) and the
  // Checkpointer saves and restores this state with the model's. Save after update(): a step half
  // done is not saved.

 private:
  // What one optimizer's step has done since the last update().
  struct OptimizerStep {
    const torch::optim::Optimizer* optimizer = nullptr;
    bool unscaled = false;
    bool stepped = false;
    std::vector<at::Tensor> found_inf;  // per device of its gradients: > 0 if one was inf/NaN
    bool agreed = false;                // found_inf_agreed holds the group's verdict
    bool found_inf_agreed = false;
  };
  OptimizerStep& step_of(const torch::optim::Optimizer& optimizer);
  bool agree_on_found_inf(OptimizerStep& step);
  std::string where() const;  // "rank R/N: " with a group

  GradScalerOptions options_;
  std::shared_ptr<ProcessGroup> group_;
  float scale_;  // float32, as PyTorch keeps it: the same growth and backoff arithmetic
  int64_t growth_tracker_ = 0;
  // In order of first use (the same on every rank, unlike addresses): the order of the all-reduces.
  std::vector<OptimizerStep> steps_;
};

}  // namespace amp
}  // namespace dtrain
