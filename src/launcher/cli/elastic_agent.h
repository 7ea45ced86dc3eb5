// The elastic agent behind `dtrain run --rdzv-backend c10d|etcd`: one per node. It joins the
// rendezvous, runs the local WorkerGroup for each completed round with that round's WORLD_SIZE,
// ranks and MASTER_ADDR/PORT, watches its workers and the rendezvous (failures, lost and waiting
// nodes, new rounds), and restarts, shrinks, grows or ends the job as Note [Rounds] in
// launcher/elastic/rendezvous.h describes.
#pragma once

#include "launcher/cli/run_command.h"
#include "launcher/cli/run_options.h"

namespace dtrain::cli {

// Runs the agent to the end of the job; returns the exit code (0 when this node's workers all
// succeeded). Throws dtrain::UsageError for bad flags found late (a rendezvous that refuses this
// node's token, an endpoint where nothing answers).
int run_elastic(const RunOptions& options, const LaunchPlan& plan);

}  // namespace dtrain::cli
