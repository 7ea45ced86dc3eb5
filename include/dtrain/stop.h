// Stopping a training loop cleanly on SIGTERM: every rank finishes the same step, the program saves
// a checkpoint, and every rank exits with kStopExitCode. SIGTERM is what `dtrain run` and torchrun
// send their workers when a job is stopped or shrunk, and what Slurm and Kubernetes send before
// they kill.
//
//   dtrain::install_stop_handler();                  // SIGTERM now only sets a flag
//   for (auto& batch : *loader) {
//     ...one step...
//     if (dtrain::should_stop(pg)) {                 // every rank, once per step
//       if (pg->rank() == 0) {
//         checkpointer.save(state);
//         checkpointer.wait();                       // an async save is on disk only now
//       }
//       pg->barrier();                               // exit once the checkpoint is on disk
//       return dtrain::kStopExitCode;                // 143: stopped, not finished
//     }
//   }
//
// Note [Agreeing to stop]: SIGTERM reaches the ranks at different times (the launcher signals its
// workers one by one; a scheduler may signal one node before another), so each rank's own flag may
// change between any two steps. A rank that stopped on its own flag would leave the others waiting
// in the next step's gradient all-reduce until their timeout. So after every step the ranks take
// the maximum of their flags (one all-reduce of one integer, microseconds over shared memory): all
// see the same answer after the same step, and all stop there together. A group that recovers in
// place does better: ResilientDataParallel::agree_to_stop() (dtrain/recovery.h) lets the ranks
// whose node got SIGTERM leave while the others go on, and stops everyone only when everyone asked.
#pragma once

#include <memory>

#include "dtrain/comm.h"
#include "dtrain/exit_codes.h"  // kStopExitCode

namespace dtrain {

// Makes SIGTERM set this process's stop flag instead of ending the process. The handler only stores
// to a lock-free atomic (async-signal-safe) and is installed with SA_RESTART, so a collective's
// socket read is not cut short by EINTR. Idempotent; replaces any SIGTERM handler installed before.
void install_stop_handler();

// Sets this process's stop flag as SIGTERM does, for a program's own reasons to stop (a wall-clock
// limit, a file that asks for it). Async-signal-safe.
void request_stop();

// This process's own flag (no communication): true once SIGTERM arrived after
// install_stop_handler(), or request_stop() was called.
bool stop_requested();

// Collective: true on every rank of `group` when any rank's flag is set (see Note [Agreeing to
// stop]). Every rank must call it at the same point of every step, as any collective. Blocks on one
// all-reduce (MAX) of one int64 until every rank of the group has called it, up to the group's
// timeout (or options.timeout); throws TimeoutError or PeerLostError as the all-reduce does. Throws
// UsageError if group is null. Does not clear the flag.
bool should_stop(const std::shared_ptr<ProcessGroup>& group, const CollectiveOptions& options = {});

}  // namespace dtrain
