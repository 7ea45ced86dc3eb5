// dtrain::spawn: ranks as re-executed processes (success, a failing rank named, a crashing rank
// named, no orphans after the parent is killed, SIGTERM to the parent reaching the workers) and as
// threads (the same parameters as processes after k DDP steps). The spawning program is
// tests/workers/spawn_worker.cpp.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace {

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Alive and not a zombie.
bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

TEST(Spawn, EveryRankRunsWithTheTorchrunEnvironment) {
  std::string dir = temp_dir("spawn-ok");
  std::filesystem::create_directories(dir);
  auto result = run_command(bin("spawn_worker") + " 3 ok " + dir, 60);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  std::string port;
  for (int r = 0; r < 3; ++r) {
    std::string text = read_file(dir + "/rank" + std::to_string(r));
    std::istringstream fields(text);
    std::string rank, world, local, master_port;
    fields >> rank >> world >> local >> master_port;
    EXPECT_EQ(rank, std::to_string(r)) << text;
    EXPECT_EQ(world, "3");
    EXPECT_EQ(local, std::to_string(r));
    EXPECT_GT(std::atoi(master_port.c_str()), 0);
    if (r > 0) EXPECT_EQ(master_port, port) << "every rank must get the same MASTER_PORT";
    port = master_port;
  }
  std::filesystem::remove_all(dir);
}

TEST(Spawn, AFailingRankIsNamedWithItsMessageAndTheOthersAreStopped) {
  auto start = std::chrono::steady_clock::now();
  auto result = run_command(bin("spawn_worker") + " 3 fail 1", 240);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("dtrain::spawn: rank 1/3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("exited with status 1: rank 1 gives up on purpose"),
            std::string::npos)
      << result.output;
  // The ranks write to the program's own stdout and stderr, not through `dtrain run`'s relay.
  EXPECT_NE(result.output.find("[dtrain] error: dtrain::spawn: rank 1/3: rank 1 gives up"),
            std::string::npos)
      << result.output;
  EXPECT_EQ(result.output.find("[rank1]: "), std::string::npos) << result.output;
  // The other ranks sleep 300 s; spawn must stop them instead of waiting (the bound leaves room for
  // starting three LibTorch processes on a loaded 2-core machine).
  EXPECT_LT(seconds, 120) << result.output;
}

TEST(Spawn, ACrashingRankIsNamedWithItsSignal) {
  auto result = run_command(bin("spawn_worker") + " 2 crash 0", 240);
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("rank 0/2"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("killed by signal " + std::to_string(SIGSEGV)), std::string::npos)
      << result.output;
}

// Starts `spawn_worker 2 <what> <dir>` as a child of this test and returns its pid (the spawning
// parent) once both workers wrote their pid files into `dir`, with the workers' pids in `workers`;
// -1 if they did not within 60 s (the parent is killed then).
pid_t start_spawn_parent(const char* what, const std::string& dir, std::vector<pid_t>& workers) {
  pid_t parent = ::fork();
  if (parent == 0) {
    std::string program = bin("spawn_worker");
    ::execl(program.c_str(), program.c_str(), "2", what, dir.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (parent > 0 && std::chrono::steady_clock::now() < deadline) {
    workers.clear();
    for (int r = 0; r < 2; ++r) {
      std::string text = read_file(dir + "/pid" + std::to_string(r));
      if (!text.empty()) workers.push_back(std::atoi(text.c_str()));
    }
    if (workers.size() == 2) return parent;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (parent > 0) {
    ::kill(parent, SIGKILL);
    ::waitpid(parent, nullptr, 0);
  }
  return -1;
}

TEST(Spawn, NoOrphansAfterTheParentIsKilled) {
  std::string dir = temp_dir("spawn-orphans");
  std::filesystem::create_directories(dir);
  std::vector<pid_t> workers;
  pid_t parent = start_spawn_parent("hang", dir, workers);
  ASSERT_GT(parent, 0) << "the workers never started";
  for (pid_t w : workers) ASSERT_TRUE(process_alive(w));
  ::kill(parent, SIGKILL);
  ::waitpid(parent, nullptr, 0);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool any_alive = true;
  while (any_alive && std::chrono::steady_clock::now() < deadline) {
    any_alive = false;
    for (pid_t w : workers) any_alive = any_alive || process_alive(w);
    if (any_alive) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t w : workers) {
    EXPECT_FALSE(process_alive(w)) << "worker " << w << " outlived its killed parent";
    if (process_alive(w)) ::kill(w, SIGKILL);
  }
  std::filesystem::remove_all(dir);
}

TEST(Spawn, SigtermToTheParentReachesTheWorkersBeforeItEnds) {
  // A scheduler that preempts a job signals the process it started, the parent: the workers must
  // get SIGTERM too and time to act on it (save a checkpoint), as under `dtrain run`, and the
  // parent must still end by that SIGTERM. Before, the parent died at once and PDEATHSIG killed the
  // workers outright.
  std::string dir = temp_dir("spawn-sigterm");
  std::filesystem::create_directories(dir);
  std::vector<pid_t> workers;
  pid_t parent = start_spawn_parent("term", dir, workers);
  ASSERT_GT(parent, 0) << "the workers never started";
  ::kill(parent, SIGTERM);
  int status = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  pid_t done = 0;
  while ((done = ::waitpid(parent, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (done == 0) {
    ::kill(parent, SIGKILL);
    ::waitpid(parent, &status, 0);
    FAIL() << "the parent did not end within 30 s of SIGTERM";
  }
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM)
      << "the parent should end by the SIGTERM it received; status " << status;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(read_file(dir + "/saved" + std::to_string(r)), "checkpoint")
        << "rank " << r << " never got the SIGTERM (or no time to act on it)";
    EXPECT_FALSE(process_alive(workers[r])) << "worker " << workers[r] << " outlived its parent";
  }
  std::filesystem::remove_all(dir);
}

std::vector<double> read_numbers(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> values;
  double v;
  while (in >> v) values.push_back(v);
  return values;
}

TEST(Spawn, ThreadRanksGiveTheSameParametersAsProcessRanks) {
  std::string dir = temp_dir("spawn-ddp");
  std::filesystem::create_directories(dir);
  auto processes =
      run_command(bin("spawn_worker") + " 2 ddp 4 " + dir + "/processes processes", 120);
  ASSERT_EQ(processes.exit_code, 0) << processes.output;
  auto threads = run_command(bin("spawn_worker") + " 2 ddp 4 " + dir + "/threads threads", 120);
  ASSERT_EQ(threads.exit_code, 0) << threads.output;
  auto a = read_numbers(dir + "/processes");
  auto b = read_numbers(dir + "/threads");
  ASSERT_EQ(a.size(), size_t{12 * 16 + 16 + 16 * 3 + 3});
  ASSERT_EQ(a.size(), b.size());
  {
    double max_difference = 0;
    for (size_t i = 0; i < a.size(); ++i)
      max_difference = std::max(max_difference, std::abs(a[i] - b[i]));
    EXPECT_LT(max_difference, 1e-6);
  }
  std::filesystem::remove_all(dir);
}

TEST(Spawn, ZeroRanksIsAUsageError) {
  auto result = run_command(bin("spawn_worker") + " 0 ok /tmp", 30);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("nprocs=0"), std::string::npos) << result.output;
}

}  // namespace
