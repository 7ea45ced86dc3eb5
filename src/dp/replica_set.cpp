// DataParallel's machinery: persistent replicas, one worker thread each, the scatter of a batch,
// and the reduction of the replicas' gradients into the module's. See dtrain/dp.h for the contract.
//
// Note [Replica devices and streams]
// On an accelerator (CUDA) each replica thread binds its device (a device guard) and queues its
// work on a stream of its own, taken once from the device's pool, so that the replicas' kernels can
// overlap even when they share a GPU. Only c10's generic guard interface is used (no CUDA headers:
// the same code builds against a CPU LibTorch, where all of this is skipped). The order between the
// caller's streams and the replicas' is kept with events, never by blocking the host:
//   - before a step, the caller records an event on its current stream of each replica's device
//     (and of the first device); the replica's stream waits for them: parameters the optimizer just
//     updated, buffers copied by the caller, and memory the caller's last reduction still reads are
//     all ready;
//   - a replica thread also makes the caller's current stream of the first device its own current
//     stream there, since LibTorch runs a copy between two GPUs on the source device's current
//     stream (the parameter refresh and a scatter from the first device);
//   - after its task the replica records an event on its stream, and the caller's current streams
//     of that device and of the first device wait for it before the outputs are gathered or the
//     gradients reduced.
// Inputs are scattered with non-blocking copies (asynchronous from pinned host memory), outputs
// gathered the same way, and the gradients are reduced on the first device, on the caller's streams
// (for forward() the reduction runs in autograd's final callback, which runs on the streams that
// surrounded backward()). On the CPU none of this exists: the guards are empty, there are no
// streams and no events.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "amp/autocast_state.h"
#include "dtrain/dp.h"
#include "profile/step_recorder.h"

namespace dtrain {
namespace detail {

class ReplicaSet {
 public:
  ReplicaSet(std::shared_ptr<torch::nn::Module> module, DataParallelBase::Forward forward,
             DataParallelOptions options);
  ~ReplicaSet();

  at::Tensor forward_backward(const at::Tensor& input, const at::Tensor& target,
                              const DataParallelBase::LossFn& loss_fn);
  at::Tensor forward(const at::Tensor& input);
  int size() const { return static_cast<int>(replicas_.size()); }
  const std::vector<c10::Device>& devices() const { return devices_; }

 private:
  // One thread per replica, fed one task at a time by the caller's thread.
  struct Worker {
    std::thread thread;
    std::function<void()> task;  // set by the caller, cleared by the worker when done
    std::exception_ptr error;
  };

  void worker_loop(int index);
  void stop_workers();
  // Runs fn(i) on workers 0..count-1 and waits for all of them; then rethrows the first failure,
  // naming its replica. Every worker finishes its task before anything is rethrown, so none is left
  // running.
  void run_on_workers(int count, const std::function<void(int)>& fn);
  // On the caller's thread, before the workers start: what must not race with replica 0's forward
  // (its buffers, which that forward updates) and what is cheap (training mode, requires_grad).
  void refresh_replica_state(int active);
  // On replica r's own thread: its parameters from the module's (unless `copy` is false: same
  // step).
  void refresh_replica_parameters(int r, bool copy);
  void reduce_gradients(int active);
  std::pair<int64_t, int64_t> slice(int64_t total, int active, int r) const;
  bool on_accelerator(int r) const { return streams_[r].has_value(); }

  std::vector<c10::optional<c10::Stream>> streams_;  // per replica: its own stream; none on the CPU
  bool all_cpu_ = true;

  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;  // [0] is the user's module
  std::vector<std::vector<at::Tensor>> params_;               // per replica, in parameters() order
  std::vector<std::vector<at::Tensor>> buffers_;
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>>
      submodules_;  // per replica, pre-order
  // Set by a gathered forward() whose backward has not run yet. Further forwards before that
  // backward (two inputs, one loss) belong to the same step: they must not copy over parameters the
  // pending graph holds, and the module's parameters cannot have changed in between anyway.
  bool awaiting_backward_ = false;
  std::vector<c10::Device> devices_;
  DataParallelBase::Forward forward_;
  int intra_op_threads_;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::vector<Worker> workers_;
  int pending_ = 0;
  bool stop_ = false;
  bool busy_ = false;  // a call is in progress: DataParallel is not for concurrent use
  // Outlives nothing it should not: the gathered-output hook holds a weak reference and refuses to
  // run against a destroyed DataParallel.
  std::shared_ptr<ReplicaSet*> self_ = std::make_shared<ReplicaSet*>(this);

  // DTRAIN_PROFILE (null when off). DataParallel's "communication" is in-process: the copies of the
  // parameters into the replicas (on the replicas' threads, before their forward) and the reduction
  // of their gradients (after every backward; nothing overlaps it). Per step the workers note when
  // their copy and their forward ended; the slowest replica sets the step's pace.
  std::unique_ptr<StepRecorder> recorder_;
  std::vector<StepRecorder::Clock::time_point> copy_end_, forward_end_;
  StepRecorder::Clock::time_point workers_start_;
  void begin_profiled_step(int64_t samples);
  void end_profiled_forward(int active);
  uint64_t parameter_bytes_ = 0;
};

ReplicaSet::ReplicaSet(std::shared_ptr<torch::nn::Module> module, DataParallelBase::Forward forward,
                       DataParallelOptions options)
    : forward_(std::move(forward)), intra_op_threads_(options.intra_op_threads) {
  if (!module) throw UsageError("DataParallel: the module is null");
  devices_ = options.devices;
  if (devices_.empty()) {
    if (options.num_replicas < 1) {
      throw UsageError("DataParallel: num_replicas=" + std::to_string(options.num_replicas) +
                       ": expected at least 1 (or a list of devices)");
    }
    devices_.assign(options.num_replicas, c10::Device(c10::kCPU));
  }
  if (options.intra_op_threads < 1) {
    throw UsageError("DataParallel: intra_op_threads=" + std::to_string(options.intra_op_threads) +
                     ": expected at least 1");
  }
  for (auto& device : devices_) {
    all_cpu_ = all_cpu_ && device.is_cpu();
    if (device.is_cpu()) {
      streams_.emplace_back();
      continue;
    }
    // Note [Replica devices and streams]
    std::string problem;
    try {
      c10::impl::VirtualGuardImpl guard(device.type());
      if (!device.has_index())
        device = c10::Device(device.type(), guard.getDevice().index());  // "cuda"
      if (device.index() >= guard.deviceCount()) {
        problem = "this process sees " + std::to_string(guard.deviceCount()) +
                  " of them (CUDA_VISIBLE_DEVICES may hide some); pass devices it has";
      } else {
        streams_.push_back(guard.getStreamFromGlobalPool(device));
      }
    } catch (const c10::Error& e) {
      problem = std::string("cannot be used here (") + e.what_without_backtrace() +
                "); pass devices this LibTorch build supports";
    }
    if (!problem.empty()) throw UsageError("DataParallel: device " + device.str() + ": " + problem);
  }
  for (const auto& p : module->parameters()) {
    if (p.device() != devices_[0]) {
      throw UsageError("DataParallel: the module's parameters are on " + p.device().str() +
                       " but the first device is " + devices_[0].str() +
                       "; move the module there first (it is replica 0)");
    }
  }
  replicas_.push_back(module);
  for (size_t r = 1; r < devices_.size(); ++r) {
    try {
      replicas_.push_back(module->clone(devices_[r]));
    } catch (const c10::Error& e) {
      throw UsageError(
          std::string("DataParallel: the module cannot be cloned into replicas (") +
          e.what_without_backtrace() +
          "). Derive it from torch::nn::Cloneable<YourModule> and build its layers in reset(), "
          "as LibTorch's own data_parallel requires.");
    }
  }
  for (auto& replica : replicas_) {
    params_.push_back(replica->parameters());
    buffers_.push_back(replica->buffers());
    submodules_.push_back(replica->modules(/*include_self=*/true));
  }
  recorder_ = StepRecorder::create_if_enabled("dp", nullptr);
  if (recorder_) {
    recorder_->add_field("replicas", static_cast<int64_t>(replicas_.size()));
    for (const auto& p : params_[0]) parameter_bytes_ += p.nbytes();
    copy_end_.resize(replicas_.size());
    forward_end_.resize(replicas_.size());
  }
  workers_.resize(replicas_.size());
  try {
    for (int i = 0; i < size(); ++i)
      workers_[i].thread = std::thread([this, i] { worker_loop(i); });
  } catch (...) {
    stop_workers();  // the threads already started must not be destroyed joinable
    throw;
  }
}

ReplicaSet::~ReplicaSet() { stop_workers(); }

void ReplicaSet::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_ready_.notify_all();
  for (auto& w : workers_) {
    if (w.thread.joinable()) w.thread.join();
  }
}

void ReplicaSet::worker_loop(int index) {
  // Per-thread with OpenMP: this replica's kernels use this many threads, whatever the caller uses.
  at::set_num_threads(intra_op_threads_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [&] { return stop_ || workers_[index].task; });
    if (stop_) return;
    auto task = std::move(workers_[index].task);
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    workers_[index].task = nullptr;
    workers_[index].error = error;
    if (--pending_ == 0) work_done_.notify_all();
  }
}

namespace {
// This thread's current stream on `device` (an accelerator).
c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}
}  // namespace

void ReplicaSet::run_on_workers(int count, const std::function<void(int)>& fn) {
  const bool grad_mode =
      at::GradMode::is_enabled();  // thread-local: carry the caller's into the workers
  // Note [Replica devices and streams]: on accelerators, events order the replicas' streams after
  // what
  // the caller queued so far (ready) and the caller's streams after the replicas' work (done).
  std::vector<c10::optional<c10::Event>> ready(count), done(count);
  c10::optional<c10::Stream> caller_first_stream;
  if (!all_cpu_) {
    if (on_accelerator(0)) caller_first_stream = current_stream(devices_[0]);
    for (int i = 0; i < count; ++i) {
      if (!on_accelerator(i)) continue;
      ready[i].emplace(devices_[i].type());
      ready[i]->record(current_stream(devices_[i]));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_) {
      throw UsageError(
          "DataParallel: called while another call on it is still running; it is not for "
          "concurrent use from several threads");
    }
    busy_ = true;
    pending_ = count;
    for (int i = 0; i < count; ++i) {
      workers_[i].error = nullptr;
      workers_[i].task = [&, i, grad_mode] {
        at::AutoGradMode mode(grad_mode);
        if (!on_accelerator(i)) {
          fn(i);
          return;
        }
        c10::DeviceGuard device_guard(devices_[i]);
        std::vector<c10::Stream> streams{*streams_[i]};
        if (caller_first_stream && caller_first_stream->device() != devices_[i]) {
          streams.push_back(
              *caller_first_stream);  // copies from the first device run on its stream
        }
        c10::MultiStreamGuard stream_guard(streams);
        if (ready[0]) streams_[i]->wait(*ready[0]);
        if (i != 0) streams_[i]->wait(*ready[i]);
        fn(i);
        done[i].emplace(devices_[i].type());
        done[i]->record(*streams_[i]);
      };
    }
  }
  work_ready_.notify_all();
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [&] { return pending_ == 0; });
  busy_ = false;
  for (int i = 0; i < count; ++i) {
    if (!done[i]) continue;
    current_stream(devices_[i]).wait(*done[i]);
    if (caller_first_stream) caller_first_stream->wait(*done[i]);
  }
  for (int i = 0; i < count; ++i) {
    if (!workers_[i].error) continue;
    std::string where =
        "DataParallel replica " + std::to_string(i) + " (" + devices_[i].str() + "): ";
    try {
      std::rethrow_exception(workers_[i].error);
    } catch (const UsageError& e) {
      throw UsageError(where + e.what());
    } catch (const c10::Error& e) {
      throw Error(where + e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw Error(where + e.what());
    } catch (...) {
      throw Error(where + "an exception that is not a std::exception");
    }
  }
}

void ReplicaSet::refresh_replica_state(int active) {
  at::NoGradGuard no_grad;
  for (int r = 1; r < active; ++r) {
    for (size_t m = 0; m < submodules_[0].size(); ++m) {
      submodules_[r][m]->train(submodules_[0][m]->is_training());  // eval() reaches every replica
    }
    for (size_t i = 0; i < params_[r].size(); ++i) {
      params_[r][i].requires_grad_(params_[0][i].requires_grad());  // so does freezing a parameter
    }
    for (size_t i = 0; i < buffers_[r].size(); ++i) buffers_[r][i].copy_(buffers_[0][i]);
  }
}

void ReplicaSet::refresh_replica_parameters(int r, bool copy) {
  if (!copy) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_[r].size(); ++i) {
    params_[r][i].copy_(params_[0][i], /*non_blocking=*/true);
    params_[r][i].mutable_grad() = at::Tensor();  // a fresh gradient each step: nothing to zero
  }
  if (recorder_) copy_end_[r] = StepRecorder::Clock::now();
}

void ReplicaSet::begin_profiled_step(int64_t samples) {
  recorder_->begin_step(samples);
  workers_start_ = StepRecorder::Clock::now();
  std::fill(copy_end_.begin(), copy_end_.end(), workers_start_);
  std::fill(forward_end_.begin(), forward_end_.end(), workers_start_);
}

void ReplicaSet::end_profiled_forward(int active) {
  // The slowest replica's parameter copy counts as exposed communication, its forward as forward.
  StepRecorder::Clock::duration copy{};
  StepRecorder::Clock::time_point forward_end = workers_start_;
  for (int r = 0; r < active; ++r) {
    copy = std::max(copy, copy_end_[r] - workers_start_);
    forward_end = std::max(forward_end, forward_end_[r]);
  }
  recorder_->add_exposed(copy);
  recorder_->end_forward(forward_end);
  recorder_->add_comm(static_cast<uint64_t>(active - 1), parameter_bytes_ * (active - 1), copy);
}

std::pair<int64_t, int64_t> ReplicaSet::slice(int64_t total, int active, int r) const {
  int64_t base = total / active, extra = total % active;
  return {r * base + std::min<int64_t>(r, extra), base + (r < extra ? 1 : 0)};
}

void ReplicaSet::reduce_gradients(int active) {
  if (active <= 1) {
    if (recorder_) recorder_->end_backward();
    return;
  }
  auto reduce_start = StepRecorder::Clock::now();
  std::vector<at::Tensor>& module_params = params_[0];
  // A parameter that got no gradient on replica 0 but did elsewhere starts from zeros.
  for (size_t i = 0; i < module_params.size(); ++i) {
    if (module_params[i].grad().defined() || !module_params[i].requires_grad()) continue;
    for (int r = 1; r < active; ++r) {
      if (params_[r][i].grad().defined()) {
        module_params[i].mutable_grad() = at::zeros_like(module_params[i]);
        break;
      }
    }
  }
  if (!all_cpu_) {
    // On accelerators the sum is made on the first device, on the caller's streams (Note [Replica
    // devices and streams]): each replica's gradient is copied there without blocking the host.
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < module_params.size(); ++i) {
      at::Tensor destination = module_params[i].grad();
      if (!destination.defined()) continue;
      for (int r = 1; r < active; ++r) {
        const at::Tensor& g = params_[r][i].grad();
        if (g.defined()) destination.add_(g.to(destination.device(), /*non_blocking=*/true));
      }
    }
  } else {
    // Every worker sums its share of every gradient's elements: balanced even when one layer
    // dominates.
    const int parts = size();
    run_on_workers(parts, [&](int part) {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < module_params.size(); ++i) {
        at::Tensor destination = module_params[i].grad();
        if (!destination.defined()) continue;
        at::Tensor flat = destination.view({-1});  // gradients of dense parameters are contiguous
        int64_t n = flat.numel(), lo = n * part / parts, hi = n * (part + 1) / parts;
        if (hi == lo) continue;
        at::Tensor share = flat.narrow(0, lo, hi - lo);
        for (int r = 1; r < active; ++r) {
          const at::Tensor& g = params_[r][i].grad();
          if (g.defined()) share.add_(g.reshape({-1}).narrow(0, lo, hi - lo).to(share.device()));
        }
      }
    });
  }
  // Consumed: a second backward through the same graph (retain_graph) must add only its own
  // gradients.
  for (int r = 1; r < active; ++r) {
    for (auto& p : params_[r]) p.mutable_grad() = at::Tensor();
  }
  awaiting_backward_ = false;
  if (recorder_) {
    auto reduce_time = StepRecorder::Clock::now() - reduce_start;
    recorder_->add_exposed(reduce_time);  // nothing overlaps the reduction
    recorder_->add_comm(1, parameter_bytes_ * (active - 1), reduce_time);
    recorder_->end_backward();
  }
}

at::Tensor ReplicaSet::forward_backward(const at::Tensor& input, const at::Tensor& target,
                                        const DataParallelBase::LossFn& loss_fn) {
  const int64_t total = input.size(0);
  if (target.size(0) != total) {
    throw UsageError("DataParallel::forward_backward: input has " + std::to_string(total) +
                     " rows but target has " + std::to_string(target.size(0)));
  }
  const int active = static_cast<int>(std::min<int64_t>(size(), total));
  std::vector<at::Tensor> losses(active);
  if (recorder_) begin_profiled_step(total);
  refresh_replica_state(active);
  awaiting_backward_ = false;  // this call runs its own backward
  const auto autocast =
      amp::detail::current_autocast_state();  // thread-local: carried into the workers
  run_on_workers(active, [&](int r) {
    if (r > 0) refresh_replica_parameters(r, true);
    auto [begin, count] = slice(total, active, r);
    at::Tensor x = input.narrow(0, begin, count).to(devices_[r], /*non_blocking=*/true);
    at::Tensor y = target.narrow(0, begin, count).to(devices_[r], /*non_blocking=*/true);
    at::Tensor loss;
    {
      // The forward and the loss under the caller's autocast scope; the backward outside it, as the
      // caller's own backward would be.
      amp::detail::AutocastStateGuard autocast_guard(autocast);
      at::Tensor output = forward_(*replicas_[r], x);
      if (recorder_) forward_end_[r] = StepRecorder::Clock::now();
      loss = loss_fn(output, y);
    }
    // Weighting each slice's mean loss by its share makes the sum the whole batch's mean loss, so
    // the gradients simply add up, uneven slices included.
    loss = loss * (static_cast<double>(count) / total);
    loss.backward();
    losses[r] = loss.detach();
  });
  if (recorder_) end_profiled_forward(active);
  reduce_gradients(active);
  // Summed on the first device, without waiting for an accelerator (item() would).
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(devices_[0]));
  for (const auto& l : losses) sum.add_(l.to(devices_[0], at::kDouble, /*non_blocking=*/true));
  return sum;
}

at::Tensor ReplicaSet::forward(const at::Tensor& input) {
  const int64_t total = input.size(0);
  const int active = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(size(), total)));
  std::vector<at::Tensor> outputs(active);
  const bool copy = !awaiting_backward_;
  if (recorder_ && copy) begin_profiled_step(total);  // not a second input of the same step
  refresh_replica_state(active);
  const auto autocast =
      amp::detail::current_autocast_state();  // thread-local: carried into the workers
  run_on_workers(active, [&](int r) {
    if (r > 0) refresh_replica_parameters(r, copy);
    auto [begin, count] = slice(total, active, r);
    amp::detail::AutocastStateGuard autocast_guard(autocast);
    outputs[r] = forward_(*replicas_[r],
                          input.narrow(0, begin, count).to(devices_[r], /*non_blocking=*/true));
    if (recorder_) forward_end_[r] = StepRecorder::Clock::now();
  });
  if (recorder_ && copy) end_profiled_forward(active);
  for (auto& out : outputs) out = out.to(devices_[0], /*non_blocking=*/true);
  at::Tensor gathered = at::cat(outputs);
  if (active > 1 && gathered.requires_grad()) {
    awaiting_backward_ = true;
    // At the start of the backward through the outputs, schedule the gradient reduction for its
    // end.
    std::weak_ptr<ReplicaSet*> self = self_;
    gathered.register_hook([self, active](const at::Tensor& grad) {
      torch::autograd::Engine::get_default_engine().queue_callback([self, active] {
        auto alive = self.lock();
        if (!alive) {
          throw UsageError(
              "DataParallel: backward() ran through an output of a DataParallel that no longer "
              "exists; keep it alive until backward() has returned");
        }
        (*alive)->reduce_gradients(active);
      });
      return grad;
    });
  }
  return gathered;
}

}  // namespace detail

// As PyTorch's DataParallel, the module is the one child, "module" (see dtrain/dp.h).
DataParallelBase::DataParallelBase(std::shared_ptr<torch::nn::Module> module, Forward forward,
                                   DataParallelOptions options)
    : torch::nn::Module("dtrain::DataParallel") {
  if (module) register_module("module", module);  // the replica set names a null one
  replicas_ = std::make_unique<detail::ReplicaSet>(std::move(module), std::move(forward),
                                                   std::move(options));
}

DataParallelBase::~DataParallelBase() = default;

at::Tensor DataParallelBase::forward_backward(const at::Tensor& input, const at::Tensor& target,
                                              const LossFn& loss_fn) {
  return replicas_->forward_backward(input, target, loss_fn);
}

at::Tensor DataParallelBase::forward(const at::Tensor& input) { return replicas_->forward(input); }

int DataParallelBase::num_replicas() const { return replicas_->size(); }

const std::vector<c10::Device>& DataParallelBase::devices() const { return replicas_->devices(); }

}  // namespace dtrain
