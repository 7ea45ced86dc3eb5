// A POSIX shared-memory segment mapped by every rank of a group on one host.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace dtrain::detail {

class ShmSegment {
 public:
  ShmSegment(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  char* base() const { return static_cast<char*>(base_); }
  size_t bytes() const { return bytes_; }

 private:
  void* base_;
  size_t bytes_;
};

// Collective over the ranks behind `store`: rank 0 creates a segment of `bytes` and reserves all of it in
// /dev/shm at once (a /dev/shm too small must mean "no shared memory", not a SIGBUS at the first write to a
// page tmpfs cannot back); the others open it by the name rank 0 publishes under `key`; once every rank
// has mapped it rank 0 unlinks the name, so nothing is left in /dev/shm whatever happens later.
// `on_mapped` runs on this rank's mapping before any peer can learn that it is attached. Returns nullptr on
// every rank when any rank could not map it; `problem` then holds what went wrong here (empty if it was
// another rank). `wanted` false: this rank takes part but declines, so every rank gets nullptr (ranks that
// disagree on wanting it still agree on the outcome). Throws only if the store times out (a peer never came).
std::unique_ptr<ShmSegment> map_group_segment(c10d::Store& store, const std::string& key, int rank, int size,
                                              size_t bytes, std::chrono::milliseconds timeout,
                                              const std::function<void(char* base)>& on_mapped,
                                              std::string& problem, bool wanted = true);

}  // namespace dtrain::detail
