// Per-step time breakdown records; see dtrain/profile.h and profile/step_recorder.h.
#include "profile/step_recorder.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

#include "common/format.h"
#include "common/log.h"
#include "dtrain/comm.h"
#include "dtrain/profile.h"

namespace dtrain {

namespace detail {
namespace {

thread_local StepRecorder* current_recorder = nullptr;

double seconds(StepRecorder::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// CPU time of the whole process: more than the step's wall time means threads besides the training
// thread (communication, intra-op pools, spinning waiters) were busy at the same time.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

std::unique_ptr<StepRecorder> StepRecorder::create_if_enabled(const std::string& strategy,
                                                              std::shared_ptr<ProcessGroup> group) {
  const int rank = group ? group->global_rank() : 0;
  const int world_size = group ? group->global_size() : 1;
  const char* path = std::getenv("DTRAIN_PROFILE");
  if (path == nullptr || *path == '\0') return nullptr;
  int fd = ::open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw UsageError(rank_text(rank, world_size) + ": environment variable DTRAIN_PROFILE='" +
                     path + "': cannot open it for appending (" + std::strerror(errno) +
                     "); give a writable file path or unset it");
  }
  return std::unique_ptr<StepRecorder>(
      new StepRecorder(strategy, std::move(group), rank, world_size, fd));
}

StepRecorder::StepRecorder(std::string strategy, std::shared_ptr<ProcessGroup> group, int rank,
                           int world_size, int fd)
    : strategy_(std::move(strategy)),
      group_(std::move(group)),
      rank_(rank),
      world_size_(world_size),
      fd_(fd) {}

StepRecorder::~StepRecorder() {
  if (current_recorder == this) current_recorder = nullptr;
  if (step_ >= 0 && optimizer_marked_ && backward_ended_) {
    write_record(optimizer_begin_ + optimizer_);
  }
  ::close(fd_);
}

StepRecorder* StepRecorder::current_on_this_thread() { return current_recorder; }

StepRecorder::CommSnapshot StepRecorder::comm_now() const {
  CommSnapshot now;
  if (group_) {
    CommStats stats = group_->stats();
    now.ops = stats.ops;
    now.bytes = stats.bytes;
    now.busy_s = stats.busy_s;
  }
  return now;
}

void StepRecorder::begin_step(int64_t samples) {
  auto now = Clock::now();
  if (step_ >= 0) write_record(now);
  ++step_;
  start_ = now;
  samples_ = samples;
  forward_ended_ = backward_ended_ = optimizer_marked_ = false;
  optimizer_ = exposed_forward_ = exposed_backward_ = exposed_after_ = Clock::duration{};
  comm_at_start_ = comm_now();
  extra_comm_ = CommSnapshot{};
  cpu_at_start_ = process_cpu_seconds();
  current_recorder = this;
}

void StepRecorder::end_forward(Clock::time_point at) {
  if (forward_ended_)
    return;  // a second forward in one step (two inputs, one loss): forward goes on
  forward_end_ = at;
  forward_ended_ = true;
}

void StepRecorder::end_backward() {
  backward_end_ = Clock::now();
  backward_ended_ = true;
}

void StepRecorder::add_exposed(Clock::duration blocked) {
  if (!forward_ended_) {
    exposed_forward_ += blocked;
  } else if (!backward_ended_) {
    exposed_backward_ += blocked;
  } else {
    exposed_after_ += blocked;
  }
}

void StepRecorder::add_comm(uint64_t ops, uint64_t bytes, Clock::duration busy) {
  extra_comm_.ops += ops;
  extra_comm_.bytes += bytes;
  extra_comm_.busy_s += seconds(busy);
}

void StepRecorder::begin_optimizer() { optimizer_begin_ = Clock::now(); }

void StepRecorder::end_optimizer() {
  optimizer_ += Clock::now() - optimizer_begin_;
  optimizer_marked_ = true;
}

void StepRecorder::write_record(Clock::time_point end) {
  // A phase whose end was not seen (a forward without backward, backward inside no_sync() that
  // never synchronized) extends to the end of the step.
  Clock::time_point forward_end = forward_ended_ ? forward_end_ : end;
  Clock::time_point backward_end = backward_ended_ ? backward_end_ : end;
  double step = seconds(end - start_);
  double forward = seconds(forward_end - start_) - seconds(exposed_forward_);
  double backward = seconds(backward_end - forward_end) - seconds(exposed_backward_);
  double after = seconds(end - backward_end) - seconds(exposed_after_);
  double exposed = seconds(exposed_forward_ + exposed_backward_ + exposed_after_);
  double optimizer = optimizer_marked_ ? seconds(optimizer_) : after;
  double other = optimizer_marked_ ? after - optimizer : 0.0;
  CommSnapshot now = comm_now();
  uint64_t ops = now.ops - comm_at_start_.ops + extra_comm_.ops;
  uint64_t bytes = now.bytes - comm_at_start_.bytes + extra_comm_.bytes;
  double comm = now.busy_s - comm_at_start_.busy_s + extra_comm_.busy_s;
  double unix_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Seconds to the nanosecond and the Unix time to the microsecond: finer digits are noise.
  auto ns = [](double s) { return std::round(s * 1e9) / 1e9; };
  nlohmann::ordered_json record = {{"rank", rank_},
                                   {"world_size", world_size_},
                                   {"strategy", strategy_},
                                   {"step", step_},
                                   {"step_s", ns(step)},
                                   {"forward_s", ns(forward)},
                                   {"backward_s", ns(backward)},
                                   {"exposed_comm_s", ns(exposed)},
                                   {"optimizer_s", ns(optimizer)},
                                   {"other_s", ns(other)},
                                   {"optimizer_marked", optimizer_marked_},
                                   {"comm_s", ns(comm)},
                                   {"comm_bytes", bytes},
                                   {"comm_ops", ops},
                                   {"samples", samples_},
                                   {"cpu_s", ns(process_cpu_seconds() - cpu_at_start_)},
                                   {"time", std::round(unix_time * 1e6) / 1e6}};
  for (const auto& [key, value] : extra_fields_) record[key] = value;
  const std::string line = record.dump() + "\n";
  if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    static bool warned = false;  // one warning per process is enough; training goes on
    if (!warned) {
      warned = true;
      DTRAIN_LOG(kWarn,
                 "could not append a step record to DTRAIN_PROFILE: " << std::strerror(errno));
    }
  }
}

}  // namespace detail

bool profiling_enabled() {
  const char* path = std::getenv("DTRAIN_PROFILE");
  return path != nullptr && *path != '\0';
}

ProfileOptimizerStep::ProfileOptimizerStep() {
  if (auto* recorder = detail::StepRecorder::current_on_this_thread()) recorder->begin_optimizer();
}

ProfileOptimizerStep::~ProfileOptimizerStep() {
  if (auto* recorder = detail::StepRecorder::current_on_this_thread()) recorder->end_optimizer();
}

}  // namespace dtrain
