// TCP port helpers for launchers: picking a free port for the master's store, and checking that an
// explicitly given one can be bound on this machine before any worker starts; and knocks, which
// tell whether a machine can be reached (for the launchers, and in-place recovery's members).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::elastic {

// A TCP port that was free on every local IPv4 address a moment ago: bind port 0, read what the
// kernel chose, close. Another process may take it before rank 0 binds it (torchrun has the same
// race); a restart picks a fresh one. Throws dtrain::InternalError when no socket can be bound.
int pick_free_port();

enum class PortProbe {
  kFree,      // `addr` is an address of this machine and `port` can be bound there
  kInUse,     // `addr` is local and something already listens on `port` (there or on every address)
  kNotLocal,  // `addr` belongs to another machine: nothing to check here
  kUnresolvable,  // `addr` does not resolve (now: a name may resolve later)
};

// Whether `host` can name a machine at all: an IPv4 or IPv6 address (an IPv6 one with its zone, if
// any), or a name of letters, digits, '-', '_' and '.' (labels of 1 to 63 characters, 253 in all;
// one trailing dot allowed).
// One that is not can never resolve: a bad flag. One that is may only not resolve yet (a scheduler
// registers a node's name once it runs), which a launcher waits out. Never blocks.
bool plausible_host(const std::string& host);

// Why `host` does not resolve now (gai_strerror's text of getaddrinfo's answer), or "" when it
// resolves to at least one address. Blocks on name resolution.
std::string resolve_failure(const std::string& host);

// Whether the store that rank 0 will host at addr:port can bind it. PyTorch's TCPStore binds the
// wildcard address with SO_REUSEADDR, so the probe binds both addr and the wildcard the same way: a
// listening socket conflicts, a TIME_WAIT leftover of a previous run does not. Never blocks on the
// network except for name resolution.
PortProbe probe_port(const std::string& addr, int port);

// The address of this machine that traffic to `host` leaves from, and the interface that carries
// it: what the kernel's routing picks for a datagram socket connected there (connect() sends
// nothing). It is the address the others reach this machine at, when they reach `host` too (the
// rendezvous endpoint, MASTER_ADDR). `family`: AF_INET for IPv4 only, AF_UNSPEC for the first
// address `host` resolves to that has a route. Empty when `host` does not resolve or no route
// leads there.
struct LocalRoute {
  std::string address;
  std::string interface;  // empty when no interface has the address (it should not happen)
};
LocalRoute route_to(const std::string& host, int family = AF_UNSPEC);

// Every address of this machine's interfaces (IPv4 and IPv6), in getifaddrs()'s order.
struct InterfaceAddress {
  std::string interface;
  std::string address;
  int family;  // AF_INET or AF_INET6
};
std::vector<InterfaceAddress> interface_addresses();

// What a machine said to a TCP connection attempt (Note [A store that stops answering] in
// src/launcher/cli/elastic_rendezvous.cpp says why a launcher asks).
enum class Knock {
  kAccepted,  // the connection was made: the machine is up and something listens on the port,
              // however busy that program is (the kernel completes the handshake for it)
  kRefused,   // the machine answered (on one of its addresses at least) that nothing listens on
              // the port any more
  kSilent,    // no answer within the timeout, no route, or the name does not resolve: the
              // machine is down or this one is cut off from it
  kUnknown,   // this machine could not try (no socket: too many open files, no buffers; no local
              // address to connect from): says nothing about the other machine
};

// One resolved TCP address.
struct SocketAddress {
  sockaddr_storage address{};
  socklen_t length = 0;
};

// Every TCP address of host:port (IPv4 and IPv6 alike), in the resolver's order; empty when it does
// not resolve. Blocks on name resolution: resolve while the network is known to work, and knock
// at the addresses later.
std::vector<SocketAddress> resolve_addresses(const std::string& host, int port);
// The same; when it returns none, *why (when given) says why (gai_strerror's text).
std::vector<SocketAddress> resolve_addresses(const std::string& host, int port, std::string* why);

// One connection attempt to each of `addresses` at once, closed at once; waits at most `timeout`.
// kAccepted if any accepted, else kRefused if any refused, else kSilent if any was tried, else
// kUnknown (none could be tried here; no addresses at all: kSilent, as a name that resolves to
// none).
Knock knock(const std::vector<SocketAddress>& addresses, std::chrono::milliseconds timeout);
// One knock() at each of `targets` at once: the answers in the same order, after at most
// `timeout` in all, or within 100 ms of `give_up` returning true (a process on its way out; the
// targets that had not answered yet then read kUnknown: nothing is judged by a knock cut short).
std::vector<Knock> knock_each(const std::vector<std::vector<SocketAddress>>& targets,
                              std::chrono::milliseconds timeout,
                              const std::function<bool()>& give_up = {});
// The same, resolving host:port first (which may block on a resolver out of reach).
Knock knock(const std::string& host, int port, std::chrono::milliseconds timeout);

// A listening TCP socket for peers to knock at (knock() above): in-place recovery's members tell
// a cut link between their hosts from a slow collective by it (Note [A link cut between members]
// in src/recovery/membership.h). The kernel completes a knock's handshake however busy the owner
// is; drain() accepts and closes what has queued, so that the backlog never fills (a full backlog
// drops handshakes: a knock would read as silent). One owner thread.
class KnockTarget {
 public:
  // Listens on `address` (numeric IPv4 or IPv6), on a port the kernel picks. Throws
  // dtrain::InternalError if it cannot.
  explicit KnockTarget(const std::string& address);
  ~KnockTarget();
  KnockTarget(const KnockTarget&) = delete;
  KnockTarget& operator=(const KnockTarget&) = delete;

  // The port it listens on (at the address given).
  int port() const { return port_; }
  // Accepts and closes every connection waiting; never blocks.
  void drain();

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace dtrain::elastic
