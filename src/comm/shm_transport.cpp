// Shared-memory all-reduce for ranks on one host; see Note [Shared-memory all-reduce] in
// shm_transport.h.
#include "comm/shm_transport.h"

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/log.h"
#include "common/process_identity.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kLine = 64;
// How often a waiting rank checks that the peers it waits for still live (one kill(pid, 0) each):
// a dead peer is reported within this, which in-place recovery (dtrain/recovery.h) waits out on
// every failure. The check runs only after the yield phase, so it never slows a step.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
constexpr auto kYieldBeforeSleeping = std::chrono::milliseconds(
    2);  // one cache line per rank's record: no false sharing between ranks

// The segment starts with this header, then one RankRecord per rank, then the slots at a page
// boundary.
struct Header {
  std::atomic<uint32_t> wake_word;  // bumped at every barrier arrival; waiters sleep on it (futex)
  std::atomic<int32_t> aborted_by;  // 1 + the group rank that failed first; 0 while healthy
  std::atomic<int32_t> aborted_kind;  // its ShmFailure::Kind, so peers report the same cause
};
struct alignas(kLine) RankRecord {
  std::atomic<uint64_t> phase;  // barriers this rank has reached
  std::atomic<int32_t> pid;     // to tell a dead peer from a slow one...
  std::atomic<uint64_t>
      pid_ns;  // ...when it lives in our pid namespace (containers sharing /dev/shm)
  // Numel, dtype and op of this rank's current operation, in field (operation count % 2): a rank
  // that runs ahead writes the other field, so a slower one still reads the right one (see
  // agree()).
  std::atomic<uint64_t> signature[2];
};

RankRecord* records_of(void* base) {
  return reinterpret_cast<RankRecord*>(static_cast<char*>(base) + kLine);
}

size_t slots_offset(int size) {
  size_t raw = kLine + kLine * static_cast<size_t>(size);
  return (raw + 4095) / 4096 * 4096;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{0, static_cast<long>(timeout.count() * 1000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Copies a rank's data into its own slot. The slot's cache lines were last read by the peers, on
// other cores; ordinary stores must first take each line back from them, which on a 2-core VM made
// copying a 7 MiB chunk in 2.5x slower than the same copy between private buffers. Streaming
// (non-temporal) stores claim the lines without reading them. Small copies stay in the cache, where
// the peers find them fastest.
void copy_into_slot(char* dst, const char* src, size_t bytes) {
#if defined(__SSE2__)
  constexpr size_t kStreamingFrom = 256 << 10;
  if (bytes >= kStreamingFrom) {
    size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, bytes - i);
    _mm_sfence();  // the streamed data is visible before the barrier that publishes it
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// out[i] = combine(a[i], b[i]); out may be a or b.
template <typename T, typename Combine>
void combine(T* out, const T* a, const T* b, int64_t n, Combine f) {
  for (int64_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
}

template <typename T>
void combine_typed(char* out, const char* a, const char* b, int64_t n, ReduceOp op) {
  T* o = reinterpret_cast<T*>(out);
  const T* x = reinterpret_cast<const T*>(a);
  const T* y = reinterpret_cast<const T*>(b);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return combine(o, x, y, n, [](T p, T q) { return p + q; });
    case ReduceOp::kProduct:
      return combine(o, x, y, n, [](T p, T q) { return p * q; });
    case ReduceOp::kMin:
      return combine(o, x, y, n, [](T p, T q) { return std::min(p, q); });
    case ReduceOp::kMax:
      return combine(o, x, y, n, [](T p, T q) { return std::max(p, q); });
  }
}

// out = a (op) b, elementwise over n elements of `type`.
void combine_into(at::ScalarType type, char* out, const char* a, const char* b, int64_t n,
                  ReduceOp op) {
  switch (type) {
    case at::kFloat:
      return combine_typed<float>(out, a, b, n, op);
    case at::kDouble:
      return combine_typed<double>(out, a, b, n, op);
    case at::kInt:
      return combine_typed<int32_t>(out, a, b, n, op);
    case at::kLong:
      return combine_typed<int64_t>(out, a, b, n, op);
    default:
      throw InternalError("shared-memory all-reduce called for an unsupported dtype");
  }
}

void reduce_into(at::ScalarType type, char* dst, const char* src, int64_t n, ReduceOp op) {
  combine_into(type, dst, dst, src, n, op);
}

// Elements [begin, end) of every region become scale * their sum over regions, summed in region
// order. Block by block through a small buffer that stays in L1, so each region is read once and
// written once.
template <typename T>
void sum_into_every_region(const std::vector<char*>& regions, int64_t begin, int64_t end, T scale) {
  constexpr int64_t kBlock = 1024;
  T sum[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t m = std::min(kBlock, end - b);
    const T* first = reinterpret_cast<const T*>(regions[0]) + b;
    for (int64_t i = 0; i < m; ++i) sum[i] = first[i];
    for (size_t r = 1; r < regions.size(); ++r) {
      const T* part = reinterpret_cast<const T*>(regions[r]) + b;
      for (int64_t i = 0; i < m; ++i) sum[i] += part[i];
    }
    if (scale != T(1)) {
      for (int64_t i = 0; i < m; ++i) sum[i] *= scale;
    }
    for (char* region : regions) std::memcpy(reinterpret_cast<T*>(region) + b, sum, m * sizeof(T));
  }
}

}  // namespace

struct ShmTransport::Segment {
  Header header;
};

std::unique_ptr<ShmTransport> ShmTransport::create(c10d::Store& store, int rank, int size,
                                                   std::chrono::milliseconds timeout) {
  const size_t bytes = slots_offset(size) + 2 * static_cast<size_t>(size) * kChunkBytes;
  std::string problem;
  SegmentOptions options;
  options.bytes = bytes;
  options.on_mapped = [rank](char* base) {
    // Before anyone can wait on this rank: a rank that dies from here on is recognized as dead.
    records_of(base)[rank].pid_ns.store(own_pid_namespace());
    records_of(base)[rank].pid.store(static_cast<int32_t>(::getpid()));
  };
  auto segment = map_group_segment(store, "shm", rank, size, timeout, options, problem);
  if (!segment) {
    if (!problem.empty()) {
      DTRAIN_LOG(kWarn,
                 "shared memory unavailable (" << problem << "); all-reduce goes through Gloo");
    }
    return nullptr;
  }
  return std::unique_ptr<ShmTransport>(new ShmTransport(rank, size, std::move(segment)));
}

ShmTransport::ShmTransport(int rank, int size, std::unique_ptr<ShmSegment> segment)
    : rank_(rank),
      size_(size),
      segment_(std::move(segment)),
      base_(segment_->base()),
      control_(reinterpret_cast<Segment*>(segment_->base())) {
  worker_ = std::thread([this] { run_queue(); });
}

ShmTransport::~ShmTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

bool ShmTransport::supports(const at::Tensor& tensor) {
  auto type = tensor.scalar_type();
  bool type_ok = type == at::kFloat || type == at::kDouble || type == at::kInt || type == at::kLong;
  return tensor.device().is_cpu() && !tensor.is_sparse() && type_ok;
}

char* ShmTransport::slot(int set, int rank) const {
  return static_cast<char*>(base_) + slots_offset(size_) +
         (static_cast<size_t>(set) * size_ + rank) * static_cast<size_t>(kChunkBytes);
}

std::shared_future<void> ShmTransport::enqueue(std::function<void()> job) {
  auto promise = std::make_shared<std::promise<void>>();
  std::shared_future<void> done = promise->get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back([this, job = std::move(job), promise] {
      std::exception_ptr failure;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        if (stop_) {
          failure = std::make_exception_ptr(ShmFailure(
              "the group was destroyed before the operation ran", ShmFailure::Kind::kDestroyed));
        }
        if (broken_) failure = broken_;
      }
      if (!failure) {
        try {
          job();
          promise->set_value();
          return;
        } catch (...) {
          failure = std::current_exception();
          std::lock_guard<std::mutex> guard(mutex_);
          if (!broken_) broken_ = failure;
        }
      }
      promise->set_exception(failure);
    });
  }
  wake_.notify_one();
  return done;
}

std::shared_future<void> ShmTransport::all_reduce_async(const at::Tensor& tensor, ReduceOp op,
                                                        std::chrono::milliseconds timeout) {
  return enqueue([this, tensor, op, timeout] { all_reduce(tensor, op, timeout); });
}

std::shared_future<void> ShmTransport::flush() {
  return enqueue([] {});
}

void ShmTransport::run_queue() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    auto job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    auto began = Clock::now();
    job();  // fails at once, without touching the segment, once stopping or broken
    busy_ns_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - began).count(),
        std::memory_order_relaxed);
    lock.lock();
  }
}

void ShmTransport::abort(const ShmFailure& failure) {
  int32_t healthy = 0;
  control_->header.aborted_kind.store(static_cast<int32_t>(failure.kind));
  control_->header.aborted_by.compare_exchange_strong(healthy, rank_ + 1);
  control_->header.wake_word.fetch_add(1, std::memory_order_release);
  futex_wake_all(&control_->header.wake_word);
  throw failure;
}

void ShmTransport::barrier(Clock::time_point deadline) {
  RankRecord* records = records_of(base_);
  std::atomic<uint32_t>* wake_word = &control_->header.wake_word;
  const uint64_t target = ++phase_;
  records[rank_].phase.store(target, std::memory_order_release);
  wake_word->fetch_add(1, std::memory_order_release);
  futex_wake_all(wake_word);

  const uint64_t my_namespace = own_pid_namespace();
  auto next_liveness_check = Clock::now() + kLivenessPeriod;
  Clock::time_point yield_until;
  for (int spins = 0;; ++spins) {
    uint32_t seen = wake_word->load(std::memory_order_acquire);
    // Checked on every pass, also right before returning: never pass a barrier against a failed
    // peer's stale counter.
    int late = -1;
    for (int r = 0; r < size_ && late < 0; ++r) {
      if (records[r].phase.load(std::memory_order_acquire) < target) late = r;
    }
    if (int32_t failed = control_->header.aborted_by.load(std::memory_order_acquire); failed > 0) {
      // A peer gave up first (usually on the same late rank): report the same cause, naming who is
      // missing here, or the peer that gave up.
      auto kind = static_cast<ShmFailure::Kind>(control_->header.aborted_kind.load());
      if (kind == ShmFailure::Kind::kDestroyed) kind = ShmFailure::Kind::kPeerLost;
      const char* cause = kind == ShmFailure::Kind::kTimeout ? "timed out"
                          : kind == ShmFailure::Kind::kMismatch
                              ? "ranks passed different tensors (numel, dtype) or ops"
                              : "peer lost";
      throw ShmFailure(
          "group rank " + std::to_string(failed - 1) + " gave up on this operation (" + cause + ")",
          kind, late >= 0 ? late : failed - 1);
    }
    if (late < 0) return;
    if (spins < 100) continue;  // the peer is usually microseconds away
    auto now = Clock::now();
    // Then yield for a while before sleeping: a waiter that yields gives its core to any runnable
    // thread (DDP's backward on a busy machine) yet sees the peer arrive at once, where waking from
    // a futex costs tens of microseconds on a VM. Measured: 2-rank DDP steps ~10% faster than
    // sleeping at once.
    if (spins == 100) yield_until = now + kYieldBeforeSleeping;
    if (now < yield_until) {
      sched_yield();
      continue;
    }
    if (now > deadline)
      abort(ShmFailure("timed out waiting for group rank " + std::to_string(late),
                       ShmFailure::Kind::kTimeout, late));
    if (now > next_liveness_check) {
      next_liveness_check = now + kLivenessPeriod;
      for (int r = 0; r < size_; ++r) {
        int32_t pid = records[r].pid.load();
        bool same_namespace = records[r].pid_ns.load() == my_namespace;
        if (records[r].phase.load() < target && pid > 0 && same_namespace && kill(pid, 0) != 0 &&
            errno == ESRCH) {
          abort(ShmFailure(
              "group rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") exited",
              ShmFailure::Kind::kPeerLost, r));
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) {
        abort(ShmFailure("the group was destroyed during the operation",
                         ShmFailure::Kind::kDestroyed));
      }
    }
    futex_wait(wake_word, seen, std::chrono::microseconds(1000));
  }
}

void ShmTransport::all_reduce(const at::Tensor& tensor, ReduceOp op,
                              std::chrono::milliseconds timeout) {
  if (!tensor.is_contiguous()) {
    at::Tensor packed = tensor.contiguous();
    all_reduce(packed, op, timeout);
    tensor.copy_(packed);
    return;
  }
  const auto deadline = Clock::now() + timeout;
  const at::ScalarType type = tensor.scalar_type();
  const int64_t element = static_cast<int64_t>(tensor.element_size());
  const int64_t per_chunk = kChunkBytes / element;
  const int64_t numel = tensor.numel();
  char* data = static_cast<char*>(tensor.data_ptr());

  publish((static_cast<uint64_t>(numel) << 8) ^ static_cast<uint64_t>(type) ^
          (static_cast<uint64_t>(op) << 4));
  if (numel == 0) {
    barrier(deadline);
    check_agreement("all-reduce", numel, type);
  }
  for (int64_t offset = 0; offset < numel; offset += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - offset);
    const int set = static_cast<int>(chunks_++ % 2);
    char* chunk = data + offset * element;
    copy_into_slot(slot(set, rank_), chunk, n * element);
    barrier(deadline);
    if (offset == 0) check_agreement("all-reduce", numel, type);
    if (size_ == 1) continue;
    if (size_ == 2 || n * element * (size_ - 1) <= kDirectBytes) {
      // One step: every rank combines all slots itself, in rank order. Its own part comes from the
      // tensor, still in this core's cache (ranks 0 and 1 only: for the others the tensor already
      // holds a partial result by the time their turn comes).
      auto part = [&](int r) -> const char* { return r == rank_ && r < 2 ? chunk : slot(set, r); };
      combine_into(type, chunk, part(0), part(1), n, op);
      for (int r = 2; r < size_; ++r) combine_into(type, chunk, chunk, part(r), n, op);
      continue;
    }
    // Share r of the chunk is [n*r/size, n*(r+1)/size): rank r reduces it into its own slot.
    const int64_t begin = n * rank_ / size_, end = n * (rank_ + 1) / size_;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      reduce_into(type, slot(set, rank_) + begin * element, slot(set, r) + begin * element,
                  end - begin, op);
    }
    barrier(deadline);
    for (int r = 0; r < size_; ++r) {
      const int64_t lo = n * r / size_, hi = n * (r + 1) / size_;
      std::memcpy(chunk + lo * element, slot(set, r) + lo * element, (hi - lo) * element);
    }
  }
}

void ShmTransport::publish(uint64_t signature) {
  signature_ = signature;
  records_of(base_)[rank_].signature[operations_ % 2].store(signature, std::memory_order_relaxed);
}

void ShmTransport::check_agreement(const char* what, int64_t numel, at::ScalarType type) {
  // Safe to read right after the operation's first barrier: a peer that is already ahead can
  // publish its next operation's signature, but only into the other field, and it cannot come back
  // to this one before this rank reaches that next operation's first barrier.
  RankRecord* records = records_of(base_);
  const int field = static_cast<int>(operations_++ % 2);
  for (int r = 0; r < size_; ++r) {
    if (records[r].signature[field].load(std::memory_order_relaxed) != signature_) {
      abort(ShmFailure("group ranks " + std::to_string(rank_) + " and " + std::to_string(r) +
                           " passed different tensors (numel, dtype) or ops to the same " + what +
                           " (this rank: " + std::to_string(numel) + " elements of " +
                           c10::toString(type) + ")",
                       ShmFailure::Kind::kMismatch, r));
    }
  }
}

std::shared_future<void> ShmTransport::all_gather_async(std::vector<at::Tensor> outputs,
                                                        const at::Tensor& input,
                                                        std::chrono::milliseconds timeout) {
  return enqueue([this, outputs = std::move(outputs), input, timeout] {
    all_gather(outputs, input, timeout);
  });
}

std::shared_future<void> ShmTransport::reduce_scatter_async(const at::Tensor& output,
                                                            std::vector<at::Tensor> inputs,
                                                            ReduceOp op,
                                                            std::chrono::milliseconds timeout) {
  return enqueue([this, output, inputs = std::move(inputs), op, timeout] {
    reduce_scatter(output, inputs, op, timeout);
  });
}

std::shared_future<void> ShmTransport::all_reduce_regions_async(
    std::vector<char*> regions, int64_t numel, at::ScalarType type, double scale,
    std::chrono::milliseconds timeout, std::shared_ptr<const void> regions_owner) {
  if (type != at::kFloat && type != at::kDouble) {
    throw InternalError("shared-memory region all-reduce called for " +
                        std::string(c10::toString(type)));
  }
  return enqueue([this, regions = std::move(regions), numel, type, scale, timeout,
                  owner = std::move(regions_owner)] {
    all_reduce_regions(regions, numel, type, scale, timeout);
  });
}

constexpr uint64_t kRegionsTag = uint64_t{1} << 60;

void ShmTransport::all_reduce_regions(const std::vector<char*>& regions, int64_t numel,
                                      at::ScalarType type, double scale,
                                      std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  publish(kRegionsTag ^ (static_cast<uint64_t>(numel) << 8) ^ static_cast<uint64_t>(type));
  barrier(deadline);  // every rank's part is complete
  check_agreement("gradient bucket all-reduce", numel, type);
  // Rank r sums share r and writes the result into every region: each element is computed once, so
  // all ranks hold the same bits. Shares start on cache-line boundaries (16 floats), so no two
  // ranks write one line.
  constexpr int64_t kAlign = 16;
  const int64_t per_rank = (numel + size_ * kAlign - 1) / (size_ * kAlign) * kAlign;
  const int64_t begin = std::min(numel, per_rank * rank_),
                end = std::min(numel, per_rank * (rank_ + 1));
  if (type == at::kFloat) {
    sum_into_every_region<float>(regions, begin, end, static_cast<float>(scale));
  } else {
    sum_into_every_region<double>(regions, begin, end, scale);
  }
  // Every region holds the whole result, and no rank reads another's region any more.
  barrier(deadline);
}

// Signatures of the two collectives below differ from an all-reduce's in their top bits, so ranks
// that issued different collectives are told apart too.
constexpr uint64_t kAllGatherTag = uint64_t{1} << 62;
constexpr uint64_t kReduceScatterTag = uint64_t{1} << 61;

void ShmTransport::all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const at::Tensor in = input.contiguous();
  std::vector<at::Tensor> out(outputs.size());
  for (size_t r = 0; r < outputs.size(); ++r)
    out[r] = outputs[r].is_contiguous() ? outputs[r] : outputs[r].contiguous();
  const int64_t element = static_cast<int64_t>(in.element_size());
  const int64_t per_chunk = kChunkBytes / element;
  const int64_t numel = in.numel();
  publish(kAllGatherTag ^ (static_cast<uint64_t>(numel) << 8) ^
          static_cast<uint64_t>(in.scalar_type()));
  if (numel == 0) {
    barrier(deadline);
    check_agreement("all-gather", numel, in.scalar_type());
  }
  const char* data = static_cast<const char*>(in.data_ptr());
  for (int64_t offset = 0; offset < numel; offset += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - offset);
    const int set = static_cast<int>(chunks_++ % 2);
    copy_into_slot(slot(set, rank_), data + offset * element, n * element);
    barrier(deadline);
    if (offset == 0) check_agreement("all-gather", numel, in.scalar_type());
    for (int r = 0; r < size_; ++r) {
      std::memcpy(static_cast<char*>(out[r].data_ptr()) + offset * element, slot(set, r),
                  n * element);
    }
  }
  for (size_t r = 0; r < outputs.size(); ++r) {
    if (!out[r].is_same(outputs[r])) outputs[r].copy_(out[r]);
  }
}

void ShmTransport::reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                  ReduceOp op, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<at::Tensor> in(inputs.size());
  for (size_t r = 0; r < inputs.size(); ++r) in[r] = inputs[r].contiguous();
  at::Tensor out = output.is_contiguous() ? output : output.contiguous();
  const at::ScalarType type = out.scalar_type();
  const int64_t element = static_cast<int64_t>(out.element_size());
  const int64_t per_chunk = kChunkBytes / element / size_;  // the slot holds one piece per rank
  const int64_t numel = out.numel();
  publish(kReduceScatterTag ^ (static_cast<uint64_t>(numel) << 8) ^ static_cast<uint64_t>(type) ^
          (static_cast<uint64_t>(op) << 4));
  if (numel == 0) {
    barrier(deadline);
    check_agreement("reduce-scatter", numel, type);
  }
  char* result = static_cast<char*>(out.data_ptr());
  for (int64_t offset = 0; offset < numel; offset += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - offset);
    const int set = static_cast<int>(chunks_++ % 2);
    for (int piece = 0; piece < size_; ++piece) {
      copy_into_slot(slot(set, rank_) + piece * n * element,
                     static_cast<const char*>(in[piece].data_ptr()) + offset * element,
                     n * element);
    }
    barrier(deadline);
    if (offset == 0) check_agreement("reduce-scatter", numel, type);
    // Every rank's piece `rank_`, summed in rank order: the same operands in the same order on any
    // rank.
    char* mine = result + offset * element;
    std::memcpy(mine, slot(set, 0) + rank_ * n * element, n * element);
    for (int r = 1; r < size_; ++r)
      reduce_into(type, mine, slot(set, r) + rank_ * n * element, n, op);
  }
  if (!out.is_same(output)) output.copy_(out);
}

}  // namespace dtrain::detail
