// Helpers shared by the launcher tests: files, bounded waits, process liveness, temporary folders
// and child processes with their output in files (killed when the test is done with them).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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

}  // namespace dtrain::cli::testing_support
