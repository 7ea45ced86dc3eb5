// A POSIX shared-memory segment mapped by every rank of a group on one host.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace dtrain::detail {

class ShmSegment {
 public:
  ShmSegment(void* base, size_t bytes, int fd) : base_(base), bytes_(bytes), fd_(fd) {}
  ~ShmSegment();  // unmaps (and closes the file, if kept)
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  char* base() const { return static_cast<char*>(base_); }
  size_t bytes() const { return bytes_; }
  int fd() const { return fd_; }  // -1 unless SegmentOptions::keep_fd

 private:
  void* base_;
  size_t bytes_;
  int fd_;
};

struct SegmentOptions {
  size_t bytes = 0;  // the segment's size, the same on every rank
  // How much of it rank 0 reserves in /dev/shm at once: a /dev/shm too small must mean "no shared
  // memory", not a SIGBUS at the first write to a page tmpfs cannot back. The rest stays sparse
  // until reserved through fd() (keep_fd).
  size_t reserve_bytes = SIZE_MAX;
  bool keep_fd = false;  // keep the file open, for later reservations
  // false: this rank takes part but declines, so every rank gets nullptr (ranks that disagree on
  // wanting the segment still agree on the outcome).
  bool wanted = true;
  // Runs on this rank's mapping before any peer can learn that it is attached.
  std::function<void(char* base)> on_mapped;
};

// Collective over the ranks behind `store`: rank 0 creates the segment, the others open it by the
// name rank 0 publishes under `key`, and once every rank has mapped it rank 0 unlinks the name, so
// nothing is left in /dev/shm whatever happens later. Returns nullptr on every rank when any rank
// could not (or would not) map it; `problem` then holds what went wrong here (empty if it was
// another rank). Throws only if the store times out (a peer never came).
std::unique_ptr<ShmSegment> map_group_segment(c10d::Store& store, const std::string& key, int rank,
                                              int size, std::chrono::milliseconds timeout,
                                              const SegmentOptions& options, std::string& problem);

}  // namespace dtrain::detail
