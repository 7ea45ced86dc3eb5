// One stage's walk through its schedule; see stage_runner.h.
#include "pipeline/stage_runner.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace dtrain::detail {

using Kind = PipelineAction::Kind;

namespace {
// Links that need no receive buffer (in-memory mailboxes) come without output metas.
TensorMeta meta(const StepData& data, int chunk, int micro_batch) {
  return data.output_meta ? data.output_meta(chunk, micro_batch) : TensorMeta{};
}
}  // namespace

StageRunner::StageRunner(int stage, const PipelineSchedule& schedule,
                         std::vector<torch::nn::Sequential> chunks, c10::Device device,
                         bool recompute)
    : stage_(stage),
      schedule_(schedule),
      chunks_(std::move(chunks)),
      device_(device),
      recompute_(recompute) {
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
      {
        torch::autograd::AutoGradMode grad_mode(!recompute_);
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
    if (recompute_) {
      torch::autograd::AutoGradMode grad_mode(true);
      slot.output = forward_chunk(c, m, slot.input, data);
    }
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
