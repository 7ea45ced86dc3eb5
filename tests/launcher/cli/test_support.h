// Helpers shared by the launcher tests: files, bounded waits, process liveness, temporary folders,
// child processes with their output in files (killed when the test is done with them) and a TCP
// listener that stands for another program holding a port.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain::cli::testing_support {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Args = std::vector<std::string>;
// Variables to set (a value) or remove (nullopt) in a child's environment.
using EnvChanges = std::vector<std::pair<std::string, std::optional<std::string>>>;

inline std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream content;
  content << file.rdbuf();
  return content.str();
}

inline void write_file(const fs::path& path, const std::string& content, bool executable = false) {
  std::ofstream(path, std::ios::binary) << content;
  fs::permissions(path, executable ? fs::perms(0755) : fs::perms(0644));
}

inline int count(const std::string& text, const std::string& needle) {
  int found = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos;
       at = text.find(needle, at + 1)) {
    ++found;
  }
  return found;
}

// The lines relayed for `rank`, prefix removed, in order (lines of different ranks interleave
// freely).
inline std::vector<std::string> lines_of(const std::string& text, int rank) {
  std::string prefix = "[rank" + std::to_string(rank) + "]: ";
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) {
    if (line.rfind(prefix, 0) == 0) lines.push_back(line.substr(prefix.size()));
  }
  return lines;
}

inline bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  Clock::time_point deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// Alive means running or stopped: a zombie is dead (it only waits for its parent, which may be an
// init that does not reap in this container).
inline bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  std::size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;  // gone meanwhile
  char state = stat[close + 2];
  return state != 'Z' && state != 'X';
}

// Parses `env` output ("NAME=value" lines).
inline std::map<std::string, std::string> parse_env(const std::string& text) {
  std::map<std::string, std::string> variables;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::size_t equals = line.find('=');
    if (equals != std::string::npos) variables[line.substr(0, equals)] = line.substr(equals + 1);
  }
  return variables;
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dtrain_cli_test_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// A child process of the test with stdout and stderr going to files; killed if still running when
// destroyed.
class ChildProcess {
 public:
  ChildProcess(const Args& argv, const fs::path& out_file, const fs::path& err_file,
               const EnvChanges& env = {}) {
    std::vector<char*> raw;
    for (const std::string& arg : argv) raw.push_back(const_cast<char*>(arg.c_str()));
    raw.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      int out = open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int err = open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int in = open("/dev/null", O_RDONLY);
      dup2(in, 0);
      dup2(out, 1);
      dup2(err, 2);
      for (const auto& [name, value] : env) {
        if (value) {
          setenv(name.c_str(), value->c_str(), 1);
        } else {
          unsetenv(name.c_str());
        }
      }
      execv(raw[0], raw.data());
      _exit(127);
    }
    started_ = Clock::now();
  }
  ~ChildProcess() {
    if (!exited_ && pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Waits for the exit; on timeout SIGKILLs the process and returns false.
  bool wait(std::chrono::milliseconds timeout) {
    bool exited = wait_until(
        [&] {
          int status = 0;
          if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
          exit_code_ = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
          return true;
        },
        timeout);
    seconds_ = std::chrono::duration<double>(Clock::now() - started_).count();
    if (!exited) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    exited_ = true;
    return exited;
  }
  int exit_code() const { return exit_code_; }
  double seconds() const { return seconds_; }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
  double seconds_ = 0;
  Clock::time_point started_;
};

// Another program on a port of 127.0.0.1 (an HTTP server, say): accepts every connection, writes
// `greeting` to it (nothing when empty) and keeps it open, silent, until destroyed. Its thread
// waits in poll() with a short timeout, so the destructor ends it within 100 ms.
class ForeignListener {
 public:
  explicit ForeignListener(std::string greeting) : greeting_(std::move(greeting)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        listen(listen_fd_, 16) != 0 ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      throw std::runtime_error("ForeignListener: cannot listen on 127.0.0.1");
    }
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~ForeignListener() {
    stop_ = true;
    thread_.join();
    for (int fd : accepted_) close(fd);
    close(listen_fd_);
  }
  ForeignListener(const ForeignListener&) = delete;
  ForeignListener& operator=(const ForeignListener&) = delete;

  int port() const { return port_; }
  // "127.0.0.1:PORT"
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  // Connections accepted so far.
  int accepted() const { return accepted_count_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd in{listen_fd_, POLLIN, 0};
      if (poll(&in, 1, 100) <= 0) continue;
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      if (!greeting_.empty()) {
        ssize_t ignored = send(fd, greeting_.data(), greeting_.size(), MSG_NOSIGNAL);
        (void)ignored;
      }
      accepted_.push_back(fd);
      ++accepted_count_;
    }
  }

  std::string greeting_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::vector<int> accepted_;  // touched by the thread only until it is joined
  std::atomic<int> accepted_count_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace dtrain::cli::testing_support
