// Cutting a torch::nn::Sequential into pipeline chunks, by hand or balanced by weights, parameters
// or measured time.
#include <torch/nn/modules/container/sequential.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "dtrain/pipeline.h"

namespace dtrain {
namespace {

void check_parts(const torch::nn::Sequential& model, int parts, const char* what) {
  if (parts < 1 || static_cast<int64_t>(model->size()) < parts) {
    throw UsageError(
        std::string(what) + ": cannot cut a model of " + std::to_string(model->size()) +
        " layers into " + std::to_string(parts) +
        " chunks; expected 1 <= chunks <= layers (use fewer stages or virtual stages)");
  }
}

}  // namespace

std::vector<int64_t> balance_by_weights(const std::vector<double>& weights, int parts) {
  const int n = static_cast<int>(weights.size());
  if (parts < 1 || parts > n) {
    throw UsageError("balance_by_weights: cannot cut " + std::to_string(n) + " weights into " +
                     std::to_string(parts) + " runs; expected 1 <= runs <= weights");
  }
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weights[i];
  const double kInf = std::numeric_limits<double>::infinity();
  // best[k][i]: the heaviest run when the first i layers form k runs; cut[k][i]: where the last run
  // starts.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k) {
    for (int i = k; i <= n; ++i) {
      for (int j = k - 1; j < i; ++j) {
        double heaviest = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        // Ties go to the later cut, which keeps the runs' sizes closer to even.
        if (heaviest <= best[k][i]) {
          best[k][i] = heaviest;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> boundaries;
  for (int k = parts, i = n; k > 1; --k) {
    i = cut[k][i];
    boundaries.push_back(i);
  }
  std::reverse(boundaries.begin(), boundaries.end());
  return boundaries;
}

std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<int64_t>& boundaries) {
  const int64_t layers = static_cast<int64_t>(model->size());
  for (size_t i = 0; i < boundaries.size(); ++i) {
    int64_t b = boundaries[i];
    if (b <= 0 || b >= layers || (i > 0 && b <= boundaries[i - 1])) {
      throw UsageError("split_sequential: boundary " + std::to_string(b) + " (#" +
                       std::to_string(i) + ") is out of order or outside 1.." +
                       std::to_string(layers - 1) +
                       "; boundaries must be strictly increasing layer indices inside a model of " +
                       std::to_string(layers) + " layers");
    }
  }
  // The chunks hold the model's own layers under their original names ("3.weight"), so parameters
  // keep their identity and messages name them as in the whole model.
  auto names = model->named_children();
  std::vector<torch::nn::Sequential> chunks(1);
  size_t next_boundary = 0;
  int64_t index = 0;
  for (const auto& layer : *model) {
    if (next_boundary < boundaries.size() && index == boundaries[next_boundary]) {
      chunks.emplace_back();
      ++next_boundary;
    }
    chunks.back()->push_back(names[index].key(), layer);
    ++index;
  }
  return chunks;
}

std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int parts) {
  check_parts(model, parts, "balance_by_parameters");
  std::vector<double> weights;
  for (const auto& child : model->children()) {
    int64_t count = 0;
    for (const auto& p : child->parameters()) count += p.numel();
    weights.push_back(static_cast<double>(count));
  }
  return balance_by_weights(weights, parts);
}

std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model, int parts,
                                     const at::Tensor& sample, int repeats) {
  check_parts(model, parts, "balance_by_time");
  if (repeats < 1) throw UsageError("balance_by_time: repeats must be at least 1");
  using Clock = std::chrono::steady_clock;
  std::vector<double> weights(model->size(), 0.0);
  // The timing runs' gradients are not the caller's: keep theirs aside.
  std::vector<at::Tensor> saved_grads;
  for (auto& p : model->parameters())
    saved_grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  for (int r = 0; r < repeats; ++r) {
    at::Tensor x = sample;
    size_t index = 0;
    torch::nn::Sequential layers = model;  // shares the model; its layers' forward is not const
    for (auto& layer : *layers) {
      at::Tensor input = x.detach().requires_grad_(x.is_floating_point());
      auto start = Clock::now();
      at::Tensor output = layer.forward(input);
      if (output.requires_grad()) output.backward(torch::ones_like(output));
      weights[index++] += std::chrono::duration<double>(Clock::now() - start).count();
      x = output.detach();
    }
  }
  size_t i = 0;
  for (auto& p : model->parameters()) p.mutable_grad() = saved_grads[i++];
  return balance_by_weights(weights, parts);
}

}  // namespace dtrain
