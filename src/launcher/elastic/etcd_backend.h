// EtcdBackend: the rendezvous state kept in an etcd server (`--rdzv-backend etcd`), so that no
// single agent hosts it and the loss of any agent leaves the job's rendezvous intact.
//
// The state is one key, <key_prefix><run id>/state (by default /dtrain/rdzv/<run id>/state),
// read and replaced through etcd's v3 JSON gateway over HTTP (libcurl):
//   get_state()  POST /v3/kv/range
//   set_state()  POST /v3/kv/txn, writing only if the key's mod_revision is still the version the
//                caller read (for a first write: only if the key was never created).
// The version handed out is the key's mod_revision: etcd's store-wide revision of the last write,
// never 0 for a stored key and different after every write. The /v3 gateway path needs etcd 3.4
// or newer (Debian 12 ships 3.4.23; etcd 3.3 only had /v3beta).
//
// The endpoints may name every member of an etcd cluster ("A:2379,B:2379,C:2379", as torchrun's
// etcd backend takes them): a call that one member does not answer goes to the next, within the
// same timeout, and later calls stay with the member that answered (Note [Failing over between
// etcd members] in etcd_backend.cpp). So the job goes on while a majority of the cluster lives.
//
// Errors (the contract of rendezvous_backend.h): every HTTP call is bounded by `timeout`,
// connecting included, and then throws dtrain::TimeoutError naming the endpoint; a refused
// connection, an HTTP error or an error etcd reports throws dtrain::CommError naming the
// endpoint and, where etcd gave one, etcd's message. With several members, a call that no member
// answered names each and what it did. A malformed endpoint (list) or an empty run id throws
// dtrain::UsageError at construction.
//
// A set_state() that timed out may still be applied later (the request can already be in etcd's
// hands): read the state again before deciding what to write next, as after a lost race.
//
// Plain HTTP only: no TLS, no etcd user authentication (etcd's error says so if it needs them).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "launcher/elastic/rendezvous_backend.h"

namespace dtrain::elastic {

class EtcdBackend : public RendezvousBackend {
 public:
  // etcd's registered client port, used when the endpoint names only a host (as torchrun does).
  static constexpr int kDefaultPort = 2379;
  // Where the state lives unless told otherwise; the run id and "/state" follow.
  static constexpr const char* kDefaultKeyPrefix = "/dtrain/rdzv/";

  // endpoints: one endpoint or several separated by commas (the members of one etcd cluster),
  // each "HOST:PORT", "HOST" (port 2379) or "[IPv6]:PORT", optionally prefixed with "http://".
  // run_id: the job's --rdzv-id; jobs with different ids never see each other's state.
  // timeout: the bound on each call below (connecting, sending and receiving together).
  // Does not touch the network; call check_reachable() for an early, clear error.
  EtcdBackend(const std::string& endpoints, const std::string& run_id,
              std::chrono::milliseconds timeout, std::string key_prefix = kDefaultKeyPrefix);
  ~EtcdBackend() override;
  EtcdBackend(const EtcdBackend&) = delete;
  EtcdBackend& operator=(const EtcdBackend&) = delete;

  std::string name() const override { return "etcd"; }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  Knock knock(std::chrono::milliseconds timeout) override;
  std::optional<VersionedState> get_state() override;
  SetResult set_state(const std::string& state, std::optional<uint64_t> expected_version) override;

  // Checks, once, at start-up, that an etcd 3.4+ answers at the endpoint (with several: at one of
  // them) and serves the v3 gateway: `GET /version`, then a range read of the state key. Blocks at
  // most 2 x timeout. Throws
  // TimeoutError or CommError with a one-line message saying what to do ("is etcd running there?
  // ..."); a launcher prints it and exits 2 before starting any worker.
  void check_reachable();

  // Every `revisions` etcd revisions, the agent whose write lands on the mark compacts etcd's
  // history older than `revisions` (Note [Compacting etcd's history] in etcd_backend.cpp): without
  // it, heartbeats would fill an etcd that does not compact itself. 0 turns it off (for an etcd
  // whose operator compacts it); tests set a small interval.
  static constexpr uint64_t kDefaultCompactionInterval = 1000;
  void set_compaction_interval(uint64_t revisions) { compaction_interval_ = revisions; }

  // Opt-in: every write attaches the state to an etcd lease of `ttl`, so that a state nobody writes
  // any more (the job ended or all its agents died) disappears between ttl/2 and ttl after the last
  // write, and a later job may reuse the run id. It must exceed the longest pause between writes
  // of a live job (the agents' heartbeat interval, with a wide margin). 0 (the default): the state
  // stays until deleted. etcd raises a TTL under its minimum (about 2 s) to that minimum.
  void set_state_ttl(std::chrono::seconds ttl) { state_ttl_ = ttl; }

  // "HOST:PORT" as the messages name it; with several members "HOST:PORT,HOST:PORT,...".
  const std::string& endpoint() const { return endpoint_; }
  // The member the next call goes to first: the one that answered last ("HOST:PORT").
  const std::string& current_member() const { return members_[current_].endpoint; }
  // The etcd key holding this job's state.
  const std::string& key() const { return key_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Http;  // the libcurl handle, reused between calls for a kept-alive connection
  struct Member {
    std::string endpoint;  // HOST:PORT
    std::string base_url;  // http://HOST:PORT
    std::string host;      // HOST without an IPv6 address's brackets
    int port = 0;
    // Its addresses, resolved at construction, for knock(): a resolver may be out of reach then.
    std::vector<SocketAddress> addresses;
  };

  // One HTTP request (POST with a body, GET without), given until `deadline`, to the members in
  // turn from the current one. `operation` names the call in messages ("read the rendezvous
  // state"). Returns the response body of an HTTP 200; throws as described above for anything
  // else.
  std::string request(const std::string& path, const std::string* post_body,
                      const std::string& operation, Clock::time_point deadline);
  // The same request to one member. Sets *unanswered before throwing when the member did not
  // answer (no connection, none kept, no reply in time, or an HTTP 5xx: etcd without a leader), so
  // that another member may.
  std::string request_to(const Member& member, const std::string& path,
                         const std::string* post_body, const std::string& operation,
                         Clock::time_point deadline, bool* unanswered);
  // "etcd at HOST:PORT" of the member that answered last, for messages about its reply.
  std::string at() const { return "etcd at " + current_member(); }

  void maybe_compact(uint64_t written_revision, Clock::time_point deadline);
  // The lease to attach the next write to (0: none), granting a new one when the current one is
  // older than half the TTL, so that a write always leaves the state at least ttl/2 to live.
  int64_t lease_for_write(Clock::time_point deadline);

  std::string endpoint_;  // every member's HOST:PORT, separated by commas
  std::vector<Member> members_;
  size_t current_ = 0;  // the member tried first: the one that answered last
  std::string key_;
  std::chrono::milliseconds timeout_;
  uint64_t compaction_interval_ = kDefaultCompactionInterval;
  std::chrono::seconds state_ttl_{0};
  int64_t lease_id_ = 0;
  Clock::time_point lease_granted_;
  std::unique_ptr<Http> http_;
};

}  // namespace dtrain::elastic
