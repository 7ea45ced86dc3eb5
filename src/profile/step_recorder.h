// StepRecorder: one rank's per-step time breakdown, written as JSON lines to DTRAIN_PROFILE (see
// dtrain/profile.h for the fields and what they mean).
//
// A strategy owns one recorder (null when profiling is off, so the hot path pays one pointer test)
// and calls it at the phase boundaries it sees: begin_step() as forward starts, end_forward(),
// end_backward(), and exposed() around anything that blocks on communication. Phases are measured
// on the training thread's clock; a step's record is written when the next step begins, because
// only then is its length (start to start) known.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {
class ProcessGroup;
}

namespace dtrain::detail {

class StepRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  // nullptr unless DTRAIN_PROFILE is set. `group` supplies the record's rank and world size (the
  // job's) and the collectives' counters (ProcessGroup::stats()); null: one process, rank 0 of 1,
  // whose strategy reports its communication through add_comm().
  static std::unique_ptr<StepRecorder> create_if_enabled(const std::string& strategy,
                                                         std::shared_ptr<ProcessGroup> group);
  ~StepRecorder();  // writes the last step if its optimizer step was marked

  void begin_step(int64_t samples);
  void end_forward(Clock::time_point at = Clock::now());
  void end_backward();
  // Time blocked on communication, already spent (measured by the caller).
  void add_exposed(Clock::duration blocked);
  // Communication the group's counters do not see (e.g. DataParallel's in-process reduction).
  void add_comm(uint64_t ops, uint64_t bytes, Clock::duration busy);

  // ProfileOptimizerStep: the recorder of this thread's latest step.
  void begin_optimizer();
  void end_optimizer();
  static StepRecorder* current_on_this_thread();
  // A strategy-specific field added to every record, e.g. ("replicas", 2).
  void add_field(std::string key, int64_t value) {
    extra_fields_.emplace_back(std::move(key), value);
  }

  // RAII: adds the time from construction to destruction to the exposed communication.
  class Blocked {
   public:
    explicit Blocked(StepRecorder* recorder) : recorder_(recorder) {
      if (recorder_) start_ = Clock::now();
    }
    ~Blocked() {
      if (recorder_) recorder_->add_exposed(Clock::now() - start_);
    }
    Blocked(const Blocked&) = delete;
    Blocked& operator=(const Blocked&) = delete;

   private:
    StepRecorder* recorder_;
    Clock::time_point start_;
  };

 private:
  StepRecorder(std::string strategy, std::shared_ptr<ProcessGroup> group, int rank, int world_size,
               int fd);
  void write_record(Clock::time_point end);
  struct CommSnapshot {
    uint64_t ops = 0, bytes = 0;
    double busy_s = 0;
  };
  CommSnapshot comm_now() const;

  const std::string strategy_;
  std::shared_ptr<ProcessGroup> group_;
  const int rank_, world_size_;
  const int fd_;
  int64_t step_ = -1;  // index of the step in progress; -1 before the first
  int64_t samples_ = 0;
  Clock::time_point start_, forward_end_, backward_end_, optimizer_begin_;
  double cpu_at_start_ = 0;  // this process's CPU time (all its threads) when the step began
  bool forward_ended_ = false, backward_ended_ = false, optimizer_marked_ = false;
  Clock::duration optimizer_{};
  // Exposed communication, by the phase it fell in (forward, backward, after backward).
  Clock::duration exposed_forward_{}, exposed_backward_{}, exposed_after_{};
  CommSnapshot comm_at_start_, extra_comm_;
  std::vector<std::pair<std::string, int64_t>> extra_fields_;
};

}  // namespace dtrain::detail
