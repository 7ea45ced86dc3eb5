// dtrain::spawn: ranks as re-executed processes of this program, or as threads. See dtrain/spawn.h.
#include "dtrain/spawn.h"

#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/thread_launch.h"
#include "common/format.h"
#include "common/log.h"

extern char** environ;

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// The environment marker of a worker, and what else the parent tells it.
constexpr const char* kRankVar = "DTRAIN_SPAWN_RANK";
constexpr const char* kNprocsVar = "DTRAIN_SPAWN_NPROCS";
constexpr const char* kParentVar = "DTRAIN_SPAWN_PARENT_PID";
constexpr const char* kErrorFdVar =
    "DTRAIN_SPAWN_ERROR_FD";  // where the worker writes fn's exception
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
  const int rank = env_int(kRankVar, -1);
  const int expected = env_int(kNprocsVar, -1);
  const int parent = env_int(kParentVar, -1);
  const int error_fd = env_int(kErrorFdVar, -1);
  // The parent set PDEATHSIG before exec; if it died before that, init (or a subreaper) adopted us.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) std::_Exit(1);
  // Not inherited by anything fn starts (a nested spawn, a child program).
  for (const char* name : {kRankVar, kNprocsVar, kParentVar, kErrorFdVar}) unsetenv(name);
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
    if (error_fd >= 0) {
      if (message.size() > kMaxMessage) message.resize(kMaxMessage);
      ssize_t ignored = ::write(error_fd, message.data(), message.size());
      (void)ignored;
    }
  }
  std::cout.flush();
  std::exit(status);
}

// ---- in the parent ----

int free_port(const std::string& addr) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("dtrain::spawn: socket(): ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  if (inet_pton(AF_INET, addr.c_str(), &address.sin_addr) != 1)
    address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  int error = errno;
  ::close(fd);
  if (port <= 0)
    throw Error(std::string("dtrain::spawn: finding a free port: ") + std::strerror(error));
  return port;
}

std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  if (args.empty())
    throw Error("dtrain::spawn: cannot read this program's arguments from /proc/self/cmdline");
  return args;
}

struct Worker {
  pid_t pid = -1;
  int error_read = -1;  // the read end of the worker's error pipe
  bool exited = false;
  int status = 0;  // waitpid's
};

std::string read_message(int fd) {
  std::string text;
  char buffer[1024];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof buffer)) > 0 && text.size() < kMaxMessage)
    text.append(buffer, n);
  return text;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// A signal meant for the whole job (Ctrl-C, a scheduler's SIGTERM, SIGHUP) that reaches the parent
// while it waits stops the workers in order, as `dtrain run` does: SIGTERM first, so they can save
// a checkpoint, SIGKILL after stop_grace; then the signal takes its usual course in the parent. The
// handler only records the signal; the wait loop, which polls every few milliseconds anyway, does
// the rest. Signals the program ignores stay ignored.
volatile std::sig_atomic_t g_job_signal = 0;

extern "C" void record_job_signal(int signo) { g_job_signal = signo; }

class JobSignals {
 public:
  JobSignals() {
    g_job_signal = 0;
    for (int signo : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction current {};
      if (::sigaction(signo, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) continue;
      struct sigaction action {};
      action.sa_handler = record_job_signal;
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_RESTART;
      ::sigaction(signo, &action, &current);
      caught_.push_back({signo, current});
    }
  }
  ~JobSignals() { restore(); }
  JobSignals(const JobSignals&) = delete;
  JobSignals& operator=(const JobSignals&) = delete;

  void restore() {
    for (const auto& [signo, previous] : caught_) ::sigaction(signo, &previous, nullptr);
    caught_.clear();
  }
  // Between fork and exec (async-signal-safe): until exec resets them, the signals are the worker's
  // own.
  void default_in_child() const {
    for (const auto& entry : caught_) {
      struct sigaction default_action {};
      default_action.sa_handler = SIG_DFL;
      ::sigaction(entry.first, &default_action, nullptr);
    }
  }

 private:
  std::vector<std::pair<int, struct sigaction>> caught_;
};

void spawn_processes(int nprocs, const SpawnOptions& options) {
  const std::vector<std::string> args = own_arguments();
  const int port = options.master_port > 0 ? options.master_port : free_port(options.master_addr);
  const pid_t parent = ::getpid();
  // The variables the workers get from us; everything else is inherited.
  const std::vector<std::string> ours = {
      "RANK",        "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
      "MASTER_PORT", kRankVar,     kNprocsVar,   kParentVar,         kErrorFdVar};
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    std::string name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& n : ours) replaced = replaced || n == name;
    if (!replaced) inherited.push_back(entry);
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  JobSignals signals;

  std::vector<Worker> workers(nprocs);
  auto stop_all = [&](int signal) {
    for (auto& w : workers) {
      if (w.pid > 0 && !w.exited) ::kill(w.pid, signal);
    }
  };
  auto reap = [&](Worker& w, int flags) {
    if (w.pid <= 0 || w.exited) return false;
    int status = 0;
    pid_t done = ::waitpid(w.pid, &status, flags);
    if (done != w.pid) return false;
    w.exited = true;
    w.status = status;
    return true;
  };
  auto stop_and_reap_all = [&] {
    stop_all(SIGTERM);
    auto deadline = Clock::now() + options.stop_grace;
    bool alive = true;
    while (alive && Clock::now() < deadline) {
      alive = false;
      for (auto& w : workers) {
        reap(w, WNOHANG);
        alive = alive || (w.pid > 0 && !w.exited);
      }
      if (alive) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    stop_all(SIGKILL);
    for (auto& w : workers) reap(w, 0);
    for (auto& w : workers) {
      if (w.error_read >= 0) ::close(w.error_read);
    }
  };

  for (int rank = 0; rank < nprocs; ++rank) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
      stop_and_reap_all();
      throw Error(std::string("dtrain::spawn: pipe2(): ") + std::strerror(errno));
    }
    std::vector<std::string> env = inherited;
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(nprocs));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nprocs));
    env.push_back("GROUP_RANK=0");
    env.push_back("MASTER_ADDR=" + options.master_addr);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back(std::string(kRankVar) + "=" + std::to_string(rank));
    env.push_back(std::string(kNprocsVar) + "=" + std::to_string(nprocs));
    env.push_back(std::string(kParentVar) + "=" + std::to_string(parent));
    env.push_back(std::string(kErrorFdVar) + "=" + std::to_string(pipe_fds[1]));
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);

    pid_t pid = ::fork();
    if (pid == 0) {
      // Between fork and exec only async-signal-safe calls: this process may have had other
      // threads.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the parent died before the line above
      signals.default_in_child();
      ::fcntl(pipe_fds[1], F_SETFD, 0);  // the worker inherits the write end
      ::execve("/proc/self/exe", argv.data(), envp.data());
      ::_exit(127);
    }
    int error = errno;
    ::close(pipe_fds[1]);
    if (pid < 0) {
      ::close(pipe_fds[0]);
      stop_and_reap_all();
      throw Error(std::string("dtrain::spawn: fork(): ") + std::strerror(error));
    }
    ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
    workers[rank].pid = pid;
    workers[rank].error_read = pipe_fds[0];
  }

  // Wait for every worker; the first that fails stops the others.
  int running = nprocs;
  while (running > 0) {
    bool progressed = false;
    for (int rank = 0; rank < nprocs; ++rank) {
      Worker& w = workers[rank];
      if (!reap(w, WNOHANG)) continue;
      progressed = true;
      --running;
      if (WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0) continue;
      // A signal to the whole process group (Ctrl-C, a scheduler signalling every process of the
      // job) reached the workers too: one that stopped on it has not failed; the signal is handled
      // below.
      if (g_job_signal != 0) continue;
      std::string message = read_message(w.error_read);
      const bool exec_failed =
          WIFEXITED(w.status) && WEXITSTATUS(w.status) == 127 && message.empty();
      stop_and_reap_all();
      std::string text = "dtrain::spawn: " + detail::rank_text(rank, nprocs) + " (pid " +
                         std::to_string(w.pid) + ") " + describe_status(w.status) +
                         (message.empty() ? "" : ": " + message);
      if (exec_failed) text += " (could not re-execute /proc/self/exe?)";
      text += "; the other ranks were stopped.";
      throw SpawnError(text, rank, WIFEXITED(w.status) ? WEXITSTATUS(w.status) : -1,
                       WIFSIGNALED(w.status) ? WTERMSIG(w.status) : 0);
    }
    if (int signo = g_job_signal; signo != 0) {
      stop_and_reap_all();
      const std::string text = std::string("dtrain::spawn: received SIG") + sigabbrev_np(signo) +
                               "; stopped " + std::to_string(running) +
                               " running worker(s): SIGTERM, SIGKILL after " +
                               detail::seconds_text(options.stop_grace) + " if still running";
      DTRAIN_LOG(kError, text);
      signals.restore();  // the program's own dispositions again
      ::raise(
          signo);  // by default this process ends here, killed by the signal as it would have been
      throw SpawnError(text + "; the program's own handler returned", -1, -1, signo);
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& w : workers) ::close(w.error_read);
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
  if (options.mode == SpawnMode::kProcesses && std::getenv(kRankVar) != nullptr)
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
