// dtrain::CudaGraphStep (dtrain/cuda_graph.h): the warm-up, the capture and the replays.
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <optional>

#include "dtrain/cuda_graph.h"

#ifdef DTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtrain {

namespace {

// The first line of an exception's message: c10's errors append a backtrace.
std::string first_line(const std::exception& e) {
  std::string text = e.what();
  return text.substr(0, text.find('\n'));
}

bool same_shapes(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || a[i].scalar_type() != b[i].scalar_type()) return false;
  }
  return true;
}

}  // namespace

struct CudaGraphStep::Impl {
  Impl(Step step, torch::optim::Optimizer& optimizer, CudaGraphStepOptions options)
      : step(std::move(step)), optimizer(optimizer), options(options) {}
  Step step;
  torch::optim::Optimizer& optimizer;
  CudaGraphStepOptions options;
  std::vector<at::Tensor> shapes;  // the first call's inputs, whose shapes are captured
  int64_t eager = 0, replayed = 0;
#ifdef DTRAIN_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> stream;  // the warm-up's and the capture's
  std::vector<at::Tensor> static_inputs;        // what the graph reads: each call's copied in
  at::Tensor static_output;                     // what the graph writes: step's result
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

CudaGraphStep::CudaGraphStep(Step step, torch::optim::Optimizer& optimizer,
                             CudaGraphStepOptions options) {
  // Every update of LibTorch's other optimizers reads a step count the host keeps (Adam's and
  // AdamW's bias corrections, Adagrad's decay): a capture would bake the first captured step's
  // value into every replay. SGD's update (momentum, Nesterov, weight decay) is tensors alone.
  if (dynamic_cast<torch::optim::SGD*>(&optimizer) == nullptr) {
    throw UsageError(
        "CudaGraphStep: only torch::optim::SGD can be captured: LibTorch's other optimizers "
        "compute their update from a step count kept on the host, which a CUDA graph would "
        "freeze at its first value; run this step eagerly");
  }
  if (options.warmup_steps < 1) {
    throw UsageError("CudaGraphStep: warmup_steps is " + std::to_string(options.warmup_steps) +
                     "; at least 1 eager step must create the optimizer's state before a capture");
  }
#ifndef DTRAIN_WITH_CUDA
  throw UsageError(
      "CudaGraphStep: dtrain was built against a LibTorch without CUDA; rebuild against a CUDA "
      "LibTorch (PyPI's torch for Linux is one) or run the step eagerly");
#else
  if (c10::cuda::device_count() == 0) {
    throw UsageError(
        "CudaGraphStep: this process sees no CUDA device (no GPU, or CUDA_VISIBLE_DEVICES "
        "empty); run the step eagerly");
  }
  impl_ = std::make_unique<Impl>(std::move(step), optimizer, options);
#endif
}

CudaGraphStep::~CudaGraphStep() = default;

bool CudaGraphStep::captured() const {
#ifdef DTRAIN_WITH_CUDA
  return impl_->graph != nullptr;
#else
  return false;
#endif
}
int64_t CudaGraphStep::eager_steps() const { return impl_->eager; }
int64_t CudaGraphStep::replayed_steps() const { return impl_->replayed; }

#ifndef DTRAIN_WITH_CUDA
at::Tensor CudaGraphStep::operator()(const std::vector<at::Tensor>&) {
  throw UsageError("CudaGraphStep: dtrain was built against a LibTorch without CUDA");
}

struct CudaStreamScope::Impl {};
CudaStreamScope::CudaStreamScope(c10::Device) {
  throw UsageError("CudaStreamScope: dtrain was built against a LibTorch without CUDA");
}
CudaStreamScope::~CudaStreamScope() = default;
#else

struct CudaStreamScope::Impl {
  explicit Impl(c10::Device device)
      : guard(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}
  c10::cuda::CUDAStreamGuard guard;
};
CudaStreamScope::CudaStreamScope(c10::Device device) {
  if (!device.is_cuda()) {
    throw UsageError("CudaStreamScope: device " + device.str() + " is not a CUDA device");
  }
  impl_ = std::make_unique<Impl>(device);
}
CudaStreamScope::~CudaStreamScope() = default;

// Note [Capturing a whole step]
// PyTorch's recipe for whole-network capture (torch.cuda.graph's documentation), in C++:
// - Warm-up: the first steps run eagerly on the capture's stream: the current one, or a stream of
//   our own while the current one is the default stream, on which CUDA refuses to capture. They
//   create what a capture may not: cuBLAS's handle and workspace, autograd's device thread, the
//   optimizer's momentum buffers (in the ordinary pool, so they outlive nothing of the graph's).
// - The capture: gradients set to None first, so that the captured backward allocates them in the
//   graph's private pool and assigns them to the parameters once, on the host, during the capture;
//   every replay then rewrites the same memory, which the captured optimizer reads. A capture does
//   not run the step, so the capturing call replays it at once.
// - Replays: each call copies its inputs into the static ones (on the current stream, ordered
//   before the replay on it) and launches the graph; the result is cloned out of the pool, since
//   the next replay overwrites it.
// - Inputs of other shapes run eagerly after the capture with the gradients zeroed in place: the
//   parameters keep the graph's gradient tensors, and the next replay still finds them.
// Autograd's engine runs the captured backward on its device thread, on the stream of each op's
// forward: the capture's, which is what makes whole-step capture work (in Python too).
at::Tensor CudaGraphStep::operator()(const std::vector<at::Tensor>& inputs) {
  Impl& s = *impl_;
  if (inputs.empty()) throw UsageError("CudaGraphStep: a step takes at least one input tensor");
  auto current = c10::cuda::getCurrentCUDAStream();
  if (s.shapes.empty()) {
    s.shapes = inputs;
    // CUDA captures on no default stream: then a stream of our own (Note [Capturing a whole step]).
    const bool on_default = current == c10::cuda::getDefaultCUDAStream(current.device_index());
    s.stream = on_default ? c10::cuda::getStreamFromPool(false, current.device_index()) : current;
  }
  const c10::Device device(c10::kCUDA, s.stream->device_index());
  const bool same = same_shapes(inputs, s.shapes);

  if (s.graph && same) {
    for (size_t i = 0; i < inputs.size(); ++i) s.static_inputs[i].copy_(inputs[i], true);
    s.graph->replay();
    ++s.replayed;
    return s.static_output.clone();
  }

  // The step, eagerly or captured, on the capture's stream after the current stream's work, and
  // the current stream's next work after it.
  const bool forked = *s.stream != current;
  if (forked) {
    c10::cuda::CUDAEvent before;
    before.record(current);
    before.block(*s.stream);
  }
  at::Tensor result;
  {
    c10::cuda::CUDAStreamGuard on_side(*s.stream);
    if (s.graph || !same || s.eager < s.options.warmup_steps) {
      // The warm-up, or a shape the graph does not know.
      s.optimizer.zero_grad(/*set_to_none=*/s.graph == nullptr);
      std::vector<at::Tensor> on_device;
      for (const auto& input : inputs) on_device.push_back(input.to(device, true));
      result = s.step(on_device);
      ++s.eager;
    } else {
      for (const auto& input : inputs) {
        s.static_inputs.push_back(at::empty(input.sizes(), input.options().device(device)));
        s.static_inputs.back().copy_(input, true);
      }
      s.optimizer.zero_grad(/*set_to_none=*/true);
      auto graph = std::make_unique<at::cuda::CUDAGraph>();
      try {
        graph->capture_begin();
        s.static_output = s.step(s.static_inputs);
        graph->capture_end();
      } catch (const std::exception& e) {
        // capture_end() ends the stream's capture and the allocator's routing into the graph's
        // pool even when CUDA refuses the graph: both are needed to go on eagerly.
        try {
          graph->capture_end();
        } catch (const std::exception&) {
        }
        const std::string why = first_line(e);
        const bool legacy = why.find("legacy stream") != std::string::npos;
        throw UsageError(
            "CudaGraphStep: the step could not be captured in a CUDA graph: " + why +
            (legacy ? ". The model's gradient accumulators were made on the default stream (by "
                      "DDP's construction, say): build the model and DDP inside a "
                      "dtrain::CudaStreamScope"
                    : ". A captured step may not wait on the host (.item(), a copy to the CPU, "
                      "a collective that blocks) nor change shapes; run it eagerly"));
      }
      s.graph = std::move(graph);
    }
  }
  if (forked) {
    c10::cuda::CUDAEvent after;
    after.record(*s.stream);
    after.block(current);
  }
  if (result.defined()) return result;
  s.graph->replay();  // the capture ran nothing: this call's step
  ++s.replayed;
  return s.static_output.clone();
}
#endif

}  // namespace dtrain
