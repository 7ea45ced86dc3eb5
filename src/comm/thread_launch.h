// Ranks as threads (dtrain::spawn with SpawnMode::kThreads): while a ScopedThreadLaunch lives on a
// thread, launch_info_from_env() called on that thread reports its rank, and init_process_group()
// with the default "env://" joins the in-process store named here instead of a TCP store. Other
// threads are unaffected.
#pragma once

#include <string>

namespace dtrain::detail {

struct ThreadLaunch {
  int rank = 0;
  int world_size = 1;
  std::string store_name;  // init_process_group("env://") opens "memory://<store_name>"
};

// The launch of the calling thread, or nullptr.
const ThreadLaunch* current_thread_launch();

class ScopedThreadLaunch {
 public:
  explicit ScopedThreadLaunch(ThreadLaunch launch);
  ~ScopedThreadLaunch();
  ScopedThreadLaunch(const ScopedThreadLaunch&) = delete;
  ScopedThreadLaunch& operator=(const ScopedThreadLaunch&) = delete;

 private:
  ThreadLaunch launch_;
  const ThreadLaunch* previous_;
};

}  // namespace dtrain::detail
