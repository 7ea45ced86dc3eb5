// DistributedDataParallelBase (the reducer does the work) and the built-in compression hooks.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>

#include <sstream>

#include "common/format.h"
#include "common/reducer.h"
#include "dtrain/ddp.h"

namespace dtrain {
namespace {

// Module::load's walk (parameters, buffers, then each child's archive), copying into the tensors
// instead of set_() (see DistributedDataParallelBase::load). `path`: the module's dotted name.
void copy_in_place(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                   const std::string& path, const std::string& who) {
  auto copy = [&](const std::string& name, at::Tensor target, bool is_buffer) {
    if (!target.defined()) return;
    at::Tensor saved;
    archive.read(name, saved, is_buffer);
    if (!saved.sizes().equals(target.sizes())) {
      std::ostringstream message;
      message << who << ": DistributedDataParallel: load: '" << path << name << "' is "
              << saved.sizes() << " in the file but " << target.sizes()
              << " in the module. Likely cause: the file was saved from another model; load a "
                 "file saved from this one.";
      throw UsageError(message.str());
    }
    target.copy_(saved);
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    copy(item.key(), item.value(), /*is_buffer=*/false);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    copy(item.key(), item.value(), /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::InputArchive child_archive;
    archive.read(child.key(), child_archive);
    copy_in_place(*child.value(), child_archive, path + child.key() + ".", who);
  }
}

}  // namespace

// Note [DDP parameter names]: the module is the one child, "module".
DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         std::shared_ptr<ProcessGroup> group,
                                                         DistributedDataParallelOptions options)
    : torch::nn::Module("dtrain::DistributedDataParallel") {
  if (module) register_module("module", module);  // the reducer names a null one
  reducer_ =
      std::make_unique<detail::Reducer>(std::move(module), std::move(group), std::move(options));
}

DistributedDataParallelBase::~DistributedDataParallelBase() = default;

DistributedDataParallelBase::NoSyncGuard::NoSyncGuard(DistributedDataParallelBase& ddp)
    : ddp_(ddp) {
  ddp_.reducer_->enter_no_sync();
}
DistributedDataParallelBase::NoSyncGuard::~NoSyncGuard() { ddp_.reducer_->leave_no_sync(); }

const std::shared_ptr<ProcessGroup>& DistributedDataParallelBase::group() const {
  return reducer_->group();
}

std::vector<std::vector<size_t>> DistributedDataParallelBase::bucket_layout() const {
  return reducer_->bucket_layout();
}

void DistributedDataParallelBase::load(torch::serialize::InputArchive& archive) {
  torch::autograd::AutoGradMode no_grad(false);
  copy_in_place(*this, archive, "", detail::rank_text(*group()));
}

void DistributedDataParallelBase::prepare_forward(int64_t samples) {
  reducer_->prepare_forward(samples);
}
void DistributedDataParallelBase::forward_done() { reducer_->end_forward(); }

namespace {

// All-reduces a low-precision copy of each bucket. The gradients arrive already divided by the
// world size, so the sum stays in the range of the original values (no fp16 overflow from summing
// first).
class CompressHook : public CommHook {
 public:
  explicit CompressHook(at::ScalarType wire_type) : wire_type_(wire_type) {}

  void start(ProcessGroup& group, GradBucket& bucket) override {
    Slot& slot = slot_for(bucket.index);
    slot.compressed = bucket.buffer->to(wire_type_);
    if (!gathers(*bucket.buffer)) slot.work = group.all_reduce_async(slot.compressed);
  }

  void finish(ProcessGroup& group, GradBucket& bucket) override {
    Slot& slot = slot_for(bucket.index);
    if (gathers(*bucket.buffer)) {
      sum_by_gathering(group, slot.compressed, *bucket.buffer);
    } else {
      slot.work.wait();
      bucket.buffer->copy_(slot.compressed);
    }
    slot.compressed = at::Tensor();
  }

 private:
  struct Slot {
    at::Tensor compressed;
    Work work;
  };
  Slot& slot_for(int index) {
    if (static_cast<size_t>(index) >= slots_.size()) slots_.resize(index + 1);
    return slots_[index];
  }
  // c10d's Gloo (1.13) cannot reduce bfloat16. On CPU the bf16 hook all-gathers the compressed
  // buckets instead (as raw 32-bit words, which Gloo can move) and sums them in float32 in rank
  // order, the same on every rank. An all-gather moves (n-1)/n of n half-size buckets per rank
  // against 2(n-1)/n full-size for a ring all-reduce: fewer bytes up to 3 ranks, equal at 4, more
  // beyond. It runs in finish(), so without overlap. NCCL reduces bf16 natively.
  bool gathers(const at::Tensor& buffer) const {
    return wire_type_ == at::kBFloat16 && !buffer.is_cuda();
  }

  static void sum_by_gathering(ProcessGroup& group, const at::Tensor& compressed, at::Tensor& out) {
    int64_t n = compressed.numel();
    at::Tensor padded = at::zeros({n + (n % 2)}, compressed.options());
    padded.narrow(0, 0, n).copy_(compressed);
    at::Tensor words = padded.view(at::kInt);
    std::vector<at::Tensor> gathered(group.size());
    for (auto& g : gathered) g = at::empty_like(words);
    group.all_gather(gathered, words);
    at::Tensor sum = at::zeros({n}, out.options().dtype(at::kFloat));
    for (auto& g : gathered) sum.add_(g.view(at::kBFloat16).narrow(0, 0, n).to(at::kFloat));
    out.copy_(sum);
  }

  at::ScalarType wire_type_;
  std::vector<Slot> slots_;
};

}  // namespace

std::shared_ptr<CommHook> fp16_compress_hook() { return std::make_shared<CompressHook>(at::kHalf); }
std::shared_ptr<CommHook> bf16_compress_hook() {
  return std::make_shared<CompressHook>(at::kBFloat16);
}

}  // namespace dtrain
