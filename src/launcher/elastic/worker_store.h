// The store the workers of a job meet through (MASTER_ADDR:MASTER_PORT), hosted by the launcher
// rather than by rank 0, so that it outlives any worker (issue 21): when rank 0 dies, the others
// keep their store and can re-form the group in place. torchrun does the same: its agent hosts the
// store and tells the workers so with TORCHELASTIC_USE_AGENT_STORE=True, under which every worker
// (PyTorch's env:// and tcp:// init, and dtrain's) connects to it as a client.
//
// The launcher does not link LibTorch (it must start fast), so this is a server of its own that
// speaks c10d's TCPStore wire protocol, as LibTorch's c10d::TCPStore client speaks it: see
// Note [TCPStore wire protocol] in worker_store.cpp. Like TCPStore it is open: no authentication,
// no encryption; bind it to an address only the job's machines reach.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain::elastic {

class WorkerStore {
 public:
  // Binds host:port and serves every client on one thread of its own until destroyed. `host` is an
  // address or name of this machine, or "" for every interface (IPv6 and IPv4 where the machine
  // has both); port 0 lets the kernel pick a free port (read it with port()). `log`, when set,
  // receives one line for each client dropped for breaking the protocol or its limits (a debug
  // line: a worker that merely exits is not logged). Throws dtrain::UsageError when `host` does
  // not resolve, is not this machine's, or the port is taken; dtrain::InternalError when no socket
  // can be made at all.
  WorkerStore(const std::string& host, int port,
              std::function<void(const std::string&)> log = nullptr);

  // Stops serving: closes every connection (a worker still waiting sees its connection close) and
  // joins the thread. Never throws.
  ~WorkerStore();

  WorkerStore(const WorkerStore&) = delete;
  WorkerStore& operator=(const WorkerStore&) = delete;

  // The port it listens on: what to hand the workers as MASTER_PORT.
  int port() const { return port_; }

  // Whether a key is set, as the workers would see it now (thread-safe). The launcher reads what
  // the workers declare through it, e.g. that they recover in place (in_place_recovery.cpp).
  bool contains(const std::string& key) const;

  // The value of a key, as the workers would read it now, or nothing when it is not set
  // (thread-safe). `dtrain scale` on several hosts reads the records the other nodes send through
  // it (scale_nodes.h).
  std::optional<std::string> value_of(const std::string& key) const;

 private:
  struct Server;
  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::thread thread_;
};

// A client's CHECK of one key in the workers' store at host:port, within `timeout`, as c10d's
// TCPStore client sends it (VALIDATE, CHECK). A launcher on another node than the store's reads
// through it what node 0's reads with contains(). kNoStore: the host refused the connection, or
// the store closed it before it answered (nothing listens there: the store is not up yet, or gone);
// kNoAnswer: no answer in time (a host lost, a link cut) or not a TCPStore's; for both, *why (when
// given) says what happened. Never throws.
enum class KeyCheck { kPresent, kAbsent, kNoStore, kNoAnswer };
KeyCheck check_in_worker_store(const std::string& host, int port, const std::string& key,
                               std::chrono::milliseconds timeout, std::string* why = nullptr);

// Both in one exchange, within `timeout` all told: a SET of each of `entries` (key, value), then
// the CHECK of `check_key`, whose answer also says that the SETs were served (SET has no reply,
// and the store serves a connection's requests in order). Each launcher of a `--recovery
// in-place` job writes through it what the workers read from it (a worker's exit,
// in_place_recovery.cpp) and asks at once whether to restart it alone: on a cut link one timeout,
// not two.
KeyCheck set_and_check_in_worker_store(
    const std::string& host, int port,
    const std::vector<std::pair<std::string, std::string>>& entries, const std::string& check_key,
    std::chrono::milliseconds timeout, std::string* why = nullptr);

}  // namespace dtrain::elastic
