// The workers' store, a c10d TCPStore server without LibTorch (see worker_store.h). Over 600 lines
// because the wire protocol's note, its request parser and its replies are read together, as in
// c10d_backend.cpp; a third of the file is the note.
//
// Note [TCPStore wire protocol]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Learnt from PyTorch's sources (pytorch/pytorch): the servers in
// torch/csrc/distributed/c10d/store/TCPStoreBackend.cpp (commit 16c9a1823c49) and
// store/TCPStoreLibUvBackend.cpp (commit 3ed60b012a74, the default server since 2.4); the client
// in torch/csrc/distributed/c10d/TCPStore.cpp (its SendBuffer, validate, ping, doWait, barrier);
// the framing helpers in Utils.hpp (tcputil::sendBytes, recvVector, recvString). Checked against
// the headers of the LibTorch we build with (PyPI torch 2.15.0, git d0f2af8b66b2:
// store/TCPStoreBackend.hpp holds the command numbers, the magic number and the reply enums) and
// against that LibTorch's compiled client by tests/launcher/elastic/worker_store_test.cpp.
//
// One TCP connection per c10d::TCPStore object; the client sends a request and, for most, blocks
// on its reply, so a connection never has two requests in flight, except CANCEL_WAIT after a WAIT
// that timed out. Integers are raw host-order bytes (the client memcpy's them; every platform
// LibTorch ships for is little-endian). A string or a value is u64 length, then the bytes. A
// request is u8 command, then its fields; the client buffers a request and sends it in pieces of
// about 1440 bytes, so a request may arrive in any number of reads, and several in one.
//
//   command         fields                                reply
//   0  VALIDATE     u32 magic 0x3C85F7CE                  none; must be the connection's first
//   1  SET          key, value                            none
//   2  COMPARE_SET  key, expected, desired                the value now stored (see below)
//   3  GET          key                                   value (empty when missing)
//   4  ADD          key, i64 delta                        i64 new value
//   5  CHECK        u64 n, n keys                         u8 0 READY (all exist) / 1 NOT_READY
//   6  WAIT         u64 n, n keys                         u8 0 STOP_WAITING once all exist
//   7  GETNUMKEYS   -                                     i64 number of keys
//   8  DELETE_KEY   key                                   i64 number deleted (0 or 1)
//   9  APPEND       key, value                            none
//   10 MULTI_GET    u64 n, n keys                         n values
//   11 MULTI_SET    u64 n, n (key, value)                 none
//   12 CANCEL_WAIT  -                                     u8 1 WAIT_CANCELED
//   13 PING         u32 nonce                             u32 the same nonce
//   14 QUEUE_PUSH   key, value                            none
//   15 QUEUE_POP    key                                   i64 queue length, then the head if any
//   16 QUEUE_LEN    key                                   i64 queue length
//   17 LIST_KEYS    -                                     i64 n, n keys
//   18 BARRIER      key, i64 world size                   u8 0 STOP_WAITING when the count is met
//
// What the client does with them:
// - Connecting: VALIDATE, then PING with its pid as the nonce; it retries the connection until its
//   timeout when either fails. A connection whose first command is not a valid VALIDATE is dropped.
// - Every key arrives with the client's prefix "/" already on it.
// - get() is WAIT on the key, then GET; multiGet() is WAIT on all, then MULTI_GET. So a GET of a
//   missing key only happens when someone deleted it in between: the answer is an empty value.
// - wait() with a timeout: WAIT, then poll(timeout) on the socket; when nothing came, it sends
//   CANCEL_WAIT and reads replies until WAIT_CANCELED (a STOP_WAITING may come first, if the keys
//   appeared in between), then throws DistStoreError. The server forgets the waiter and answers
//   WAIT_CANCELED even when it was not waiting any more. barrier() times out the same way.
// - A waiter parks until every key it waits for exists: a set, add, append, compare-set or
//   multi-set of each of them counts down; at zero the server sends STOP_WAITING. A key that exists
//   when WAIT arrives does not count.
// - add(key, 0) is how a client reads a counter (Python's store.add(k, 0)); ADD of a missing key
//   starts from 0. The value is kept as decimal text ("12"), so get() of a counter reads "12", and
//   ADD to a key holding something else is an error (the server drops that client, as libuv's
//   does on std::stoll's exception).
// - COMPARE_SET: a missing key with an empty `expected` is set to `desired`; a missing key with any
//   other `expected` is left missing and the reply is `expected` (the server "lies", says its own
//   comment); an existing key is replaced when it equals `expected`; either way the reply is the
//   value now stored.
// - Queues (only when the client's useLibUV is on, the default) are apart from the keys: CHECK
//   and WAIT count a non-empty queue as an existing key, a QUEUE_PUSH wakes one waiter of that
//   name, and queuePop(block=true) is WAIT, then QUEUE_POP.
// - BARRIER adds 1 to the counter `key` and replies when it reaches the world size, waking the
//   earlier arrivals too.
// Limits, as libuv's server has them (so anything torchrun's store takes, this one takes): a key
// up to 8 KiB, a value up to 8 MiB, up to 128 Ki keys in one request. A request over them is
// refused and its client dropped (a debug line says why); so is an unknown command.
#include "launcher/elastic/worker_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "common/format.h"
#include "dtrain/errors.h"

namespace dtrain::elastic {
namespace {

constexpr uint32_t kValidationMagic = 0x3C85F7CE;
constexpr uint64_t kMaxKeyBytes = 8 * 1024;
constexpr uint64_t kMaxValueBytes = 8 * 1024 * 1024;
constexpr uint64_t kMaxKeysPerRequest = 128 * 1024;
// One request whole (a MULTI_SET of many values) may not exceed this: the server holds a request
// until its last byte, and a client must not make it hold gigabytes.
constexpr std::size_t kMaxRequestBytes = 128 * 1024 * 1024;
// A worker that stops reading its replies: past this much unsent output it is dropped rather than
// held in memory for ever.
constexpr std::size_t kMaxPendingOutput = 256 * 1024 * 1024;

enum class Command : uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kAppend = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kCancelWait = 12,
  kPing = 13,
  kQueuePush = 14,
  kQueuePop = 15,
  kQueueLen = 16,
  kListKeys = 17,
  kBarrier = 18,
};
constexpr uint8_t kReady = 0;
constexpr uint8_t kNotReady = 1;
constexpr uint8_t kStopWaiting = 0;
constexpr uint8_t kWaitCanceled = 1;

// A request that breaks the protocol or a limit: its client is dropped, the reason logged.
class Refused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Reads the fields of one request from a client's input, starting at `at`. Each read returns false
// when the input ends first (the rest has not arrived yet: read again from the start later) and
// throws Refused for a length over its limit.
class Reader {
 public:
  Reader(const std::string& input, std::size_t at) : input_(input), at_(at) {}

  template <typename T>
  bool value(T* out) {
    if (input_.size() - at_ < sizeof(T)) return false;
    std::memcpy(out, input_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool bytes(std::string* out, uint64_t limit, const char* what) {
    uint64_t length = 0;
    std::size_t start = at_;
    if (!value(&length)) return false;
    if (length > limit) {
      throw Refused(std::string(what) + " of " + std::to_string(length) + " bytes (limit " +
                    std::to_string(limit) + ")");
    }
    if (input_.size() - at_ < length) {
      at_ = start;
      return false;
    }
    out->assign(input_, at_, length);
    at_ += length;
    return true;
  }
  bool key(std::string* out) { return bytes(out, kMaxKeyBytes, "a key"); }
  bool payload(std::string* out) { return bytes(out, kMaxValueBytes, "a value"); }
  bool count(uint64_t* out) {
    if (!value(out)) return false;
    if (*out > kMaxKeysPerRequest) {
      throw Refused(std::to_string(*out) + " keys in one request (limit " +
                    std::to_string(kMaxKeysPerRequest) + ")");
    }
    return true;
  }
  bool keys(std::vector<std::string>* out) {
    uint64_t n = 0;
    if (!count(&n)) return false;
    out->resize(n);
    for (auto& key_text : *out) {
      if (!key(&key_text)) return false;
    }
    return true;
  }
  std::size_t at() const { return at_; }

 private:
  const std::string& input_;
  std::size_t at_;
};

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}
void put_bytes(std::string& out, const std::string& bytes) {
  put<uint64_t>(out, bytes.size());
  out += bytes;
}

std::string describe(const sockaddr_storage& address, socklen_t length) {
  char host[NI_MAXHOST] = "?";
  char port[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, host, sizeof(host), port,
              sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  return std::string(host) + ":" + port;
}

// The counter in `text` ("12"), as ADD and BARRIER read it: empty when it is not an integer.
std::optional<int64_t> counter_of(const std::string& text) {
  int64_t number = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return number;
}

// A listening socket bound to `address`, or -1 with errno set.
int listen_on(const sockaddr* address, socklen_t length, bool dual_stack) {
  int fd = socket(address->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  int on = 1;
  // A TIME_WAIT leftover of the previous run must not keep a restarted launcher off its port.
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  if (dual_stack) {
    int off = 0;
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
  }
  // Every worker of a large job connects at once: take the system's longest backlog.
  if (bind(fd, address, length) != 0 || listen(fd, SOMAXCONN) != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

}  // namespace

struct WorkerStore::Server {
  struct Client {
    int fd = -1;
    std::string peer;
    std::string input;  // received, not yet handled; handled requests end at `consumed`
    std::size_t consumed = 0;
    std::string output;       // replies not yet sent
    bool validated = false;   // its first request was VALIDATE with the magic number
    std::size_t awaited = 0;  // keys its WAIT (or BARRIER) still waits for; 0: not waiting
    bool drop = false;
  };

  int listen_fd = -1;
  int wake_read = -1;
  int wake_write = -1;
  std::function<void(const std::string&)> log;

  uint64_t next_id = 0;
  std::map<uint64_t, Client> clients;
  std::map<std::string, std::string> values;
  // Held by the serving thread while it handles requests, and by contains() from the launcher's.
  mutable std::mutex values_mutex;
  std::map<std::string, std::deque<std::string>> queues;
  // Key -> the clients parked on it, in arrival order (a client once per time it named the key).
  std::map<std::string, std::vector<uint64_t>> waiters;

  ~Server() {
    for (auto& [id, client] : clients) close(client.fd);
    for (int fd : {listen_fd, wake_read, wake_write}) {
      if (fd >= 0) close(fd);
    }
  }

  void debug(const std::string& line) const {
    if (log) log(line);
  }

  // ---- the store ---------------------------------------------------------------------------

  bool exists(const std::string& key) const {
    if (values.count(key)) return true;
    auto queue = queues.find(key);
    return queue != queues.end() && !queue->second.empty();
  }

  void reply(Client& client, const std::string& bytes) {
    client.output += bytes;
    flush(client);
  }

  // `key` now exists: every client parked on it counts down, and those at zero are answered.
  void wake_all(const std::string& key) {
    auto parked = waiters.find(key);
    if (parked == waiters.end()) return;
    std::vector<uint64_t> ids = std::move(parked->second);
    waiters.erase(parked);
    for (uint64_t id : ids) count_down(id);
  }

  // A pushed queue element goes to one waiter only: the first parked on its name.
  void wake_one(const std::string& key) {
    auto parked = waiters.find(key);
    if (parked == waiters.end()) return;
    uint64_t id = parked->second.front();
    parked->second.erase(parked->second.begin());
    if (parked->second.empty()) waiters.erase(parked);
    count_down(id);
  }

  void count_down(uint64_t id) {
    auto found = clients.find(id);
    if (found == clients.end() || found->second.awaited == 0) return;
    if (--found->second.awaited == 0) reply(found->second, std::string(1, char(kStopWaiting)));
  }

  // Parks `id` until every key of `keys` that does not exist yet does; false when none is missing.
  bool park(uint64_t id, const std::vector<std::string>& keys) {
    std::size_t missing = 0;
    for (const auto& key : keys) {
      if (exists(key)) continue;
      waiters[key].push_back(id);
      ++missing;
    }
    clients.at(id).awaited = missing;
    return missing > 0;
  }

  // The client stops waiting (CANCEL_WAIT, or its connection is gone).
  void unpark(uint64_t id) {
    auto found = clients.find(id);
    if (found != clients.end()) found->second.awaited = 0;
    for (auto it = waiters.begin(); it != waiters.end();) {
      std::erase(it->second, id);
      it = it->second.empty() ? waiters.erase(it) : std::next(it);
    }
  }

  void set(const std::string& key, std::string value) {
    values[key] = std::move(value);
    wake_all(key);
  }

  // ---- requests ----------------------------------------------------------------------------

  // Handles the request at the start of the client's unhandled input; false when it has not
  // arrived whole yet. Throws Refused.
  bool handle_one(uint64_t id, Client& client) {
    Reader in(client.input, client.consumed);
    uint8_t command_byte = 0;
    if (!in.value(&command_byte)) return false;
    auto command = static_cast<Command>(command_byte);
    if (!client.validated && command != Command::kValidate) {
      throw Refused("first request is command " + std::to_string(command_byte) +
                    ", not VALIDATE: not a TCPStore client");
    }
    std::string out;
    switch (command) {
      case Command::kValidate: {
        uint32_t magic = 0;
        if (!in.value(&magic)) return false;
        if (magic != kValidationMagic) {
          throw Refused("VALIDATE with magic number " + std::to_string(magic) +
                        ": not a TCPStore client");
        }
        client.validated = true;
        break;
      }
      case Command::kPing: {
        uint32_t nonce = 0;
        if (!in.value(&nonce)) return false;
        put(out, nonce);
        break;
      }
      case Command::kSet:
      case Command::kAppend:
      case Command::kQueuePush: {
        std::string key, value;
        if (!in.key(&key) || !in.payload(&value)) return false;
        if (command == Command::kSet) {
          set(key, std::move(value));
        } else if (command == Command::kAppend) {
          values[key] += value;
          wake_all(key);
        } else {
          queues[key].push_back(std::move(value));
          wake_one(key);
        }
        break;
      }
      case Command::kCompareSet: {
        std::string key, expected, desired;
        if (!in.key(&key) || !in.payload(&expected) || !in.payload(&desired)) return false;
        auto found = values.find(key);
        if (found == values.end()) {
          if (expected.empty()) {
            set(key, desired);
            put_bytes(out, desired);
          } else {
            put_bytes(out, expected);  // PyTorch's servers answer so; the key stays missing
          }
        } else {
          if (found->second == expected) {
            found->second = std::move(desired);
            wake_all(key);  // nobody waits on an existing key, but a BARRIER may
          }
          put_bytes(out, values.at(key));
        }
        break;
      }
      case Command::kGet: {
        std::string key;
        if (!in.key(&key)) return false;
        auto found = values.find(key);
        put_bytes(out, found == values.end() ? std::string() : found->second);
        break;
      }
      case Command::kAdd:
      case Command::kBarrier: {
        std::string key;
        int64_t number = 0;
        if (!in.key(&key) || !in.value(&number)) return false;
        const int64_t delta = command == Command::kAdd ? number : 1;
        int64_t total = delta;
        if (auto found = values.find(key); found != values.end()) {
          auto current = counter_of(found->second);
          if (!current) {
            throw Refused("ADD to key '" + key + "', whose value is not an integer");
          }
          if (__builtin_add_overflow(*current, delta, &total)) {
            throw Refused("ADD to key '" + key + "' overflows int64");
          }
        }
        values[key] = std::to_string(total);
        if (command == Command::kAdd) {
          put(out, total);
          wake_all(key);
        } else if (total >= number) {
          wake_all(key);
          out += char(kStopWaiting);
        } else {
          waiters[key].push_back(id);
          client.awaited = 1;
        }
        break;
      }
      case Command::kCheck: {
        std::vector<std::string> keys;
        if (!in.keys(&keys)) return false;
        bool all = true;
        for (const auto& key : keys) all = all && exists(key);
        out += char(all ? kReady : kNotReady);
        break;
      }
      case Command::kWait: {
        std::vector<std::string> keys;
        if (!in.keys(&keys)) return false;
        if (!park(id, keys)) out += char(kStopWaiting);
        break;
      }
      case Command::kGetNumKeys:
        put<int64_t>(out, static_cast<int64_t>(values.size()));
        break;
      case Command::kDeleteKey: {
        std::string key;
        if (!in.key(&key)) return false;
        put<int64_t>(out, static_cast<int64_t>(values.erase(key)));
        break;
      }
      case Command::kMultiGet: {
        std::vector<std::string> keys;
        if (!in.keys(&keys)) return false;
        for (const auto& key : keys) {
          auto found = values.find(key);
          put_bytes(out, found == values.end() ? std::string() : found->second);
        }
        break;
      }
      case Command::kMultiSet: {
        uint64_t n = 0;
        if (!in.count(&n)) return false;
        std::vector<std::pair<std::string, std::string>> pairs(n);
        for (auto& [key, value] : pairs) {
          if (!in.key(&key) || !in.payload(&value)) return false;
        }
        for (auto& [key, value] : pairs) set(key, std::move(value));
        break;
      }
      case Command::kCancelWait:
        unpark(id);
        out += char(kWaitCanceled);
        break;
      case Command::kQueuePop: {
        std::string key;
        if (!in.key(&key)) return false;
        auto& queue = queues[key];
        put<int64_t>(out, static_cast<int64_t>(queue.size()));
        if (!queue.empty()) {
          put_bytes(out, queue.front());
          queue.pop_front();
        }
        if (queue.empty()) queues.erase(key);
        break;
      }
      case Command::kQueueLen: {
        std::string key;
        if (!in.key(&key)) return false;
        auto found = queues.find(key);
        put<int64_t>(out, found == queues.end() ? 0 : static_cast<int64_t>(found->second.size()));
        break;
      }
      case Command::kListKeys:
        put<int64_t>(out, static_cast<int64_t>(values.size()));
        for (const auto& entry : values) put_bytes(out, entry.first);
        break;
      default:
        throw Refused("unknown command " + std::to_string(command_byte));
    }
    client.consumed = in.at();
    if (!out.empty()) reply(client, out);
    return true;
  }

  // Handles every whole request the client has sent; marks it to drop on a refused one.
  void handle_input(uint64_t id, Client& client) {
    std::lock_guard<std::mutex> lock(values_mutex);
    try {
      while (!client.drop && client.consumed < client.input.size() && handle_one(id, client)) {
      }
    } catch (const Refused& refused) {
      debug("worker store: dropped " + client.peer + ": " + refused.what());
      client.drop = true;
    }
    // Keep only what is unhandled; a long-lived connection must not grow its buffer.
    client.input.erase(0, client.consumed);
    client.consumed = 0;
    if (!client.drop && client.input.size() > kMaxRequestBytes) {
      debug("worker store: dropped " + client.peer + ": a request of more than " +
            std::to_string(kMaxRequestBytes) + " bytes");
      client.drop = true;
    }
  }

  // ---- sockets -----------------------------------------------------------------------------

  // Sends what the socket takes now; the rest waits for POLLOUT.
  void flush(Client& client) {
    while (!client.output.empty() && !client.drop) {
      ssize_t n =
          send(client.fd, client.output.data(), client.output.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        client.output.erase(0, static_cast<std::size_t>(n));
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (client.output.size() > kMaxPendingOutput) {
          debug("worker store: dropped " + client.peer + ": it reads none of its " +
                std::to_string(client.output.size()) + " bytes of replies");
          client.drop = true;
        }
        return;
      } else {
        client.drop = true;  // the worker is gone
      }
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage address{};
      socklen_t length = sizeof(address);
      int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&address), &length,
                       SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) return;  // EAGAIN: none left; anything else: the next poll tells
      int on = 1;
      // Replies are small and awaited: do not hold them back for Nagle's algorithm.
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
      Client client;
      client.fd = fd;
      client.peer = describe(address, length);
      clients.emplace(next_id++, std::move(client));
    }
  }

  // Reads what the socket has, up to 1 MiB (the other clients get their turn); false when the
  // connection is closed or broken.
  bool receive(Client& client) {
    char buffer[64 * 1024];
    for (int reads = 0; reads < 16; ++reads) {
      ssize_t n = recv(client.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n > 0) {
        client.input.append(buffer, static_cast<std::size_t>(n));
        if (static_cast<std::size_t>(n) < sizeof(buffer)) return true;
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return true;
      } else {
        return false;
      }
    }
    return true;
  }

  void serve() {
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    for (;;) {
      fds.clear();
      ids.clear();
      fds.push_back({wake_read, POLLIN, 0});
      fds.push_back({listen_fd, POLLIN, 0});
      for (const auto& [id, client] : clients) {
        short events = POLLIN;
        if (!client.output.empty()) events |= POLLOUT;
        fds.push_back({client.fd, events, 0});
        ids.push_back(id);
      }
      if (poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        debug(std::string("worker store: poll failed: ") + std::strerror(errno) + "; stopped");
        return;
      }
      if (fds[0].revents != 0) return;  // the destructor asks us to stop
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const short events = fds[i + 2].revents;
        if (events == 0) continue;
        auto found = clients.find(ids[i]);
        if (found == clients.end()) continue;
        Client& client = found->second;
        if (events & POLLOUT) flush(client);
        if (events & (POLLIN | POLLHUP | POLLERR)) {
          bool open = receive(client);
          handle_input(ids[i], client);  // what arrived before a close still counts
          if (!open) client.drop = true;
        }
      }
      for (auto it = clients.begin(); it != clients.end();) {
        if (!it->second.drop) {
          ++it;
          continue;
        }
        const uint64_t id = it->first;
        close(it->second.fd);
        it = clients.erase(it);
        unpark(id);
      }
      if (fds[1].revents & POLLIN) accept_all();
    }
  }
};

WorkerStore::WorkerStore(const std::string& host, int port,
                         std::function<void(const std::string&)> log)
    : server_(std::make_unique<Server>()) {
  if (port < 0 || port > 65535) {
    throw UsageError("worker store: port " + std::to_string(port) +
                     ": expected 0 (any free port) or 1..65535");
  }
  server_->log = std::move(log);
  const std::string where = (host.empty() ? "*" : host) + ":" + std::to_string(port);
  int fd = -1;
  int error = 0;
  if (host.empty()) {
    // Every interface: IPv6's wildcard, which also takes IPv4 where the system allows; else IPv4's.
    sockaddr_in6 any6{};
    any6.sin6_family = AF_INET6;
    any6.sin6_addr = in6addr_any;
    any6.sin6_port = htons(static_cast<uint16_t>(port));
    fd = listen_on(reinterpret_cast<sockaddr*>(&any6), sizeof(any6), /*dual_stack=*/true);
    if (fd < 0 && errno != EADDRINUSE) {
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      any4.sin_port = htons(static_cast<uint16_t>(port));
      fd = listen_on(reinterpret_cast<sockaddr*>(&any4), sizeof(any4), false);
    }
    error = errno;
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) {
      throw UsageError("worker store: cannot resolve '" + host +
                       "'; expected an address or host name of this machine");
    }
    // IPv4 first: MASTER_ADDR is most often an IPv4 address or a name the workers resolve to one.
    for (int family : {AF_INET, AF_INET6}) {
      for (const addrinfo* entry = found; entry && fd < 0; entry = entry->ai_next) {
        if (entry->ai_family != family) continue;
        fd = listen_on(entry->ai_addr, entry->ai_addrlen, false);
        error = errno;
      }
    }
    freeaddrinfo(found);
  }
  if (fd < 0) {
    if (error == EADDRINUSE) {
      throw UsageError("worker store: cannot listen on " + where +
                       ": the port is taken; pick another (port 0 picks a free one)");
    }
    if (error == EADDRNOTAVAIL) {
      throw UsageError("worker store: cannot listen on " + where + ": '" + host +
                       "' is not an address of this machine");
    }
    throw InternalError("worker store: cannot listen on " + where + ": " + std::strerror(error));
  }
  server_->listen_fd = fd;
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw InternalError(std::string("worker store: cannot make its wake-up pipe: ") +
                        std::strerror(errno));
  }
  server_->wake_read = pipe_fds[0];
  server_->wake_write = pipe_fds[1];
  thread_ = std::thread([server = server_.get()] {
    try {
      server->serve();
    } catch (const std::exception& e) {  // std::bad_alloc: stop serving rather than terminate
      server->debug(std::string("worker store: stopped: ") + e.what());
    }
  });
}

bool WorkerStore::contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(server_->values_mutex);
  return server_->exists(key);
}

std::optional<std::string> WorkerStore::value_of(const std::string& key) const {
  std::lock_guard<std::mutex> lock(server_->values_mutex);
  auto found = server_->values.find(key);
  if (found == server_->values.end()) return std::nullopt;
  return found->second;
}

WorkerStore::~WorkerStore() {
  if (server_ && server_->wake_write >= 0) {
    ssize_t ignored = write(server_->wake_write, "x", 1);
    (void)ignored;
  }
  if (thread_.joinable()) {
    try {
      thread_.join();
    } catch (...) {  // join() of a joinable thread other than this one does not throw
    }
  }
}

namespace {

// One deadline for the whole exchange: poll()'s timeout in milliseconds, at least 0.
int ms_left(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

// Connects a non-blocking socket to one address before the deadline; -1 with *why set otherwise.
// *refused: the host answered that nothing listens on the port.
int connect_before(const addrinfo& address, std::chrono::steady_clock::time_point deadline,
                   std::string* why, bool* refused) {
  int fd = socket(address.ai_family, address.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                  address.ai_protocol);
  if (fd < 0) {
    *why = std::string("no socket: ") + std::strerror(errno);
    return -1;
  }
  if (connect(fd, address.ai_addr, address.ai_addrlen) != 0 && errno != EINPROGRESS) {
    *refused = errno == ECONNREFUSED;
    *why = std::strerror(errno);
    close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  int error = 0;
  socklen_t length = sizeof(error);
  if (poll(&p, 1, ms_left(deadline)) <= 0) {
    *why = "no connection";
  } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != 0) {
    *refused = error == ECONNREFUSED;
    *why = std::strerror(error != 0 ? error : errno);
  } else {
    return fd;
  }
  close(fd);
  return -1;
}

// One client's requests to the workers' store at host:port: VALIDATE, then `request`, then reads
// `reply_size` bytes of answer into *reply, within `timeout` all told. Returns "" when it has them,
// else why not; *refused (when given) then says whether nothing listens there (the connection was
// refused, or closed before the answer). One connection per call: these are rare (a worker's
// exit), and a connection kept open would outlive the store it was made for.
std::string exchange_with_worker_store(const std::string& host, int port,
                                       const std::string& request, std::size_t reply_size,
                                       std::string* reply, std::chrono::milliseconds timeout,
                                       bool* refused = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string seconds = detail::seconds_text(timeout);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) {
    return "cannot resolve '" + host + "'";
  }
  std::string why;
  int fd = -1;
  bool every_address_refused = true;
  for (const addrinfo* entry = found; entry && fd < 0; entry = entry->ai_next) {
    bool address_refused = false;
    fd = connect_before(*entry, deadline, &why, &address_refused);
    every_address_refused = every_address_refused && address_refused;
  }
  freeaddrinfo(found);
  if (fd < 0) {
    if (refused != nullptr) *refused = every_address_refused;
    return why == "no connection" ? "no connection within " + seconds : why;
  }

  std::string sent;
  put<uint8_t>(sent, static_cast<uint8_t>(Command::kValidate));
  put<uint32_t>(sent, kValidationMagic);
  sent += request;
  std::string_view rest = sent;
  while (!rest.empty() && why.empty()) {
    ssize_t n = send(fd, rest.data(), rest.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      rest.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, ms_left(deadline)) <= 0) why = "no answer within " + seconds;
    } else {
      why = std::strerror(errno);
    }
  }
  reply->clear();
  while (reply->size() < reply_size && why.empty()) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, ms_left(deadline)) <= 0) {
      why = "no answer within " + seconds;
      break;
    }
    char buffer[64];
    ssize_t n =
        recv(fd, buffer, std::min(sizeof(buffer), reply_size - reply->size()), MSG_DONTWAIT);
    if (n > 0) {
      reply->append(buffer, static_cast<std::size_t>(n));
    } else if (n == 0 || errno == ECONNRESET) {
      // Gone between our connect and its answer (a launcher dropping the last round's store):
      // for the caller, as a refused connection.
      why = n == 0 ? "the store closed the connection" : std::strerror(errno);
      if (refused != nullptr) *refused = true;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      why = std::strerror(errno);
    }
  }
  close(fd);
  return why;
}

}  // namespace

KeyCheck check_in_worker_store(const std::string& host, int port, const std::string& key,
                               std::chrono::milliseconds timeout, std::string* why) {
  return set_and_check_in_worker_store(host, port, {}, key, timeout, why);
}

KeyCheck set_and_check_in_worker_store(
    const std::string& host, int port,
    const std::vector<std::pair<std::string, std::string>>& entries, const std::string& key,
    std::chrono::milliseconds timeout, std::string* why) {
  std::string request;
  for (const auto& [set_key, value] : entries) {
    put<uint8_t>(request, static_cast<uint8_t>(Command::kSet));
    put_bytes(request, set_key);
    put_bytes(request, value);
  }
  put<uint8_t>(request, static_cast<uint8_t>(Command::kCheck));
  put<uint64_t>(request, 1);
  put_bytes(request, key);
  std::string answer;
  bool refused = false;
  std::string failed =
      exchange_with_worker_store(host, port, request, 1, &answer, timeout, &refused);
  if (failed.empty() && answer[0] != 0 && answer[0] != 1) {
    failed = "a wrong answer to CHECK (not a TCPStore?)";
  }
  if (!failed.empty()) {
    if (why != nullptr) *why = failed;
    return refused ? KeyCheck::kNoStore : KeyCheck::kNoAnswer;
  }
  return answer[0] == 0 ? KeyCheck::kPresent : KeyCheck::kAbsent;  // 0: READY, the key exists
}

}  // namespace dtrain::elastic
