// RendezvousBackend: where the agents of an elastic job keep their one shared rendezvous state.
//
// The rendezvous algorithm (rendezvous.h) is written once against this interface; each backend only
// stores an opaque blob with a version and replaces it atomically. That is PyTorch's own split
// (torch.distributed.elastic.rendezvous.dynamic_rendezvous over a RendezvousStateBackend), and it
// keeps the backends small: the c10d-style backend is a compare-and-set on the store an agent hosts
// at the endpoint, the etcd backend a transaction that compares the key's mod_revision.
//
// Contract: every call blocks on the network at most `timeout` (given at construction) and then
// throws dtrain::TimeoutError naming the endpoint; a store that refuses the connection throws
// dtrain::CommError naming the endpoint and the cause. Safe to call from one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "launcher/elastic/ports.h"

namespace dtrain::elastic {

struct VersionedState {
  std::string state;     // the bytes last stored (the rendezvous serialises its state here)
  uint64_t version = 0;  // changes on every successful set; never 0 for a stored state
};

class RendezvousBackend {
 public:
  virtual ~RendezvousBackend() = default;

  // "c10d" or "etcd": for messages.
  virtual std::string name() const = 0;

  // Bounds the calls after this one by `timeout` instead of the one given at construction (the
  // agent shortens it mid-job: Note [A store that stops answering] in
  // src/launcher/cli/elastic_rendezvous.cpp). A backend whose calls never block ignores it.
  virtual void set_timeout(std::chrono::milliseconds timeout) { (void)timeout; }

  // Whether the store's machine still takes a TCP connection (with several, as etcd's members,
  // the best answer of any), waiting at most `timeout`: asked when the store has stopped
  // answering, to tell a store that is only slow from one that is gone or cut off (Note [A store
  // that stops answering] in src/launcher/cli/elastic_rendezvous.cpp). A backend that cannot tell
  // says kAccepted, and its store is waited for as long as a call may take.
  virtual Knock knock(std::chrono::milliseconds timeout) {
    (void)timeout;
    return Knock::kAccepted;
  }

  // The state now stored, or nullopt when none was ever set for this job.
  virtual std::optional<VersionedState> get_state() = 0;

  // Stores `state` if the stored version is still `expected_version` (nullopt: only if nothing is
  // stored yet). Returns what is stored afterwards and whether this call's write is the one stored:
  // on a lost race the caller merges its change into the returned state and tries again.
  struct SetResult {
    VersionedState current;
    bool written = false;
  };
  virtual SetResult set_state(const std::string& state,
                              std::optional<uint64_t> expected_version) = 0;
};

}  // namespace dtrain::elastic
