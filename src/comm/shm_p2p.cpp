// Shared-memory point to point for ranks on one host; see Note [Shared-memory point to point] in
// shm_p2p.h. The segment layout, the futex waits and the peer-death checks are one protocol: kept
// in one file (a little over 600 lines) so that both sides of every handshake read side by side.
#include "comm/shm_p2p.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>

#include "comm/store_bytes.h"
#include "common/log.h"
#include "common/process_identity.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kLine = 64;
constexpr uint64_t kHeaderBytes = 32;    // also the padding unit, so a header never wraps the ring
constexpr uint32_t kMagic = 0x64747032;  // "dtp2": a header that lacks it means the ring is corrupt
constexpr int kSpinPasses = 200;         // a ping-pong peer usually answers within microseconds
constexpr auto kLivenessPeriod = std::chrono::milliseconds(200);

std::atomic<uint64_t> messages_received{0};
std::atomic<int64_t> ring_bytes_override{0};

// Why a rank no longer takes part, in its RankRecord.
enum Gone : int32_t { kPresent = 0, kClosed = 1, kFailed = 2 };

struct alignas(kLine) RankRecord {
  std::atomic<uint32_t> wake;  // bumped when there is news for this rank; its threads sleep on it
  std::atomic<uint32_t>
      sleepers;  // threads of this rank asleep on `wake`: a waker skips the syscall at 0
  std::atomic<int32_t> pid;      // to tell a dead peer from a slow one...
  std::atomic<int32_t> gone;     // Gone
  std::atomic<uint64_t> pid_ns;  // ...when it lives in our pid namespace
};

// One directed pair sender -> receiver; head and tail on their own lines, each written by one side.
struct PairControl {
  alignas(kLine) std::atomic<uint64_t> head;  // bytes the sender has written
  std::atomic<uint32_t> ring_state;           // RingState, set by the sender
  std::atomic<uint32_t> sender_waiting;       // 1 while the sender has bytes that do not fit
  alignas(kLine) std::atomic<uint64_t> tail;  // bytes the receiver has consumed
};
enum RingState : uint32_t { kRingUnused = 0, kRingReady = 1, kRingNoSpace = 2 };

struct MessageHeader {
  uint32_t magic;
  int32_t tag;
  int32_t dtype;  // at::ScalarType
  int32_t unused;
  int64_t bytes;
  int64_t unused2;
};
static_assert(sizeof(MessageHeader) == kHeaderBytes, "a header fills one padding unit");

size_t records_offset() { return kLine; }
size_t pairs_offset(int size) { return records_offset() + kLine * static_cast<size_t>(size); }
size_t control_bytes(int size) {
  size_t raw = pairs_offset(size) + sizeof(PairControl) * static_cast<size_t>(size) * size;
  return (raw + 4095) / 4096 * 4096;
}
size_t segment_bytes(int size, int64_t ring_bytes) {
  return control_bytes(size) + static_cast<size_t>(size) * size * static_cast<size_t>(ring_bytes);
}

uint64_t padded(int64_t bytes) {
  return (static_cast<uint64_t>(bytes) + kHeaderBytes - 1) / kHeaderBytes * kHeaderBytes;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000),
              static_cast<long>(timeout.count() % 1000000 * 1000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Ring copies: `position` counts bytes since the ring began; the ring wraps at `ring_bytes` (a
// power of two).
void copy_into_ring(char* ring, uint64_t ring_bytes, uint64_t position, const char* from,
                    uint64_t n) {
  if (n == 0) return;
  uint64_t at = position & (ring_bytes - 1);
  uint64_t first = std::min(n, ring_bytes - at);
  std::memcpy(ring + at, from, first);
  if (n > first) std::memcpy(ring, from + first, n - first);
}

void copy_out_of_ring(const char* ring, uint64_t ring_bytes, uint64_t position, char* to,
                      uint64_t n) {
  if (n == 0) return;
  uint64_t at = position & (ring_bytes - 1);
  uint64_t first = std::min(n, ring_bytes - at);
  std::memcpy(to, ring + at, first);
  if (n > first) std::memcpy(to + first, ring, n - first);
}

std::string describe(at::ScalarType dtype, int64_t bytes) {
  int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  return std::to_string(bytes / element) + " elements of " + c10::toString(dtype) + " (" +
         std::to_string(bytes) + " bytes)";
}

}  // namespace

// A message copied out of the ring before anyone asked for it.
struct ShmPointToPoint::Held {
  at::ScalarType dtype;
  int64_t bytes;
  std::vector<char> data;
  bool complete = false;
  std::shared_ptr<ShmMessage> recv;  // posted while the message was still streaming in
};

struct ShmPointToPoint::Outgoing {
  std::deque<std::shared_ptr<ShmMessage>> queue;  // oldest first; only the front is partly written
  uint64_t head = 0;                              // this side's copy of the pair's head
  bool ring_reserved = false;
};

struct ShmPointToPoint::Incoming {
  uint64_t tail = 0;  // this side's copy of the pair's tail
  std::map<int, std::deque<std::shared_ptr<ShmMessage>>> posted;  // recvs without a message, by tag
  size_t posted_count = 0;
  std::map<int, std::deque<std::shared_ptr<Held>>>
      held;  // messages without a recv, by tag, oldest first
  // The message being read out of the ring, into a recv, a held buffer, or nowhere (a mismatch).
  bool reading = false;
  std::shared_ptr<ShmMessage> into;
  std::shared_ptr<Held> held_into;
  int64_t bytes = 0;
  int64_t moved = 0;
};

namespace {
RankRecord* records_of(void* base) {
  return reinterpret_cast<RankRecord*>(static_cast<char*>(base) + records_offset());
}
PairControl& pair_of(void* base, int size, int from, int to) {
  auto* pairs = reinterpret_cast<PairControl*>(static_cast<char*>(base) + pairs_offset(size));
  return pairs[static_cast<size_t>(from) * size + to];
}
}  // namespace

std::unique_ptr<ShmPointToPoint> ShmPointToPoint::create(c10d::Store& store, int rank, int size,
                                                         std::chrono::milliseconds timeout) {
  // Rank 0's ring size holds for everyone, so every rank maps the same layout.
  int64_t ring_bytes = ring_bytes_override.load();
  if (ring_bytes == 0) ring_bytes = kDefaultRingBytes;
  if (rank == 0) {
    store.set("p2p/ring-bytes", bytes_of(std::to_string(ring_bytes)));
  } else {
    auto value = store.get("p2p/ring-bytes");
    ring_bytes = std::stoll(std::string(value.begin(), value.end()));
  }
  SegmentOptions options;
  options.bytes = segment_bytes(size, ring_bytes);
  options.reserve_bytes = control_bytes(size);  // the rings take no memory until first used
  options.keep_fd = true;                       // ...and are reserved through the file then
  options.on_mapped = [rank](char* base) {
    // Before any peer can wait on this rank: from here on its death is recognized.
    records_of(base)[rank].pid_ns.store(own_pid_namespace());
    records_of(base)[rank].pid.store(static_cast<int32_t>(::getpid()));
  };
  std::string problem;
  auto segment = map_group_segment(store, "p2p", rank, size, timeout, options, problem);
  if (!segment) {
    if (!problem.empty()) {
      DTRAIN_LOG(kWarn, "shared memory unavailable for point to point ("
                            << problem << "); send/recv go through Gloo");
    }
    return nullptr;
  }
  return std::unique_ptr<ShmPointToPoint>(
      new ShmPointToPoint(rank, size, std::move(segment), ring_bytes));
}

ShmPointToPoint::ShmPointToPoint(int rank, int size, std::unique_ptr<ShmSegment> segment,
                                 int64_t ring_bytes)
    : rank_(rank),
      size_(size),
      segment_(std::move(segment)),
      fd_(segment_->fd()),
      base_(segment_->base()),
      ring_bytes_(ring_bytes),
      outgoing_(size),
      incoming_(size) {
  progress_thread_ = std::thread([this] { run_progress_thread(); });
}

ShmPointToPoint::~ShmPointToPoint() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake(rank_);
  progress_thread_.join();
  // Peers waiting on this rank fail fast; what it already wrote stays readable in their mapping.
  int32_t present = kPresent;
  records_of(base_)[rank_].gone.compare_exchange_strong(present, kClosed);
  for (int r = 0; r < size_; ++r) wake(r);
}

bool ShmPointToPoint::supports(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.layout() == at::kStrided;
}

char* ShmPointToPoint::ring(int from, int to) const {
  return static_cast<char*>(base_) + control_bytes(size_) +
         (static_cast<size_t>(from) * size_ + to) * static_cast<size_t>(ring_bytes_);
}

void ShmPointToPoint::wake(int rank) {
  RankRecord& record = records_of(base_)[rank];
  record.wake.fetch_add(1);
  if (record.sleepers.load() > 0) futex_wake_all(&record.wake);
}

void ShmPointToPoint::complete_locked(ShmMessage& message, std::exception_ptr error) {
  message.error = error;
  message.done.store(true, std::memory_order_release);
  if (!error && !message.is_send) ++messages_received;
  // A waiter of this rank may be asleep on it. Nobody waiting (an isend done in its caller, or
  // while the caller computes): no wake-up, which would only stir the progress thread.
  if (waiters_.load() > 0) wake(rank_);
}

bool ShmPointToPoint::has_pending_work_locked() {
  for (int r = 0; r < size_; ++r) {
    if (!outgoing_[r].queue.empty() || incoming_[r].reading) return true;
    if (pair_of(base_, size_, r, rank_).sender_waiting.load(std::memory_order_acquire) != 0)
      return true;
  }
  return false;
}

std::shared_ptr<ShmMessage> ShmPointToPoint::send(const at::Tensor& tensor, int dst, int tag) {
  auto message = std::make_shared<ShmMessage>();
  message->is_send = true;
  message->peer = dst;
  message->tag = tag;
  message->data = tensor;
  message->bytes = static_cast<int64_t>(tensor.numel() * tensor.element_size());
  std::lock_guard<std::mutex> lock(mutex_);
  outgoing_[dst].queue.push_back(message);
  push_locked(dst);  // a message that fits is in the ring before isend returns
  return message;
}

std::shared_ptr<ShmMessage> ShmPointToPoint::recv(const at::Tensor& tensor, int src, int tag) {
  auto message = std::make_shared<ShmMessage>();
  message->peer = src;
  message->tag = tag;
  message->data = tensor;
  message->bytes = static_cast<int64_t>(tensor.numel() * tensor.element_size());
  std::lock_guard<std::mutex> lock(mutex_);
  Incoming& in = incoming_[src];
  auto held = in.held.find(tag);
  if (held != in.held.end() && !held->second.empty()) {
    // The oldest message with this tag arrived before its recv: it is this recv's.
    std::shared_ptr<Held> oldest = held->second.front();
    held->second.pop_front();
    if (held->second.empty()) in.held.erase(held);
    if (oldest->dtype != tensor.scalar_type() || oldest->bytes != message->bytes) {
      complete_locked(*message, std::make_exception_ptr(ShmFailure(
                                    "the message holds " + describe(oldest->dtype, oldest->bytes) +
                                        " but this recv expects " +
                                        describe(tensor.scalar_type(), message->bytes),
                                    ShmFailure::Kind::kMismatch, src)));
    } else if (oldest->complete) {
      if (message->bytes > 0) std::memcpy(tensor.data_ptr(), oldest->data.data(), message->bytes);
      complete_locked(*message);
    } else {
      oldest->recv = message;  // still streaming in: handed over when complete
    }
    return message;
  }
  in.posted[tag].push_back(message);
  ++in.posted_count;
  pull_locked(src);  // the message may be waiting in the ring already
  return message;
}

void ShmPointToPoint::progress_locked() {
  for (int r = 0; r < size_; ++r) {
    if (!outgoing_[r].queue.empty()) push_locked(r);
    pull_locked(r);
  }
}

void ShmPointToPoint::push_locked(int dst) {
  Outgoing& out = outgoing_[dst];
  PairControl& pair = pair_of(base_, size_, rank_, dst);
  if (!out.ring_reserved) {
    // First message to dst: reserve its ring now, so a full /dev/shm is an error here and not a
    // SIGBUS in the middle of a copy.
    off_t offset = static_cast<off_t>(ring(rank_, dst) - static_cast<char*>(base_));
    if (int err = posix_fallocate(fd_, offset, static_cast<off_t>(ring_bytes_)); err != 0) {
      pair.ring_state.store(kRingNoSpace, std::memory_order_release);
      wake(dst);
      auto failure = std::make_exception_ptr(
          ShmFailure("cannot reserve " + std::to_string(ring_bytes_) +
                         " bytes in /dev/shm for messages to group rank " + std::to_string(dst) +
                         " (" + std::strerror(err) +
                         "); free space in /dev/shm or set DTRAIN_SHM=0 to send through Gloo",
                     ShmFailure::Kind::kPeerLost, dst));
      for (auto& message : out.queue) complete_locked(*message, failure);
      out.queue.clear();
      return;
    }
    pair.ring_state.store(kRingReady, std::memory_order_release);
    out.ring_reserved = true;
  }
  char* buffer = ring(rank_, dst);
  const uint64_t capacity = static_cast<uint64_t>(ring_bytes_);
  bool wrote = false;
  bool waiting_changed = false;
  for (;;) {
    while (!out.queue.empty()) {
      ShmMessage& message = *out.queue.front();
      uint64_t free = capacity - (out.head - pair.tail.load(std::memory_order_acquire));
      if (!message.header_moved) {
        if (free < kHeaderBytes) break;
        MessageHeader header{
            kMagic, message.tag,   static_cast<int32_t>(message.data.scalar_type()),
            0,      message.bytes, 0};
        copy_into_ring(buffer, capacity, out.head, reinterpret_cast<const char*>(&header),
                       kHeaderBytes);
        out.head += kHeaderBytes;
        free -= kHeaderBytes;
        message.header_moved = true;
        wrote = true;
      }
      const uint64_t total = padded(message.bytes);
      const uint64_t n = std::min<uint64_t>(free, total - message.moved);
      if (n > 0) {
        // Only the payload's bytes are copied; the padding after it is skipped.
        const uint64_t payload = message.moved < message.bytes
                                     ? std::min<uint64_t>(n, message.bytes - message.moved)
                                     : 0;
        copy_into_ring(buffer, capacity, out.head,
                       static_cast<const char*>(message.data.data_ptr()) + message.moved, payload);
        message.moved += n;
        out.head += n;
        wrote = true;
      }
      if (static_cast<uint64_t>(message.moved) < total) break;  // the ring is full
      auto done = out.queue.front();
      out.queue.pop_front();
      complete_locked(*done);
    }
    if (wrote) pair.head.store(out.head, std::memory_order_release);
    if (out.queue.empty()) break;
    // The ring is full. Say so, then look at the tail once more: a receiver that freed space just
    // before it could see sender_waiting would not wake this side, and the message would wait for
    // a futex timeout (100-200 ms). With both the flag's store here and the tail's store in
    // pull_locked sequentially consistent, one of the two sides sees the other's store.
    if (pair.sender_waiting.load(std::memory_order_relaxed) == 0) {
      pair.sender_waiting.store(1, std::memory_order_seq_cst);
      waiting_changed = true;
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    const uint64_t needed = out.queue.front()->header_moved ? 1 : kHeaderBytes;
    if (capacity - (out.head - pair.tail.load(std::memory_order_seq_cst)) < needed) break;
  }
  if (out.queue.empty() && pair.sender_waiting.load(std::memory_order_relaxed) != 0) {
    pair.sender_waiting.store(0, std::memory_order_release);
    waiting_changed = true;
  }
  if (wrote || waiting_changed) wake(dst);
}

void ShmPointToPoint::pull_locked(int src) {
  Incoming& in = incoming_[src];
  PairControl& pair = pair_of(base_, size_, src, rank_);
  const char* buffer = ring(src, rank_);
  const uint64_t capacity = static_cast<uint64_t>(ring_bytes_);
  bool consumed = false;
  while (true) {
    const uint64_t head = pair.head.load(std::memory_order_acquire);
    if (!in.reading) {
      if (head - in.tail < kHeaderBytes) break;
      MessageHeader header;
      copy_out_of_ring(buffer, capacity, in.tail, reinterpret_cast<char*>(&header), kHeaderBytes);
      if (header.magic != kMagic) {
        throw InternalError(
            "shared-memory point to point: corrupt message header in the ring from group rank " +
            std::to_string(src));
      }
      auto posted = in.posted.find(header.tag);
      const bool wanted = posted != in.posted.end() && !posted->second.empty();
      // Nobody needs this message out of the ring yet: leave it there (no copy) until a recv from
      // src is posted, or the sender needs the space.
      if (!wanted && in.posted_count == 0 &&
          pair.sender_waiting.load(std::memory_order_acquire) == 0)
        break;
      const auto dtype = static_cast<at::ScalarType>(header.dtype);
      in.reading = true;
      in.bytes = header.bytes;
      in.moved = 0;
      if (wanted) {
        std::shared_ptr<ShmMessage> recv = posted->second.front();
        posted->second.pop_front();
        if (posted->second.empty()) in.posted.erase(posted);  // tags are often used once per step
        --in.posted_count;
        if (dtype != recv->data.scalar_type() || header.bytes != recv->bytes) {
          // Consume the message anyway (into nowhere): the sender must not stay stuck behind it.
          complete_locked(*recv, std::make_exception_ptr(ShmFailure(
                                     "the message holds " + describe(dtype, header.bytes) +
                                         " but this recv expects " +
                                         describe(recv->data.scalar_type(), recv->bytes),
                                     ShmFailure::Kind::kMismatch, src)));
        } else {
          in.into = recv;
        }
      } else {
        auto held = std::make_shared<Held>();
        held->dtype = dtype;
        held->bytes = header.bytes;
        held->data.resize(static_cast<size_t>(header.bytes));
        in.held[header.tag].push_back(held);
        in.held_into = held;
      }
      in.tail += kHeaderBytes;
      consumed = true;
    }
    const uint64_t total = padded(in.bytes);
    const uint64_t n = std::min<uint64_t>(head - in.tail, total - in.moved);
    if (n > 0) {
      char* to = in.into        ? static_cast<char*>(in.into->data.data_ptr())
                 : in.held_into ? in.held_into->data.data()
                                : nullptr;
      const uint64_t payload =
          in.moved < in.bytes ? std::min<uint64_t>(n, static_cast<uint64_t>(in.bytes - in.moved))
                              : 0;
      if (to) copy_out_of_ring(buffer, capacity, in.tail, to + in.moved, payload);
      in.moved += n;
      in.tail += n;
      consumed = true;
    }
    if (static_cast<uint64_t>(in.moved) < total) break;  // the rest is not written yet
    if (in.into) complete_locked(*in.into);
    if (in.held_into) {
      in.held_into->complete = true;
      if (auto recv = in.held_into->recv) {
        // Its recv came while it streamed in; recv() already took it off the held list.
        if (recv->bytes > 0)
          std::memcpy(recv->data.data_ptr(), in.held_into->data.data(), recv->bytes);
        complete_locked(*recv);
      }
    }
    in.reading = false;
    in.into.reset();
    in.held_into.reset();
  }
  if (consumed) {
    // Sequentially consistent, paired with the sender's store of sender_waiting (see push_locked).
    pair.tail.store(in.tail, std::memory_order_seq_cst);
    if (pair.sender_waiting.load(std::memory_order_seq_cst) != 0) wake(src);
  }
}

void ShmPointToPoint::give_up(ShmMessage& message, const ShmFailure& failure) {
  // Peers waiting on this rank fail fast instead of waiting out their own timeouts.
  int32_t present = kPresent;
  records_of(base_)[rank_].gone.compare_exchange_strong(present, kFailed);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) wake(r);
  }
  throw failure;
}

void ShmPointToPoint::wait(ShmMessage& message, std::chrono::milliseconds timeout) {
  if (message.done.load(std::memory_order_acquire)) {
    if (message.error) rethrow_failure(message);
    return;
  }
  RankRecord& me = records_of(base_)[rank_];
  RankRecord& peer = records_of(base_)[message.peer];
  const auto deadline = Clock::now() + timeout;
  auto next_liveness_check = Clock::now() + kLivenessPeriod;
  static const uint64_t my_namespace = own_pid_namespace();
  struct Waiting {
    std::atomic<int>& waiters;
    ShmPointToPoint& self;
    explicit Waiting(std::atomic<int>& w, ShmPointToPoint& s) : waiters(w), self(s) { ++waiters; }
    ~Waiting() {
      // The progress thread rested while this thread moved the data; it takes over what is left
      // (news that came after this thread's last pass would otherwise wait for the next one).
      if (--waiters == 0) {
        std::unique_lock<std::mutex> lock(self.mutex_);
        if (self.has_pending_work_locked()) {
          lock.unlock();
          self.wake(self.rank_);
        }
      }
    }
  } waiting(waiters_, *this);

  auto progress_and_done = [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    progress_locked();
    return message.done.load(std::memory_order_acquire);
  };
  for (int pass = 0; !message.done.load(std::memory_order_acquire); ++pass) {
    const uint32_t seen = me.wake.load();
    if (progress_and_done()) break;
    if (pass < kSpinPasses) continue;
    const auto now = Clock::now();
    // The peer cannot answer any more: it failed, closed its group, or its process is gone. What it
    // wrote before is still delivered (the progress pass above, and one more below).
    std::string lost;
    if (int32_t gone = peer.gone.load(std::memory_order_acquire); gone != kPresent) {
      lost = "group rank " + std::to_string(message.peer) +
             (gone == kClosed ? " destroyed its group" : " gave up after an error of its own");
    } else if (!message.is_send &&
               pair_of(base_, size_, message.peer, rank_).ring_state.load() == kRingNoSpace) {
      lost =
          "group rank " + std::to_string(message.peer) + " could not reserve its ring in /dev/shm";
    } else if (now > next_liveness_check) {
      next_liveness_check = now + kLivenessPeriod;
      int32_t pid = peer.pid.load();
      if (pid > 0 && peer.pid_ns.load() == my_namespace && kill(pid, 0) != 0 && errno == ESRCH) {
        lost = "group rank " + std::to_string(message.peer) + " (pid " + std::to_string(pid) +
               ") exited";
      }
    }
    if (!lost.empty()) {
      if (progress_and_done()) break;
      give_up(message, ShmFailure(lost, ShmFailure::Kind::kPeerLost, message.peer));
    }
    if (now > deadline) {
      give_up(message,
              ShmFailure("timed out waiting for group rank " + std::to_string(message.peer),
                         ShmFailure::Kind::kTimeout, message.peer));
    }
    me.sleepers.fetch_add(1);
    if (me.wake.load() == seen) {
      auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
      futex_wait(&me.wake, seen,
                 std::clamp<std::chrono::microseconds>(left, std::chrono::microseconds(1),
                                                       kLivenessPeriod));
    }
    me.sleepers.fetch_sub(1);
  }
  if (message.error) rethrow_failure(message);
}

void ShmPointToPoint::rethrow_failure(ShmMessage& message) {
  try {
    std::rethrow_exception(message.error);
  } catch (const ShmFailure& failure) {
    give_up(message, failure);
  }
}

void ShmPointToPoint::run_progress_thread() {
  RankRecord& me = records_of(base_)[rank_];
  while (true) {
    const uint32_t seen = me.wake.load();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return;
      if (waiters_.load() == 0) {
        try {
          progress_locked();
        } catch (const std::exception& e) {
          // A corrupt ring: the waiter of the affected message sees the same when it moves the
          // data.
          DTRAIN_LOG(kWarn, "shared-memory point to point: " << e.what());
        }
      }
    }
    me.sleepers.fetch_add(1);
    if (me.wake.load() == seen) futex_wait(&me.wake, seen, std::chrono::milliseconds(100));
    me.sleepers.fetch_sub(1);
  }
}

uint64_t shm_p2p_messages_received() { return messages_received.load(); }

void set_shm_p2p_ring_bytes(int64_t bytes) {
  if (bytes != 0 && (bytes < 64 || (bytes & (bytes - 1)) != 0)) {
    throw UsageError("set_shm_p2p_ring_bytes(" + std::to_string(bytes) +
                     "): expected 0 or a power of two >= 64");
  }
  ring_bytes_override.store(bytes);
}

}  // namespace dtrain::detail
