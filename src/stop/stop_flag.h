// The parts of dtrain/stop.h that tests reach directly: ranks as threads of one process share one
// stop flag, so the agreement is tested with each thread's own flag passed in.
#pragma once

#include "dtrain/comm.h"

namespace dtrain::detail {

// should_stop's collective with this rank's flag given: true on every rank when any passes true.
bool agree_to_stop(ProcessGroup& group, bool this_rank_stops, const CollectiveOptions& options);

// Clears this process's stop flag (tests that raise SIGTERM at themselves).
void clear_stop_request();

}  // namespace dtrain::detail
