// dtrain::spawn: ranks as re-executed processes of this program, or as threads. See dtrain/spawn.h.
#include "dtrain/spawn.h"

#include <ATen/Parallel.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "comm/thread_launch.h"
#include "common/format.h"
#include "common/log.h"
#include "launcher/elastic/ports.h"
#include "launcher/elastic/signal_pipe.h"
#include "launcher/elastic/worker_group.h"

namespace dtrain {
namespace {

// The environment marker of a worker: the number of ranks its parent spawned. Its rank is its
// LOCAL_RANK.
constexpr const char* kNprocsVar = "DTRAIN_SPAWN_NPROCS";
constexpr size_t kMaxMessage = 4096;

int env_int(const char* name, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (*end != '\0') {
    throw UsageError(
        std::string("dtrain::spawn: environment variable ") + name + "='" + text +
        "': expected an integer (it is set by dtrain::spawn for its workers; do not set it)");
  }
  return static_cast<int>(value);
}

// ---- in a worker ----

[[noreturn]] void run_worker(int nprocs, const std::function<void(int)>& fn) {
  const int rank = env_int("LOCAL_RANK", -1);
  const int expected = env_int(kNprocsVar, -1);
  // Not inherited by anything fn starts (a nested spawn, a child program).
  unsetenv(kNprocsVar);
  int status = 0;
  std::string message;
  try {
    if (expected != nprocs) {
      throw UsageError(
          "dtrain::spawn: the worker reached spawn(" + std::to_string(nprocs) +
          ", ...) but its parent spawned " + std::to_string(expected) +
          " ranks. Decide nprocs the same way in every run of the program (from argv), and call "
          "spawn() once, early in main().");
    }
    fn(rank);
  } catch (const UsageError& e) {
    status = 2;
    message = e.what();
  } catch (const std::exception& e) {
    status = 1;
    message = e.what();
  } catch (...) {
    status = 1;
    message = "an exception that is not a std::exception";
  }
  if (status != 0) {
    DTRAIN_LOG(kError, "dtrain::spawn: " << detail::rank_text(rank, nprocs) << ": " << message);
    // For the parent's SpawnError, in torchrun's layout of the file (PyTorch's @record writes the
    // same).
    if (const char* path = std::getenv("TORCHELASTIC_ERROR_FILE")) {
      if (message.size() > kMaxMessage) message.resize(kMaxMessage);
      const nlohmann::json error = {
          {"message",
           {{"message", message},
            {"extraInfo", {{"timestamp", std::to_string(std::time(nullptr))}}}}}};
      std::ofstream(path) << error.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  std::cout.flush();
  std::exit(status);
}

// ---- in the parent ----

std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  if (args.empty())
    throw Error("dtrain::spawn: cannot read this program's arguments from /proc/self/cmdline");
  return args;
}

// The message a worker left in its TORCHELASTIC_ERROR_FILE; empty when it left none.
std::string error_file_message(const std::string& path) {
  try {
    std::ifstream in(path);
    return nlohmann::json::parse(in).at("message").at("message").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    return "";
  }
}

// A signal meant for the whole job (Ctrl-C, a scheduler's SIGTERM, SIGHUP) that reaches the parent
// while it waits stops the workers in order, as `dtrain run` does: SIGTERM first, so they can save
// a checkpoint, SIGKILL after stop_grace; then the signal takes its usual course in the parent.
// Signals the program ignores stay ignored.
std::vector<int> job_signals() {
  std::vector<int> signals;
  for (int signo : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction current {};
    if (::sigaction(signo, nullptr, &current) == 0 && current.sa_handler != SIG_IGN)
      signals.push_back(signo);
  }
  return signals;
}

// The ranks are a WorkerGroup, the supervisor of `dtrain run`'s workers (own process groups,
// PDEATHSIG, stop with a grace period, everything reaped), with the program's own stdout and
// stderr instead of relayed lines.
void spawn_processes(int nprocs, const SpawnOptions& options) {
  elastic::WorkerGroupOptions group_options;
  group_options.name = "dtrain::spawn";
  group_options.command = own_arguments();
  group_options.executable = "/proc/self/exe";
  group_options.local_world_size = nprocs;
  group_options.grace_period = options.stop_grace;
  group_options.relay_output = false;
  group_options.extra_env = {{kNprocsVar, std::to_string(nprocs)}};
  elastic::WorkerGroupRound round;
  round.world_size = nprocs;
  round.master_addr = options.master_addr;
  round.master_port = options.master_port > 0 ? options.master_port : elastic::pick_free_port();

  int signo = 0;
  int stopped = 0;
  {
    elastic::SignalPipe signals(job_signals());
    elastic::WorkerGroup group(group_options);
    group.start(round);
    const elastic::WaitResult result = group.wait(signals.fd());
    if (result.state == elastic::WaitResult::State::kSucceeded) return;
    if (result.state == elastic::WaitResult::State::kFailed) {
      // The first failure stops the others.
      const elastic::WorkerExit& failed = result.failures.front();
      const std::string message = error_file_message(failed.error_file);
      group.stop();
      std::string text =
          "dtrain::spawn: " + detail::rank_text(failed.global_rank, nprocs) + " (pid " +
          std::to_string(failed.pid) + ") " +
          (failed.signal != 0 ? "was killed by signal " + std::to_string(failed.signal) + " (" +
                                    strsignal(failed.signal) + ")"
                              : "exited with status " + std::to_string(failed.exit_code)) +
          (message.empty() ? "" : ": " + message);
      if (failed.exit_code == 127 && message.empty())
        text += " (could not re-execute /proc/self/exe?)";
      text += "; the other ranks were stopped.";
      throw SpawnError(text, failed.global_rank, failed.exit_code, failed.signal);
    }
    // A signal reached the parent (it wins over a failure seen at the same time: a signal to every
    // process of the job stops the workers too, and those have not failed).
    signo = signals.take();
    stopped = group.running();
    group.stop(signals.fd());
  }  // the group's temporary folder goes, and the program's own dispositions come back, before
     // the signal may end this process
  const std::string text = std::string("dtrain::spawn: received SIG") + sigabbrev_np(signo) +
                           "; stopped " + std::to_string(stopped) +
                           " running worker(s): SIGTERM, SIGKILL after " +
                           detail::seconds_text(options.stop_grace) + " if still running";
  DTRAIN_LOG(kError, text);
  ::raise(signo);  // by default this process ends here, killed by the signal as it would have been
  throw SpawnError(text + "; the program's own handler returned", -1, -1, signo);
}

void spawn_threads(int nprocs, const std::function<void(int)>& fn) {
  static std::atomic<int> calls{0};
  const std::string store =
      "dtrain-spawn-" + std::to_string(::getpid()) + "-" + std::to_string(calls++);
  std::mutex mutex;
  int failed_rank = -1;
  std::string failure;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < nprocs; ++rank) {
    threads.emplace_back([&, rank] {
      std::string message;
      try {
        at::set_num_threads(1);  // ranks, not intra-op threads, share the cores; fn may change it
        detail::ScopedThreadLaunch launch({rank, nprocs, store});
        fn(rank);
        return;
      } catch (const std::exception& e) {
        message = e.what();
      } catch (...) {
        message = "an exception that is not a std::exception";
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (failed_rank < 0) {
        failed_rank = rank;
        failure = message;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failed_rank >= 0) {
    throw SpawnError(
        "dtrain::spawn: " + detail::rank_text(failed_rank, nprocs) + " (thread) failed: " + failure,
        failed_rank, -1, 0);
  }
}

}  // namespace

void spawn(int nprocs, const std::function<void(int)>& fn, const SpawnOptions& options) {
  if (options.mode == SpawnMode::kProcesses && std::getenv(kNprocsVar) != nullptr)
    run_worker(nprocs, fn);
  if (nprocs < 1) {
    throw UsageError("dtrain::spawn: nprocs=" + std::to_string(nprocs) + ": expected at least 1");
  }
  if (!fn) throw UsageError("dtrain::spawn: fn is empty");
  if (options.mode == SpawnMode::kThreads) {
    spawn_threads(nprocs, fn);
  } else {
    spawn_processes(nprocs, options);
  }
}

}  // namespace dtrain
