// The parameter check, the bucketing and the gradient hook that DDP and sharded data parallelism
// share (see common/gradient_sync.h).
#include "common/gradient_sync.h"

#include <ATen/ATen.h>
// Node in full: LibTorch 2.15 brings it in through variable.h, 2.11 does not.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "comm/device_check.h"
#include "common/format.h"
#include "common/stable_hash.h"

namespace dtrain::detail {
namespace {

// A parameter's name, dtype and shape as one number, compared across ranks (never negative, so
// that -1 can stand for "no parameter here").
int64_t fingerprint(const std::string& name, const at::Tensor& t) {
  std::ostringstream text;
  text << name << '|' << t.scalar_type() << '|' << t.sizes();
  return stable_hash(text.str());
}

// What a rank has at position `index`, as the message shows it.
std::string describe(const std::vector<NamedParameter>& parameters, size_t index) {
  if (index >= parameters.size()) {
    return "no parameter #" + std::to_string(index) + " (" + std::to_string(parameters.size()) +
           " in all)";
  }
  std::ostringstream out;
  const auto& [name, t] = parameters[index];
  out << "'" << name << "' " << t.sizes() << " " << t.scalar_type();
  return out.str();
}

// Every rank's description of its parameter #index, gathered as one character per int64 (the
// error path: a few kilobytes at most, in a dtype every transport moves).
std::vector<std::string> gather_descriptions(ProcessGroup& group,
                                             const std::vector<NamedParameter>& parameters,
                                             size_t index) {
  constexpr int64_t kMaxChars = 256;
  std::string mine = describe(parameters, index).substr(0, kMaxChars);
  at::Tensor chars = at::zeros({kMaxChars}, at::kLong);
  for (size_t i = 0; i < mine.size(); ++i) chars[static_cast<int64_t>(i)] = mine[i];
  std::vector<at::Tensor> all(group.size());
  for (auto& t : all) t = at::empty_like(chars);
  group.all_gather(all, chars);
  std::vector<std::string> descriptions;
  for (const auto& t : all) {
    std::string text;
    auto values = t.accessor<int64_t, 1>();
    for (int64_t i = 0; i < kMaxChars && values[i] != 0; ++i) text += static_cast<char>(values[i]);
    descriptions.push_back(text);
  }
  return descriptions;
}

}  // namespace

void check_same_parameters(ProcessGroup& group, const std::vector<NamedParameter>& parameters,
                           const std::string& what) {
  const int n = group.size();
  if (n == 1) return;
  // First the counts, so that the fingerprints can be gathered in tensors of one length on every
  // rank (positions past a rank's count hold -1); with them each rank's process and GPU, for the
  // check that no two thread ranks train on one GPU (comm/device_check.h).
  int device = -1;
  for (const auto& [name, parameter] : parameters) {
    if (parameter.is_cuda()) {
      device = parameter.get_device();
      break;
    }
  }
  at::Tensor count = at::tensor(
      {static_cast<int64_t>(parameters.size()), own_process_id(), static_cast<int64_t>(device)},
      at::kLong);
  std::vector<at::Tensor> counts(n);
  for (auto& c : counts) c = at::empty({3}, at::kLong);
  group.all_gather(counts, count);
  int64_t longest = 0;
  std::vector<RankProcess> processes;
  for (int r = 0; r < n; ++r) {
    longest = std::max(longest, counts[r][0].item<int64_t>());
    processes.push_back({group.global_rank_of(r), counts[r][1].item<int64_t>(),
                         static_cast<int>(counts[r][2].item<int64_t>())});
  }
  // Every rank gathered the same: every rank refuses alike, none is left waiting.
  const std::string sharing = describe_threads_sharing_a_gpu(processes);
  if (!sharing.empty()) throw UsageError(rank_text(group) + ": " + what + ": " + sharing + ".");
  at::Tensor mine = at::full({longest}, int64_t{-1}, at::kLong);
  for (size_t i = 0; i < parameters.size(); ++i) {
    mine[static_cast<int64_t>(i)] = fingerprint(parameters[i].first, parameters[i].second);
  }
  std::vector<at::Tensor> all(n);
  for (auto& t : all) t = at::empty_like(mine);
  group.all_gather(all, mine);

  // The first position where some rank differs from rank 0. Every rank sees the same gathered
  // tensors, so every rank finds the same one and takes part in the gather below.
  for (int64_t i = 0; i < longest; ++i) {
    std::vector<int> differing;
    for (int r = 1; r < n; ++r) {
      if (all[r][i].item<int64_t>() != all[0][i].item<int64_t>()) differing.push_back(r);
    }
    if (differing.empty()) continue;
    const auto descriptions = gather_descriptions(group, parameters, static_cast<size_t>(i));
    std::ostringstream message;
    message << rank_text(group) << ": " << what << ": parameter #" << i
            << " differs between ranks: ranks {";
    for (size_t k = 0; k < differing.size(); ++k) {
      message << (k ? "," : "") << group.global_rank_of(differing[k]);
    }
    message << "} do not match rank " << group.global_rank_of(0)
            << " in name, shape or dtype: rank " << group.global_rank_of(0) << " has "
            << descriptions[0];
    for (int r : differing) {
      message << ", rank " << group.global_rank_of(r) << " has " << descriptions[r];
    }
    message << ". Likely cause: the model is built differently on some ranks (constructor "
               "arguments, flags, randomness in its structure). Build the same model on every "
               "rank.";
    throw UsageError(message.str());
  }
}

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& parameters,
                                                int64_t first_bucket_cap_bytes,
                                                int64_t bucket_cap_bytes) {
  std::vector<std::vector<size_t>> buckets;
  std::vector<int64_t> bucket_bytes;
  std::map<std::pair<at::ScalarType, std::string>, size_t> open;  // (dtype, device) -> bucket
  for (size_t k = parameters.size(); k-- > 0;) {
    const at::Tensor& t = parameters[k];
    auto key = std::make_pair(t.scalar_type(), t.device().str());
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    auto it = open.find(key);
    if (it == open.end() || bucket_bytes[it->second] + bytes >
                                (it->second == 0 ? first_bucket_cap_bytes : bucket_cap_bytes)) {
      buckets.emplace_back();
      bucket_bytes.push_back(0);
      it = open.insert_or_assign(key, buckets.size() - 1).first;
    }
    buckets[it->second].push_back(k);
    bucket_bytes[it->second] += bytes;
  }
  return buckets;
}

namespace {

class CallAfterAccumulate : public torch::autograd::FunctionPostHook {
 public:
  explicit CallAfterAccumulate(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

}  // namespace

GradientReadyHook::GradientReadyHook(const at::Tensor& parameter, std::function<void()> on_ready)
    : accumulator_(torch::autograd::impl::grad_accumulator(parameter)) {
  key_ = accumulator_->add_post_hook(std::make_unique<CallAfterAccumulate>(std::move(on_ready)));
}

// The accumulator may outlive this object (the module keeps it), and the function points at its
// owner, which is going away.
GradientReadyHook::~GradientReadyHook() { accumulator_->del_post_hook(key_); }

}  // namespace dtrain::detail
