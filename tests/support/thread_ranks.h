// Tier-1 test harness: runs `world_size` ranks as threads of this process, each with its own
// process group over a shared in-memory store, and rethrows the first failure on the calling
// thread.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "dtrain/comm.h"

namespace dtrain::testing {

// A store name no other test in this process uses.
inline std::string unique_store_name(const std::string& stem) {
  static std::atomic<int> counter{0};
  return "memory://" + stem + "-" + std::to_string(counter++);
}

inline void run_ranks(int world_size, const std::function<void(int rank)>& body) {
  std::mutex mutex;
  std::exception_ptr first_failure;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_failure) first_failure = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first_failure) std::rethrow_exception(first_failure);
}

// Runs `body(rank, group)` on `world_size` thread-ranks, each with a group from init_process_group.
// `body` takes the group as init_process_group returns it and dtrain's classes take it,
// `const std::shared_ptr<ProcessGroup>&`, or as `ProcessGroup&` where it only runs collectives.
// shared_memory=false forces every all-reduce through Gloo, so both transports get tested.
template <typename Body>
void run_group(int world_size, Body&& body,
               std::chrono::milliseconds timeout = std::chrono::seconds(60),
               bool shared_memory = true) {
  std::string method = unique_store_name("group");
  run_ranks(world_size, [&](int rank) {
    InitOptions options;
    options.init_method = method;
    options.rank = rank;
    options.world_size = world_size;
    options.timeout = timeout;
    options.shared_memory = shared_memory;
    std::shared_ptr<ProcessGroup> group = init_process_group(options);
    if constexpr (std::is_invocable_v<Body&, int, const std::shared_ptr<ProcessGroup>&>) {
      body(rank, group);
    } else {
      body(rank, *group);
    }
  });
}

}  // namespace dtrain::testing
