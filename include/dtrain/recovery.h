// dtrain::ResilientDataParallel: DistributedDataParallel that survives the loss of ranks without a
// restart. When a rank dies, the survivors abandon the step, re-form their group among themselves
// and redo the step at the smaller size, from the state they hold: no process restart, no
// checkpoint read. A replacement (a worker the launcher restarts alone, `dtrain run --recovery
// in-place`) is admitted at a step boundary and receives the model, the optimizer and the sampler's
// position from a live peer over the group, not from disk. torchft's idea, in C++.
//
//   Net net;
//   torch::optim::SGD optimizer(net->parameters(), 0.1);
//   dtrain::DistributedSampler sampler(dataset_size, 1, 0);  // dealt by the recovery
//   dtrain::ResilientDataParallel rdp(net, optimizer, sampler);  // joins the job, or is admitted
//   if (rdp.job_finished()) return 0;  // a newcomer that came too late
//   if (rdp.left()) return dtrain::kLeftExitCode;  // one asked to stop (SIGTERM) before it joined
//   for (int64_t epoch = sampler.epoch(); epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);  // keeps the position a newcomer received
//     while (rdp.step([&](auto& ddp) {
//       auto batch = sampler.next(32);  // this rank's share of the step
//       if (!batch) return false;       // the epoch is over (on every rank at once)
//       optimizer.zero_grad();
//       loss_fn(ddp(x_of(*batch)), y_of(*batch)).backward();
//       optimizer.step();
//       return true;
//     })) {}
//   }
//   rdp.finish();  // the end, agreed among the live members: no barrier of your own after it
//
// Note [In-place recovery]
// - A step commits on every survivor or on none, in effect. A ring all-reduce can finish on one
//   rank and fail on another, so one survivor may have stepped its optimizer where another did not.
//   After re-forming, the survivors compare their committed step counts (at most one apart: no rank
//   finishes a step's all-reduce before every rank has contributed to it) and the most advanced one
//   sends its state to all; a step that finished anywhere used every rank's gradient and stands.
//   A newcomer also takes the sender's default CPU generator (dropout and the like continue one
//   stream); a laggard keeps its own.
// - The sampler follows committed steps: step() notes its position before the body runs, and a
//   failed step puts it back. The survivors then deal what is left of the epoch over the new size
//   (DistributedSampler::reshard), so every sample is used exactly once. A laggard takes the
//   sender's position right after the step it missed, not where the sender's next step began: at
//   an epoch's end its step() returns false, as the sender's did, and its own loop calls set_epoch
//   and finish() as the sender's did, so an epoch loop of any shape (a count of its own, as above,
//   or on sampler.epoch()) stays in step on every member (Note [Where the sampler stands],
//   src/recovery/resilient_data_parallel.cpp).
// - The end is agreed like a step (finish(), Note [The end of training] in the same file): a
//   member that failed the last step is healed and ends with the others; one that died after it
//   is not waited for, and the survivors end at their size with the last step standing. Nothing
//   collective should run outside step() and finish() (a barrier of the program's own cannot
//   re-form).
// - A group that failed is never used again (Gloo has no abort: a stuck operation may still write
//   into its buffers). Each generation gets its own store prefix ("dtrain/gen<G>/"), shared-memory
//   segments and gradient buckets; the old ones are released on a background thread.
// - Membership is agreed in the store (src/recovery/membership.h): survivors register for the next
//   generation; it closes when every member of the last one has come, or those missing are seen
//   dead (a process on this host is checked by its pid at once; one on another host by its
//   launcher's exit notice or its stale heartbeat), or `settle` has passed. A survivor that comes
//   after it closed is told so and exits; the launcher restarts it as a newcomer. A newcomer whose
//   transfer fails (the member sending the state died) re-forms with the others and receives it
//   again; a generation of newcomers only (every member holding the state died) stops with a
//   CommError rather than train a fresh model as the job.
// - Liveness is told by heartbeats through the store (Note [Heartbeats], membership.h): every
//   member adds to a counter of its own every 100 ms, off the training thread and on a store
//   connection of its own, and reads the others'. One whose counter has not moved for `lost_after`
//   (3 s) is lost: a wait on a Gloo collective asks between slices of 100 ms and is abandoned (the
//   operation is left to the old group, released without being waited for), and the survivors
//   re-form without waiting `settle`. A member that abandons a generation after a failure marks the
//   next one failed, and the others stop waiting on the old one's collectives too. A process whose
//   heartbeats the store has answered none of for `lost_after` is cut off and stops with a
//   CommError naming the store: the side of a partition without the store must not go on as a
//   second job.
// - Admission is checked at every step boundary, and every member sees the same answer at the
//   same step: rank 0's count of the newcomers rides as one number on the step's gradient
//   all-reduce (no collective of its own; Note [A number riding on the gradients],
//   src/comm/group_state.h). Where the gradients cannot carry it (a comm hook, half-precision or
//   CUDA gradients), one all-reduce of one number every `admit_every` steps agrees on it instead.
//   The store is polled for newcomers on a background thread, never on the training thread.
// - The store must outlive every worker: under `dtrain run --recovery in-place` node 0's launcher
//   hosts it (TORCHELASTIC_USE_AGENT_STORE=True) and rank 0 dies like any rank; started otherwise,
//   rank 0 hosts it and its death ends the job.
// - Detected, and in how long (doc/recovery.md, doc/benchmarks.md): a dead process on this host at
//   once (its pid); a dead process on another host at once by the transport (its host resets the
//   connections) and by the exit notice its launcher writes into the store (Note [Heartbeats]; the
//   survivors' next step 0.6 s after the kill on three namespace hosts, against 2.5 s when they
//   waited min(`settle`, `lost_after`) for it); a lost host or a cut link after
//   `lost_after` (heartbeats; next step 3.1-3.2 s after the fault, against 32 s before); the
//   store's host lost ends the job after `lost_after` on every member, each naming the store.
// - A member asked to stop (SIGTERM after dtrain::install_stop_handler(), dtrain/stop.h) leaves
//   in place (Note [Leaving in place] below) when the body asks agree_to_stop().
// - A link cut between two members' hosts while both still reach the store stops no heartbeat:
//   a member that has waited for a Gloo collective issued `lost_after` ago knocks at the others (a
//   TCP connection to a port each listens on, at the address its collectives use), and one that
//   answers no knock within 3.5 s is cut from it; the generation is abandoned, and the next one
//   closes without one of each pair that cannot reach each other (the one cut from more members,
//   the higher rank of equals), which is restarted as a newcomer and admitted once it reaches every
//   member again.
//   Every generation, the first included, is knocked at before it connects (Note [A link cut
//   between members], src/recovery/membership.h).
// - Limits (today): the store is a single point of failure (node 0's launcher). On GPUs, NCCL's
//   waits poll and ask the heartbeats as Gloo's do, and a failed generation's communicator is
//   aborted (Note [Waiting for NCCL], src/comm/work.cpp); run on one H100 with two ranks, not yet
//   on several GPUs or hosts.
//
// Note [Leaving in place]
// SIGTERM reaches one node of a job (a scheduler takes it back) or all of them (the job is
// cancelled), and a process cannot tell which. Stopping every rank for one node's SIGTERM, as
// dtrain::should_stop does, costs every rank a restart from the checkpoint. So at each step
// boundary the members count who asked to stop (agree_to_stop(): one all-reduce of one number, as
// should_stop's):
//   - nobody: the step goes on;
//   - some: they leave (kLeave: the caller ends the process, exit code dtrain::kLeftExitCode, and
//     saves nothing) and the others re-form without them at once and go on (the body continues at
//     the new size; nothing of the step had changed). The ones who stay hold the whole state, so
//     nothing is lost; a member that gets SIGTERM later leaves at a later boundary, and the last
//     ones stop together;
//   - all, or so many that fewer than RecoveryOptions::min_size would stay: every member stops
//     (kStopAll: rank 0 saves a checkpoint and every rank exits, as with should_stop).
// A member whose departure would take the job's store with it (the process that hosts it, or
// every process on node 0 when node 0's launcher hosts it: TORCHELASTIC_USE_AGENT_STORE=True)
// counts for everyone: its SIGTERM stops the whole job, with a checkpoint, instead of leaving the
// others without a store. A leaving member writes its own exit notice (Note [Heartbeats],
// src/recovery/membership.h), so the others do not wait `settle` for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/exit_codes.h"  // kLeftExitCode

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

struct RecoveryOptions {
  // After a failure, how long the survivors wait for a member that neither came nor is seen dead
  // (by its pid on this host, or its stale heartbeat: see lost_after) before they re-form without
  // it.
  std::chrono::milliseconds settle = std::chrono::seconds(2);
  // Steps between two admission checks where the check cannot ride on the gradients' all-reduce
  // (see Note [In-place recovery] above); each then costs one all-reduce of one number.
  int64_t admit_every = 10;
  // Re-formations (failures, admissions and departures) after which a failure is final: a job that
  // loses a rank on every step is broken, not unlucky.
  int max_recoveries = 32;
  // Fewest ranks the job goes on with; below it, a failure is final.
  int min_size = 1;
  // Joining, collectives and state transfer: InitOptions::timeout's meaning (0: DTRAIN_TIMEOUT_S,
  // or kDefaultTimeout).
  std::chrono::milliseconds timeout{0};
  // How each generation's DistributedDataParallel is built.
  DistributedDataParallelOptions ddp;
  // Heartbeats through the job's store, every 100 ms, tell a lost host or a cut link, which resets
  // no connection: a member whose heartbeat has not moved for this long is lost (the survivors
  // abandon the step and re-form without it, not waiting `settle`), and a process whose heartbeats
  // the store has answered none of for this long is cut off and stops (a CommError).
  std::chrono::milliseconds lost_after = std::chrono::seconds(3);
  // The program's own tensors that travel with the model (fixed shapes, the same on every member;
  // on the CPU or the module's device): a laggard or a newcomer receives the most advanced member's
  // values in place, e.g. a trainer's step count and per-epoch sample counts. Keep them as they
  // stand after the last committed step when step() is called.
  std::vector<at::Tensor> state;
};

// What happened to the job so far, the same on every member (a newcomer receives it).
struct RecoveryStats {
  int64_t generation = 0;    // group formations after the first
  int64_t recoveries = 0;    // failures survived in place
  int64_t admitted = 0;      // newcomers admitted
  int64_t steps = 0;         // committed steps
  int64_t steps_redone = 0;  // steps abandoned by a failure and done again at the new size
  int64_t departed = 0;      // members that left on SIGTERM (Note [Leaving in place])
};

// What the members agreed about stopping at a step boundary (Note [Leaving in place]).
enum class StopAgreement {
  kGoOn,     // nobody asked, or others left and this member goes on without them
  kLeave,    // this member asked and the others go on: exit with kLeftExitCode, saving nothing
  kStopAll,  // every member stops: rank 0 saves, then every rank exits (as dtrain::should_stop)
};

// What being ready to recover has cost this process so far, nothing failing (the bench's "at most
// 1% of a step": bench/recovery_overhead.sh): the admission checks' all-reduces on the training
// thread (wall time, the wait for the slower member included, so an upper bound) and the CPU time
// of the heartbeat thread (on a machine whose cores all train, taken from training). Not the same
// on every member; the recoveries themselves are not in it.
struct ReadinessCost {
  int64_t admission_checks = 0;   // all-reduces of their own
  double admission_s = 0;         // their time
  int64_t admission_carried = 0;  // checks that rode on a gradient all-reduce, at no time of theirs
  double heartbeat_cpu_s = 0;
};

namespace detail {
class RecoveryCore;
}

// The type-independent part of ResilientDataParallel<M> (src/recovery/).
class ResilientDataParallelBase {
 public:
  virtual ~ResilientDataParallelBase();
  ResilientDataParallelBase(const ResilientDataParallelBase&) = delete;
  ResilientDataParallelBase& operator=(const ResilientDataParallelBase&) = delete;

  // Runs one training step: `body` does forward, backward and the optimizer step through the
  // current DDP and returns true, or returns false without training when the sampler has nothing
  // left (then step() returns false too). When a collective fails (CommError), the step is
  // abandoned, the group re-formed and the body run again at the new size; when a newcomer waits,
  // it is admitted before the body runs. Blocks for a recovery up to `settle` plus the timeout.
  // Throws CommError when the failure is final (see RecoveryOptions), or this rank was left out.
  bool step(const std::function<bool()>& body);

  // Collective, inside the body before anything of the step changes, on every member at the same
  // step: who asked to stop (dtrain::stop_requested()), agreed as Note [Leaving in place] says.
  // When others leave, this member re-forms without them before it returns kGoOn, and the body goes
  // on at the new size. A CommError propagates: step() re-forms and runs the body again.
  StopAgreement agree_to_stop();

  // The current generation's group (a new one after every re-formation: do not keep it across
  // steps).
  const std::shared_ptr<ProcessGroup>& group() const;
  RecoveryStats stats() const;
  ReadinessCost readiness_cost() const;
  // Ends training, collectively: call it on every member once its training loop is over (step()
  // returned false at the last epoch's end), instead of a barrier of the program's own. The live
  // members agree on the end; a failure meanwhile re-forms the group as in step() (a member whose
  // last step failed is healed and ends with the others; a dead one is not waited for). Then it
  // stops watching, tells newcomers still waiting that the job is over, and, where rank 0 hosts the
  // store, keeps it until the others are done with the store. group() and stats() afterwards are
  // the final ones (world size, committed steps). Throws CommError as step() does. Once called,
  // step() returns false. (The destructor stops watching too.)
  void finish();
  // False once some process has begun forming the next generation: this one is being abandoned,
  // with or without this process. One store round trip. Check it before acting for the whole job
  // from the group's rank 0 (writing a checkpoint), so that a rank of an abandoned generation (one
  // that was left out while it stalled, say) never does.
  bool generation_current() const;
  // True for a newcomer that came after the job finished: it joined nothing (group() is null,
  // step() returns false) and should end, successfully:
  //   if (rdp.job_finished()) return 0;
  bool job_finished() const;
  // True once this process has left the job on SIGTERM (agree_to_stop() said kLeave), or, as a
  // newcomer, was asked to stop before it asked to be admitted (install the stop handler,
  // dtrain::install_stop_handler, before constructing: then a newcomer that has asked is admitted
  // and leaves at its first agree_to_stop()). It joined nothing, or no longer belongs (step()
  // returns false), and should end with dtrain::kLeftExitCode, which its launcher reads as a
  // departure:
  //   if (rdp.left()) return dtrain::kLeftExitCode;
  bool left() const;
  // True for a newcomer admitted into the running job: it received the state from a live peer and
  // must not load a checkpoint over it. False for the job's first members, also when their first
  // generation re-formed before the first step (stats().generation is then above 0): they load
  // the checkpoint, if any, as the group they ended up in.
  bool admitted_as_newcomer() const;

 protected:
  ResilientDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                            torch::optim::Optimizer& optimizer, DistributedSampler sampler,
                            RecoveryOptions options);
  // Joins the job (or, with DTRAIN_RECOVERY_JOIN=1, waits to be admitted and receives the state),
  // then wraps. Called by the derived constructor, once wrap() can run.
  void start();
  // Builds this generation's DDP around the module on `group`; unwrap() drops it.
  virtual void wrap(const std::shared_ptr<ProcessGroup>& group) = 0;
  virtual void unwrap() = 0;

 private:
  friend class detail::RecoveryCore;
  std::unique_ptr<detail::RecoveryCore> core_;
};

// DDP around a module of type ModuleType that recovers in place (see the top of this file).
// `optimizer` steps the module's parameters; `sampler` is re-dealt over every generation's group
// (build it with world size 1 and rank 0, or anything: start() deals it).
template <typename ModuleType>
class ResilientDataParallel : public ResilientDataParallelBase {
 public:
  ResilientDataParallel(std::shared_ptr<ModuleType> module, torch::optim::Optimizer& optimizer,
                        DistributedSampler sampler, RecoveryOptions options = {})
      : ResilientDataParallelBase(module, optimizer, sampler, options),
        module_(std::move(module)),
        ddp_options_(options.ddp) {
    start();
  }
  ResilientDataParallel(const torch::nn::ModuleHolder<ModuleType>& module,
                        torch::optim::Optimizer& optimizer, DistributedSampler sampler,
                        RecoveryOptions options = {})
      : ResilientDataParallel(module.ptr(), optimizer, std::move(sampler), std::move(options)) {}

  // As ResilientDataParallelBase::step, the body given this generation's DDP.
  template <typename Body>
  bool step(Body&& body) {
    return ResilientDataParallelBase::step([&] { return static_cast<bool>(body(ddp_)); });
  }
  DistributedDataParallel<ModuleType>& ddp() { return ddp_; }
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 protected:
  void wrap(const std::shared_ptr<ProcessGroup>& group) override {
    ddp_ = DistributedDataParallel<ModuleType>(module_, group, ddp_options_);
  }
  void unwrap() override { ddp_ = DistributedDataParallel<ModuleType>(nullptr); }

 private:
  std::shared_ptr<ModuleType> module_;
  DistributedDataParallelOptions ddp_options_;
  DistributedDataParallel<ModuleType> ddp_{nullptr};
};

template <typename ModuleType, typename... Rest>
ResilientDataParallel(std::shared_ptr<ModuleType>, Rest&&...) -> ResilientDataParallel<ModuleType>;
template <typename ModuleType, typename... Rest>
ResilientDataParallel(const torch::nn::ModuleHolder<ModuleType>&, Rest&&...)
    -> ResilientDataParallel<ModuleType>;

}  // namespace dtrain
