// The gradient reducer: buckets, autograd hooks, the end-of-backward finalization (Note [DDP
// gradient buckets] in dtrain/ddp.h). Its two owners are DistributedDataParallel (one backward per
// step, finalized by the autograd engine) and DistributedPipeline's data-parallel stages (one
// backward per micro-batch, only the last one averaged, finalized by the pipeline once it has sent
// its own gradients on): how it is driven is chosen when it is made (Reducer::Finalize).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/shared_buckets.h"
#include "common/gradient_sync.h"
#include "dtrain/ddp.h"
#include "profile/step_recorder.h"

namespace dtrain::detail {

struct RidingNumber;  // comm/group_state.h

class Reducer {
 public:
  enum class Finalize {
    // DDP: the first gradient of a backward queues the wait for the all-reduces at the end of
    // that backward (an autograd engine callback); prepare_forward() decides whether the step
    // averages (not inside no_sync()). Each step is a DTRAIN_PROFILE record.
    kAtEndOfBackward,
    // A pipeline stage: only a backward announced with set_sync_next_backward(true) averages, and
    // its wait happens in finalize(), called by the owner. Its steps are not recorded (yet).
    kByOwner,
  };
  Reducer(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group,
          DistributedDataParallelOptions options, Finalize finalize = Finalize::kAtEndOfBackward);
  ~Reducer();

  // `samples`: rows of this rank's input, for the DTRAIN_PROFILE record (0: unknown).
  void prepare_forward(int64_t samples = 0);
  void end_forward() {
    if (recorder_) recorder_->end_forward();
  }

  // Finalize::kByOwner only (see there).
  void set_sync_next_backward(bool sync);
  void finalize();
  void enter_no_sync() { ++no_sync_depth_; }
  void leave_no_sync() { --no_sync_depth_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  std::vector<std::vector<size_t>> bucket_layout() const;

 private:
  struct Bucket {
    at::Tensor buffer;           // flat gradients of the bucket's parameters
    int64_t offset = 0;          // of the buffer in shared_'s region, in bytes
    std::vector<size_t> params;  // indices into params_
    size_t pending = 0;          // parameters whose gradient has not arrived in this backward
    Work work;                   // the plain all-reduce (no comm hook)
  };
  struct Param {
    at::Tensor tensor;
    std::string name;                         // module path, for error messages
    std::unique_ptr<GradientReadyHook> hook;  // calls on_gradient_ready
    size_t bucket = 0;
    at::Tensor slot;               // this parameter's view into its bucket
    bool ready = false;            // its gradient arrived in this backward
    bool had_no_gradient = false;  // .grad was undefined when it became ready
    // A backward of this rank gave it a gradient since the last averaging backward, no_sync()
    // ones included (PyTorch's local_used_map_); what find_unused_parameters all-reduces.
    bool used_since_sync = false;
  };

  void broadcast_from_rank0(const std::vector<at::Tensor>& tensors);
  void build_buckets();
  void on_gradient_ready(size_t index);
  void mark_ready(size_t index);
  void launch_ready_buckets();
  void launch(size_t bucket_index);
  // What the shared-memory reduction multiplies its sums by (Note [Gradient buckets in shared
  // memory]).
  double shared_reduction_scale() const;
  void finalize_backward();
  void reset_iteration();
  std::string who() const;

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  // Ranks on one host: the buckets live in shared memory and are reduced where they lie
  // (Note [Gradient buckets in shared memory]); null otherwise.
  std::unique_ptr<SharedBuckets> shared_;
  at::Tensor inverse_world_size_;  // 0-dim, multiplies gradients on their way into the buckets
  // World size 1: the local gradients already are the average. The hooks only track which
  // parameters got a gradient (for the unused-parameter error); no buckets, no copies, no
  // collectives.
  bool local_only_ = false;
  // Note [A number riding on the gradients] (comm/group_state.h): the group's, when the bucket
  // launched last can carry it (as the last element of its buffer); null otherwise.
  std::shared_ptr<RidingNumber> riding_;

  std::mutex mutex_;  // hooks of a CUDA backward may run on several device threads
  std::atomic<int> no_sync_depth_{0};
  bool sync_this_iteration_ = true;
  bool backward_started_ = false;
  const bool explicit_finalize_;  // Finalize::kByOwner
  size_t next_to_launch_ = 0;
  std::unique_ptr<StepRecorder> recorder_;  // null unless DTRAIN_PROFILE is set
};

}  // namespace dtrain::detail
