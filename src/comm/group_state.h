// What a process group and its operations in flight hold, shared by the files of src/comm/:
//   connect.cpp         the store, the start-up meeting, the backends (Gloo, NCCL, shared memory);
//   work.cpp            operations in flight, one class per transport, and the errors they raise;
//   process_group.cpp   the collectives and point to point, group creation;
//   shared_buckets.cpp  DDP's gradient buckets in shared memory.
// ProcessGroup and Work (dtrain/comm.h) are the public faces of GroupState and WorkState.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "comm/progress.h"
#include "common/format.h"
#include "dtrain/comm.h"

namespace dtrain::detail {

class ShmTransport;
class ShmPointToPoint;
struct ShmMessage;

// Note [A number riding on the gradients]
// One number that DDP's gradient all-reduce carries for the group's owner, so that the ranks agree
// on it at no collective of its own: in-place recovery's admission check (src/recovery), which
// would otherwise cost an all-reduce at its step boundaries. A DDP built on a group that has one
// (GroupState::riding_number) reserves one element after the gradients of the bucket it launches
// last, when that bucket holds float or double gradients and no comm hook replaces the all-reduce
// (a hook owns the bucket's contents; a half-precision number is exact only up to 256). Each rank
// writes its contribution there as the bucket starts; once the backward's all-reduces are waited
// for, the sum over the ranks is read back and `carried` counts one more. Every rank carries it in
// the same backwards, so an owner that compares `carried` with what it last read takes the same
// branch on every rank. Where nothing carries it, `carried` stays 0 and the owner agrees by a
// collective of its own.
struct RidingNumber {
  std::atomic<double> contribution{0};  // this rank's part in the next synchronised backward
  std::atomic<double> sum{0};           // the sum over the ranks in the last one that carried it
  std::atomic<int64_t> carried{0};      // synchronised backwards that carried it
};

struct GroupState {
  std::string name;
  int rank = 0;
  int size = 1;
  std::vector<int> global_ranks;  // group rank -> job rank, for messages
  int world_size = 1;             // the job's size, for the "rank R/N" prefix
  std::string master_addr;        // picks Gloo's network interface: the one that routes there
  std::chrono::milliseconds timeout{kDefaultTimeout};
  c10::intrusive_ptr<c10d::Store> root_store;  // unprefixed; sub-groups prefix it again
  c10::intrusive_ptr<c10d::Store> store;       // this group's keys
  // Set by the group's owner before it builds a DDP on the group; null: DDP carries nothing.
  // (Above the CUDA members: tests, built without DTRAIN_WITH_CUDA, set it too.)
  std::shared_ptr<RidingNumber> riding_number;
  c10::intrusive_ptr<c10d::Backend> gloo;
#ifdef DTRAIN_WITH_CUDA
  std::once_flag nccl_once;
  c10::intrusive_ptr<c10d::Backend> nccl;
  bool nccl_aborted = false;  // abort_nccl() ran: the destructor lets it go, undestroyed
#endif
  std::unique_ptr<ProgressTracker> progress;
  bool shared_memory_allowed = true;  // InitOptions::shared_memory and DTRAIN_SHM
  bool cuda_through_gloo = false;     // DTRAIN_CUDA_BACKEND=gloo: CUDA tensors take Gloo
  std::unique_ptr<ShmTransport> shm;  // all members on one host: collectives in shared memory
  std::unique_ptr<ShmPointToPoint> shm_p2p;  // ...and isend/irecv of CPU tensors
  int subgroups_created = 0;
  int shared_buckets_created = 0;  // names each DDP's segment alike on every rank
  // CommStats: updated from the caller's thread (starts) and whichever thread waits (busy time).
  std::atomic<uint64_t> stat_ops{0};
  std::atomic<uint64_t> stat_bytes{0};
  std::atomic<int64_t> stat_busy_ns{0};  // operations not on the shared-memory transport's thread
  // Asked by a wait on a collective of this group (Gloo's, NCCL's or the shared-memory
  // transport's) every kAbandonSlice while the collective is not done (point to point is waited in
  // one call: see wait_for()): a non-empty answer abandons the wait
  // with PeerLostError giving it as the cause (the operation is left to run, and the group is never
  // used again). In-place recovery sets it to its heartbeats' verdict (src/recovery/membership.h),
  // so that a lost host or a cut link, which resets no connection, ends the wait in seconds instead
  // of at the timeout. The meeting that creates the group (connect_group) asks it too, between its
  // looks at the store: a member that died before it came. Unset (the default), a wait is one call.
  // Set before the group's first operation; called on the waiting thread: it must be cheap and
  // never block.
  // `since`: when the operation being waited for was issued (for the meeting: when it began).
  std::function<std::string(std::chrono::steady_clock::time_point since)> abandon_check;
  // A collective that fails without the transport naming a dead peer first waits three of the
  // peers' progress posts (0.3 s, ProgressTracker::describe_missing) so that its message can say
  // who never arrived. In-place recovery turns it off for its generations: it re-forms the group at
  // once, and its own line says what failed.
  bool wait_for_peer_posts = true;
  // The first failure; later calls fail fast with it instead of hanging on a broken transport.
  std::mutex failure_mutex;
  std::string failure;

  GroupState();
  ~GroupState();

  std::string who() const;          // "rank R/N", the job's numbers
  std::string group_label() const;  // "group 'NAME'"
  // Records the group's first failure (later ones keep it).
  void record_failure(const std::string& message);
  // Throws CommError if an earlier operation failed: the transport may be half-broken.
  void check_usable();
  // Aborts NCCL's communicator, if the group has one (in-place recovery, after a failure: its
  // kernels may wait on the device for a peer that is gone). The group is not used again.
  void abort_nccl();
};

// How a transport's operation ended badly, sorted once where the transport's own error is caught,
// so that the message built from it never guesses from the text.
struct TransportFailure {
  enum class Kind {
    kTimeout,    // the deadline passed first
    kPeerLost,   // a peer's connection failed or closed before the deadline
    kMismatch,   // the ranks passed tensors that do not match (a usage error)
    kDestroyed,  // the group went away while the operation was queued (a usage error)
    kAbandoned,  // GroupState::abandon_check said to stop waiting (cause: its answer)
  };
  Kind kind;
  std::string cause;   // the transport's own words
  int late_rank = -1;  // group rank the transport saw missing, when it knows
};

// What a transport hands back for an operation it started: Gloo and NCCL's c10d::Work, a queued
// shared-memory collective, a shared-memory message. See work.cpp.
class InFlight {
 public:
  // How often a wait asks GroupState::abandon_check, when set.
  static constexpr std::chrono::milliseconds kAbandonSlice{100};

  virtual ~InFlight() = default;
  // Blocks until the operation finished or `timeout` passed (counted from this call, as c10d's wait
  // counts), or `abandon` (GroupState::abandon_check; may be empty) answered. Throws
  // TransportFailure; `started` (when the operation was issued) tells a timeout from an early
  // failure. The shared-memory transport's point to point ignores `abandon` (its peers are on this
  // host, where a dead one is seen by its pid at once); its collectives ask it too, for a peer that
  // hangs or gave up on the group, which no pid tells.
  virtual void wait(std::chrono::steady_clock::time_point started,
                    std::chrono::milliseconds timeout,
                    const std::function<std::string()>& abandon) = 0;
  // Non-blocking: finished, successfully or not.
  virtual bool finished() const = 0;
  // The shared-memory transport times its own operations for CommStats (busy time on its thread).
  virtual bool timed_by_transport() const { return false; }
};

// `nccl`: the work is NCCL's, whose wait(t) cannot be cut into slices (see work.cpp); a wait that
// asks `abandon` polls it instead.
std::unique_ptr<InFlight> c10d_in_flight(c10::intrusive_ptr<c10d::Work> work, bool nccl = false);
std::unique_ptr<InFlight> shm_collective_in_flight(std::shared_future<void> done);
std::unique_ptr<InFlight> shm_message_in_flight(ShmPointToPoint& transport,
                                                std::shared_ptr<ShmMessage> message);

// One operation of a group, from its start to the end of its wait.
struct WorkState {
  std::shared_ptr<GroupState> group;  // kept alive: a Work may outlive its ProcessGroup
  std::chrono::steady_clock::time_point started;
  std::unique_ptr<InFlight> in_flight;
  const char* op = "";
  uint64_t seq = 0;  // collective sequence number; 0 for point to point
  int peer = -1;     // point to point: the other group rank
  int tag = 0;       // point to point: the message's tag
  std::chrono::milliseconds timeout{0};
  std::function<void()> finish;  // runs after a successful wait (e.g. divide for an average)
  bool done = false;
};

// Starts an operation: checks the group is usable, counts it, numbers it (collectives), logs it
// under DTRAIN_DEBUG=detail, and runs `launch`, which must set work.in_flight. A transport error at
// launch becomes dtrain's error as in wait_for().
std::shared_ptr<WorkState> start_work(const std::shared_ptr<GroupState>& group, const char* op,
                                      bool collective, int peer, const CollectiveOptions& options,
                                      uint64_t bytes,
                                      const std::function<void(WorkState&)>& launch);
// Blocks until the operation is done (then runs its finish step once), or throws dtrain's error for
// it: TimeoutError when its deadline passed, naming the ranks that never arrived; PeerLostError
// with the transport's own words and when it happened; UsageError for mismatched tensors.
void wait_for(WorkState& work);

// The private parts of ProcessGroup and Work, for the files of src/comm/ only (dtrain/comm.h
// befriends this one struct).
struct GroupInternals {
  static const std::shared_ptr<GroupState>& state(const ProcessGroup& group) {
    return group.state_;
  }
  static Work work(std::shared_ptr<WorkState> state) { return Work(std::move(state)); }
  static std::shared_ptr<ProcessGroup> group(std::shared_ptr<GroupState> state) {
    return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(state)));
  }
};

}  // namespace dtrain::detail
