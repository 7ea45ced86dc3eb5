// The c10d rendezvous store and its client (see c10d_backend.h for the protocol). Server and
// client of one wire format in one file (a little over 600 lines), so each message's two ends are
// read together.
#include "launcher/elastic/c10d_backend.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "common/format.h"
#include "dtrain/errors.h"

namespace dtrain::elastic {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[4] = {'D', 'T', 'R', 'S'};
constexpr unsigned char kProtocolVersion = 1;
constexpr std::size_t kNonceBytes = 32;
constexpr std::size_t kMacBytes = 32;
constexpr std::size_t kServerHelloBytes = 4 + 1 + 1 + kNonceBytes;
// An unauthenticated peer may send this much and take this long before it is dropped.
constexpr std::size_t kMaxHelloFrame = 1024;
constexpr auto kHelloDeadline = std::chrono::seconds(5);
// The client's patience for the server's greeting, which the store sends as soon as it accepts a
// connection: a peer silent for this long after accepting is not a store (an HTTP server waits for
// the request). The same 5 s the store gives a client for its hello: generous for a loaded host,
// short beside the join timeout (60 s) that the agent would otherwise wait out.
constexpr auto kGreetingTimeout = kHelloDeadline;
// The rendezvous state of a job is a few KiB; anything near this is a bug or an attack.
constexpr std::size_t kMaxFrame = 16u << 20;

enum HelloStatus : unsigned char { kWelcome = 0, kWrongToken = 1, kTokenRequired = 2 };

std::string random_bytes(std::size_t n) {
  std::string bytes(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(bytes.data()), static_cast<int>(n)) != 1) {
    throw InternalError("dtrain run: cannot draw random bytes for the rendezvous handshake");
  }
  return bytes;
}

std::string mac_of(const std::string& token, const char* label, const std::string& first,
                   const std::string& second) {
  if (token.empty()) return std::string(kMacBytes, '\0');
  return hmac_sha256(token, std::string(label) + first + second);
}

bool same_mac(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void put_u32(std::string& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(value >> shift));
}
void put_u64(std::string& out, uint64_t value) {
  for (int shift = 56; shift >= 0; shift -= 8) out.push_back(static_cast<char>(value >> shift));
}
void put_string(std::string& out, const std::string& text) {
  put_u32(out, static_cast<uint32_t>(text.size()));
  out += text;
}

// Reads fields from a received payload; any overrun is a malformed message.
class Reader {
 public:
  explicit Reader(const std::string& data) : data_(data) {}
  unsigned char u8() {
    need(1);
    return static_cast<unsigned char>(data_[at_++]);
  }
  uint64_t uint(int bytes) {
    need(static_cast<std::size_t>(bytes));
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i) value = (value << 8) | static_cast<unsigned char>(data_[at_++]);
    return value;
  }
  std::string bytes(std::size_t n) {
    need(n);
    std::string out = data_.substr(at_, n);
    at_ += n;
    return out;
  }
  std::string string() { return bytes(static_cast<std::size_t>(uint(4))); }

 private:
  void need(std::size_t n) {
    if (data_.size() - at_ < n) throw std::runtime_error("malformed message");
  }
  const std::string& data_;
  std::size_t at_ = 0;
};

std::string framed(const std::string& payload) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(payload.size()));
  return out + payload;
}

std::string describe_peer(const sockaddr_storage& address) {
  char host[NI_MAXHOST] = "?";
  char port[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<const sockaddr*>(&address), sizeof(address), host, sizeof(host),
              port, sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  return std::string(host) + ":" + port;
}

// One resolved address of `host` (IPv4 preferred: what the other nodes most likely use); false,
// with *why (gai_strerror's text), when it does not resolve.
bool resolve(const std::string& host, int port, sockaddr_storage* out, socklen_t* length,
             std::string* why) {
  const std::vector<SocketAddress> found = resolve_addresses(host, port, why);
  if (found.empty()) return false;
  auto chosen = std::find_if(found.begin(), found.end(), [](const SocketAddress& address) {
    return address.address.ss_family == AF_INET;
  });
  if (chosen == found.end()) chosen = found.begin();
  *out = chosen->address;
  *length = chosen->length;
  return true;
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(left.count());
}

// "--rdzv-endpoint HOST:PORT: the host name 'HOST' does not resolve (WHY)": the message of an
// UnresolvedHostError, after "dtrain run: ".
std::string unresolved(const std::string& host, int port, const std::string& why) {
  std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return "--rdzv-endpoint " + shown + ":" + std::to_string(port) + ": the host name '" + host +
         "' does not resolve (" + why + ")";
}

// poll() of one descriptor for `events`, which also gives up, throwing InterruptedError, once
// `interrupt_fd` (when >= 0) is readable: a signal for the launcher ends a call at once.
int poll_one(int fd, short events, int timeout_ms, int interrupt_fd) {
  pollfd fds[2] = {{fd, events, 0}, {interrupt_fd, POLLIN, 0}};
  int ready = poll(fds, interrupt_fd >= 0 ? 2 : 1, timeout_ms);
  if (ready > 0 && interrupt_fd >= 0 && (fds[1].revents & POLLIN) != 0) {
    throw InterruptedError("dtrain run: the call to the rendezvous store was interrupted");
  }
  return ready;
}

}  // namespace

std::string hmac_sha256(const std::string& key, const std::string& message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &length);
  return std::string(reinterpret_cast<char*>(digest), length);
}

// ---------------------------------------------------------------------------------------------
// Server

struct C10dStoreServer::Impl {
  struct Entry {
    std::string value;
    uint64_t version = 0;
  };
  struct Connection {
    int fd = -1;
    std::string peer;
    std::string server_nonce;
    bool authenticated = false;
    Clock::time_point hello_deadline;
    std::string input;
  };

  int listen_fd = -1;
  int wake_read = -1;
  int wake_write = -1;
  std::string token;
  std::function<void(const std::string&)> log;
  std::map<std::string, Entry> entries;
  uint64_t next_version = 1;
  std::vector<Connection> connections;

  ~Impl() {
    for (Connection& connection : connections) close(connection.fd);
    for (int fd : {listen_fd, wake_read, wake_write}) {
      if (fd >= 0) close(fd);
    }
  }

  void accept_one() {
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&address), &length,
                     SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    int on = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
    Connection connection;
    connection.fd = fd;
    connection.peer = describe_peer(address);
    connection.server_nonce = random_bytes(kNonceBytes);
    connection.hello_deadline = Clock::now() + kHelloDeadline;
    std::string hello(kMagic, sizeof(kMagic));
    hello.push_back(static_cast<char>(kProtocolVersion));
    hello.push_back(token.empty() ? 0 : 1);
    hello += connection.server_nonce;
    if (!send_all(fd, hello)) {
      close(fd);
      return;
    }
    connections.push_back(std::move(connection));
  }

  // Small replies to a peer that reads them: a full socket buffer only happens to a peer that
  // stopped reading, which is then dropped.
  static bool send_all(int fd, const std::string& data) {
    std::size_t sent = 0;
    while (sent < data.size()) {
      ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd out{fd, POLLOUT, 0};
        if (poll(&out, 1, 1000) <= 0) return false;
        continue;
      }
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }

  // Handles every complete frame in the connection's input; false drops the connection.
  bool handle_input(Connection& connection) {
    while (connection.input.size() >= 4) {
      Reader header(connection.input);
      std::size_t length = header.uint(4);
      std::size_t limit = connection.authenticated ? kMaxFrame : kMaxHelloFrame;
      if (length > limit) {
        if (log) log("rendezvous store: dropped " + connection.peer + ": oversized message");
        return false;
      }
      if (connection.input.size() < 4 + length) return true;
      std::string payload = connection.input.substr(4, length);
      connection.input.erase(0, 4 + length);
      try {
        if (!(connection.authenticated ? handle_request(connection, payload)
                                       : handle_hello(connection, payload))) {
          return false;
        }
      } catch (const std::exception&) {
        if (log) log("rendezvous store: dropped " + connection.peer + ": malformed message");
        return false;
      }
    }
    return true;
  }

  bool handle_hello(Connection& connection, const std::string& payload) {
    Reader reader(payload);
    if (reader.u8() != 'H') throw std::runtime_error("not a hello");
    std::string client_nonce = reader.bytes(kNonceBytes);
    std::string client_mac = reader.bytes(kMacBytes);
    std::string expected =
        mac_of(token, "dtrain-rdzv-client", connection.server_nonce, client_nonce);
    bool zero_mac = client_mac == std::string(kMacBytes, '\0');
    std::string reply(1, static_cast<char>(kWelcome));
    if (!token.empty() && !same_mac(client_mac, expected)) {
      reply[0] = static_cast<char>(zero_mac ? kTokenRequired : kWrongToken);
      if (log) {
        log("rendezvous store: refused a connection from " + connection.peer + ": " +
            (zero_mac ? "it presented no token" : "wrong token"));
      }
      send_all(connection.fd, framed(reply + std::string(kMacBytes, '\0')));
      return false;
    }
    reply += mac_of(token, "dtrain-rdzv-server", client_nonce, connection.server_nonce);
    connection.authenticated = true;
    return send_all(connection.fd, framed(reply));
  }

  bool handle_request(Connection& connection, const std::string& payload) {
    Reader reader(payload);
    unsigned char op = reader.u8();
    std::string key = reader.string();
    bool written = false;
    if (op == 'S') {
      bool has_expected = reader.u8() != 0;
      uint64_t expected = reader.uint(8);
      std::string value = reader.string();
      auto found = entries.find(key);
      bool matches = has_expected ? (found != entries.end() && found->second.version == expected)
                                  : found == entries.end();
      if (matches) {
        entries[key] = Entry{std::move(value), next_version++};
        written = true;
      }
    } else if (op != 'G') {
      throw std::runtime_error("unknown request");
    }
    std::string reply;
    reply.push_back(written ? 1 : 0);
    auto found = entries.find(key);
    reply.push_back(found != entries.end() ? 1 : 0);
    put_u64(reply, found != entries.end() ? found->second.version : 0);
    put_string(reply, found != entries.end() ? found->second.value : std::string());
    return send_all(connection.fd, framed(reply));
  }
};

std::unique_ptr<C10dStoreServer> C10dStoreServer::try_host(
    const std::string& host, int port, std::string token,
    std::function<void(const std::string&)> log) {
  sockaddr_storage address{};
  socklen_t length = 0;
  if (std::string why; !resolve(host, port, &address, &length, &why)) {
    throw UnresolvedHostError("dtrain run: " + unresolved(host, port, why));
  }
  int fd = socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return nullptr;
  int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  // The endpoint's own address, never the wildcard: the store is reachable exactly where the job
  // said it would be, not on every interface of the machine.
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), length) != 0 || listen(fd, 64) != 0) {
    close(fd);  // EADDRINUSE: another agent hosts it; EADDRNOTAVAIL: not this machine's address
    return nullptr;
  }
  std::unique_ptr<C10dStoreServer> server(new C10dStoreServer());
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  impl.listen_fd = fd;
  impl.token = std::move(token);
  impl.log = std::move(log);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw InternalError("dtrain run: cannot create a pipe for the rendezvous store");
  }
  impl.wake_read = pipe_fds[0];
  impl.wake_write = pipe_fds[1];
  server->address_ = describe_peer(address);
  server->thread_ = std::thread([raw = server.get()] { raw->serve(); });
  return server;
}

C10dStoreServer::~C10dStoreServer() {
  if (impl_ && impl_->wake_write >= 0) {
    ssize_t ignored = write(impl_->wake_write, "x", 1);
    (void)ignored;
  }
  if (thread_.joinable()) thread_.join();
}

void C10dStoreServer::serve() {
  Impl& impl = *impl_;
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({impl.wake_read, POLLIN, 0});
    fds.push_back({impl.listen_fd, POLLIN, 0});
    for (const auto& connection : impl.connections) fds.push_back({connection.fd, POLLIN, 0});
    int ready = poll(fds.data(), fds.size(), 500);
    if (ready < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) impl.accept_one();
    std::vector<bool> keep(impl.connections.size(), true);
    for (std::size_t i = 0; i < impl.connections.size() && i + 2 < fds.size(); ++i) {
      Impl::Connection& connection = impl.connections[i];
      if (fds[i + 2].revents != 0) {
        char buffer[65536];
        ssize_t n = recv(connection.fd, buffer, sizeof(buffer), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          keep[i] = false;
          continue;
        }
        if (n > 0) connection.input.append(buffer, static_cast<std::size_t>(n));
        keep[i] = impl.handle_input(connection);
      }
      if (keep[i] && !connection.authenticated && Clock::now() > connection.hello_deadline) {
        if (impl.log) {
          impl.log("rendezvous store: dropped " + connection.peer + ": no hello within 5 s");
        }
        keep[i] = false;
      }
    }
    std::vector<Impl::Connection> kept;
    for (std::size_t i = 0; i < impl.connections.size(); ++i) {
      if (i < keep.size() && !keep[i]) {
        close(impl.connections[i].fd);
      } else {
        kept.push_back(std::move(impl.connections[i]));
      }
    }
    impl.connections = std::move(kept);
  }
}

// ---------------------------------------------------------------------------------------------
// Client

namespace {

// Sends everything before the deadline; false when the connection broke.
// `interrupt_fd`, here and below: see poll_one().
bool send_until(int fd, const std::string& data, Clock::time_point deadline, int interrupt_fd) {
  std::size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (poll_one(fd, POLLOUT, remaining_ms(deadline), interrupt_fd) <= 0) {
        throw TimeoutError("send");
      }
      continue;
    }
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

// Reads exactly n bytes before the deadline (TimeoutError("receive")); false when the peer closed.
bool receive_until(int fd, std::size_t n, std::string* out, Clock::time_point deadline,
                   int interrupt_fd) {
  out->clear();
  while (out->size() < n) {
    int ready = poll_one(fd, POLLIN, remaining_ms(deadline), interrupt_fd);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) throw TimeoutError("receive");
    char buffer[65536];
    ssize_t got = recv(fd, buffer, std::min(sizeof(buffer), n - out->size()), MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) return false;
    out->append(buffer, static_cast<std::size_t>(got));
  }
  return true;
}

// "HTTP/1.1 400 Bad Request\r\n...": the first bytes a peer sent, printable, for a message.
std::string preview(const std::string& bytes) {
  constexpr std::size_t kShown = 24;
  std::string text;
  for (std::size_t i = 0; i < bytes.size() && i < kShown; ++i) {
    unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c == '\r') {
      text += "\\r";
    } else if (c == '\n') {
      text += "\\n";
    } else if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      text.push_back(static_cast<char>(c));
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      text += escaped;
    }
  }
  return bytes.size() > kShown ? text + "..." : text;
}

// Reads the store's greeting (kServerHelloBytes) into `hello`, checking every byte as it arrives
// against the store's magic, so that another program is told by its first answer, not by a
// timeout. Returns false when the peer closed before sending anything (what a port forwarder whose
// target is not up yet does: the store may still come). Throws NotAStoreError saying what the peer
// did, for the caller's message, at bytes that are not the magic, a close after some bytes, or no
// complete greeting by `greeting_deadline`; TimeoutError("receive") at `deadline` when that comes
// first.
bool receive_greeting(int fd, std::string* hello, Clock::time_point greeting_deadline,
                      Clock::time_point deadline, int interrupt_fd) {
  hello->clear();
  Clock::time_point until = std::min(greeting_deadline, deadline);
  while (hello->size() < kServerHelloBytes) {
    int ready = poll_one(fd, POLLIN, remaining_ms(until), interrupt_fd);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      if (deadline < greeting_deadline) throw TimeoutError("receive");
      std::string waited = detail::seconds_text(kGreetingTimeout);
      throw NotAStoreError(
          hello->empty() ? "it accepted the connection and sent nothing within " + waited
                         : "it sent '" + preview(*hello) + "', then nothing within " + waited);
    }
    char buffer[kServerHelloBytes];
    ssize_t got = recv(fd, buffer, kServerHelloBytes - hello->size(), MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) {
      if (hello->empty()) return false;
      throw NotAStoreError("it sent '" + preview(*hello) + "' and closed the connection");
    }
    hello->append(buffer, static_cast<std::size_t>(got));
    std::size_t checked = std::min(hello->size(), sizeof(kMagic));
    if (hello->compare(0, checked, kMagic, checked) != 0) {
      throw NotAStoreError("it sent '" + preview(*hello) + "'");
    }
  }
  return true;
}

bool receive_frame(int fd, std::string* payload, Clock::time_point deadline, int interrupt_fd) {
  std::string header;
  if (!receive_until(fd, 4, &header, deadline, interrupt_fd)) return false;
  Reader reader(header);
  std::size_t length = reader.uint(4);
  if (length > kMaxFrame) return false;
  return receive_until(fd, length, payload, deadline, interrupt_fd);
}

}  // namespace

C10dBackend::C10dBackend(std::string host, int port, std::string job_id, std::string token,
                         std::chrono::milliseconds timeout)
    : host_(std::move(host)),
      port_(port),
      job_id_(std::move(job_id)),
      token_(std::move(token)),
      timeout_(timeout),
      addresses_(resolve_addresses(host_, port_)) {}

C10dBackend::~C10dBackend() { disconnect(); }

Knock C10dBackend::knock(std::chrono::milliseconds timeout) {
  return addresses_.empty() ? elastic::knock(host_, port_, timeout)
                            : elastic::knock(addresses_, timeout);
}

void C10dBackend::disconnect() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

std::string C10dBackend::endpoint_text() const {
  std::string host = host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_;
  return host + ":" + std::to_string(port_);
}

void C10dBackend::connect_and_authenticate(Clock::time_point deadline) {
  std::string where = "the c10d rendezvous store at " + endpoint_text();
  sockaddr_storage address{};
  socklen_t length = 0;
  // Resolved anew for each connection (a store's node that moved may have a new address). A name
  // that does not resolve is a failed call like a refused connection: the agent retries it while
  // joining, and rides it out mid-job as any store trouble.
  if (std::string why; !resolve(host_, port_, &address, &length, &why)) {
    throw UnresolvedHostError("dtrain run: " + unresolved(host_, port_, why));
  }
  int fd = socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw CommError("dtrain run: " + where + ": cannot create a socket");
  fd_ = fd;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    if (errno != EINPROGRESS) {
      int error = errno;
      disconnect();
      throw CommError("dtrain run: " + where + ": " + std::strerror(error));
    }
    int ready = 0;
    try {
      ready = poll_one(fd, POLLOUT, remaining_ms(deadline), interrupt_fd_);
    } catch (const InterruptedError&) {
      disconnect();
      throw;
    }
    if (ready <= 0) {
      disconnect();
      throw TimeoutError("dtrain run: " + where + ": no answer within the call's " +
                         detail::seconds_text(timeout_) + " timeout");
    }
    int error = 0;
    socklen_t size = sizeof(error);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size);
    if (error != 0) {
      disconnect();
      throw CommError("dtrain run: " + where + ": " + std::strerror(error));
    }
  }
  int on = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));

  try {
    std::string hello;
    try {
      if (!receive_greeting(fd, &hello, Clock::now() + kGreetingTimeout, deadline, interrupt_fd_)) {
        throw CommError("dtrain run: " + where + " closed the connection before its greeting");
      }
    } catch (const NotAStoreError& cause) {
      throw NotAStoreError("dtrain run: --rdzv-endpoint " + endpoint_text() +
                           " answers, but is not a dtrain/c10d rendezvous store (" +
                           std::string(cause.what()) +
                           "): another program likely holds the port; pick another port for "
                           "--rdzv-endpoint on every node, or stop that program");
    }
    if (hello[4] != static_cast<char>(kProtocolVersion)) {
      throw UsageError("dtrain run: " + where + " speaks rendezvous protocol version " +
                       std::to_string(static_cast<unsigned char>(hello[4])) +
                       ", this dtrain speaks version " + std::to_string(kProtocolVersion) +
                       "; run the same dtrain on every node");
    }
    bool token_required = hello[5] != 0;
    std::string server_nonce = hello.substr(6, kNonceBytes);
    if (!token_required && !token_.empty()) {
      throw UsageError("dtrain run: " + where +
                       " is open (its host has no token) but this node has one; give every node "
                       "the same DTRAIN_RDZV_TOKEN");
    }
    std::string client_nonce = random_bytes(kNonceBytes);
    std::string message(1, 'H');
    message += client_nonce + mac_of(token_, "dtrain-rdzv-client", server_nonce, client_nonce);
    std::string reply;
    if (!send_until(fd, framed(message), deadline, interrupt_fd_) ||
        !receive_frame(fd, &reply, deadline, interrupt_fd_) || reply.size() != 1 + kMacBytes) {
      throw CommError("dtrain run: " + where + " closed the connection during the handshake");
    }
    if (reply[0] == static_cast<char>(kTokenRequired)) {
      throw UsageError("dtrain run: " + where +
                       " refused this node: it requires a token; set DTRAIN_RDZV_TOKEN (or "
                       "--rdzv-token) as on the other nodes");
    }
    if (reply[0] != static_cast<char>(kWelcome)) {
      throw UsageError("dtrain run: " + where +
                       " refused this node: wrong token; give every node the same "
                       "DTRAIN_RDZV_TOKEN");
    }
    if (!same_mac(reply.substr(1),
                  mac_of(token_, "dtrain-rdzv-server", client_nonce, server_nonce))) {
      throw UsageError("dtrain run: " + where +
                       " could not prove it knows the job's token; check --rdzv-endpoint");
    }
  } catch (const TimeoutError&) {
    disconnect();
    throw TimeoutError("dtrain run: " + where + ": handshake not answered within the call's " +
                       detail::seconds_text(timeout_) + " timeout");
  } catch (...) {
    disconnect();
    throw;
  }
}

std::string C10dBackend::call(const std::string& request) {
  std::string where = "the c10d rendezvous store at " + endpoint_text();
  Clock::time_point deadline = Clock::now() + timeout_;
  // A connection idle since the last call may have broken meanwhile; one fresh connection is tried
  // before the store counts as gone.
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool fresh = fd_ < 0;
    if (fresh) connect_and_authenticate(deadline);
    std::string reply;
    try {
      if (send_until(fd_, framed(request), deadline, interrupt_fd_) &&
          receive_frame(fd_, &reply, deadline, interrupt_fd_)) {
        return reply;
      }
    } catch (const InterruptedError&) {
      disconnect();  // a request half sent or half answered
      throw;
    } catch (const TimeoutError&) {
      disconnect();
      throw TimeoutError("dtrain run: " + where + ": no answer within the call's " +
                         detail::seconds_text(timeout_) + " timeout");
    }
    disconnect();
    if (fresh) break;
  }
  throw CommError("dtrain run: " + where + " closed the connection");
}

std::optional<VersionedState> C10dBackend::get_state() {
  std::string request(1, 'G');
  put_string(request, job_id_);
  std::string reply = call(request);
  Reader reader(reply);
  reader.u8();
  bool has_state = reader.u8() != 0;
  uint64_t version = reader.uint(8);
  std::string value = reader.string();
  if (!has_state) return std::nullopt;
  return VersionedState{std::move(value), version};
}

RendezvousBackend::SetResult C10dBackend::set_state(const std::string& state,
                                                    std::optional<uint64_t> expected_version) {
  std::string request(1, 'S');
  put_string(request, job_id_);
  request.push_back(expected_version ? 1 : 0);
  put_u64(request, expected_version.value_or(0));
  put_string(request, state);
  std::string reply = call(request);
  Reader reader(reply);
  SetResult result;
  result.written = reader.u8() != 0;
  reader.u8();
  result.current.version = reader.uint(8);
  result.current.state = reader.string();
  return result;
}

std::string C10dBackend::local_address() {
  if (fd_ < 0) connect_and_authenticate(Clock::now() + timeout_);
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
  std::string text = describe_peer(address);
  return text.substr(0, text.rfind(':'));
}

}  // namespace dtrain::elastic
