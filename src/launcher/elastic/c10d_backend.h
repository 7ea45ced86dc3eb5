// The c10d rendezvous backend: a small TCP key/value store that one agent of the job hosts at
// --rdzv-endpoint, and a RendezvousBackend client that every agent (the host included) talks to it
// through. The name follows torchrun's `--rdzv-backend c10d`, whose store is also hosted by the
// agent that can bind the endpoint; the store itself is not PyTorch's TCPStore (the launcher does
// not link LibTorch, and TCPStore has no authentication).
//
// Protocol, length-prefixed frames ([u32 big-endian length][payload]) over one TCP connection:
//   server hello (unframed, 38 bytes): "DTRS", version 1, token_required (0/1), server_nonce[32]
//   client hello: 'H', client_nonce[32], client_mac[32]
//   server reply: status (0 welcome, 1 wrong token, 2 token required), server_mac[32]
//   then requests  'G' key                               -> get
//                  'S' key has_expected expected value   -> compare-and-set
//   answered by    written has_state version value
// client_mac = HMAC-SHA256(token, "dtrain-rdzv-client" | server_nonce | client_nonce) and
// server_mac the same over "dtrain-rdzv-server" | client_nonce | server_nonce: each side proves it
// knows the token without sending it, and a recorded exchange cannot be replayed (fresh nonces).
// Without a token the macs are zeros and the store is open, as torchrun's is.
//
// Security: the server listens on the endpoint's address only (never on every interface), compares
// macs in constant time, refuses and logs (with the peer's address) anyone without the token, gives
// an unauthenticated peer 5 s and 1 KiB for its hello, and never reads a request before the hello.
// What it does not do: encrypt, or authenticate each message after the hello. The token keeps
// strangers out; it does not protect against an attacker on the network path who can hijack a TCP
// connection (run jobs on a private network, or use etcd with TLS).
//
// Limit: the store lives in the hosting agent's process. If that agent dies, the job cannot
// continue (torchrun's c10d backend has the same single point of failure); the etcd backend has
// none.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/errors.h"
#include "launcher/elastic/rendezvous_backend.h"

namespace dtrain::elastic {

// The peer at the endpoint accepted the connection but is not a dtrain rendezvous store: its first
// bytes are not the store's greeting, or it sent none within the greeting timeout (5 s; a store
// greets at once, an HTTP server waits for a request). Most likely another program holds the port.
// Unlike a refused connection (the store's host may start later), waiting cannot help.
class NotAStoreError : public CommError {
 public:
  using CommError::CommError;
};

// The endpoint's host name does not resolve: not yet, maybe (a scheduler registers the name of the
// store's node once that node runs, after the others may have started). A CommError, not a
// UsageError: the flags may well be right, so the agent retries until its join timeout and then
// exits 1, which a scheduler retries; mid-job it is one more store call that failed.
class UnresolvedHostError : public CommError {
 public:
  using CommError::CommError;
};

// A client call given up because its interrupt fd became readable (a signal for the launcher:
// C10dBackend::set_interrupt_fd).
class InterruptedError : public CommError {
 public:
  using CommError::CommError;
};

// Serves the store on a thread of its own until destroyed.
class C10dStoreServer {
 public:
  // Binds host:port (host resolved to one address of this machine) and starts serving, or returns
  // nullptr when this process cannot host it: the port is taken (another agent hosts it) or the
  // address is not this machine's. `log` receives one line per refused peer. An empty token means
  // an open store. Throws UnresolvedHostError when `host` does not resolve (yet).
  static std::unique_ptr<C10dStoreServer> try_host(const std::string& host, int port,
                                                   std::string token,
                                                   std::function<void(const std::string&)> log);
  ~C10dStoreServer();
  C10dStoreServer(const C10dStoreServer&) = delete;
  C10dStoreServer& operator=(const C10dStoreServer&) = delete;

  // "127.0.0.1:29400": where it listens.
  const std::string& address() const { return address_; }

 private:
  C10dStoreServer() = default;
  void serve();

  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string address_;
  std::thread thread_;
};

// A client of the store at host:port for one job (the job id is the key of its state).
class C10dBackend : public RendezvousBackend {
 public:
  // Connects lazily, on the first call. `timeout` bounds every call (connect, hello, request); the
  // store's greeting must also come within 5 s of the connection (else NotAStoreError). A peer that
  // speaks anything else throws NotAStoreError at its first byte that is not the store's.
  C10dBackend(std::string host, int port, std::string job_id, std::string token,
              std::chrono::milliseconds timeout);
  ~C10dBackend() override;

  std::string name() const override { return "c10d"; }
  // From the next call on, a call also gives up, throwing InterruptedError, as soon as `fd` is
  // readable (-1: never): the agent's join at start, where a signal must not wait out a store that
  // is silent or not up yet. Only while no other thread uses the backend (the heartbeats must not
  // fail on a signal the agent is about to handle).
  void set_interrupt_fd(int fd) { interrupt_fd_ = fd; }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  Knock knock(std::chrono::milliseconds timeout) override;
  std::optional<VersionedState> get_state() override;
  SetResult set_state(const std::string& state, std::optional<uint64_t> expected_version) override;

  // The local address of the connection to the store: an address of this machine that the other
  // nodes can reach (they reach the store through the same network). Connects if needed.
  std::string local_address();

 private:
  // One request/response; reconnects once when the connection broke since the last call.
  std::string call(const std::string& request);
  void connect_and_authenticate(std::chrono::steady_clock::time_point deadline);
  void disconnect();
  // "host:port", "[v6]:port".
  std::string endpoint_text() const;

  std::string host_;
  int port_;
  std::string job_id_;
  std::string token_;
  std::chrono::milliseconds timeout_;
  // host_:port_'s addresses, resolved at construction: a knock must not wait on a resolver that
  // the same cut may have put out of reach.
  std::vector<SocketAddress> addresses_;
  int fd_ = -1;
  int interrupt_fd_ = -1;
};

// HMAC-SHA256 of `message` under `key` (32 bytes), exposed for tests.
std::string hmac_sha256(const std::string& key, const std::string& message);

}  // namespace dtrain::elastic
