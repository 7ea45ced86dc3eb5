// Shared-memory all-reduce for ranks on one host; see Note [Shared-memory all-reduce] in shm_transport.h.
#include "comm/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>

#include "common/log.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kLine = 64;  // one cache line per rank's record: no false sharing between ranks

// The segment starts with this header, then one RankRecord per rank, then the slots at a page boundary.
struct Header {
  std::atomic<uint32_t> wake_word;  // bumped at every barrier arrival; waiters sleep on it (futex)
};
struct alignas(kLine) RankRecord {
  std::atomic<uint64_t> phase;  // barriers this rank has reached
  std::atomic<int32_t> pid;     // to tell a dead peer from a slow one
};

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

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

template <typename T, typename Combine>
void combine_into(T* dst, const T* src, int64_t n, Combine combine) {
  for (int64_t i = 0; i < n; ++i) dst[i] = combine(dst[i], src[i]);
}

template <typename T>
void reduce_typed(char* dst, const char* src, int64_t n, ReduceOp op) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return combine_into(d, s, n, [](T a, T b) { return a + b; });
    case ReduceOp::kProduct:
      return combine_into(d, s, n, [](T a, T b) { return a * b; });
    case ReduceOp::kMin:
      return combine_into(d, s, n, [](T a, T b) { return std::min(a, b); });
    case ReduceOp::kMax:
      return combine_into(d, s, n, [](T a, T b) { return std::max(a, b); });
  }
}

void reduce_into(at::ScalarType type, char* dst, const char* src, int64_t n, ReduceOp op) {
  switch (type) {
    case at::kFloat: return reduce_typed<float>(dst, src, n, op);
    case at::kDouble: return reduce_typed<double>(dst, src, n, op);
    case at::kInt: return reduce_typed<int32_t>(dst, src, n, op);
    case at::kLong: return reduce_typed<int64_t>(dst, src, n, op);
    default: throw InternalError("shared-memory all-reduce called for an unsupported dtype");
  }
}

}  // namespace

struct ShmTransport::Segment {
  Header header;
};

std::unique_ptr<ShmTransport> ShmTransport::create(c10d::Store& store, int rank, int size,
                                                   std::chrono::milliseconds timeout) {
  const size_t bytes = slots_offset(size) + 2 * static_cast<size_t>(size) * kChunkBytes;
  std::string name;
  int fd = -1;
  std::string problem;
  if (rank == 0) {
    std::random_device random;
    name = "/dtrain-" + std::to_string(::getpid()) + "-" + std::to_string(random());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      problem = std::strerror(errno);
      if (fd >= 0) shm_unlink(name.c_str());
      name.clear();
    }
    store.set("shm/name", bytes_of(name));  // empty: no shared memory for this group
  } else {
    auto value = store.get("shm/name");
    name.assign(value.begin(), value.end());
    if (!name.empty()) {
      fd = shm_open(name.c_str(), O_RDWR, 0600);
      if (fd < 0) problem = std::strerror(errno);
    }
  }
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) problem = std::strerror(errno);
    close(fd);
  }
  bool attached = base != MAP_FAILED;
  store.set("shm/attached/" + std::to_string(rank), bytes_of(attached ? "1" : "0"));

  // Everyone learns whether everyone attached: the group uses shared memory only if all ranks can.
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back("shm/attached/" + std::to_string(r));
  store.wait(keys, timeout);
  bool all_attached = true;
  for (const auto& key : keys) {
    auto value = store.get(key);
    all_attached = all_attached && value.size() == 1 && value[0] == '1';
  }
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());  // mapped everywhere now; no name to leak
  if (!all_attached) {
    if (attached) munmap(base, bytes);
    if (!problem.empty()) {
      DTRAIN_LOG(kWarn, "shared memory unavailable (" << problem << "); all-reduce goes through Gloo");
    }
    return nullptr;
  }
  return std::unique_ptr<ShmTransport>(new ShmTransport(rank, size, base, bytes));
}

ShmTransport::ShmTransport(int rank, int size, void* base, size_t bytes)
    : rank_(rank), size_(size), base_(base), bytes_(bytes), control_(static_cast<Segment*>(base)) {
  auto* record = reinterpret_cast<RankRecord*>(static_cast<char*>(base_) + kLine) + rank_;
  record->pid.store(static_cast<int32_t>(::getpid()));
  worker_ = std::thread([this] { run_queue(); });
}

ShmTransport::~ShmTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
  munmap(base_, bytes_);
}

bool ShmTransport::supports(const at::Tensor& tensor, ReduceOp op) {
  auto type = tensor.scalar_type();
  bool type_ok = type == at::kFloat || type == at::kDouble || type == at::kInt || type == at::kLong;
  return tensor.device().is_cpu() && tensor.is_contiguous() && !tensor.is_sparse() && type_ok;
}

char* ShmTransport::slot(int set, int rank) const {
  return static_cast<char*>(base_) + slots_offset(size_) +
         (static_cast<size_t>(set) * size_ + rank) * static_cast<size_t>(kChunkBytes);
}

std::shared_future<void> ShmTransport::all_reduce_async(const at::Tensor& tensor, ReduceOp op,
                                                        std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<void>>();
  std::shared_future<void> done = promise->get_future().share();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back([this, tensor, op, timeout, promise] {
      try {
        all_reduce(tensor, op, timeout);
        promise->set_value();
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
  }
  wake_.notify_one();
  return done;
}

void ShmTransport::run_queue() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    auto job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
}

void ShmTransport::barrier(Clock::time_point deadline, std::chrono::milliseconds timeout) {
  auto* records = reinterpret_cast<RankRecord*>(static_cast<char*>(base_) + kLine);
  std::atomic<uint32_t>* wake_word = &control_->header.wake_word;
  const uint64_t target = ++phase_;
  records[rank_].phase.store(target, std::memory_order_release);
  wake_word->fetch_add(1, std::memory_order_release);
  futex_wake_all(wake_word);

  auto next_liveness_check = Clock::now() + std::chrono::milliseconds(200);
  for (int spins = 0;; ++spins) {
    uint32_t seen = wake_word->load(std::memory_order_acquire);
    int late = -1;
    for (int r = 0; r < size_ && late < 0; ++r) {
      if (records[r].phase.load(std::memory_order_acquire) < target) late = r;
    }
    if (late < 0) return;
    if (spins < 100) continue;  // the peer is usually microseconds away
    auto now = Clock::now();
    if (now > deadline) throw ShmFailure("timed out", true);
    if (now > next_liveness_check) {
      next_liveness_check = now + std::chrono::milliseconds(200);
      for (int r = 0; r < size_; ++r) {
        int32_t pid = records[r].pid.load();
        if (records[r].phase.load() < target && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
          throw ShmFailure("rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") exited", false);
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) throw ShmFailure("the group was destroyed during the operation", false);
    }
    futex_wait(wake_word, seen, std::chrono::microseconds(1000));
  }
}

void ShmTransport::all_reduce(const at::Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const int64_t element = static_cast<int64_t>(tensor.element_size());
  const int64_t per_chunk = kChunkBytes / element;
  const int64_t numel = tensor.numel();
  char* data = static_cast<char*>(tensor.data_ptr());
  for (int64_t offset = 0; offset < numel; offset += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - offset);
    const int set = static_cast<int>(chunks_++ % 2);
    char* chunk = data + offset * element;
    std::memcpy(slot(set, rank_), chunk, n * element);
    barrier(deadline, timeout);
    // Share r of the chunk is [n*r/size, n*(r+1)/size): rank r reduces it into its own slot.
    const int64_t begin = n * rank_ / size_, end = n * (rank_ + 1) / size_;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      reduce_into(tensor.scalar_type(), slot(set, rank_) + begin * element, slot(set, r) + begin * element,
                  end - begin, op);
    }
    barrier(deadline, timeout);
    for (int r = 0; r < size_; ++r) {
      const int64_t lo = n * r / size_, hi = n * (r + 1) / size_;
      std::memcpy(chunk + lo * element, slot(set, r) + lo * element, (hi - lo) * element);
    }
  }
}

}  // namespace dtrain::detail
