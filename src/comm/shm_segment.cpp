// Shared-memory segments mapped by every rank of a group; see shm_segment.h.
#include "comm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <vector>

#include "comm/store_bytes.h"
#include "common/format.h"

namespace dtrain::detail {

ShmSegment::~ShmSegment() {
  munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

std::unique_ptr<ShmSegment> map_group_segment(c10d::Store& store, const std::string& key, int rank,
                                              int size, std::chrono::milliseconds timeout,
                                              const SegmentOptions& options, std::string& problem) {
  problem.clear();
  const size_t bytes = options.bytes;
  const bool wanted = options.wanted;
  std::string name;
  int fd = -1;
  auto give_up_fd = [&](const char* what) {
    problem = std::string(what) + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    fd = -1;
  };
  if (rank == 0 && !wanted) {
    store.set(key + "/name", bytes_of(""));
  } else if (rank == 0) {
    std::random_device random;
    name = "/dtrain-" + std::to_string(::getpid()) + "-" + std::to_string(random());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      give_up_fd("shm_open");
    } else if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      give_up_fd("sizing the segment");
    } else if (int err = posix_fallocate(
                   fd, 0, static_cast<off_t>(std::min(bytes, options.reserve_bytes)));
               err != 0) {
      errno = err;
      give_up_fd("reserving the segment in /dev/shm");
    }
    if (fd < 0) {
      shm_unlink(name.c_str());
      name.clear();
    }
    store.set(key + "/name", bytes_of(name));  // empty: no shared memory
  } else {
    auto value = store.get(key + "/name");
    name.assign(value.begin(), value.end());
    if (!name.empty() && wanted) {
      fd = shm_open(name.c_str(), O_RDWR, 0600);
      if (fd < 0) give_up_fd("shm_open");
    }
  }
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) problem = std::string("mmap: ") + std::strerror(errno);
    if (base == MAP_FAILED || !options.keep_fd) {
      close(fd);
      fd = -1;
    }
  }
  const bool attached = base != MAP_FAILED;
  if (attached && options.on_mapped) options.on_mapped(static_cast<char*>(base));
  store.set(key + "/attached/" + std::to_string(rank), bytes_of(attached ? "1" : "0"));

  // Everyone learns whether everyone attached: the segment is used only if all ranks can.
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key + "/attached/" + std::to_string(r));
  bool all_attached = true;
  std::vector<int> not_attached;
  try {
    store.wait(keys, timeout);
    for (int r = 0; r < size; ++r) {
      auto value = store.get(keys[r]);
      if (value.size() == 1 && value[0] == '1') continue;
      all_attached = false;
      not_attached.push_back(r);
    }
  } catch (...) {
    if (rank == 0 && !name.empty()) shm_unlink(name.c_str());
    if (attached) munmap(base, bytes);
    if (fd >= 0) close(fd);
    throw;
  }
  if (rank == 0 && !name.empty())
    shm_unlink(name.c_str());  // mapped everywhere now; no name to leak
  if (!all_attached) {
    // Every rank says why it falls back, not only the one that failed: the message each caller
    // prints then names the ranks whose attach failed (theirs also say how).
    if (wanted && problem.empty()) {
      std::vector<std::string> ranks;
      for (int r : not_attached) ranks.push_back(std::to_string(r));
      problem = "rank" + std::string(ranks.size() > 1 ? "s " : " ") + list_text(ranks) +
                " could not map the segment";
    }
    if (attached) munmap(base, bytes);
    if (fd >= 0) close(fd);
    return nullptr;
  }
  return std::make_unique<ShmSegment>(base, bytes, fd);
}

}  // namespace dtrain::detail
