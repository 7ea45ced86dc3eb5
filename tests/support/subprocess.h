// Tier-2 test helper: runs a shell command (usually `dtrain run ...`) with a time limit and returns
// its exit code and combined output.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <regex>
#include <string>

namespace dtrain::testing {

struct CommandResult {
  int exit_code = -1;  // 124 when the time limit killed it
  std::string output;  // stdout and stderr interleaved
};

inline std::string bin(const std::string& program) {
  return std::string(DTRAIN_BIN_DIR) + "/" + program;
}

inline CommandResult run_command(const std::string& command, int time_limit_s = 120) {
  std::string full = "timeout -k 5 " + std::to_string(time_limit_s) + " " + command + " 2>&1";
  CommandResult result;
  FILE* pipe = popen(full.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> chunk;
  size_t n;
  while ((n = fread(chunk.data(), 1, chunk.size(), pipe)) > 0)
    result.output.append(chunk.data(), n);
  int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// The first `"key": <number>` in a program's output (its JSON result line; a space after the colon
// or none), or -1 when there is none.
inline int64_t json_int(const std::string& output, const std::string& key) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex("\"" + key + "\": *([0-9]+)"))) return -1;
  return std::stoll(match[1]);
}

inline double json_number(const std::string& output, const std::string& key) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex("\"" + key + "\": *([0-9.]+)"))) return -1;
  return std::stod(match[1]);
}

}  // namespace dtrain::testing
