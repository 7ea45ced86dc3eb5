// The static rendezvous (see static_rendezvous.h).
#include "launcher/cli/static_rendezvous.h"

#include "launcher/elastic/ports.h"

namespace dtrain::cli {

using elastic::Verdict;

bool RestartBudget::spend() {
  if (spent_ >= max_) return false;
  ++spent_;
  return true;
}

StaticRendezvous::StaticRendezvous(const RunOptions& options, bool auto_port)
    : options_(options), auto_port_(auto_port), restarts_(options.max_restarts) {}

// Nothing to wait for: no signal to watch, and the job never ends here.
std::optional<elastic::WorkerGroupRound> StaticRendezvous::next_round(
    elastic::SignalPipe& /*signals*/, int* /*exit_code*/) {
  elastic::WorkerGroupRound round;
  round.group_rank = options_.node_rank;
  round.group_world_size = options_.nnodes;
  round.base_rank = options_.node_rank * options_.nproc_per_node;
  round.world_size = options_.nnodes * options_.nproc_per_node;
  round.master_addr = options_.master_addr;
  // A fresh port each round: the previous store's port may linger, or another program may have
  // taken it meanwhile.
  round.master_port = auto_port_ ? elastic::pick_free_port() : options_.master_port;
  round.restart_count = restarts_.spent();
  return round;
}

Verdict StaticRendezvous::report_failure(const elastic::WorkerExit& root) {
  if (root.usage_error() && restarts_.max() > 0) {
    return {Verdict::Kind::kShutdown,
            "not restarting: exit code 2 is a usage error (a bad flag, variable or file), which a "
            "restart cannot fix"};
  }
  if (!restarts_.spend()) {
    return {Verdict::Kind::kShutdown,
            "no restarts left (--max-restarts " + std::to_string(restarts_.max()) + ")"};
  }
  return {Verdict::Kind::kNewRound, "restarting the worker group of this node: attempt " +
                                        std::to_string(restarts_.spent()) + " (restart " +
                                        std::to_string(restarts_.spent()) + " of " +
                                        std::to_string(restarts_.max()) + ")"};
}

}  // namespace dtrain::cli
