// All-reduce through shared memory among the ranks of a group that all run on one host.
//
// Note [Shared-memory all-reduce]
// On one machine, Gloo moves every byte through TCP over loopback: a few kernel copies per byte and
// a wake-up per message, about 1 GB/s here against ~35 GB/s for memcpy. Ranks on one host can
// instead meet in one shared segment. For each chunk of the tensor:
//   1. every rank copies its chunk into its own slot;                    barrier
//   2. rank r sums share r of the chunk over all slots, in place in slot r; barrier
//   3. every rank copies the reduced shares back out of their owners' slots.
// Two sets of slots alternate between chunks, so step 1 of chunk k+2 (same set as chunk k) cannot
// overwrite a slot someone still reads in step 3 of chunk k: every rank finished it before reaching
// chunk k+1's first barrier. Each rank's bytes cross memory three times, and every rank sums the
// same operands in the same order, so all ranks get bit-identical results.
//
// With 2 ranks (or a small chunk) steps 2 and 3 become one: after the first barrier every rank
// combines all slots itself, in rank order 0..N-1, straight into its tensor. Each rank still reads
// N-1 peers' worth of data from other cores (for N = 2 the same as the shares and the reduced
// shares), but it saves a barrier, the write of its share and the copy back out. Copying into the
// slot uses streaming stores: the slot's cache lines were last read by the peers, and ordinary
// stores would first take each line back from them. On a 2-core VM these two changes took a 7 MiB
// all-reduce between 2 ranks from 1.85 ms to ~0.6 ms.
//
// A barrier is a counter per rank in the segment: a rank bumps its own and waits until every
// counter has caught up, so a late rank is known by name, and a rank whose process is gone (its pid
// no longer exists) is reported at once instead of after the timeout. Waiters spin briefly, then
// yield their core for up to 2 ms (ranks usually outnumber idle cores, and a yielding waiter still
// sees the peer at once), then sleep on a futex. A rank that fails marks the segment aborted, so no
// peer can pass a later barrier against its stale counter and take half-reduced data for a result;
// every queued operation then fails too. Before its first barrier each operation also publishes its
// size and dtype, and right after it, before reading any peer's data, ranks that disagree are named
// instead of silently pairing different chunks.
//
// All-gather and reduce-scatter are the two halves of that exchange, each with one barrier per
// chunk:
//   all-gather:     every rank copies its input chunk into its slot; barrier; every rank copies
//                   every slot out.
//   reduce-scatter: every rank copies its N input pieces' chunks side by side into its slot;
//                   barrier; rank r sums piece r over all slots (in rank order 0..N-1) straight
//                   into its output.
// One barrier per chunk is enough with the two alternating slot sets: a rank writes set s again
// (chunk k+2) only after passing chunk k+1's barrier, which every rank reaches only after reading
// chunk k. Each rank's bytes cross memory twice; a reduce-scatter reads 1/N of what an all-reduce
// reads.
//
// Operations run in order on one thread per group, so all_reduce_async overlaps with the caller's
// work (DDP's backward) just as Gloo's does.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "comm/shm_segment.h"
#include "dtrain/comm.h"

namespace dtrain::detail {

// Raised on the transport's thread; ProcessGroup turns it into dtrain's TimeoutError /
// PeerLostError with the full message.
struct ShmFailure : std::runtime_error {
  enum class Kind { kTimeout, kPeerLost, kMismatch, kDestroyed };
  ShmFailure(const std::string& what, Kind kind, int late_rank = -1)
      : std::runtime_error(what), kind(kind), late_rank(late_rank) {}
  Kind kind;
  int late_rank;  // group rank that had not arrived, when known
};

class ShmTransport {
 public:
  // Bytes of each rank's slot in each of the two slot sets: big enough that the barriers (two per
  // chunk) are a small cost against the copies, small enough that 8 ranks need only 64 MiB of
  // /dev/shm.
  static constexpr int64_t kChunkBytes = int64_t{4} << 20;
  // An all-reduce chunk is combined in one step (every rank reads every slot) with 2 ranks, or when
  // the peers' parts of it add up to at most this; see Note [Shared-memory all-reduce].
  static constexpr int64_t kDirectBytes = int64_t{256} << 10;

  // Collective over the group's store: group rank 0 creates the segment, the others map it, then
  // rank 0 unlinks its name so nothing is left in /dev/shm whatever happens later. Returns nullptr
  // (and the group keeps using Gloo) when shared memory is unavailable.
  static std::unique_ptr<ShmTransport> create(c10d::Store& store, int rank, int size,
                                              std::chrono::milliseconds timeout);
  ~ShmTransport();

  // Whether this transport can reduce `tensor`: a dense CPU tensor of a type it sums. Depends only
  // on what every rank must agree on anyway (device, dtype), so all ranks pick the same transport.
  static bool supports(const at::Tensor& tensor);

  // Queues the all-reduce; the future completes when `tensor` holds the result, or carries a
  // ShmFailure.
  std::shared_future<void> all_reduce_async(const at::Tensor& tensor, ReduceOp op,
                                            std::chrono::milliseconds timeout);
  // outputs[r] (each with input's numel and dtype) receives rank r's input.
  std::shared_future<void> all_gather_async(std::vector<at::Tensor> outputs,
                                            const at::Tensor& input,
                                            std::chrono::milliseconds timeout);
  // inputs: one per rank, each with output's numel and dtype; output receives the reduction over
  // ranks of their inputs[rank()] (kAvg sums here; the caller divides).
  std::shared_future<void> reduce_scatter_async(const at::Tensor& output,
                                                std::vector<at::Tensor> inputs, ReduceOp op,
                                                std::chrono::milliseconds timeout);
  // Each rank's part of one buffer lies in shared memory, at regions[r] in this process's mapping
  // (numel elements of float or double each). Queues the in-place all-reduce: every element becomes
  // scale * (the sum over ranks) in every region. See Note [Gradient buckets in shared memory] in
  // shared_buckets.h.
  // `regions_owner` keeps the regions mapped until the operation has run: a wait that is abandoned
  // (GroupState::abandon_check) returns while it may still run, and its owner may be gone by then.
  std::shared_future<void> all_reduce_regions_async(std::vector<char*> regions, int64_t numel,
                                                    at::ScalarType type, double scale,
                                                    std::chrono::milliseconds timeout,
                                                    std::shared_ptr<const void> regions_owner);
  // Completes once every operation queued before it has finished (for ProcessGroup::barrier).
  std::shared_future<void> flush();
  // Summed time this transport's thread spent running operations (for CommStats::busy_s).
  int64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

 private:
  struct Segment;
  ShmTransport(int rank, int size, std::unique_ptr<ShmSegment> segment);
  void run_queue();
  void all_reduce(const at::Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout);
  void all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                  std::chrono::milliseconds timeout);
  void reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op,
                      std::chrono::milliseconds timeout);
  void all_reduce_regions(const std::vector<char*>& regions, int64_t numel, at::ScalarType type,
                          double scale, std::chrono::milliseconds timeout);
  // Every operation publishes its signature (numel, dtype, op, kind) before its first barrier and
  // checks right after that barrier, before reading any peer's slot, that every rank passed the
  // same: ranks that disagree are named instead of pairing different chunks.
  void publish(uint64_t signature);
  void check_agreement(const char* what, int64_t numel, at::ScalarType type);
  void barrier(std::chrono::steady_clock::time_point deadline);
  [[noreturn]] void abort(const ShmFailure& failure);
  std::shared_future<void> enqueue(std::function<void()> job);
  char* slot(int set, int rank) const;

  const int rank_;
  const int size_;
  std::unique_ptr<ShmSegment> segment_;
  void* base_;
  Segment* control_;
  uint64_t phase_ = 0;       // barriers this rank has passed
  uint64_t chunks_ = 0;      // chunks processed, selects the slot set
  uint64_t operations_ = 0;  // operations checked, selects the signature field
  uint64_t signature_ = 0;   // of the operation in progress

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::exception_ptr broken_;  // the first failure: later operations fail with it, untouched
  std::atomic<int64_t> busy_ns_{0};
  std::thread worker_;
};

}  // namespace dtrain::detail
