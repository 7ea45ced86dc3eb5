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

#include <cstdint>
#include <optional>
#include <string>

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
