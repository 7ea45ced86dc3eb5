// The fixture of the `dtrain run` end-to-end tests (launcher_test.cpp, recovery_test.cpp): runs the
// real build/bin/dtrain with small /bin/sh workers in a temporary folder, every wait bounded.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "test_support.h"

namespace dtrain::cli::testing_support {

// A launcher run normally takes well under a second; the bound only turns a hang into a failure,
// and is generous because the test machine may be loaded.
constexpr auto kRunTimeout = 30s;

struct RunResult {
  int exit_code = -1;  // -1: the launcher timed out (and was killed)
  std::string out;
  std::string err;
  double seconds = 0;
};

class LauncherTest : public testing::Test {
 protected:
  // Runs `dtrain ARGS...` to completion (bounded by `timeout`).
  RunResult dtrain(const Args& args, const EnvChanges& env = {},
                   std::chrono::milliseconds timeout = kRunTimeout) {
    Args argv = {DTRAIN_LAUNCHER};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string name = "launcher" + std::to_string(runs_++);
    ChildProcess launcher(argv, dir_ / (name + ".out"), dir_ / (name + ".err"), env);
    RunResult result;
    bool exited = launcher.wait(timeout);
    EXPECT_TRUE(exited) << "dtrain did not exit within the time limit: "
                        << testing::PrintToString(args);
    if (exited) result.exit_code = launcher.exit_code();
    result.out = read_file(dir_ / (name + ".out"));
    result.err = read_file(dir_ / (name + ".err"));
    result.seconds = launcher.seconds();
    return result;
  }

  // A shell worker: `script` runs under /bin/sh with the test's temporary folder as $1.
  Args sh(const std::string& script) const {
    return {"/bin/sh", "-c", script, "sh", dir_.path().string()};
  }

  // The pid written by each rank to "<prefix>.<rank>" in the temporary folder, once all are
  // written.
  std::vector<pid_t> wait_for_pids(const std::string& prefix, int ranks) {
    std::vector<pid_t> pids;
    bool written = wait_until(
        [&] {
          pids.clear();
          for (int rank = 0; rank < ranks; ++rank) {
            std::string text = read_file(dir_ / (prefix + "." + std::to_string(rank)));
            if (text.empty() || text.back() != '\n') return false;
            pids.push_back(static_cast<pid_t>(std::stol(text)));
          }
          return true;
        },
        kRunTimeout);
    EXPECT_TRUE(written) << "workers did not write their " << prefix << " files";
    for (pid_t pid : pids) cleanup_.push_back(pid);
    return pids;
  }

  // Waits (bounded) for every pid to be gone; reports the survivors.
  void expect_all_gone(const std::vector<pid_t>& pids, const std::string& what) {
    bool gone = wait_until(
        [&] {
          for (pid_t pid : pids) {
            if (process_alive(pid)) return false;
          }
          return true;
        },
        5s);
    std::string survivors;
    for (pid_t pid : pids) {
      if (!process_alive(pid)) continue;
      survivors += ' ';  // appended: GCC 12 warns falsely on ' ' + std::to_string(pid)
      survivors += std::to_string(pid);
    }
    EXPECT_TRUE(gone) << what << " still alive:" << survivors;
  }

  void TearDown() override {
    // A failed test must not leave sleepers behind for the next one.
    for (pid_t pid : cleanup_) {
      if (process_alive(pid)) {
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
      }
    }
  }

  TempDir dir_;
  int runs_ = 0;
  std::vector<pid_t> cleanup_;
};

inline Args concat(Args head, const Args& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

}  // namespace dtrain::cli::testing_support
