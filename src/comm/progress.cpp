// Progress records for naming missing ranks; see Note [Progress publishing off the hot path].
#include "comm/progress.h"

#include <chrono>
#include <sstream>

#include "comm/store_bytes.h"
#include "common/log.h"

namespace dtrain::detail {
namespace {

std::string key_for(int rank) { return "progress/" + std::to_string(rank); }

// Wall-clock time, comparable between hosts (unlike steady_clock) as far as their clocks agree.
int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string unreadable_store(const std::string& why) {
  return "the store could not be read to find the missing ranks (" + why +
         "); rank 0 hosts it and may have died";
}

}  // namespace

ProgressTracker::ProgressTracker(c10::intrusive_ptr<c10d::Store> store, int group_rank,
                                 int group_size)
    : store_(std::move(store)), rank_(group_rank), size_(group_size) {
  publish_now();
  publisher_ = std::thread([this] { publish_loop(); });
}

ProgressTracker::~ProgressTracker() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  publisher_.join();
}

uint64_t ProgressTracker::begin(const char* op) {
  std::lock_guard<std::mutex> lock(latest_mutex_);
  op_ = op;
  return ++seq_;
}

void ProgressTracker::publish_now() {
  std::lock_guard<std::mutex> lock(publish_mutex_);
  uint64_t seq;
  const char* op;
  {
    std::lock_guard<std::mutex> latest(latest_mutex_);
    seq = seq_;
    op = op_;
  }
  if (seq == published_seq_) return;
  std::string record = std::to_string(seq) + " " + op + " " + std::to_string(unix_ms());
  try {
    store_->set(key_for(rank_), bytes_of(record));
    published_seq_ = seq;
  } catch (const std::exception& e) {
    // The store's host (rank 0) may be gone; the collective itself will report the failure.
    DTRAIN_LOG(kDebug, "could not publish progress: " << e.what());
  }
}

void ProgressTracker::publish_loop() {
  std::unique_lock<std::mutex> lock(wake_mutex_);
  while (!stop_) {
    wake_.wait_for(lock, kPublishInterval);
    if (stop_) break;
    lock.unlock();
    publish_now();
    lock.lock();
  }
}

std::string ProgressTracker::describe_missing(uint64_t seq, const std::vector<int>& to_global,
                                              bool let_peers_post) {
  publish_now();
  // A failure (unlike a timeout) can come right after peers moved on: give their publishers time to
  // post where they are. This runs only on the error path.
  if (let_peers_post) std::this_thread::sleep_for(3 * kPublishInterval);
  std::vector<int> missing;
  std::ostringstream where;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    uint64_t seen = 0;
    std::string op = "nothing";
    int64_t published_ms = 0;
    try {
      if (store_->check({key_for(r)})) {
        auto bytes = store_->get(key_for(r));
        std::istringstream record(std::string(bytes.begin(), bytes.end()));
        record >> seen >> op >> published_ms;
      }
    } catch (const c10::Error& e) {
      // The store's own message, without the C++ backtrace c10 appends to what(): this sentence
      // ends up in every peer's one-line error.
      return unreadable_store(e.what_without_backtrace());
    } catch (const std::exception& e) {
      return unreadable_store(e.what());
    }
    if (seen >= seq) continue;
    missing.push_back(r);
    if (missing.size() <= 4) {  // enough to act on; the set of ranks below names them all
      where << (missing.size() > 1 ? "; " : "") << "rank " << to_global[r] << " last seen at "
            << (seen == 0 ? std::string("start-up") : op + " #" + std::to_string(seen));
      // How long it has not moved on tells a dead or hung rank (many seconds) from one that is busy
      // elsewhere. A peer whose clock runs ahead of ours would give a negative age: then none is
      // given.
      const int64_t age_ms = unix_ms() - published_ms;
      if (seen != 0 && published_ms > 0 && age_ms >= 0) {
        where << ", " << age_ms / 1000 << "." << age_ms % 1000 / 100 << " s ago";
      }
    }
  }
  if (missing.empty()) {
    return "every rank reached it, so the transport itself stalled or a peer died inside it";
  }
  std::ostringstream out;
  out << "ranks {";
  for (size_t i = 0; i < missing.size(); ++i) out << (i ? "," : "") << to_global[missing[i]];
  out << "} never joined (" << where.str() << ")";
  return out.str();
}

}  // namespace dtrain::detail
