// The part of a pipeline that one stage runs, whatever carries its tensors: it walks the stage's
// actions of a PipelineSchedule, runs its chunks' forwards and backwards, and hands activations and
// gradients to a StageLink. The single-process pipeline links stages through in-memory mailboxes,
// the distributed one through the comm layer's isend/irecv.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "dtrain/pipeline.h"
#include "pipeline/split_backward.h"

namespace dtrain::detail {

// Shape and dtype of a tensor that crosses stages: the receiver of a comm message allocates from
// it.
struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  bool operator==(const TensorMeta& other) const {
    return sizes == other.sizes && dtype == other.dtype;
  }
};

// Which message a tensor is: the activation leaving chunk `chunk` for micro-batch m, or the
// gradient flowing back into it. Unique within a step, so stages match messages by tag whatever
// order they arrive in.
inline int message_tag(const PipelineSchedule& s, PipelineAction::Kind kind, int chunk,
                       int micro_batch) {
  return ((chunk * s.micro_batches + micro_batch) << 1) |
         (kind == PipelineAction::Kind::kBackward ? 1 : 0);
}

// Rows of each of M micro-batches of a batch: the first `rows % M` get one more.
std::vector<int64_t> micro_batch_rows(int64_t rows, int micro_batches);

class StageLink {
 public:
  virtual ~StageLink() = default;
  // Non-blocking: hands `tensor` to `to_stage`; the link keeps it alive until delivered.
  virtual void send(const at::Tensor& tensor, int to_stage, int tag) = 0;
  // Blocks until the tensor `from_stage` sent with `tag` arrives (the link's timeout bounds the
  // wait). `meta` is what the sender's chunk produces, for links that must allocate the receive
  // buffer.
  virtual at::Tensor recv(int from_stage, int tag, const TensorMeta& meta) = 0;
  // Blocks until every send of this step has been delivered.
  virtual void flush() = 0;
};

// One step's data as a stage sees it.
struct StepData {
  std::vector<at::Tensor> inputs;  // per micro-batch, on the stage's device; stage of chunk 0 only
  std::vector<at::Tensor>
      targets;  // per micro-batch, on the stage's device; stage of the last chunk only
  std::vector<int64_t> rows;  // rows of each micro-batch
  int64_t total_rows = 0;
  // Output meta of chunk c for micro-batch m (distributed links allocate receive buffers from it).
  std::function<TensorMeta(int chunk, int micro_batch)> output_meta;
  const PipelineLossFn* loss_fn = nullptr;
};

class StageRunner {
 public:
  // chunks[i] is chunk stage + i·stages of the model; `device` is where they live. rng_mutex:
  // shared by the runners of stages that run side by side in one process (Note [Recompute and
  // random draws] in stage_runner.cpp); null gives this runner one of its own.
  StageRunner(int stage, const PipelineSchedule& schedule,
              std::vector<torch::nn::Sequential> chunks, c10::Device device, bool recompute,
              std::shared_ptr<std::mutex> rng_mutex = nullptr);

  // Called before each pass that accumulates parameter gradients into a local chunk (a whole
  // backward, or the W of a split one; a B accumulates none): local index, and whether it is that
  // chunk's last such pass of the step (where data-parallel gradient averaging starts).
  std::function<void(size_t local_chunk, bool last)> before_backward;

  // Runs this stage's actions for one step. Returns the sum of its micro-batches' weighted losses
  // (only the stage holding the last chunk has any), as a CPU double.
  double run(StageLink& link, const StepData& data);

  // Forward only (inference), no gradients: returns the last chunk's outputs per micro-batch (last
  // stage).
  std::vector<at::Tensor> run_forward(StageLink& link, const StepData& data);

  int stage() const { return stage_; }
  const std::vector<torch::nn::Sequential>& chunks() const { return chunks_; }
  c10::Device device() const { return device_; }
  // Most micro-batches whose activations this stage held at once in the last step.
  int peak_in_flight() const { return peak_in_flight_; }

 private:
  struct Slot {  // one micro-batch's state in one local chunk, between its forward and backward
    at::Tensor input;  // detached, requires grad unless chunk 0
    // With its graph (the weighted loss on the last chunk); undefined with recompute.
    at::Tensor output;
    WeightGradStore weight_pass;  // between the B and the W of a split backward
    // With recompute: per generator of generators_, its state before the first forward, or
    // undefined where that forward drew nothing from it.
    std::vector<at::Tensor> rng_states;
  };
  size_t local(int chunk) const { return static_cast<size_t>(chunk / schedule_.stages); }
  at::Tensor forward_chunk(int chunk, int micro_batch, const at::Tensor& input,
                           const StepData& data);
  // Forward of a chunk whose backward will recompute it: notes the generators' states in `slot`.
  at::Tensor first_forward(int chunk, int micro_batch, Slot& slot, const StepData& data);
  // The forward again, with gradients, drawing what first_forward drew.
  at::Tensor recomputed_forward(int chunk, int micro_batch, Slot& slot, const StepData& data);

  int stage_;
  const PipelineSchedule& schedule_;
  std::vector<torch::nn::Sequential> chunks_;
  c10::Device device_;
  bool recompute_;
  // With recompute: the default generators a chunk's forward may draw from (the CPU's, and the
  // stage's CUDA device's), and the lock that keeps stages sharing them from drawing at once.
  std::vector<at::Generator> generators_;
  std::shared_ptr<std::mutex> rng_mutex_;
  std::vector<std::vector<Slot>> slots_;  // [local chunk][micro-batch]
  // Per local chunk: index in the stage's actions of its last whole backward or W.
  std::vector<int> last_backward_;
  int peak_in_flight_ = 0;
};

}  // namespace dtrain::detail
