// Per-step time breakdown: where a training step's time goes.
//
// With DTRAIN_PROFILE=FILE in the environment, every DistributedDataParallel and DataParallel
// appends one JSON object per training step to FILE (one line, one write(2), O_APPEND: the ranks of
// a job can share one file; `dtrain scale` reads them). Fields, in seconds of wall-clock time on
// this rank:
//
//   step_s          start of this step's forward to the start of the next step's forward
//   forward_s       forward, minus the time it waited on communication (buffer broadcasts)
//   backward_s      end of forward to end of backward (the loss computation included), minus the
//                   time backward was blocked on communication
//   exposed_comm_s  time the step waited on communication: blocking parts of the gradient
//                   all-reduces (launches, waits at the end of backward), buffer broadcasts
//   optimizer_s     see below
//   other_s         the rest of step_s (0 unless the optimizer step is marked)
//   comm_s, comm_bytes, comm_ops
//                   total duration, payload bytes and number of the step's collectives
//   samples         rows of the first tensor argument of forward (0 when it is not a tensor)
//   cpu_s           CPU time of the whole process (all its threads) during the step; above step_s
//                   means other threads (communication, intra-op pools, spinning waiters) ran
//                   beside training
//   rank, world_size, strategy ("ddp", "dp"), step (0, 1, ...), time (unix seconds at the step's
//   end)
//
// DDP does not see optimizer.step(). By default optimizer_s is everything from the end of backward
// to the next forward (zero_grad, optimizer step, loading the next batch, logging), so the fields
// add up to step_s. To separate the optimizer step from the rest, mark it:
//
//   { dtrain::ProfileOptimizerStep timed;  optimizer.step(); }
//
// then optimizer_s is the marked time and other_s the rest. A step is written when the next one
// starts; the last step of a run is written when the DDP/DataParallel is destroyed, only if its
// optimizer step was marked (otherwise its end is unknown). With DTRAIN_PROFILE unset all of this
// costs one pointer test per forward and per backward.
#pragma once

namespace dtrain {

// True when DTRAIN_PROFILE is set (read when a DDP or DataParallel is constructed).
bool profiling_enabled();

// Marks the optimizer step of the current thread's most recent DDP/DataParallel step (RAII: from
// construction to destruction). Does nothing when profiling is off or no step has run on this
// thread.
class ProfileOptimizerStep {
 public:
  ProfileOptimizerStep();
  ~ProfileOptimizerStep();
  ProfileOptimizerStep(const ProfileOptimizerStep&) = delete;
  ProfileOptimizerStep& operator=(const ProfileOptimizerStep&) = delete;
};

}  // namespace dtrain
