// The exit codes by which a training process tells its launcher how it stopped short of the end,
// in a header of their own so that the launcher (`dtrain run`, built without LibTorch) and the
// library agree on them.
#pragma once

namespace dtrain {

// The exit code of a rank that stopped on SIGTERM: 128 + SIGTERM, what a shell reports for a
// process ended by SIGTERM and what torchrun's workers end with. Not 0: the job is not finished, so
// no script may take it for success; a launcher with restarts left (`dtrain run --max-restarts`)
// restarts it, and the program resumes from its checkpoint (dtrain/stop.h).
inline constexpr int kStopExitCode = 143;

// The exit code of a rank that left a job recovering in place on SIGTERM while the other ranks
// went on without it, saving nothing (Note [Leaving in place], dtrain/recovery.h). Not 143, so
// that its launcher can tell it from a rank that stopped with its peers at a checkpoint: a node
// whose workers all left lets the rendezvous's running round go on in place, and a worker that
// left alone on a node that goes on is restarted as a newcomer, as a failed one is. Not 0: this
// process did not finish the job. 75 is sysexits.h's EX_TEMPFAIL ("a temporary failure; retry
// later"), which a program's own failures rarely use, and what a departure is to a launcher that
// does not know it.
inline constexpr int kLeftExitCode = 75;

}  // namespace dtrain
