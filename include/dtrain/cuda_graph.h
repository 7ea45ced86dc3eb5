// dtrain::CudaGraphStep: a whole training step (forward, backward, the optimizer's update) captured
// once in a CUDA graph and replayed, what PyTorch's "whole-network capture" recipe does in Python
// (torch.cuda.graph), for a C++ loop. At a small batch a GPU step is dozens of kernels of a few
// microseconds each, and the host's cost of issuing them (LibTorch's dispatcher, autograd's engine,
// the optimizer's per-parameter loop) sets the speed, not the GPU; a replay issues them all in one
// launch.
//
//   auto step = [&](const std::vector<at::Tensor>& in) {   // in: fixed shapes, on the GPU
//     at::Tensor loss = loss_fn(ddp->forward(in[0]), in[1]);
//     loss.backward();
//     optimizer.step();
//     return loss;
//   };
//   dtrain::CudaGraphStep graphed(step, optimizer);
//   for (auto& [x, y] : batches) loss = graphed({x, y});    // x, y: pinned host or device tensors
//
// The capture's stream is the current one, or a stream of CudaGraphStep's own while the current one
// is the default stream (CUDA captures on no other). With DDP, build the model and DDP inside a
// CudaStreamScope (below) and run the loop there: see its comment.
//
// The step runs eagerly for the first options.warmup_steps calls (on the capture's stream: they
// create what a capture may not, such as cuBLAS's workspace and the optimizer's state), is captured
// on the next and replayed from then on. Every call is one real step on its own inputs: nothing is
// run twice or skipped. Inputs of other shapes than the captured ones (an epoch's short last batch)
// run eagerly, into the same gradient tensors.
//
// What a captured step may not do (the capture fails with one line naming CUDA's error): wait for
// the GPU on the host (.item(), a copy to the CPU, a collective that waits on the host, such as
// DDP's all-reduce over several ranks), change shapes or control flow from one step to the next,
// or change the learning rate (its value is baked into the captured kernels). The step must not
// zero the gradients: CudaGraphStep does (to None before the capture, as PyTorch's recipe, so that
// the graph allocates them; in place after it).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/errors.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

struct CudaGraphStepOptions {
  // Eager steps before the capture. PyTorch's recipe uses 3 (its DDP notes 11, for NCCL's lazy
  // set-up, which a graphed step here does not do).
  int warmup_steps = 3;
};

class CudaGraphStep {
 public:
  // `step(inputs)` runs one whole step on `inputs` (the captured copies, on the GPU) and returns
  // what the caller wants back from it, usually the loss. `optimizer`: whose gradients are zeroed
  // before each step. Throws UsageError where dtrain was built without CUDA.
  using Step = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
  CudaGraphStep(Step step, torch::optim::Optimizer& optimizer, CudaGraphStepOptions options = {});
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // One step on `inputs` (any device; the first call fixes their shapes, dtypes and the GPU):
  // returns step's result, a tensor of its own (not overwritten by later steps).
  at::Tensor operator()(const std::vector<at::Tensor>& inputs);

  // Whether the step has been captured (after warmup_steps calls).
  bool captured() const;
  // Calls so far that ran eagerly (the warm-up and inputs of other shapes) and that replayed.
  int64_t eager_steps() const;
  int64_t replayed_steps() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A stream of its own, the current one on `device` while this lives (c10::cuda::CUDAStreamGuard for
// code that includes no CUDA header). Why a graphed DDP step needs one: autograd runs each
// parameter's gradient accumulation on the stream that was current when its accumulator was made,
// and DDP keeps the accumulators from its construction. Made on the legacy default stream, they
// make the captured backward wait on it, which CUDA refuses ("operation would make the legacy
// stream depend on a capturing blocking stream"). Built inside this scope, they live on the stream
// the step is then captured on. Everything in the scope runs on that one stream, in order, as on
// the default stream.
class CudaStreamScope {
 public:
  explicit CudaStreamScope(c10::Device device);
  ~CudaStreamScope();
  CudaStreamScope(const CudaStreamScope&) = delete;
  CudaStreamScope& operator=(const CudaStreamScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
