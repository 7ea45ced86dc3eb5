// Pipeline parallelism across processes: one stage per rank of the pipeline group, activations and
// gradients through the comm layer's isend/irecv, the pre-flight check, and DDP's reducer for data
// × pipeline. See dtrain/pipeline.h.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>

#include "common/format.h"
#include "common/reducer.h"
#include "dtrain/sharded.h"
#include "pipeline/stage_runner.h"
#include "sharded/pipeline_steps.h"

namespace dtrain {
namespace detail {
namespace {

constexpr int kMaxDims = 8;  // dimensions a batch or an activation may have
constexpr int64_t kErrorTextBytes =
    1024;  // room for one stage's pre-flight error, shared with every rank
constexpr int kPreflightTagBase = 1 << 24;  // above every schedule tag (message_tag)

// Step header, all-reduced (summed) over the pipeline group: stage 0 fills the batch's part, the
// last stage the target's, everyone else zeros; so one small collective tells every stage what
// comes.
enum HeaderField {
  kRows,
  kInputDtype,
  kInputDims,
  kInputSizes,
  kTargetRows = kInputSizes + kMaxDims,
  kHeaderLen
};
constexpr int64_t kMissing = -1;  // "not given": stage 0 got no input, the last stage no target

std::string describe(const TensorMeta& meta) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < meta.sizes.size(); ++i) out << (i ? ", " : "") << meta.sizes[i];
  out << "] " << c10::toString(meta.dtype);
  return out.str();
}

TensorMeta meta_of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type()}; }

TensorMeta with_rows(TensorMeta meta, int64_t rows) {
  meta.sizes[0] = rows;
  return meta;
}

// Sends to the pipeline group's neighbours without waiting; keeps each tensor alive until its send
// is done.
class GroupLink : public StageLink {
 public:
  GroupLink(ProcessGroup& group, std::chrono::milliseconds timeout) : group_(group) {
    options_.timeout = timeout;
  }
  void send(const at::Tensor& tensor, int to_stage, int tag) override {
    at::Tensor contiguous = tensor.contiguous();
    pending_.push_back({group_.isend(contiguous, to_stage, tag, options_), contiguous});
    // Done sends need no keeping: bounds what a long step holds.
    while (!pending_.empty() && pending_.front().work.is_completed()) {
      pending_.front().work.wait();  // rethrows a failed send
      pending_.pop_front();
    }
  }
  at::Tensor recv(int from_stage, int tag, const TensorMeta& meta) override {
    at::Tensor buffer =
        at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device_));
    group_.irecv(buffer, from_stage, tag, options_).wait();
    return buffer;
  }
  void flush() override {
    while (!pending_.empty()) {
      pending_.front().work.wait();
      pending_.pop_front();
    }
  }
  void set_device(c10::Device device) { device_ = device; }

 private:
  struct Pending {
    Work work;
    at::Tensor tensor;
  };
  ProcessGroup& group_;
  CollectiveOptions options_;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::deque<Pending> pending_;
};

bool has_trainable_parameters(const torch::nn::Module& chunk) {
  for (const auto& p : chunk.parameters()) {
    if (p.requires_grad()) return true;
  }
  return false;
}

// Runs `fn` with every submodule in eval mode, restoring each one's own mode afterwards (modules()
// is pre-order, so restoring in that order lets a child keep a mode that differs from its
// parent's).
template <typename Fn>
void in_eval_mode(torch::nn::Module& module, Fn&& fn) {
  auto modules = module.modules(/*include_self=*/true);
  std::vector<bool> training;
  for (auto& m : modules) training.push_back(m->is_training());
  module.eval();
  struct Restore {
    std::vector<std::shared_ptr<torch::nn::Module>>& modules;
    std::vector<bool>& training;
    ~Restore() {
      for (size_t i = 0; i < modules.size(); ++i) modules[i]->train(training[i]);
    }
  } restore{modules, training};
  fn();
}

}  // namespace

class DistributedPipelineImpl {
 public:
  DistributedPipelineImpl(std::vector<torch::nn::Sequential> chunks, const RankMesh& mesh,
                          PipelineOptions options, c10::Device device)
      : options_(options),
        device_(device),
        group_(mesh.pipeline_group),
        data_group_(mesh.data_group) {
    if (!group_)
      throw UsageError(
          "DistributedPipeline: the mesh has no pipeline group; build it with make_rank_mesh");
    stage_ = group_->rank();
    const int stages = group_->size(), v = options_.virtual_stages;
    timeout_ = options_.timeout.count() > 0 ? options_.timeout : group_->timeout();

    // Everything a rank can get wrong on its own is collected first and agreed on below, so that
    // all ranks throw together instead of some of them waiting for the others.
    std::string problem;
    try {
      schedule_ = make_schedule(options_.schedule, stages, options_.micro_batches, v);
      check_schedule(schedule_);
      std::vector<torch::nn::Sequential> mine;
      if (static_cast<int>(chunks.size()) == stages * v) {
        for (int c = stage_; c < stages * v; c += stages) mine.push_back(chunks[c]);
      } else if (static_cast<int>(chunks.size()) == v) {
        mine = chunks;
      } else {
        throw UsageError("was given " + std::to_string(chunks.size()) +
                         " chunks; expected the whole model's " + std::to_string(stages * v) +
                         " (" + std::to_string(stages) + " stages x " + std::to_string(v) +
                         " virtual stages) or this stage's " + std::to_string(v));
      }
      for (size_t i = 0; i < mine.size(); ++i) {
        for (const auto& item : mine[i]->named_parameters()) {
          if (item.value().device() != device_) {
            throw UsageError("parameter '" + item.key() + "' of chunk " +
                             std::to_string(stage_ + i * stages) + " is on " +
                             item.value().device().str() + ", expected " + device_.str() +
                             "; move each stage's chunks to its device (chunk->to(device)) first");
          }
        }
      }
      runner_ = std::make_unique<StageRunner>(stage_, schedule_, std::move(mine), device_,
                                              options_.recompute);
    } catch (const UsageError& e) {
      problem = e.what();
    }
    if (problem.empty() && (options_.zero_stage < 0 || options_.zero_stage > 3)) {
      problem = "zero_stage=" + std::to_string(options_.zero_stage) +
                ": expected 0 (DDP over the data replicas) or a ZeRO stage 1-3";
    }
    if (problem.empty() && options_.zero_stage > 0 && !data_group_) {
      problem = "zero_stage=" + std::to_string(options_.zero_stage) +
                " shards over the mesh's data group, and this mesh has none; build it with "
                "make_rank_mesh";
    }
    agree_on_options();
    raise_if_any(problem);

    if (options_.zero_stage > 0) {
      shard_over_data_group();
    } else if (data_group_ && data_group_->size() > 1) {
      // A chunk without trainable parameters (an activation alone) has nothing to average.
      for (const auto& chunk : runner_->chunks()) {
        if (!has_trainable_parameters(*chunk)) {
          reducers_.push_back(nullptr);
          continue;
        }
        reducers_.push_back(std::make_unique<Reducer>(chunk.ptr(), data_group_,
                                                      DistributedDataParallelOptions{},
                                                      Reducer::Finalize::kByOwner));
      }
      // Only the pass that completes a chunk's gradients averages them: its last backward, or with
      // ZB-H1 its last W (a B accumulates no parameter gradient; Note [Split backward]).
      runner_->before_backward = [this](size_t local, bool last) {
        if (reducers_[local]) reducers_[local]->set_sync_next_backward(last && no_sync_depth == 0);
      };
    }
  }

  at::Tensor forward_backward(const at::Tensor& input, const at::Tensor& target,
                              const PipelineLossFn& loss_fn) {
    const int last_stage = schedule_.stage_of(schedule_.chunks() - 1);
    at::Tensor header = at::zeros({kHeaderLen}, at::kLong);
    if (stage_ == 0) {
      if (!input.defined() || input.dim() == 0 || input.dim() > kMaxDims) {
        header[kRows] = kMissing;
      } else {
        header[kRows] = input.size(0);
        header[kInputDtype] = static_cast<int64_t>(input.scalar_type());
        header[kInputDims] = input.dim();
        for (int64_t d = 0; d < input.dim(); ++d) header[kInputSizes + d] = input.size(d);
      }
    }
    if (stage_ == last_stage)
      header[kTargetRows] = target.defined() && target.dim() > 0 ? target.size(0) : kMissing;
    group_->all_reduce(header);
    auto h = header.accessor<int64_t, 1>();
    const int64_t rows = h[kRows];
    if (rows == kMissing) {
      fail("stage 0 was given no input batch (an undefined or 0-dimensional tensor, or more than " +
           std::to_string(kMaxDims) + " dimensions); pass the batch's input on stage 0");
    }
    if (h[kTargetRows] != rows) {
      fail("the last stage's target has " +
           (h[kTargetRows] == kMissing ? std::string("no rows (undefined)")
                                       : std::to_string(h[kTargetRows]) + " rows") +
           " but stage 0's batch has " + std::to_string(rows) +
           "; pass the same batch's target on stage " + std::to_string(last_stage));
    }
    if (rows < options_.micro_batches) {
      fail("a batch of " + std::to_string(rows) + " rows cannot be cut into " +
           std::to_string(options_.micro_batches) +
           " micro-batches; use at least that many rows per pipeline or "
           "fewer micro-batches");
    }
    TensorMeta batch{{}, static_cast<at::ScalarType>(h[kInputDtype])};
    for (int64_t d = 0; d < h[kInputDims]; ++d) batch.sizes.push_back(h[kInputSizes + d]);

    StepData data;
    data.rows = micro_batch_rows(rows, options_.micro_batches);
    data.total_rows = rows;
    data.loss_fn = &loss_fn;
    if (stage_ == 0) {
      int64_t offset = 0;
      at::Tensor on_device = input.to(device_);
      for (int64_t r : data.rows)
        data.inputs.push_back(on_device.narrow(0, offset, r)), offset += r;
    }
    if (stage_ == last_stage) {
      int64_t offset = 0;
      at::Tensor on_device = target.to(device_);
      for (int64_t r : data.rows)
        data.targets.push_back(on_device.narrow(0, offset, r)), offset += r;
    }
    // ZeRO's full parameters, for the pre-flight's dry run too (Note [ZeRO in a pipeline]). A step
    // that throws ends every wrapper's step as not completed (end_step is a no-op for one that
    // did not begin).
    struct ShardedStep {
      std::vector<std::shared_ptr<ShardedDataParallelBase>>* sharded;
      bool completed = false;
      ~ShardedStep() {
        for (auto& s : *sharded) {
          if (s) ShardedPipelineSteps::end_step(*s, completed);
        }
      }
    } sharded_step{&sharded_};
    for (auto& sharded : sharded_) {
      if (sharded) ShardedPipelineSteps::begin_step(*sharded);
    }
    if (!(batch == preflight_batch_)) {
      preflight(batch, data);
      preflight_batch_ = batch;
    }
    data.output_meta = [this, &data](int chunk, int m) {
      return output_meta_.at({chunk, data.rows[m]});
    };

    for (auto& reducer : reducers_) {
      if (reducer) reducer->prepare_forward();
    }
    GroupLink link(*group_, timeout_);
    link.set_device(device_);
    double loss = runner_->run(link, data);
    for (auto& sharded : sharded_) {
      if (sharded) ShardedPipelineSteps::finish_step(*sharded);
    }
    sharded_step.completed = true;
    for (auto& reducer : reducers_) {
      if (reducer) reducer->finalize();
    }

    // Every rank reports the step's loss: the last stage's, averaged over the data-parallel
    // pipelines.
    at::Tensor total = at::full({1}, loss, at::kDouble);
    group_->all_reduce(total);
    if (data_group_ && data_group_->size() > 1) data_group_->all_reduce(total, ReduceOp::kAvg);
    return total.reshape({}).to(at::kFloat);
  }

  int stage() const { return stage_; }
  int stages() const { return schedule_.stages; }
  const PipelineSchedule& schedule() const { return schedule_; }
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> result;
    for (size_t i = 0; i < runner_->chunks().size(); ++i) {
      const bool sharded = i < sharded_.size() && sharded_[i];
      for (auto& p : sharded ? sharded_[i]->parameters() : runner_->chunks()[i]->parameters())
        result.push_back(p);
    }
    return result;
  }
  std::vector<std::shared_ptr<ShardedDataParallelBase>> sharded_chunks() const {
    std::vector<std::shared_ptr<ShardedDataParallelBase>> result;
    for (const auto& sharded : sharded_) {
      if (sharded) result.push_back(sharded);
    }
    return result;
  }

  int no_sync_depth = 0;  // DistributedPipeline::NoSyncGuards alive

 private:
  std::string who() const { return rank_text(*group_); }
  std::string stage_label(int stage) const {
    return "stage " + std::to_string(stage) + " (rank " +
           std::to_string(group_->global_rank_of(stage)) + ")";
  }
  // A problem every rank detected alike: thrown on every rank without further communication.
  [[noreturn]] void fail(const std::string& what) const {
    throw UsageError(who() + ": pipeline: " + what);
  }

  // Note [ZeRO in a pipeline]: ShardedDataParallel around each local chunk that has something to
  // train, over the data group (also of one rank: the layout is then the same at every degree).
  void shard_over_data_group() {
    ShardedDataParallelOptions sharded;
    sharded.stage = options_.zero_stage;
    for (const auto& chunk : runner_->chunks()) {
      const bool trainable = has_trainable_parameters(*chunk);
      sharded_.push_back(
          trainable ? std::make_shared<ShardedDataParallelBase>(chunk.ptr(), data_group_, sharded)
                    : nullptr);
    }
    runner_->before_backward = [this](size_t local, bool last) {
      if (sharded_[local]) {
        ShardedPipelineSteps::sync_next_backward(*sharded_[local], last && no_sync_depth == 0);
      }
    };
  }

  // Every rank must run the same schedule over the same number of stages.
  void agree_on_options() {
    at::Tensor mine = at::tensor(
        {static_cast<int64_t>(options_.schedule), static_cast<int64_t>(options_.micro_batches),
         static_cast<int64_t>(options_.virtual_stages), static_cast<int64_t>(options_.recompute),
         static_cast<int64_t>(options_.zero_stage)},
        at::kLong);
    std::vector<at::Tensor> all(group_->size());
    for (auto& t : all) t = at::empty_like(mine);
    group_->all_gather(all, mine);
    const char* names[] = {"schedule", "micro_batches", "virtual_stages", "recompute",
                           "zero_stage"};
    for (int r = 1; r < group_->size(); ++r) {
      for (int64_t f = 0; f < mine.numel(); ++f) {
        if (all[r][f].item<int64_t>() != all[0][f].item<int64_t>()) {
          fail("pre-flight: " + stage_label(r) + " runs with " + names[f] + "=" +
               std::to_string(all[r][f].item<int64_t>()) + " but " + stage_label(0) + " with " +
               std::to_string(all[0][f].item<int64_t>()) +
               "; every rank must pass the same PipelineOptions");
        }
      }
    }
  }

  // Shares each rank's problem (empty: none) with every rank of the pipeline group; throws the
  // first one on all of them.
  void raise_if_any(const std::string& problem) {
    at::Tensor mine = at::zeros({kErrorTextBytes}, at::kByte);
    std::string text = problem.substr(0, kErrorTextBytes - 1);
    std::copy(text.begin(), text.end(), mine.data_ptr<uint8_t>());
    std::vector<at::Tensor> all(group_->size());
    for (auto& t : all) t = at::empty_like(mine);
    group_->all_gather(all, mine);
    for (int r = 0; r < group_->size(); ++r) {
      std::string theirs(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()));
      if (!theirs.empty()) fail("pre-flight: " + stage_label(r) + ": " + theirs);
    }
  }

  // Dry-runs one micro-batch of each distinct size through the chunks in order, in eval mode and
  // without gradients, each stage telling the next what its chunk produces. Learns the shapes that
  // distributed receives allocate, and turns a chunk that cannot take its predecessor's output into
  // an error on every rank before anything can hang.
  void preflight(const TensorMeta& batch, const StepData& data) {
    std::vector<int64_t> sizes = data.rows;
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()),
                sizes.end());  // one or two micro-batch sizes
    const int chunks = schedule_.chunks();
    const int64_t message_len = 1 + static_cast<int64_t>(sizes.size()) * (2 + kMaxDims);
    std::string problem;
    output_meta_.clear();
    CollectiveOptions options;
    options.timeout = timeout_;
    for (int c = stage_; c < chunks; c += schedule_.stages) {
      // What chunk c receives: the batch's micro-batches, or chunk c-1's outputs as its stage
      // reports them.
      std::vector<TensorMeta> inputs;
      bool upstream_failed = false;
      if (c == 0) {
        for (int64_t r : sizes) inputs.push_back(with_rows(batch, r));
      } else {
        at::Tensor message = at::zeros({message_len}, at::kLong);
        group_->recv(message, schedule_.stage_of(c - 1), kPreflightTagBase + c - 1, options);
        auto m = message.accessor<int64_t, 1>();
        upstream_failed = m[0] != 0;
        for (size_t i = 0; i < sizes.size() && !upstream_failed; ++i) {
          int64_t base = 1 + static_cast<int64_t>(i) * (2 + kMaxDims);
          TensorMeta meta{{}, static_cast<at::ScalarType>(m[base + 1])};
          for (int64_t d = 0; d < m[base]; ++d) meta.sizes.push_back(m[base + 2 + d]);
          output_meta_[{c - 1, sizes[i]}] = meta;
          inputs.push_back(meta);
        }
      }
      std::vector<TensorMeta> outputs;
      if (!upstream_failed && problem.empty()) {
        try {
          outputs = dry_run(c, inputs, sizes, data);
        } catch (const UsageError& e) {
          problem = e.what();
        }
      }
      if (c + 1 < chunks) {
        at::Tensor message = at::zeros({message_len}, at::kLong);
        message[0] = outputs.empty() ? 1 : 0;
        for (size_t i = 0; i < outputs.size(); ++i) {
          int64_t base = 1 + static_cast<int64_t>(i) * (2 + kMaxDims);
          message[base] = static_cast<int64_t>(outputs[i].sizes.size());
          message[base + 1] = static_cast<int64_t>(outputs[i].dtype);
          for (size_t d = 0; d < outputs[i].sizes.size(); ++d)
            message[base + 2 + d] = outputs[i].sizes[d];
        }
        group_->send(message, schedule_.stage_of(c + 1), kPreflightTagBase + c, options);
      }
    }
    raise_if_any(problem);
  }

  std::vector<TensorMeta> dry_run(int c, const std::vector<TensorMeta>& inputs,
                                  const std::vector<int64_t>& sizes, const StepData& data) {
    torch::nn::Sequential chunk = runner_->chunks()[c / schedule_.stages];
    const bool last = c + 1 == schedule_.chunks();
    std::vector<TensorMeta> outputs;
    torch::autograd::AutoGradMode no_grad(false);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const TensorMeta& in = inputs[i];
      at::Tensor output;
      try {
        in_eval_mode(*chunk, [&] {
          output = chunk->forward(
              at::zeros(in.sizes, at::TensorOptions().dtype(in.dtype).device(device_)));
        });
      } catch (const std::exception& e) {
        std::string what = e.what();
        if (auto* c10_error = dynamic_cast<const c10::Error*>(&e))
          what = c10_error->what_without_backtrace();
        throw UsageError("chunk " + std::to_string(c) + " cannot take " +
                         (c == 0 ? std::string("the batch's micro-batch ")
                                 : "chunk " + std::to_string(c - 1) + "'s output ") +
                         describe(in) + ": " + what.substr(0, what.find('\n')));
      }
      if (last) {
        // The loss must accept the last chunk's output with its micro-batch of targets.
        at::Tensor target = data.targets.front().narrow(0, 0, sizes[i]);
        try {
          in_eval_mode(*chunk, [&] { (void)(*data.loss_fn)(output, target); });
        } catch (const std::exception& e) {
          std::string what = e.what();
          if (auto* c10_error = dynamic_cast<const c10::Error*>(&e))
            what = c10_error->what_without_backtrace();
          throw UsageError("the loss function rejects the last chunk's output " +
                           describe(meta_of(output)) + " with targets " +
                           describe(meta_of(target)) + ": " + what.substr(0, what.find('\n')));
        }
        continue;
      }
      if (!output.is_floating_point() || output.dim() == 0 || output.dim() > kMaxDims ||
          output.size(0) != sizes[i]) {
        throw UsageError("chunk " + std::to_string(c) + " outputs " + describe(meta_of(output)) +
                         " for a micro-batch of " + std::to_string(sizes[i]) +
                         " rows; a chunk that feeds another must output a floating-point "
                         "tensor (gradients flow back through it) whose first dimension is the "
                         "micro-batch's rows");
      }
      outputs.push_back(meta_of(output));
      output_meta_[{c, sizes[i]}] = outputs.back();
    }
    return outputs;
  }

  PipelineOptions options_;
  c10::Device device_;
  std::shared_ptr<ProcessGroup> group_, data_group_;
  int stage_ = 0;
  std::chrono::milliseconds timeout_;
  PipelineSchedule schedule_;
  std::unique_ptr<StageRunner> runner_;
  std::vector<std::unique_ptr<Reducer>> reducers_;
  // ZeRO (options.zero_stage > 0): per local chunk, null for one without trainable parameters.
  std::vector<std::shared_ptr<ShardedDataParallelBase>> sharded_;
  TensorMeta preflight_batch_;  // the batch shape the output metas below are for
  std::map<std::pair<int, int64_t>, TensorMeta>
      output_meta_;  // (chunk, micro-batch rows) -> its output
};

}  // namespace detail

DistributedPipeline::DistributedPipeline(std::vector<torch::nn::Sequential> chunks,
                                         const RankMesh& mesh, PipelineOptions options,
                                         c10::Device device)
    : impl_(std::make_unique<detail::DistributedPipelineImpl>(std::move(chunks), mesh, options,
                                                              device)) {}
DistributedPipeline::~DistributedPipeline() = default;
at::Tensor DistributedPipeline::forward_backward(const at::Tensor& input, const at::Tensor& target,
                                                 const PipelineLossFn& loss_fn) {
  return impl_->forward_backward(input, target, loss_fn);
}
int DistributedPipeline::stage() const { return impl_->stage(); }
int DistributedPipeline::stages() const { return impl_->stages(); }
const PipelineSchedule& DistributedPipeline::schedule() const { return impl_->schedule(); }
std::vector<at::Tensor> DistributedPipeline::parameters() const { return impl_->parameters(); }
std::vector<std::shared_ptr<ShardedDataParallelBase>> DistributedPipeline::sharded_chunks() const {
  return impl_->sharded_chunks();
}
DistributedPipeline::NoSyncGuard::NoSyncGuard(DistributedPipeline& pipe) : pipe_(pipe) {
  ++pipe_.impl_->no_sync_depth;
}
DistributedPipeline::NoSyncGuard::~NoSyncGuard() { --pipe_.impl_->no_sync_depth; }

}  // namespace dtrain
