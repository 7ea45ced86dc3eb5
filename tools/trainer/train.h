// The trainer's run: set-up, resumption from a checkpoint, the training loop and the final report.
#pragma once

#include <string>

#include "flags.h"

namespace trainer {

// Trains as `flags` say in this process, one rank of the job (dtrain::init_process_group reads
// which). Rank 0 shows progress and test accuracy per epoch and ends with one JSON line. Returns
// the exit code: 0 when done; 143 (128 + SIGTERM) when SIGTERM stopped the job and a checkpoint was
// saved, so that no script takes an unfinished job for success. Under DTRAIN_RECOVERY=in-place
// (`dtrain run --recovery in-place`) --strategy ddp recovers from a rank's death in place (Note
// [The trainer in place], train.cpp); the other strategies, --amp and --spawn say in one line that
// they recover by restarting.
int train(const Flags& flags);

}  // namespace trainer
