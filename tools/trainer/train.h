// The trainer's run: set-up, resumption from a checkpoint, the training loop and the final report.
#pragma once

#include <string>

#include "flags.h"

namespace trainer {

// Trains as `flags` say in this process, one rank of the job (dtrain::init_process_group reads
// which). Rank 0 shows progress and test accuracy per epoch and ends with one JSON line. Returns
// the exit code: 0 when done; 143 (128 + SIGTERM) when SIGTERM stopped the job and a checkpoint was
// saved, so that no script takes an unfinished job for success.
int train(const Flags& flags);

// Under DTRAIN_RECOVERY=in-place: why this job cannot recover in place ("" when it can), and the
// training loop that does (train_in_place.cpp). train() hands over to it, or says in one line why
// it recovers by restarting instead.
std::string in_place_unsupported_reason(const Flags& flags);
// A measurement as the final JSON line reports it: six significant digits.
double six_digits(double x);
int train_in_place(const Flags& flags);

}  // namespace trainer
