// The static rendezvous (see static_rendezvous.h).
#include "launcher/cli/static_rendezvous.h"

#include <poll.h>

#include <chrono>

#include "common/format.h"
#include "launcher/elastic/ports.h"

namespace dtrain::cli {

using elastic::Verdict;

bool RestartBudget::spend() {
  if (spent_ >= max_) return false;
  ++spent_;
  return true;
}

StaticRendezvous::StaticRendezvous(const RunOptions& options, bool auto_port,
                                   bool master_unresolved)
    : options_(options),
      auto_port_(auto_port),
      master_unresolved_(master_unresolved),
      restarts_(options.max_restarts) {}

bool StaticRendezvous::wait_for_master(elastic::SignalPipe& signals, int* exit_code) {
  using Clock = std::chrono::steady_clock;
  const std::string& host = options_.master_addr;
  const Clock::time_point start = Clock::now();
  const std::chrono::duration<double> timeout(options_.rdzv_conf.join_timeout_s);
  std::string why = elastic::resolve_failure(host);
  const bool waited = !why.empty();
  if (waited) {
    say("--master-addr: the host name '" + host + "' does not resolve (" + why +
        "); waiting up to " + detail::seconds_text(timeout) +
        " (--rdzv-conf join_timeout) for it: the master's node may not be registered yet");
  }
  while (!why.empty()) {
    if (Clock::now() - start >= timeout) {
      say("--master-addr: the host name '" + host + "' did not resolve (" + why +
          ") after trying for " + detail::seconds_text(Clock::now() - start) +
          " (--rdzv-conf join_timeout); check --master-addr, or allow the master's node longer "
          "to register its name");
      *exit_code = 1;
      return false;
    }
    pollfd wake{signals.fd(), POLLIN, 0};
    if (poll(&wake, 1, 250) > 0) {
      if (int signo = signals.take(); signo != 0) {
        say("received " + elastic::signal_name(signo) +
            " while waiting for --master-addr to resolve; leaving");
        *exit_code = 128 + signo;
        return false;
      }
    }
    why = elastic::resolve_failure(host);
  }
  master_unresolved_ = false;
  if (waited) {
    say("--master-addr: '" + host + "' resolves now, after " +
        detail::seconds_text(Clock::now() - start));
  }
  check_master_port_free(options_, elastic::probe_port(host, options_.master_port));
  return true;
}

std::optional<elastic::WorkerGroupRound> StaticRendezvous::next_round(elastic::SignalPipe& signals,
                                                                      int* exit_code) {
  if (master_unresolved_ && !wait_for_master(signals, exit_code)) return std::nullopt;
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
