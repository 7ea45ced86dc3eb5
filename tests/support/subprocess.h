// Tier-2 test helper: runs a shell command (usually `dtrain run ...`) with a time limit and returns
// its exit code and combined output.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
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

// A TCP port nobody holds right now, for a store the test's processes meet at, picked at random
// below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range). A port inside it
// (the kernel's pick for port 0) is handed out to any outgoing connection on the machine, and
// under `ctest -j` another test's client socket took one before the store bound it: both agents of
// a rendezvous then found the port taken and neither hosted the store. The launcher's tests pick
// their ports here too; dtrain::elastic::pick_free_port (the kernel's pick, as torchrun's) is the
// launcher's own, for the master port it picks for its workers.
inline bool port_bindable_now(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  close(fd);
  return bound;
}

inline int free_port() {
  int ephemeral_low = 32768, ephemeral_high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low >> ephemeral_high;
  // The wider of the spans below and above the range (a container may give it 1024-65535: then
  // neither, and the kernel's pick below is all there is).
  int first = 10000, last = ephemeral_low - 1;
  if (65535 - ephemeral_high > last - first) first = ephemeral_high + 1, last = 65535;
  static std::mt19937 random(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  for (int attempt = 0; last - first >= 1000 && attempt < 200; ++attempt) {
    const int port = std::uniform_int_distribution<int>(first, last)(random);
    if (port_bindable_now(port)) return port;
  }
  // No span outside the range, or nothing free there: the kernel's pick.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
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

// Whether the output holds `"key": <integer>` (its JSON result line; a space after the colon or
// none).
inline bool json_has_int(const std::string& output, const std::string& key) {
  return std::regex_search(output, std::regex("\"" + key + "\": *-?[0-9]+"));
}

// The first `"key": <integer>` in a program's output. A missing key fails the calling test, with
// the output shown, and reads as -1: a sentinel alone would pass EXPECT_LT, EXPECT_NE and the
// comparison of two runs that both printed nothing. Where no result line is the expected outcome,
// ask json_has_int.
inline int64_t json_int(const std::string& output, const std::string& key) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex("\"" + key + "\": *(-?[0-9]+)"))) {
    ADD_FAILURE() << "no \"" << key << "\": <integer> in the program's output:\n" << output;
    return -1;
  }
  return std::stoll(match[1]);
}

// The first `"key": <number>` in a program's output, sign and exponent included (Python prints
// 1e-06), or NaN when there is none or it is `null` (nlohmann's JSON and Python's write a NaN or
// an infinity so): NaN fails every comparison, so a run that diverged, or printed nothing, cannot
// pass a test by matching another that did the same.
inline double json_number(const std::string& output, const std::string& key) {
  std::smatch match;
  const std::regex number("\"" + key + "\": *(-?[0-9.]+(?:[eE][-+]?[0-9]+)?|NaN|-?Infinity)");
  if (!std::regex_search(output, match, number)) return std::nan("");
  return std::stod(match[1]);
}

// The first `"key": [integers]` in a program's output as written ("[60000,60000]"), or "" when
// there is none (which matches no expected list).
inline std::string json_list(const std::string& output, const std::string& key) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex("\"" + key + "\": *(\\[[0-9, ]*\\])")))
    return "";
  return match[1];
}

}  // namespace dtrain::testing
