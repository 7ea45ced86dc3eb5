// Point-to-point messages (isend/irecv) through shared memory among the ranks of a group that all
// run on one host.
//
// Note [Shared-memory point to point]
// Gloo moves a send through TCP loopback: about 1 ms per message here, which would dominate a
// pipeline with many micro-batches. Ranks on one host instead share one segment per group holding,
// for every directed pair sender -> receiver, a ring buffer of kDefaultRingBytes. The segment is
// sized for every pair but only its control records are reserved in /dev/shm up front; a pair's
// ring is reserved (posix_fallocate) by its sender on the first message, so a 64-rank group whose
// ranks talk to two neighbours each uses 2 rings per rank, not 63.
//
// A message in a ring is a 32-byte header (tag, dtype, bytes) followed by the payload, padded to 32
// bytes so that headers never wrap. The sender owns `head` (bytes written), the receiver `tail`
// (bytes consumed); both only grow. Payloads larger than the free space stream through the ring:
// the sender writes what fits, the receiver copies out what is there, and each wakes the other.
//
// Matching follows comm.h's contract: by (peer, tag), in order among messages with the same peer
// and tag. The receiver reads a header when a recv from that sender is posted (any tag) or the
// sender is waiting for space. A message whose tag nobody asked for yet is copied out into a held
// buffer, so one tag never blocks another and a sender never blocks on a receiver that is busy
// elsewhere. A message that is already entirely in the ring and that nobody asked for stays there
// (no extra copy) until a recv from its sender is posted.
//
// Who moves the bytes: the caller of isend/irecv does at once what it can (a message that fits is
// in the ring when isend returns); the thread that waits for a message moves everything for this
// rank while it waits (no hand-off between threads on the hot path); a progress thread per group
// moves data while nobody waits (the caller computes or runs a collective), so a peer is never
// stalled by a rank that is not in a point-to-point call. Waiters spin briefly, then sleep on a
// futex word per rank that every peer bumps when it wrote to or read from a ring of that rank.
//
// Failures are those of the all-reduce: a wait gives up after its timeout naming the peer; a peer
// whose process is gone (pid checked every 200 ms) or that failed or closed its group is reported
// within about that time. A recv whose message has a different size or dtype fails as a mismatch
// naming the tag; the message is consumed, so the sender is not stuck. A rank that failed marks
// itself gone in the segment, so peers waiting on it fail fast too.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "comm/shm_transport.h"  // ShmFailure

namespace dtrain::detail {

// One isend or irecv through shared memory.
struct ShmMessage {
  bool is_send = false;
  int peer = -1;  // group rank of the other side
  int tag = 0;
  at::Tensor data;  // contiguous: what is sent, or where a recv lands
  int64_t bytes = 0;
  // Progress (guarded by the channel's mutex): a send's header written, payload bytes (with
  // padding) written so far.
  bool header_moved = false;
  int64_t moved = 0;
  std::exception_ptr error;  // a ShmFailure; set before `done`
  std::atomic<bool> done{false};
};

class ShmPointToPoint {
 public:
  // Bytes of each directed pair's ring: large enough that a 64 MiB message streams with few
  // wake-ups, small enough to stay in cache and that a rank talking to two neighbours reserves 4
  // MiB.
  static constexpr int64_t kDefaultRingBytes = int64_t{1} << 20;

  // Collective over the group's store, as ShmTransport::create: rank 0 creates the segment,
  // everyone maps it, rank 0 unlinks its name. Returns nullptr (the group keeps Gloo for point to
  // point) when a rank cannot map it.
  static std::unique_ptr<ShmPointToPoint> create(c10d::Store& store, int rank, int size,
                                                 std::chrono::milliseconds timeout);
  ~ShmPointToPoint();

  // Whether `tensor` can go through shared memory: a strided CPU tensor (any dtype the caller
  // allows).
  static bool supports(const at::Tensor& tensor);

  // Start a transfer; never blocks on the peer. `tensor` must be contiguous and stay untouched
  // until the message is done.
  std::shared_ptr<ShmMessage> send(const at::Tensor& tensor, int dst, int tag);
  std::shared_ptr<ShmMessage> recv(const at::Tensor& tensor, int src, int tag);
  // Blocks until `message` is done or `timeout` passed (counted from this call, as Gloo's wait
  // does); moves every message of this rank meanwhile. Throws the ShmFailure that ended it.
  void wait(ShmMessage& message, std::chrono::milliseconds timeout);

  int64_t ring_bytes() const { return ring_bytes_; }

 private:
  struct Held;
  struct Outgoing;
  struct Incoming;
  ShmPointToPoint(int rank, int size, std::unique_ptr<ShmSegment> segment, int64_t ring_bytes);
  void progress_locked();
  void push_locked(int dst);
  void pull_locked(int src);
  void complete_locked(ShmMessage& message, std::exception_ptr error = nullptr);
  bool has_pending_work_locked();
  [[noreturn]] void rethrow_failure(ShmMessage& message);
  void wake(int rank);
  void run_progress_thread();
  [[noreturn]] void give_up(ShmMessage& message, const ShmFailure& failure);
  char* ring(int from, int to) const;

  const int rank_;
  const int size_;
  const std::unique_ptr<ShmSegment> segment_;
  const int fd_;  // the segment's file, kept open: rings are reserved on first use
  void* const base_;
  const int64_t ring_bytes_;

  std::mutex mutex_;                // everything below, and every ring this rank writes or reads
  std::vector<Outgoing> outgoing_;  // by destination
  std::vector<Incoming> incoming_;  // by source
  bool stop_ = false;
  std::atomic<int> waiters_{
      0};  // threads inside wait(): they move the data, the progress thread rests
  std::thread progress_thread_;
};

// Messages delivered through shared-memory point to point in this process so far: lets tests prove
// the fast path was taken rather than a silent fallback to Gloo.
uint64_t shm_p2p_messages_received();

// Ring size for groups created afterwards in this process (0: kDefaultRingBytes; else a power of
// two of at least 64). Tests set a tiny ring to reach the streaming paths with small tensors.
void set_shm_p2p_ring_bytes(int64_t bytes);

}  // namespace dtrain::detail
