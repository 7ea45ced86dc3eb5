// TCP port helpers for launchers: picking a free port for the master's store, and checking that an
// explicitly given one can be bound on this machine before any worker starts.
#pragma once

#include <string>

namespace dtrain::elastic {

// A TCP port that was free on every local IPv4 address a moment ago: bind port 0, read what the
// kernel chose, close. Another process may take it before rank 0 binds it (torchrun has the same
// race); a restart picks a fresh one. Throws dtrain::InternalError when no socket can be bound.
int pick_free_port();

enum class PortProbe {
  kFree,      // `addr` is an address of this machine and `port` can be bound there
  kInUse,     // `addr` is local and something already listens on `port` (there or on every address)
  kNotLocal,  // `addr` belongs to another machine: nothing to check here
  kUnresolvable,  // `addr` is not a valid address or host name
};

// Whether the store that rank 0 will host at addr:port can bind it. PyTorch's TCPStore binds the
// wildcard address with SO_REUSEADDR, so the probe binds both addr and the wildcard the same way: a
// listening socket conflicts, a TIME_WAIT leftover of a previous run does not. Never blocks on the
// network except for name resolution.
PortProbe probe_port(const std::string& addr, int port);

// The address of this machine that traffic to host:port leaves from, which is the address the other
// nodes of a job can reach it at (they reach the same rendezvous endpoint). Found with a UDP
// connect(), which sends nothing. Empty when `host` does not resolve or no route leads there.
std::string local_address_towards(const std::string& host, int port);

}  // namespace dtrain::elastic
