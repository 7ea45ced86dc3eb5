// Progress records: how far each rank of a group has got in its sequence of collectives, kept in
// the group's store so that a rank that times out can name the ranks that never arrived.
//
// Note [Progress publishing off the hot path]
// Writing to the store on every collective would cost a TCP round trip (tens of microseconds) per
// call, a visible share of a small DDP step. Instead a collective only bumps an in-memory counter,
// and a background thread publishes "<seq> <op> <unix ms>" to the store when it changed, at most
// every kPublishInterval. A rank that times out has waited far longer than that interval, so by
// then every peer that reached the collective has published it; the timed-out rank publishes its
// own record at once and reads everyone's.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace dtrain::detail {

class ProgressTracker {
 public:
  static constexpr std::chrono::milliseconds kPublishInterval{100};

  // `store` is the group's own (prefixed) store; records live under "progress/<group rank>".
  ProgressTracker(c10::intrusive_ptr<c10d::Store> store, int group_rank, int group_size);
  ~ProgressTracker();

  // Called as a collective starts on this rank; returns its sequence number (1, 2, ...). `op` must
  // be a string literal (kept by pointer).
  uint64_t begin(const char* op);

  // One sentence naming the group ranks that have not reached collective `seq`, with where each was
  // last seen and how long ago (by the clocks of both hosts, to within kPublishInterval), e.g.
  // "ranks {3} never joined (rank 3 last seen at broadcast #36, 30.1 s ago)". `to_global` maps
  // group ranks to the job's ranks for the message. `let_peers_post`: first wait a few publish
  // intervals so that peers that moved on have posted it (a failure can come right after); not
  // needed when the transport has already seen which peer died, and in-place recovery
  // (dtrain/recovery.h) would wait for it on every failure.
  std::string describe_missing(uint64_t seq, const std::vector<int>& to_global,
                               bool let_peers_post = true);

 private:
  void publish_loop();
  void publish_now();

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  // The latest collective's number and name, read together by the publisher (a tiny lock, never
  // held across the store's I/O, so a collective never waits for a publication).
  std::mutex latest_mutex_;
  uint64_t seq_ = 0;
  const char* op_ = "init";
  uint64_t published_seq_ = UINT64_MAX;  // touched under publish_mutex_ only
  std::mutex publish_mutex_;
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread publisher_;
};

}  // namespace dtrain::detail
