// TCP port helpers for launchers (see ports.h).
#include "launcher/elastic/ports.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/errors.h"

namespace dtrain::elastic {
namespace {

// A socket closed on every path out of the scope that made it.
class Socket {
 public:
  explicit Socket(int family) : fd_(socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0)) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// bind() result for `address` with its port replaced by `port`: 0, or the errno.
int try_bind(const sockaddr* address, socklen_t length, int port) {
  sockaddr_storage copy{};
  std::memcpy(&copy, address, length);
  if (copy.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&copy)->sin_port = htons(static_cast<uint16_t>(port));
  } else if (copy.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&copy)->sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    return EAFNOSUPPORT;
  }
  Socket socket(copy.ss_family);
  if (socket.fd() < 0) return errno;
  int on = 1;
  setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  if (bind(socket.fd(), reinterpret_cast<sockaddr*>(&copy), length) != 0) return errno;
  return 0;
}

// The wildcard address of `family` with the given port.
int try_bind_wildcard(int family, int port) {
  if (family == AF_INET6) {
    sockaddr_in6 any{};
    any.sin6_family = AF_INET6;
    any.sin6_addr = in6addr_any;
    return try_bind(reinterpret_cast<sockaddr*>(&any), sizeof(any), port);
  }
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  return try_bind(reinterpret_cast<sockaddr*>(&any), sizeof(any), port);
}

}  // namespace

int pick_free_port() {
  Socket socket(AF_INET);
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  any.sin_port = 0;
  if (socket.fd() < 0 || bind(socket.fd(), reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0) {
    throw InternalError(
        std::string("dtrain run: cannot bind a socket to pick a free master port: ") +
        std::strerror(errno) + "; pass --master-port explicitly");
  }
  socklen_t length = sizeof(any);
  getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&any), &length);
  return ntohs(any.sin_port);
}

PortProbe probe_port(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* results = nullptr;
  if (getaddrinfo(addr.c_str(), nullptr, &hints, &results) != 0 || results == nullptr) {
    return PortProbe::kUnresolvable;
  }
  PortProbe verdict = PortProbe::kNotLocal;
  for (addrinfo* result = results; result != nullptr; result = result->ai_next) {
    // Port 0 always binds on a local address; EADDRNOTAVAIL means the address is another machine's.
    if (try_bind(result->ai_addr, result->ai_addrlen, 0) != 0) continue;
    verdict = PortProbe::kFree;
    if (try_bind(result->ai_addr, result->ai_addrlen, port) == EADDRINUSE ||
        try_bind_wildcard(result->ai_family, port) == EADDRINUSE) {
      verdict = PortProbe::kInUse;
      break;
    }
  }
  freeaddrinfo(results);
  return verdict;
}

std::vector<InterfaceAddress> interface_addresses() {
  std::vector<InterfaceAddress> found;
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return found;
  for (ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    const void* raw =
        family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr)
        : family == AF_INET6
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr)
            : nullptr;
    char text[INET6_ADDRSTRLEN] = {0};
    if (raw && inet_ntop(family, raw, text, sizeof text)) {
      found.push_back({i->ifa_name, text, family});
    }
  }
  freeifaddrs(interfaces);
  return found;
}

LocalRoute route_to(const std::string& host, int family) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  // Any port: a datagram socket's connect() only picks the route.
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return {};
  LocalRoute route;
  for (addrinfo* a = found; a != nullptr && route.address.empty(); a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* raw =
          local.ss_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, raw, text, sizeof text)) route.address = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (route.address.empty()) return route;
  for (const auto& [interface, address, address_family] : interface_addresses()) {
    if (address == route.address) {
      route.interface = interface;
      break;
    }
  }
  return route;
}

std::vector<SocketAddress> resolve_addresses(const std::string& host, int port) {
  return resolve_addresses(host, port, nullptr);
}

std::vector<SocketAddress> resolve_addresses(const std::string& host, int port, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* results = nullptr;
  std::vector<SocketAddress> addresses;
  if (int status = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &results);
      status != 0) {
    if (why != nullptr) *why = status == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(status);
    return addresses;
  }
  for (addrinfo* result = results; result != nullptr; result = result->ai_next) {
    if (result->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SocketAddress address;
    std::memcpy(&address.address, result->ai_addr, result->ai_addrlen);
    address.length = static_cast<socklen_t>(result->ai_addrlen);
    addresses.push_back(address);
  }
  freeaddrinfo(results);
  if (addresses.empty() && why != nullptr) *why = "no address";
  return addresses;
}

bool plausible_host(const std::string& host) {
  in6_addr ignored{};
  if (inet_pton(AF_INET, host.c_str(), &ignored) == 1) return true;
  if (host.find(':') != std::string::npos) {
    // IPv6, maybe with its zone ("fe80::1%eth0"), which getaddrinfo takes and inet_pton does not.
    return inet_pton(AF_INET6, host.substr(0, host.find('%')).c_str(), &ignored) == 1;
  }
  std::string name = host;
  if (!name.empty() && name.back() == '.') name.pop_back();  // a fully qualified name's root
  if (name.empty() || name.size() > 253) return false;
  std::size_t label = 0;
  for (char c : name) {
    if (c == '.') {
      if (label == 0) return false;
      label = 0;
      continue;
    }
    const bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                         (c >= '0' && c <= '9') || c == '-' || c == '_';
    if (!allowed || ++label > 63) return false;
  }
  return label > 0;
}

std::string resolve_failure(const std::string& host) {
  std::string why;
  return resolve_addresses(host, 0, &why).empty() ? why : std::string();
}

std::vector<Knock> knock_each(const std::vector<std::vector<SocketAddress>>& targets,
                              std::chrono::milliseconds timeout,
                              const std::function<bool()>& give_up) {
  // Every address of every target at once (a name with an IPv6 address that refuses and an IPv4
  // one that accepts must read as accepted), each connection non-blocking, then one poll over
  // those in flight.
  std::vector<Knock> answers(targets.size(), Knock::kSilent);
  std::vector<int> refused(targets.size(), 0);
  std::vector<int> tried(targets.size(), 0);  // attempts that left this machine
  std::vector<std::unique_ptr<Socket>> sockets;
  std::vector<pollfd> waiting;
  std::vector<size_t> waiting_target;  // parallel to `waiting`
  for (size_t t = 0; t < targets.size(); ++t) {
    for (const SocketAddress& address : targets[t]) {
      if (answers[t] == Knock::kAccepted) break;
      auto socket = std::make_unique<Socket>(address.address.ss_family);
      if (socket->fd() < 0) continue;  // out of descriptors or buffers: not tried
      fcntl(socket->fd(), F_SETFL, fcntl(socket->fd(), F_GETFL) | O_NONBLOCK);
      if (connect(socket->fd(), reinterpret_cast<const sockaddr*>(&address.address),
                  address.length) == 0) {
        answers[t] = Knock::kAccepted;
      } else if (errno == ECONNREFUSED) {
        ++refused[t];
      } else if (errno == EINPROGRESS) {
        ++tried[t];
        waiting.push_back(pollfd{socket->fd(), POLLOUT, 0});
        waiting_target.push_back(t);
      } else if (errno == ENETUNREACH || errno == EHOSTUNREACH || errno == ETIMEDOUT ||
                 errno == EPERM || errno == EACCES) {
        ++tried[t];  // no route there, or a local firewall rule: no way there from here
      }
      sockets.push_back(std::move(socket));
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Slices of at most 100 ms where the caller may give up (a process on its way out).
  const std::chrono::milliseconds slice = give_up ? std::chrono::milliseconds(100) : timeout;
  bool given_up = false;
  while (!waiting.empty()) {
    if (give_up && give_up()) {
      given_up = true;
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const int ready =
        poll(waiting.data(), waiting.size(), static_cast<int>(std::min(left, slice).count()));
    if (ready < 0 && errno == EINTR) continue;  // a signal for the launcher: poll again
    if (ready == 0 && std::chrono::steady_clock::now() < deadline) continue;  // the next slice
    if (ready <= 0) break;                                                    // no answer in time
    for (size_t i = 0; i < waiting.size();) {
      const size_t t = waiting_target[i];
      if (waiting[i].revents == 0 && answers[t] != Knock::kAccepted) {
        ++i;
        continue;
      }
      if (waiting[i].revents != 0) {
        int error = 0;
        socklen_t size = sizeof(error);
        getsockopt(waiting[i].fd, SOL_SOCKET, SO_ERROR, &error, &size);
        if (error == 0) answers[t] = Knock::kAccepted;
        if (error == ECONNREFUSED) ++refused[t];
      }
      waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
      waiting_target.erase(waiting_target.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  // Refused by one address and silent on another (an IPv6 address without a route, say): the
  // machine answered, so it is up.
  for (size_t t = 0; t < targets.size(); ++t) {
    if (answers[t] == Knock::kAccepted) continue;
    if (given_up &&
        std::find(waiting_target.begin(), waiting_target.end(), t) != waiting_target.end()) {
      answers[t] = Knock::kUnknown;  // still in flight when the caller gave up
    } else if (refused[t] > 0) {
      answers[t] = Knock::kRefused;
    } else if (tried[t] == 0 && !targets[t].empty()) {
      answers[t] = Knock::kUnknown;  // every attempt failed here, before any packet left
    }
  }
  return answers;
}

Knock knock(const std::vector<SocketAddress>& addresses, std::chrono::milliseconds timeout) {
  return knock_each({addresses}, timeout).front();
}

Knock knock(const std::string& host, int port, std::chrono::milliseconds timeout) {
  return knock(resolve_addresses(host, port), timeout);
}

KnockTarget::KnockTarget(const std::string& address) {
  const std::vector<SocketAddress> found = resolve_addresses(address, 0);
  auto fail = [&](const std::string& what) {
    throw InternalError("in-place recovery: cannot listen for peers' knocks on " + address + ": " +
                        what);
  };
  if (found.empty()) fail("not a numeric address");
  const SocketAddress& where = found.front();
  fd_ = socket(where.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) fail(std::strerror(errno));
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (bind(fd_, reinterpret_cast<const sockaddr*>(&where.address), where.length) != 0 ||
      listen(fd_, SOMAXCONN) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    const std::string why = std::strerror(errno);
    close(fd_);
    fd_ = -1;
    fail(why);
  }
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
}

KnockTarget::~KnockTarget() {
  if (fd_ >= 0) close(fd_);
}

void KnockTarget::drain() {
  for (int fd; (fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) close(fd);
}

}  // namespace dtrain::elastic
