// Who this process is, as peers on the same machine can check it: the pid namespace a pid means
// something in, and the host's name. Shared by the shared-memory transports (a dead peer is told
// from a slow one by its pid) and in-place recovery's membership (a member seen dead by its pid).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace dtrain::detail {

// The inode of /proc/self/ns/pid: equal for processes whose pids can be checked with kill(pid, 0)
// from here (containers sharing /dev/shm may not share a pid namespace); 0 when unknown.
inline uint64_t own_pid_namespace() {
  struct stat info {};
  return stat("/proc/self/ns/pid", &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
}

// This machine's hostname; "unknown" when it cannot be read.
inline std::string own_hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

// A process of this host among every host's: "<hostname>/<pid>/<pid namespace>", as in-place
// recovery's store names it (a member's id, a launcher's notice that a worker exited, a member's
// mark that it took part in the end).
inline std::string process_key(pid_t pid) {
  return own_hostname() + "/" + std::to_string(pid) + "/" + std::to_string(own_pid_namespace());
}

}  // namespace dtrain::detail
