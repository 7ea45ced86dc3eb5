// Single-process model parallelism: one thread per stage, stages linked by in-memory mailboxes; see
// dtrain/pipeline.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/container/sequential.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "common/format.h"
#include "pipeline/stage_runner.h"

namespace dtrain {
namespace detail {
namespace {

// Thrown in a stage whose wait was cut short because another stage failed: never the error
// reported.
struct StageAborted : std::runtime_error {
  StageAborted() : std::runtime_error("stopped because another stage failed") {}
};

// Tensors in flight between the stages of one process, keyed by (receiving stage, tag). A send
// copies the tensor to the receiver's device (a no-op between CPU stages), so the receiver never
// waits on another device's work.
class Mailboxes {
 public:
  Mailboxes(std::vector<c10::Device> devices, std::chrono::milliseconds timeout)
      : devices_(std::move(devices)), timeout_(timeout) {}

  void put(int to_stage, int tag, const at::Tensor& tensor) {
    at::Tensor moved = tensor.to(devices_[to_stage]);
    std::lock_guard<std::mutex> lock(mutex_);
    boxes_[{to_stage, tag}] = moved;
    arrived_.notify_all();
  }

  at::Tensor take(int stage, int from_stage, int tag) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto key = std::make_pair(stage, tag);
    bool arrived =
        arrived_.wait_for(lock, timeout_, [&] { return aborted_ || boxes_.count(key) > 0; });
    if (aborted_) throw StageAborted();
    if (!arrived) {
      throw TimeoutError("pipeline stage " + std::to_string(stage) + ": waited " +
                         detail::seconds_text(timeout_) + " for a tensor from stage " +
                         std::to_string(from_stage) + " (message " + std::to_string(tag) +
                         ") that never came. Likely cause: stage " + std::to_string(from_stage) +
                         " is stuck in its forward or backward (a dtrain bug if it is idle).");
    }
    at::Tensor tensor = std::move(boxes_[key]);
    boxes_.erase(key);
    return tensor;
  }

  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    arrived_.notify_all();
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = false;
    boxes_.clear();
  }

 private:
  std::vector<c10::Device> devices_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<std::pair<int, int>, at::Tensor> boxes_;
  bool aborted_ = false;
};

class LocalLink : public StageLink {
 public:
  LocalLink(Mailboxes& boxes, int stage) : boxes_(boxes), stage_(stage) {}
  void send(const at::Tensor& tensor, int to_stage, int tag) override {
    boxes_.put(to_stage, tag, tensor);
  }
  at::Tensor recv(int from_stage, int tag, const TensorMeta&) override {
    return boxes_.take(stage_, from_stage, tag);
  }
  void flush() override {}

 private:
  Mailboxes& boxes_;
  int stage_;
};

std::vector<at::Tensor> split_rows(const at::Tensor& batch, const std::vector<int64_t>& rows) {
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (int64_t r : rows) {
    parts.push_back(batch.narrow(0, offset, r));
    offset += r;
  }
  return parts;
}

}  // namespace

// Rows of each micro-batch: the first `rows % M` get one more (as DataParallel slices a batch).
std::vector<int64_t> micro_batch_rows(int64_t rows, int micro_batches) {
  std::vector<int64_t> result;
  for (int m = 0; m < micro_batches; ++m)
    result.push_back(rows / micro_batches + (m < rows % micro_batches ? 1 : 0));
  return result;
}

class SingleProcessPipeline {
 public:
  SingleProcessPipeline(std::vector<torch::nn::Sequential> chunks, std::vector<c10::Device> devices,
                        PipelineOptions options, int stages)
      : options_(options) {
    if (options_.micro_batches < 1) {
      throw UsageError("Pipeline: micro_batches=" + std::to_string(options_.micro_batches) +
                       ": expected at least 1");
    }
    if (options_.intra_op_threads < 1) {
      throw UsageError("Pipeline: intra_op_threads=" + std::to_string(options_.intra_op_threads) +
                       ": expected at least 1");
    }
    if (options_.zero_stage != 0) {
      throw UsageError("Pipeline: zero_stage=" + std::to_string(options_.zero_stage) +
                       ": one process holds every stage once, with no replicas to shard over; "
                       "ZeRO is DistributedPipeline's (over the mesh's data group)");
    }
    if (stages <= 0)
      stages = devices.empty() ? static_cast<int>(chunks.size()) / options_.virtual_stages
                               : static_cast<int>(devices.size());
    if (devices.empty()) devices.assign(std::max(stages, 0), c10::Device(c10::kCPU));
    if (static_cast<int>(devices.size()) != stages || stages < 1 ||
        static_cast<int>(chunks.size()) != stages * options_.virtual_stages) {
      throw UsageError("Pipeline: " + std::to_string(chunks.size()) + " chunks for " +
                       std::to_string(stages) + " stages (" + std::to_string(devices.size()) +
                       " devices) with " + std::to_string(options_.virtual_stages) +
                       " virtual stages each; expected chunks = stages x virtual stages and one "
                       "device per stage");
    }
    schedule_ =
        make_schedule(options_.schedule, stages, options_.micro_batches, options_.virtual_stages);
    check_schedule(schedule_);
    devices_ = devices;
    timeout_ = options_.timeout.count() > 0 ? options_.timeout : kDefaultTimeout;
    boxes_ = std::make_unique<Mailboxes>(devices_, timeout_);
    // The stages draw from the process's default generators side by side: with recompute their
    // forwards take turns (Note [Recompute and random draws] in stage_runner.cpp).
    auto rng_mutex = std::make_shared<std::mutex>();
    for (int s = 0; s < stages; ++s) {
      std::vector<torch::nn::Sequential> mine;
      for (int c = s; c < schedule_.chunks(); c += stages) {
        chunks[c]->to(devices_[s]);
        mine.push_back(chunks[c]);
      }
      runners_.push_back(std::make_unique<StageRunner>(s, schedule_, std::move(mine), devices_[s],
                                                       options_.recompute, rng_mutex));
    }
    threads_.resize(stages);
    try {
      for (int s = 0; s < stages; ++s)
        threads_[s].thread = std::thread([this, s] { worker_loop(s); });
    } catch (...) {
      stop();
      throw;
    }
  }

  ~SingleProcessPipeline() { stop(); }

  at::Tensor forward_backward(const at::Tensor& input, const at::Tensor& target,
                              const PipelineLossFn& loss_fn) {
    StepData data = prepare(input, &target);
    data.loss_fn = &loss_fn;
    std::vector<double> losses(stages(), 0.0);
    run_stages([&](int s) {
      LocalLink link(*boxes_, s);
      losses[s] = runners_[s]->run(link, data);
    });
    double total = 0;
    for (double l : losses) total += l;
    return at::scalar_tensor(total, at::kDouble).to(at::kFloat);
  }

  at::Tensor forward(const at::Tensor& input) {
    StepData data = prepare(input, nullptr);
    std::vector<at::Tensor> outputs;
    run_stages([&](int s) {
      LocalLink link(*boxes_, s);
      auto mine = runners_[s]->run_forward(link, data);
      if (s == schedule_.stage_of(schedule_.chunks() - 1)) outputs = std::move(mine);
    });
    return at::cat(outputs);
  }

  int stages() const { return schedule_.stages; }
  const PipelineSchedule& schedule() const { return schedule_; }
  std::vector<int> peak_micro_batches_held() const {
    std::vector<int> held;
    for (const auto& runner : runners_) held.push_back(runner->peak_in_flight());
    return held;
  }
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> result;
    for (const auto& runner : runners_) {
      for (const auto& chunk : runner->chunks()) {
        for (auto& p : chunk->parameters()) result.push_back(p);
      }
    }
    return result;
  }

 private:
  struct Worker {
    std::thread thread;
    std::function<void()> task;
  };

  StepData prepare(const at::Tensor& input, const at::Tensor* target) {
    const int64_t rows = input.dim() > 0 ? input.size(0) : 0;
    if (rows < options_.micro_batches) {
      throw UsageError(
          "Pipeline: a batch of " + std::to_string(rows) + " rows cannot be cut into " +
          std::to_string(options_.micro_batches) +
          " micro-batches; use a batch of at least that many rows or fewer micro-batches");
    }
    if (target && (target->dim() == 0 || target->size(0) != rows)) {
      throw UsageError("Pipeline: the target has " +
                       std::to_string(target->dim() ? target->size(0) : 0) +
                       " rows but the input has " + std::to_string(rows) +
                       "; expected one target row per input row");
    }
    StepData data;
    data.rows = micro_batch_rows(rows, options_.micro_batches);
    data.total_rows = rows;
    data.inputs = split_rows(input.to(devices_[0]), data.rows);
    int last_stage = schedule_.stage_of(schedule_.chunks() - 1);
    if (target) data.targets = split_rows(target->to(devices_[last_stage]), data.rows);
    return data;
  }

  // Runs fn(stage) on every stage's thread and waits for all. A stage that fails stops the others
  // (their waits end at once) and its error is rethrown, naming the stage.
  void run_stages(const std::function<void(int)>& fn) {
    boxes_->reset();
    std::exception_ptr failure;
    int failed_stage = -1;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      pending_ = stages();
      for (int s = 0; s < stages(); ++s) {
        threads_[s].task = [this, s, &fn, &failure, &failed_stage] {
          try {
            fn(s);
          } catch (const StageAborted&) {
          } catch (...) {
            {
              std::lock_guard<std::mutex> guard(mutex_);
              if (!failure) {
                failure = std::current_exception();
                failed_stage = s;
              }
            }
            boxes_->abort();
          }
        };
      }
      work_ready_.notify_all();
      work_done_.wait(lock, [&] { return pending_ == 0; });
    }
    if (!failure) return;
    try {
      std::rethrow_exception(failure);
    } catch (const UsageError& e) {
      throw UsageError("pipeline stage " + std::to_string(failed_stage) + ": " + e.what());
    } catch (const CommError& e) {
      throw;
    } catch (const c10::Error& e) {
      throw UsageError("pipeline stage " + std::to_string(failed_stage) + " (" +
                       devices_[failed_stage].str() + "): " + e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw Error("pipeline stage " + std::to_string(failed_stage) + ": " + e.what());
    }
  }

  void worker_loop(int s) {
    at::set_num_threads(options_.intra_op_threads);
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      work_ready_.wait(lock, [&] { return stop_ || threads_[s].task; });
      if (stop_) return;
      auto task = std::move(threads_[s].task);
      threads_[s].task = nullptr;
      lock.unlock();
      task();
      lock.lock();
      if (--pending_ == 0) work_done_.notify_all();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      work_ready_.notify_all();
    }
    for (auto& w : threads_) {
      if (w.thread.joinable()) w.thread.join();
    }
  }

  PipelineOptions options_;
  PipelineSchedule schedule_;
  std::vector<c10::Device> devices_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Mailboxes> boxes_;
  std::vector<std::unique_ptr<StageRunner>> runners_;
  std::vector<Worker> threads_;
  std::mutex mutex_;
  std::condition_variable work_ready_, work_done_;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace detail

Pipeline::Pipeline(std::vector<torch::nn::Sequential> chunks, std::vector<c10::Device> devices,
                   PipelineOptions options, int stages)
    : impl_(std::make_unique<detail::SingleProcessPipeline>(std::move(chunks), std::move(devices),
                                                            options, stages)) {}
Pipeline::~Pipeline() = default;
at::Tensor Pipeline::forward_backward(const at::Tensor& input, const at::Tensor& target,
                                      const PipelineLossFn& loss_fn) {
  return impl_->forward_backward(input, target, loss_fn);
}
at::Tensor Pipeline::forward(const at::Tensor& input) { return impl_->forward(input); }
int Pipeline::stages() const { return impl_->stages(); }
const PipelineSchedule& Pipeline::schedule() const { return impl_->schedule(); }
std::vector<at::Tensor> Pipeline::parameters() const { return impl_->parameters(); }
std::vector<int> Pipeline::peak_micro_batches_held() const {
  return impl_->peak_micro_batches_held();
}

}  // namespace dtrain
