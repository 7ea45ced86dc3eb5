// One stage's walk through its schedule; see stage_runner.h.
#include "pipeline/stage_runner.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace dtrain::detail {

using Kind = PipelineAction::Kind;

// Note [Recompute and random draws]
// With recompute, a chunk's forward runs twice: without gradients when its micro-batch passes
// through, and with them at its backward. A chunk that draws random numbers (dropout in training
// mode) must draw the same ones both times, or the activation sent on and the loss come from one
// mask and the gradients from another: the gradient of no function. As torch.utils.checkpoint
// does (preserve_rng_state, its default), the first forward notes the state of each default
// generator it may draw from (the CPU's, and the stage's CUDA device's: LibTorch's modules draw
// from the default generator of their tensors' device, and a stage cannot hand them one of its
// own), and the recomputed forward sets that state, runs, and puts back the state it found. So the
// stream of draws is the one without recompute: a run whose draws come in a fixed order (one
// stage per process under DistributedPipeline, one drawing stage in a Pipeline) trains the same
// numbers with recompute on or off. A generator the first forward did not draw from is left alone
// at the recompute, so a chunk without random draws never writes a generator another thread may be
// using.
// The stages of a single-process Pipeline share those generators (one CPU generator per process,
// one per CUDA device), so between noting the state and drawing, another stage could draw or put
// back a state of its own. Their recompute-mode forwards therefore hold one lock (rng_mutex_) from
// the note to the last draw: the forwards of such stages do not overlap (their backwards still
// do), the price of masks that match. Masks then match their gradients, but which stage draws
// first is still the threads' race, as without recompute: a deterministic mask per micro-batch
// would need a seed per (chunk, micro-batch) set into the shared generator under that lock for
// every forward, recompute or not, which serializes every pipeline's forwards and rewinds the
// generator under any other thread drawing from it. Other threads of the process that draw while a
// step recomputes are not covered (nor are they by torch.utils.checkpoint).

namespace {

at::Tensor generator_state(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();  // a copy
}

void set_generator_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Links that need no receive buffer (in-memory mailboxes) come without output metas.
TensorMeta meta(const StepData& data, int chunk, int micro_batch) {
  return data.output_meta ? data.output_meta(chunk, micro_batch) : TensorMeta{};
}
}  // namespace

StageRunner::StageRunner(int stage, const PipelineSchedule& schedule,
                         std::vector<torch::nn::Sequential> chunks, c10::Device device,
                         bool recompute, std::shared_ptr<std::mutex> rng_mutex)
    : stage_(stage),
      schedule_(schedule),
      chunks_(std::move(chunks)),
      device_(device),
      recompute_(recompute),
      rng_mutex_(rng_mutex ? std::move(rng_mutex) : std::make_shared<std::mutex>()) {
  if (recompute_) {
    // Note [Recompute and random draws]. The context's default generator of a CUDA device is
    // reached through LibTorch's CUDA hooks, so this compiles in a CPU-only build too.
    generators_.push_back(at::detail::getDefaultCPUGenerator());
    if (device_.is_cuda()) generators_.push_back(at::globalContext().defaultGenerator(device_));
  }
  slots_.assign(chunks_.size(), std::vector<Slot>(schedule_.micro_batches));
  last_backward_.assign(chunks_.size(), -1);
  const auto& actions = schedule_.actions[stage_];
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].kind == Kind::kBackward || actions[i].kind == Kind::kBackwardWeight)
      last_backward_[local(actions[i].chunk)] = static_cast<int>(i);
  }
}

at::Tensor StageRunner::forward_chunk(int chunk, int micro_batch, const at::Tensor& input,
                                      const StepData& data) {
  at::Tensor output = chunks_[local(chunk)]->forward(input);
  if (chunk + 1 < schedule_.chunks()) return output;
  // The last chunk turns its output into this micro-batch's share of the batch's mean loss.
  at::Tensor loss = (*data.loss_fn)(output, data.targets[micro_batch]);
  if (loss.numel() != 1) {
    throw UsageError("pipeline: the loss function returned " + std::to_string(loss.numel()) +
                     " values for micro-batch " + std::to_string(micro_batch) +
                     "; expected one (the mean loss over the micro-batch's rows)");
  }
  return loss.reshape({}) * (static_cast<double>(data.rows[micro_batch]) / data.total_rows);
}

at::Tensor StageRunner::first_forward(int chunk, int micro_batch, Slot& slot,
                                      const StepData& data) {
  std::lock_guard<std::mutex> lock(*rng_mutex_);
  std::vector<at::Tensor> before;
  for (auto& generator : generators_) before.push_back(generator_state(generator));
  at::Tensor output;
  {
    torch::autograd::AutoGradMode no_grad(false);
    output = forward_chunk(chunk, micro_batch, slot.input, data);
  }
  slot.rng_states.assign(generators_.size(), at::Tensor());
  for (size_t g = 0; g < generators_.size(); ++g) {
    if (!at::equal(generator_state(generators_[g]), before[g]))
      slot.rng_states[g] = std::move(before[g]);
  }
  return output;
}

at::Tensor StageRunner::recomputed_forward(int chunk, int micro_batch, Slot& slot,
                                           const StepData& data) {
  std::lock_guard<std::mutex> lock(*rng_mutex_);
  // The states found now, put back after the forward (also when it throws): the stream goes on
  // as if the forward had run once.
  struct PutBack {
    std::vector<at::Generator>& generators;
    std::vector<at::Tensor> found;
    ~PutBack() {
      for (size_t g = 0; g < found.size(); ++g) {
        if (!found[g].defined()) continue;
        try {
          set_generator_state(generators[g], found[g]);
        } catch (...) {
          // Setting a state that get_state gave cannot fail in practice; a destructor must not
          // throw either way.
        }
      }
    }
  } put_back{generators_, std::vector<at::Tensor>(generators_.size())};
  for (size_t g = 0; g < generators_.size() && g < slot.rng_states.size(); ++g) {
    if (!slot.rng_states[g].defined()) continue;
    put_back.found[g] = generator_state(generators_[g]);
    set_generator_state(generators_[g], slot.rng_states[g]);
  }
  torch::autograd::AutoGradMode grad_mode(true);
  return forward_chunk(chunk, micro_batch, slot.input, data);
}

double StageRunner::run(StageLink& link, const StepData& data) {
  const int chunks = schedule_.chunks();
  const auto& actions = schedule_.actions[stage_];
  double loss_sum = 0;
  int in_flight = 0;
  peak_in_flight_ = 0;
  for (size_t i = 0; i < actions.size(); ++i) {
    const PipelineAction& a = actions[i];
    const int c = a.chunk, m = a.micro_batch;
    Slot& slot = slots_[local(c)][m];
    if (a.kind == Kind::kForward) {
      at::Tensor received = c == 0 ? data.inputs[m]
                                   : link.recv(schedule_.stage_of(c - 1),
                                               message_tag(schedule_, Kind::kForward, c - 1, m),
                                               meta(data, c - 1, m));
      // Each chunk's graph starts at its input, so its backward can run on its own, on its own
      // stage.
      slot.input = received.detach();
      if (c > 0 && slot.input.is_floating_point()) slot.input.requires_grad_(true);
      at::Tensor output;
      if (recompute_) {
        output = first_forward(c, m, slot, data);
      } else {
        torch::autograd::AutoGradMode grad_mode(true);
        output = forward_chunk(c, m, slot.input, data);
      }
      if (c + 1 < chunks) {
        link.send(output.detach(), schedule_.stage_of(c + 1),
                  message_tag(schedule_, Kind::kForward, c, m));
      } else {
        loss_sum += output.detach().item<double>();
      }
      if (!recompute_) slot.output = output;
      peak_in_flight_ = std::max(peak_in_flight_, ++in_flight);
      continue;
    }
    const bool last = static_cast<int>(i) == last_backward_[local(c)];
    if (a.kind == Kind::kBackwardWeight) {
      // W of Note [Split backward]: the parameters' gradients, and their hooks, now.
      if (before_backward) before_backward(local(c), last);
      backward_weight(slot.weight_pass);
      slot = Slot();  // frees what B kept for it
      --in_flight;
      continue;
    }
    if (a.kind == Kind::kBackward && before_backward) before_backward(local(c), last);
    if (recompute_) slot.output = recomputed_forward(c, m, slot, data);
    at::Tensor grad_output;
    if (c + 1 < chunks) {
      grad_output = link.recv(schedule_.stage_of(c + 1),
                              message_tag(schedule_, Kind::kBackward, c, m), meta(data, c, m));
    }
    at::Tensor grad_input;
    if (a.kind == Kind::kBackwardInput) {
      // B: the input gradient only; the parameters' gradients wait in slot.weight_pass for W.
      grad_input = backward_input(slot.output, grad_output, c > 0 ? slot.input : at::Tensor(),
                                  slot.weight_pass);
    } else {
      if (grad_output.defined()) {
        torch::autograd::backward({slot.output}, {grad_output});
      } else {
        torch::autograd::backward({slot.output});
      }
      if (c > 0) grad_input = slot.input.grad();
    }
    if (c > 0) {
      if (!grad_input.defined()) grad_input = at::zeros_like(slot.input);  // input ignored
      link.send(grad_input, schedule_.stage_of(c - 1),
                message_tag(schedule_, Kind::kBackward, c - 1, m));
    }
    if (a.kind == Kind::kBackwardInput) {
      slot.input = slot.output = at::Tensor();  // W needs neither: it holds its part of the graph
      continue;
    }
    slot = Slot();  // frees the micro-batch's activations
    --in_flight;
  }
  link.flush();
  return loss_sum;
}

std::vector<at::Tensor> StageRunner::run_forward(StageLink& link, const StepData& data) {
  torch::autograd::AutoGradMode no_grad(false);
  const int chunks = schedule_.chunks();
  std::vector<at::Tensor> outputs(schedule_.micro_batches);
  for (const PipelineAction& a : schedule_.actions[stage_]) {
    if (a.kind != Kind::kForward) continue;
    const int c = a.chunk, m = a.micro_batch;
    at::Tensor input =
        c == 0 ? data.inputs[m]
               : link.recv(schedule_.stage_of(c - 1),
                           message_tag(schedule_, Kind::kForward, c - 1, m), meta(data, c - 1, m));
    at::Tensor output = chunks_[local(c)]->forward(input);
    if (c + 1 < chunks) {
      link.send(output, schedule_.stage_of(c + 1), message_tag(schedule_, Kind::kForward, c, m));
    } else {
      outputs[m] = output;
    }
  }
  link.flush();
  return outputs;
}

}  // namespace dtrain::detail
