// WorkerGroup: spawning, watching, relaying and stopping the local worker processes (see
// worker_group.h). Over 600 lines because these four share one table of workers and one poll loop;
// in-place recovery (restart_worker(), a section of its own after stop()) reuses both rather than
// splitting them.
#include "launcher/elastic/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "dtrain/errors.h"
#include "launcher/elastic/signal_pipe.h"

extern char** environ;

namespace dtrain::elastic {
namespace {

using Clock = std::chrono::steady_clock;

// A worker writing a very long line without a newline (a progress bar, binary junk) is cut into
// pieces of this size, so the launcher's memory stays bounded.
constexpr std::size_t kMaxLineBytes = 64 * 1024;
// One read() per ready pipe per wake-up, so a chatty worker cannot starve the others.
constexpr std::size_t kReadChunk = 64 * 1024;
// When a worker exits, its pipes still hold what it wrote last; read that much before reporting it.
constexpr std::size_t kDrainOnExitBytes = 4 * 1024 * 1024;
// How long stop() waits for SIGKILLed workers to be reaped before giving up on them (a process
// stuck in uninterruptible I/O cannot be helped; the launcher must still exit).
constexpr std::chrono::seconds kReapAfterKillTimeout{10};
// Poll timeout when no pidfd tells us about exits: 50 ms keeps failure detection prompt at
// negligible cost.
constexpr int kPollFallbackMs = 50;
// With pidfds every exit wakes poll() at once; the timeout is only a safety net.
constexpr int kPollWithPidfdMs = 1000;
// Exit code of a worker whose exec failed (the shell's convention for "command not found").
constexpr int kExecFailedExitCode = 127;

// The variables the launcher sets for its workers, torchrun's agent's and dtrain's own; inherited
// values of these are replaced (an outer job's DTRAIN_RECOVERY_JOIN=1 must not make every worker a
// newcomer).
constexpr const char* kWorkerVariables[] = {"LOCAL_RANK",
                                            "RANK",
                                            "GROUP_RANK",
                                            "ROLE_RANK",
                                            "ROLE_NAME",
                                            "LOCAL_WORLD_SIZE",
                                            "WORLD_SIZE",
                                            "GROUP_WORLD_SIZE",
                                            "ROLE_WORLD_SIZE",
                                            "MASTER_ADDR",
                                            "MASTER_PORT",
                                            "TORCHELASTIC_RESTART_COUNT",
                                            "TORCHELASTIC_MAX_RESTARTS",
                                            "TORCHELASTIC_RUN_ID",
                                            "TORCHELASTIC_USE_AGENT_STORE",
                                            "TORCHELASTIC_ERROR_FILE",
                                            "TORCHELASTIC_SIGNALS_TO_HANDLE",
                                            "DTRAIN_RECOVERY",
                                            "DTRAIN_RECOVERY_JOIN"};

// Writes all of `data`, retrying short writes and EINTR. Output to a closed pipe (EPIPE: `dtrain
// run | head`) or a broken terminal is dropped: losing relayed lines must never stop the launcher
// from supervising its workers.
void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      // A non-blocking stdout inherited from the shell: wait briefly for room, then give up.
      struct pollfd p {
        fd, POLLOUT, 0
      };
      if (poll(&p, 1, 1000) <= 0) return;
    } else {
      return;
    }
  }
}

// For a script whose #! line names an interpreter that cannot run (a typo, a Python not installed
// on this node): what is wrong with it, else "". exec fails then with the script's own path in
// errno's words ("No such file or directory"), which blames the script, and every restart fails
// the same way.
std::string interpreter_problem(const std::string& script) {
  std::ifstream in(script, std::ios::binary);
  std::string line(256, '\0');  // the kernel reads no more of a #! line either
  in.read(line.data(), static_cast<std::streamsize>(line.size()));
  line.resize(static_cast<std::size_t>(in.gcount()));
  line = line.substr(0, line.find('\n'));
  if (line.rfind("#!", 0) != 0) return "";
  std::size_t begin = line.find_first_not_of(" \t", 2);
  if (begin == std::string::npos) return "its #! line names no interpreter";
  std::size_t end = line.find_first_of(" \t\r", begin);
  const std::string interpreter = line.substr(begin, end == std::string::npos ? end : end - begin);
  if (access(interpreter.c_str(), X_OK) == 0) return "";
  return "its #! line asks for the interpreter '" + interpreter + "', which " +
         (errno == ENOENT ? std::string("does not exist on this node")
                          : std::string("cannot run: ") + std::strerror(errno));
}

// Async-signal-safe text for the errno values exec can realistically fail with (strerror is not on
// the list of functions a forked child may call).
const char* exec_error_text(int error) {
  switch (error) {
    case ENOENT:
      return "No such file or directory";
    case EACCES:
      return "Permission denied";
    case ENOEXEC:
      return "Exec format error (a script needs a #! line)";
    case E2BIG:
      return "Argument list too long";
    case ENOMEM:
      return "Cannot allocate memory";
    case ETXTBSY:
      return "Text file busy";
    case EISDIR:
      return "Is a directory";
    case ELOOP:
      return "Too many levels of symbolic links";
    default:
      return "exec failed";
  }
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd >= 0) fcntl(fd, F_SETFD, FD_CLOEXEC);
  return fd;
#else
  (void)pid;
  return -1;  // kernels before 5.3: wait() falls back to a short poll timeout
#endif
}

bool is_regular_executable(const std::string& path, bool* exists) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) return false;
  if (!S_ISREG(info.st_mode)) return false;
  *exists = true;
  return access(path.c_str(), X_OK) == 0;
}

std::string local_time_now() {
  std::time_t now = std::time(nullptr);
  std::tm parts{};
  localtime_r(&now, &parts);
  char text[64];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S %z", &parts);
  return text;
}

}  // namespace

// -------------------------------------------------------------------------------------------------

struct WorkerGroup::Stream {
  int fd = -1;         // read end of the worker's pipe (non-blocking); -1 after EOF or close
  int target_fd = -1;  // where the prefixed lines go
  bool is_stderr = false;
  std::string partial;  // bytes after the last line end, waiting for the rest of their line
  // The last line ended with '\r': a '\n' that comes next belongs to it ("\r\n").
  bool after_carriage_return = false;
};

struct WorkerGroup::Worker {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;         // also the worker's process group id (it calls setpgid(0, 0))
  int restart_count = 0;  // its TORCHELASTIC_RESTART_COUNT (restart_worker() gives it its own)
  int pidfd = -1;         // readable when the worker exits; -1 if the kernel has no pidfd_open
  bool reaped = true;     // waitpid() has collected it (or it was never started)
  // Its process group may still have members (the worker itself, or children it left behind).
  // Cleared as soon as the group is seen empty, so a recycled process group id is never signalled.
  bool group_alive = false;
  Stream out;
  Stream err;
  int log_fd = -1;
  std::string prefix;      // "[rank3]: "
  std::string error_file;  // its TORCHELASTIC_ERROR_FILE
  std::deque<std::string> stderr_tail;
};

std::string signal_name(int signo) {
  switch (signo) {
#define DTRAIN_SIGNAL_CASE(name) \
  case name:                     \
    return #name;
    DTRAIN_SIGNAL_CASE(SIGHUP)
    DTRAIN_SIGNAL_CASE(SIGINT)
    DTRAIN_SIGNAL_CASE(SIGQUIT)
    DTRAIN_SIGNAL_CASE(SIGILL)
    DTRAIN_SIGNAL_CASE(SIGTRAP)
    DTRAIN_SIGNAL_CASE(SIGABRT)
    DTRAIN_SIGNAL_CASE(SIGBUS)
    DTRAIN_SIGNAL_CASE(SIGFPE)
    DTRAIN_SIGNAL_CASE(SIGKILL)
    DTRAIN_SIGNAL_CASE(SIGUSR1)
    DTRAIN_SIGNAL_CASE(SIGSEGV)
    DTRAIN_SIGNAL_CASE(SIGUSR2)
    DTRAIN_SIGNAL_CASE(SIGPIPE)
    DTRAIN_SIGNAL_CASE(SIGALRM)
    DTRAIN_SIGNAL_CASE(SIGTERM)
    DTRAIN_SIGNAL_CASE(SIGCHLD)
    DTRAIN_SIGNAL_CASE(SIGCONT)
    DTRAIN_SIGNAL_CASE(SIGSTOP)
    DTRAIN_SIGNAL_CASE(SIGTSTP)
    DTRAIN_SIGNAL_CASE(SIGTTIN)
    DTRAIN_SIGNAL_CASE(SIGTTOU)
    DTRAIN_SIGNAL_CASE(SIGURG)
    DTRAIN_SIGNAL_CASE(SIGXCPU)
    DTRAIN_SIGNAL_CASE(SIGXFSZ)
    DTRAIN_SIGNAL_CASE(SIGVTALRM)
    DTRAIN_SIGNAL_CASE(SIGPROF)
    DTRAIN_SIGNAL_CASE(SIGWINCH)
    DTRAIN_SIGNAL_CASE(SIGIO)
    DTRAIN_SIGNAL_CASE(SIGSYS)
#undef DTRAIN_SIGNAL_CASE
    default:
      return "signal " + std::to_string(signo);
  }
}

std::string WorkerExit::describe() const {
  if (signal != 0) {
    return "killed by signal " + std::to_string(signal) + " (" + signal_name(signal) + ")";
  }
  return "exited with code " + std::to_string(exit_code);
}

int WorkerExit::launcher_exit_code() const {
  if (signal != 0) return 128 + signal;
  return exit_code;
}

std::string find_executable(const std::string& name, std::string* why) {
  bool exists = false;
  if (name.find('/') != std::string::npos) {
    if (is_regular_executable(name, &exists)) return name;
    if (why) *why = exists ? "not executable" : "no such file";
    return {};
  }
  const char* path_variable = std::getenv("PATH");
  // exec's default search path when PATH is unset.
  std::string path = path_variable ? path_variable : "/usr/local/bin:/usr/bin:/bin";
  std::size_t begin = 0;
  while (begin <= path.size()) {
    std::size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    std::string folder = path.substr(begin, end - begin);
    if (folder.empty()) folder = ".";  // an empty PATH entry means the current directory
    std::string candidate = folder + "/" + name;
    if (is_regular_executable(candidate, &exists)) return candidate;
    begin = end + 1;
  }
  if (why) *why = exists ? "found on PATH but not executable" : "not found on PATH";
  return {};
}

// -------------------------------------------------------------------------------------------------

WorkerGroup::WorkerGroup(WorkerGroupOptions options) : options_(std::move(options)) {
  if (options_.command.empty()) throw UsageError(options_.name + ": no program to run");
  if (options_.local_world_size < 1) {
    throw UsageError(options_.name + ": local world size must be positive, got " +
                     std::to_string(options_.local_world_size));
  }
}

WorkerGroup::~WorkerGroup() {
  // The owner is leaving (an exception, or the end of main): no grace, but no orphans either.
  for (Worker& worker : workers_) {
    if (!worker.reaped) {
      kill(-worker.pid, SIGKILL);
      kill(worker.pid, SIGKILL);
      int status = 0;
      while (waitpid(worker.pid, &status, 0) < 0 && errno == EINTR) {
      }
      worker.reaped = true;
    } else if (worker.group_alive && kill(-worker.pid, 0) == 0) {
      kill(-worker.pid, SIGKILL);
    }
    close_worker(worker);
  }
  if (dev_null_ >= 0) close(dev_null_);
  if (!error_file_root_.empty()) {
    // A destructor must not throw; a leftover temporary folder is harmless.
    std::error_code ignored;
    std::filesystem::remove_all(error_file_root_, ignored);
  }
}

int WorkerGroup::running() const {
  return static_cast<int>(
      std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return !w.reaped; }));
}

std::vector<WorkerGroup::RunningWorker> WorkerGroup::running_workers() const {
  std::vector<RunningWorker> result;
  for (const Worker& w : workers_) {
    if (!w.reaped) result.push_back({w.local_rank, w.global_rank, w.pid});
  }
  return result;
}

void WorkerGroup::kill_worker(int local_rank) {
  for (Worker& w : workers_) {
    if (w.local_rank != local_rank || w.reaped) continue;
    if (kill(-w.pid, SIGKILL) != 0) kill(w.pid, SIGKILL);
  }
}

void WorkerGroup::start(const WorkerGroupRound& round) {
  if (running() != 0) {
    throw InternalError(options_.name + ": WorkerGroup::start called while " +
                        std::to_string(running()) +
                        " workers of the previous round still run; call stop() first");
  }
  for (Worker& worker : workers_) close_worker(worker);
  workers_.clear();
  round_ = round;

  std::string why;
  executable_ = options_.executable.empty() ? find_executable(options_.command[0], &why)
                                            : options_.executable;
  if (executable_.empty()) {
    throw UsageError(options_.name + ": program '" + options_.command[0] + "': " + why);
  }
  if (const std::string problem = interpreter_problem(executable_); !problem.empty()) {
    throw UsageError(options_.name + ": program '" + options_.command[0] + "': " + problem +
                     "; fix that line, or run the interpreter yourself: dtrain run ... -- "
                     "INTERPRETER " +
                     options_.command[0]);
  }
  if (dev_null_ < 0) {
    dev_null_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (dev_null_ < 0) {
      throw InternalError(options_.name + ": cannot open /dev/null: " + std::strerror(errno));
    }
  }

  // The environment every worker shares: the launcher's own, minus the variables set below, plus
  // the caller's extras, plus torchrun's. Rank-specific variables are added per worker
  // (worker_env()).
  std::vector<std::string>& shared_env = shared_env_;
  shared_env.clear();
  auto is_replaced = [&](std::string_view entry) {
    std::string_view key = entry.substr(0, entry.find('='));
    for (const char* name : kWorkerVariables) {
      if (key == name) return true;
    }
    for (const auto& [name, value] : options_.extra_env) {
      if (key == name) return true;
    }
    return false;
  };
  for (char** entry = environ; entry && *entry; ++entry) {
    if (!is_replaced(*entry)) shared_env.emplace_back(*entry);
  }
  for (const auto& [name, value] : options_.extra_env) shared_env.push_back(name + "=" + value);
  auto set = [&](const char* name, const std::string& value) {
    shared_env.push_back(std::string(name) + "=" + value);
  };
  set("ROLE_NAME", options_.role);
  if (options_.rank_variables) {
    set("LOCAL_WORLD_SIZE", std::to_string(options_.local_world_size));
    set("WORLD_SIZE", std::to_string(round.world_size));
    set("ROLE_WORLD_SIZE", std::to_string(round.world_size));  // one role: the role is the world
    set("GROUP_RANK", std::to_string(round.group_rank));
    set("GROUP_WORLD_SIZE", std::to_string(round.group_world_size));
    set("MASTER_ADDR", round.master_addr);
    set("MASTER_PORT", std::to_string(round.master_port));
  }
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(round.restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
  set("TORCHELASTIC_RUN_ID", options_.run_id);
  // "False": PyTorch's env:// init then lets rank 0 host the TCPStore at MASTER_ADDR:MASTER_PORT.
  // "True" (exactly as PyTorch reads it): node 0's launcher hosts it (WorkerStore), and every rank
  // is a client.
  set("TORCHELASTIC_USE_AGENT_STORE", round.agent_store ? "True" : "False");
  // What torchrun exports from its own --signals-to-handle; dtrain handles exactly that default.
  set("TORCHELASTIC_SIGNALS_TO_HANDLE", kLauncherSignalNames);
  set("DTRAIN_RECOVERY", options_.recovery);
  if (round.join_running) set("DTRAIN_RECOVERY_JOIN", "1");
  // torchrun's agent turns NCCL's async error handling on unless the user chose: a rank whose peer
  // died then fails instead of hanging in a collective, and the launcher can restart the group.
  if (std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr &&
      !is_replaced("TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  }

  workers_.resize(static_cast<std::size_t>(options_.local_world_size));
  // Open every log before forking anything, so a bad --log-dir fails with no worker started.
  for (int local_rank = 0; local_rank < options_.local_world_size; ++local_rank) {
    Worker& worker = workers_[static_cast<std::size_t>(local_rank)];
    worker.local_rank = local_rank;
    worker.global_rank = round.base_rank + local_rank;
    worker.restart_count = round.restart_count;
    worker.prefix = "[rank" + std::to_string(worker.global_rank) + "]: ";
    try {
      worker.error_file = make_error_file(round.restart_count, local_rank);
      open_log(worker);
    } catch (...) {
      for (Worker& opened : workers_) close_worker(opened);
      workers_.clear();
      throw;
    }
  }

  for (Worker& worker : workers_) {
    try {
      spawn(worker, worker_env(worker, {}));
    } catch (...) {
      // Leave nothing of this round behind: the caller gets the error, not half a group.
      signal_groups(SIGKILL);
      stop();
      throw;
    }
  }
}

void WorkerGroup::open_log(Worker& worker) {
  if (options_.log_dir.empty()) return;
  std::string path = options_.log_dir + "/rank" + std::to_string(worker.global_rank) + ".log";
  worker.log_fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (worker.log_fd < 0) {
    throw UsageError("dtrain run: --log-dir: cannot open " + path + ": " + std::strerror(errno));
  }
}

std::vector<std::string> WorkerGroup::worker_env(
    const Worker& worker, const std::vector<std::pair<std::string, std::string>>& overrides) const {
  std::vector<std::string> env = shared_env_;
  // Replaced, not appended: with a name twice, getenv() would find the round's value first.
  for (const auto& [name, value] : overrides) {
    std::erase_if(env, [&](const std::string& entry) { return entry.rfind(name + "=", 0) == 0; });
    env.push_back(name + "=" + value);
  }
  env.push_back("TORCHELASTIC_ERROR_FILE=" + worker.error_file);
  if (!options_.rank_variables) return env;
  env.push_back("LOCAL_RANK=" + std::to_string(worker.local_rank));
  env.push_back("RANK=" + std::to_string(worker.global_rank));
  env.push_back("ROLE_RANK=" + std::to_string(worker.global_rank));
  return env;
}

std::string WorkerGroup::make_error_file(int restart_count, int local_rank) {
  namespace fs = std::filesystem;
  if (error_file_root_.empty()) {
    // torchrun's place: a fresh folder under $TMPDIR (Python's tempfile.gettempdir()).
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/dtrain_run_XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      throw UsageError(options_.name +
                       ": cannot create a folder for TORCHELASTIC_ERROR_FILE like " + pattern +
                       ": " + std::strerror(errno) + "; set TMPDIR to a writable directory");
    }
    error_file_root_ = pattern;
  }
  // One folder per attempt and local rank, as torchrun lays them out, so no attempt finds an older
  // attempt's file (PyTorch's @record would warn and overwrite it).
  fs::path folder = fs::path(error_file_root_) / ("attempt_" + std::to_string(restart_count)) /
                    std::to_string(local_rank);
  std::error_code error;
  fs::create_directories(folder, error);
  if (error) {
    throw UsageError(options_.name + ": cannot create " + folder.string() +
                     " for TORCHELASTIC_ERROR_FILE: " + error.message() +
                     "; set TMPDIR to a writable directory");
  }
  // A number may come again (an elastic round numbered like a worker's earlier restart alone):
  // what that run left is not this one's error.
  fs::remove(folder / "error.json", error);
  return (folder / "error.json").string();
}

void WorkerGroup::spawn(Worker& worker, const std::vector<std::string>& env) {
  // Everything the child needs is built before fork(): between fork and exec only async-signal-safe
  // calls are allowed.
  std::vector<char*> argv;
  for (const std::string& arg : options_.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& entry : env) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);
  std::string exec_error = options_.name + ": rank " + std::to_string(worker.global_rank) +
                           ": cannot execute '" + executable_ + "': ";

  // The worker's stdout and stderr: pipes that wait() and stop() relay, or this process's own.
  int out_pipe[2] = {-1, STDOUT_FILENO};
  int err_pipe[2] = {-1, STDERR_FILENO};
  if (options_.relay_output && pipe2(out_pipe, O_CLOEXEC) != 0) {
    throw InternalError(std::string("dtrain run: pipe: ") + std::strerror(errno) +
                        " (too many open files? raise `ulimit -n`)");
  }
  if (options_.relay_output && pipe2(err_pipe, O_CLOEXEC) != 0) {
    int error = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    throw InternalError(std::string("dtrain run: pipe: ") + std::strerror(error) +
                        " (too many open files? raise `ulimit -n`)");
  }

  const pid_t launcher = getpid();
  // Block every signal across fork: otherwise a Ctrl-C landing in the child before exec would run
  // the launcher's handler there and write to the launcher's signal pipe.
  sigset_t all_signals;
  sigset_t previous_mask;
  sigfillset(&all_signals);
  pthread_sigmask(SIG_SETMASK, &all_signals, &previous_mask);
  pid_t pid = fork();
  if (pid == 0) {
    // Child. Own process group, so stop() can signal the worker together with anything it spawns.
    setpgid(0, 0);
    // If the launcher dies (even by SIGKILL), the kernel kills the worker: no orphans. The launcher
    // may have died before prctl took effect; then our parent is already someone else.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(1);
    // Caught signals reset on exec anyway; reset them now so none runs the launcher's handler in
    // the child. SIGPIPE and SIGXFSZ get their default back even if ignored (what Python's
    // subprocess does): the launcher ignores SIGPIPE for itself, a worker should not inherit that.
    for (int signo = 1; signo < NSIG; ++signo) {
      if (signo == SIGKILL || signo == SIGSTOP) continue;
      struct sigaction action {};
      if (sigaction(signo, nullptr, &action) != 0) continue;
      bool caught = action.sa_handler != SIG_DFL && action.sa_handler != SIG_IGN;
      bool ignored_by_launcher =
          action.sa_handler == SIG_IGN && (signo == SIGPIPE || signo == SIGXFSZ);
      if (caught || ignored_by_launcher) {
        struct sigaction reset {};
        reset.sa_handler = SIG_DFL;
        sigemptyset(&reset.sa_mask);
        sigaction(signo, &reset, nullptr);
      }
    }
    sigprocmask(SIG_SETMASK, &previous_mask, nullptr);
    // stdin, stdout, stderr. dup2 clears close-on-exec on the copies; the originals close at exec.
    int targets[3] = {dev_null_, out_pipe[1], err_pipe[1]};
    for (int fd = 0; fd < 3; ++fd) {
      if (targets[fd] == fd) {
        fcntl(fd, F_SETFD, 0);
      } else {
        dup2(targets[fd], fd);
      }
    }
    execve(executable_.c_str(), argv.data(), envp.data());
    int error = errno;
    write_all(2, exec_error);
    write_all(2, exec_error_text(error));
    write_all(2, "\n");
    _exit(kExecFailedExitCode);
  }
  int fork_error = errno;
  pthread_sigmask(SIG_SETMASK, &previous_mask, nullptr);
  if (options_.relay_output) {
    close(out_pipe[1]);
    close(err_pipe[1]);
  }
  if (pid < 0) {
    close(out_pipe[0]);  // -1 without relaying: nothing to close
    close(err_pipe[0]);
    throw InternalError(options_.name + ": fork: " + std::strerror(fork_error));
  }
  // Also set the group from this side: whichever of parent and child runs first, the group exists
  // before stop() could signal it.
  setpgid(pid, pid);
  worker.pid = pid;
  worker.reaped = false;
  worker.group_alive = true;
  worker.pidfd = open_pidfd(pid);
  worker.out = Stream{out_pipe[0], options_.out_fd, false, {}};
  worker.err = Stream{err_pipe[0], options_.err_fd, true, {}};
  if (options_.relay_output) {
    fcntl(worker.out.fd, F_SETFL, O_NONBLOCK);
    fcntl(worker.err.fd, F_SETFL, O_NONBLOCK);
  }
  worker.stderr_tail.clear();
  write_log(worker, "==== dtrain run: attempt " + std::to_string(worker.restart_count) + " (" +
                        "TORCHELASTIC_RESTART_COUNT=" + std::to_string(worker.restart_count) +
                        "): rank " + std::to_string(worker.global_rank) + "/" +
                        std::to_string(round_.world_size) + " (local rank " +
                        std::to_string(worker.local_rank) + "), pid " + std::to_string(pid) +
                        ", started " + local_time_now() + " ====\n");
}

// -------------------------------------------------------------------------------------------------

WaitResult WorkerGroup::wait(int interrupt_fd) {
  WaitResult result;
  for (;;) {
    std::vector<WorkerExit> exits;
    reap(&exits);
    for (WorkerExit& exit : exits) {
      if (!exit.succeeded()) result.failures.push_back(std::move(exit));
    }
    // A signal to the launcher wins over a failure seen in the same wake-up: the user asked to
    // stop, so the caller must not restart.
    bool interrupted = false;
    if (interrupt_fd >= 0) {
      struct pollfd p {
        interrupt_fd, POLLIN, 0
      };
      interrupted = poll(&p, 1, 0) > 0;
    }
    if (interrupted) {
      result.state = WaitResult::State::kInterrupted;
      return result;
    }
    if (!result.failures.empty()) {
      result.state = WaitResult::State::kFailed;
      return result;
    }
    if (running() == 0) {
      result.state = WaitResult::State::kSucceeded;
      return result;
    }
    bool every_exit_wakes_us = std::all_of(
        workers_.begin(), workers_.end(), [](const Worker& w) { return w.reaped || w.pidfd >= 0; });
    pump(every_exit_wakes_us ? kPollWithPidfdMs : kPollFallbackMs, interrupt_fd);
  }
}

std::vector<WorkerExit> WorkerGroup::stop(int interrupt_fd,
                                          std::optional<std::chrono::milliseconds> grace) {
  return stop_workers(interrupt_fd, grace, nullptr, nullptr);
}

std::vector<WorkerExit> WorkerGroup::stop(SignalPipe& signals, int* signo,
                                          std::optional<std::chrono::milliseconds> grace) {
  *signo = 0;
  return stop_workers(signals.fd(), grace, &signals, signo);
}

std::vector<WorkerExit> WorkerGroup::stop_workers(int interrupt_fd,
                                                  std::optional<std::chrono::milliseconds> grace,
                                                  SignalPipe* signals, int* signo) {
  std::vector<WorkerExit> exits;
  reap(&exits);
  signal_groups(SIGTERM);
  // Stopping has two phases: SIGTERM and wait until the workers and everything in their process
  // groups are gone or the grace period ends; then SIGKILL to the groups and wait only for our own
  // children (grandchildren are not ours to reap).
  Clock::time_point deadline = Clock::now() + grace.value_or(options_.grace_period);
  bool killed = false;
  for (;;) {
    // After SIGKILL, leftovers in the groups are only waited for when we can reap them ourselves;
    // otherwise they may be zombies of another parent that never disappear from their group.
    bool groups_done = (killed && !options_.reap_orphans) || !any_group_alive();
    if (running() == 0 && groups_done) break;
    Clock::time_point now = Clock::now();
    if (!killed && now >= deadline) {
      signal_groups(SIGKILL);
      killed = true;
      deadline = now + kReapAfterKillTimeout;
    } else if (killed && now >= deadline) {
      std::string stuck;
      for (const Worker& worker : workers_) {
        if (!worker.reaped) stuck += " " + std::to_string(worker.pid);
      }
      write_all(options_.err_fd,
                options_.name + ": workers with pids" + stuck +
                    " did not exit after SIGKILL (stuck in the kernel?); giving up\n");
      break;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    int timeout = static_cast<int>(std::clamp<long long>(left, 1, kPollFallbackMs));
    bool interrupted = pump(timeout, killed ? -1 : interrupt_fd);
    if (interrupted && !killed && signals != nullptr && *signo == 0) {
      // The first signal of a stop the launcher began: the workers already have the SIGTERM it
      // asks for, and keep their grace. (0: woken with nothing to read; nothing to count.)
      *signo = signals->take();
      if (*signo != 0) {
        write_all(options_.err_fd, options_.name + ": received " + signal_name(*signo) +
                                       " while stopping the workers; they keep their grace " +
                                       "period (a second signal kills them at once)\n");
      }
    } else if (interrupted && !killed) {
      // A second Ctrl-C while waiting out the grace period: the user does not want to wait.
      signal_groups(SIGKILL);
      killed = true;
      deadline = Clock::now() + kReapAfterKillTimeout;
    }
    reap(&exits);
  }
  for (Worker& worker : workers_) close_worker(worker);
  last_stop_killed_ = killed;
  return exits;
}

// -------------------------------------------------------------------------------------------------
// In-place recovery: one worker replaced while the others keep running.

void WorkerGroup::restart_worker(int local_rank, int restart_count) {
  if (local_rank < 0 || local_rank >= static_cast<int>(workers_.size())) {
    throw InternalError("dtrain run: WorkerGroup::restart_worker: no local rank " +
                        std::to_string(local_rank) + " in a group of " +
                        std::to_string(workers_.size()) + " worker(s)");
  }
  Worker& worker = workers_[static_cast<std::size_t>(local_rank)];
  if (!worker.reaped) {
    throw InternalError("dtrain run: WorkerGroup::restart_worker: local rank " +
                        std::to_string(local_rank) + " (pid " + std::to_string(worker.pid) +
                        ") still runs; restart only a worker that wait() reported");
  }
  // What the dead worker left in its process group (a data-loader child, a shell's background job)
  // would keep its pipes open and compete with the newcomer for its files and devices. It has no
  // worker left to report to, so it goes at once, without a grace period.
  if (worker.group_alive && kill(-worker.pid, 0) == 0) kill(-worker.pid, SIGKILL);
  worker.group_alive = false;
  close_worker(worker);  // relays the old process's last output, closes its pipes and log

  worker.restart_count = restart_count;
  worker.error_file = make_error_file(restart_count, local_rank);
  open_log(worker);
  spawn(worker, worker_env(worker, {{"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
                                    {"DTRAIN_RECOVERY_JOIN", "1"}}));
}

// -------------------------------------------------------------------------------------------------

bool WorkerGroup::pump(int timeout_ms, int extra_fd) {
  std::vector<struct pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;  // parallel to fds; null for non-stream entries
  if (extra_fd >= 0) {
    fds.push_back({extra_fd, POLLIN, 0});
    owners.emplace_back(nullptr, nullptr);
  }
  for (Worker& worker : workers_) {
    for (Stream* stream : {&worker.out, &worker.err}) {
      if (stream->fd < 0) continue;
      fds.push_back({stream->fd, POLLIN, 0});
      owners.emplace_back(&worker, stream);
    }
    if (!worker.reaped && worker.pidfd >= 0) {
      fds.push_back({worker.pidfd, POLLIN, 0});
      owners.emplace_back(nullptr, nullptr);  // reap() looks at it next
    }
  }
  int ready = poll(fds.data(), fds.size(), timeout_ms);
  if (ready <= 0) return false;  // timeout, or EINTR: the caller loops
  bool extra_ready = false;
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    if (extra_fd >= 0 && i == 0) {
      extra_ready = true;
    } else if (owners[i].second != nullptr) {
      read_stream(*owners[i].first, *owners[i].second, kReadChunk);
    }
  }
  return extra_ready;
}

void WorkerGroup::read_stream(Worker& worker, Stream& stream, std::size_t max_bytes) {
  char buffer[kReadChunk];
  std::size_t total = 0;
  while (stream.fd >= 0 && total < max_bytes) {
    ssize_t n = read(stream.fd, buffer, sizeof(buffer));
    if (n > 0) {
      total += static_cast<std::size_t>(n);
      emit_lines(worker, stream, std::string_view(buffer, static_cast<std::size_t>(n)), false);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {
      // EOF (every writer closed it) or a broken pipe: flush the unterminated last line.
      emit_lines(worker, stream, {}, true);
      close(stream.fd);
      stream.fd = -1;
    }
  }
}

void WorkerGroup::emit_lines(Worker& worker, Stream& stream, std::string_view data,
                             bool flush_partial) {
  // Complete lines are prefixed and batched into one write, so lines of different ranks interleave
  // whole (a write of up to PIPE_BUF bytes to a pipe is atomic).
  std::string batch;
  auto emit = [&](std::string_view line) {
    batch += worker.prefix;
    batch += line;
    batch += '\n';
    if (stream.is_stderr) {
      worker.stderr_tail.emplace_back(line);
      while (worker.stderr_tail.size() > options_.stderr_tail_lines) worker.stderr_tail.pop_front();
    }
  };
  // A line ends at '\n', at "\r\n" and at a lone '\r': a progress bar redrawn with '\r' is relayed
  // as one line per redraw, as it is written, not as one line at its end. A '\r' that ends nothing
  // (the bar's first character, "\r\r") is dropped; the '\n' of a "\r\n" may come in the next read.
  while (!data.empty()) {
    if (stream.after_carriage_return && data.front() == '\n') data.remove_prefix(1);
    stream.after_carriage_return = false;
    std::size_t end = data.find_first_of("\r\n");
    if (end == std::string_view::npos) {
      stream.partial.append(data);
      if (stream.partial.size() >= kMaxLineBytes) {
        emit(stream.partial);
        stream.partial.clear();
      }
      break;
    }
    bool carriage_return = data[end] == '\r';
    std::string_view piece = data.substr(0, end);
    data.remove_prefix(end + 1);
    if (carriage_return && piece.empty() && stream.partial.empty()) continue;
    if (stream.partial.empty()) {
      emit(piece);
    } else {
      stream.partial.append(piece);
      emit(stream.partial);
      stream.partial.clear();
    }
    stream.after_carriage_return = carriage_return;
  }
  if (flush_partial && !stream.partial.empty()) {
    emit(stream.partial);
    stream.partial.clear();
  }
  if (batch.empty()) return;
  auto routed = [&](const std::vector<int>& streams) {
    const auto rank = static_cast<std::size_t>(worker.local_rank);
    return rank >= streams.size() || (streams[rank] & (stream.is_stderr ? 2 : 1)) != 0;
  };
  if (routed(options_.console_streams)) write_all(stream.target_fd, batch);
  if (worker.log_fd >= 0 && routed(options_.log_streams)) write_all(worker.log_fd, batch);
}

void WorkerGroup::reap(std::vector<WorkerExit>* exits) {
  if (options_.reap_orphans) {
    // Every child of this process is ours: collect workers and reparented leftovers alike.
    for (;;) {
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid < 0 && errno == EINTR) continue;
      if (pid <= 0) break;  // 0: nobody else exited yet; ECHILD: no children at all
      for (Worker& worker : workers_) {
        if (!worker.reaped && worker.pid == pid) record_exit(worker, status, exits);
      }
    }
    return;
  }
  for (Worker& worker : workers_) {
    if (worker.reaped) continue;
    int status = 0;
    pid_t result = waitpid(worker.pid, &status, WNOHANG);
    if (result == 0 || (result < 0 && errno == EINTR)) continue;
    // ECHILD: someone else reaped it; report a failure rather than guess success.
    if (result < 0) status = 1 << 8;
    record_exit(worker, status, exits);
  }
}

void WorkerGroup::record_exit(Worker& worker, int status, std::vector<WorkerExit>* exits) {
  worker.reaped = true;
  if (worker.pidfd >= 0) {
    close(worker.pidfd);
    worker.pidfd = -1;
  }
  // What it wrote just before exiting is still in the pipes: relay it before anyone reports on it.
  read_stream(worker, worker.out, kDrainOnExitBytes);
  read_stream(worker, worker.err, kDrainOnExitBytes);
  // Leftover children keep the group (and its id) alive; an empty group's id may be recycled, so it
  // must not be signalled again.
  worker.group_alive = kill(-worker.pid, 0) == 0;

  WorkerExit exit;
  exit.global_rank = worker.global_rank;
  exit.local_rank = worker.local_rank;
  exit.pid = worker.pid;
  exit.restart_count = worker.restart_count;
  exit.error_file = worker.error_file;
  if (WIFSIGNALED(status)) {
    exit.signal = WTERMSIG(status);
  } else {
    exit.exit_code = WEXITSTATUS(status);
  }
  // The unterminated last stderr line belongs in the summary too.
  exit.stderr_tail.assign(worker.stderr_tail.begin(), worker.stderr_tail.end());
  if (!worker.err.partial.empty()) exit.stderr_tail.push_back(worker.err.partial);
  write_log(worker, "==== dtrain run: attempt " + std::to_string(worker.restart_count) + ": rank " +
                        std::to_string(worker.global_rank) + " (pid " + std::to_string(worker.pid) +
                        ") " + exit.describe() + " ====\n");
  exits->push_back(std::move(exit));
}

void WorkerGroup::signal_groups(int signo) {
  for (Worker& worker : workers_) {
    if (worker.reaped && !worker.group_alive) continue;
    if (kill(-worker.pid, signo) != 0) {
      if (!worker.reaped)
        kill(worker.pid, signo);  // no group (cannot happen, but never skip a child)
      else
        worker.group_alive = false;
    }
  }
}

bool WorkerGroup::any_group_alive() {
  bool any = false;
  for (Worker& worker : workers_) {
    if (!worker.group_alive) continue;
    if (kill(-worker.pid, 0) != 0 && errno == ESRCH) {
      worker.group_alive = false;
    } else {
      any = true;
    }
  }
  return any;
}

void WorkerGroup::close_worker(Worker& worker) {
  for (Stream* stream : {&worker.out, &worker.err}) {
    if (stream->fd < 0) continue;
    read_stream(worker, *stream, kDrainOnExitBytes);
    if (stream->fd >= 0) {
      // Still open: a leftover process holds the write end. What it wrote is relayed; stop
      // listening.
      emit_lines(worker, *stream, {}, true);
      close(stream->fd);
      stream->fd = -1;
    }
  }
  if (worker.pidfd >= 0 && worker.reaped) {
    close(worker.pidfd);
    worker.pidfd = -1;
  }
  if (worker.log_fd >= 0) {
    close(worker.log_fd);
    worker.log_fd = -1;
  }
}

void WorkerGroup::write_log(Worker& worker, const std::string& text) {
  if (worker.log_fd >= 0) write_all(worker.log_fd, text);
}

}  // namespace dtrain::elastic
