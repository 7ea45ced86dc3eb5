// dtrain's logger (see log.h).
#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/format.h"

namespace dtrain::log {
namespace {

Level level_from_env() {
  const char* debug = std::getenv("DTRAIN_DEBUG");
  if (debug && std::strcmp(debug, "detail") == 0) return Level::kDebug;
  const char* value = std::getenv("DTRAIN_LOG");
  if (!value) return Level::kWarn;
  if (!std::strcmp(value, "error")) return Level::kError;
  if (!std::strcmp(value, "info")) return Level::kInfo;
  if (!std::strcmp(value, "debug")) return Level::kDebug;
  if (std::strcmp(value, "warn") != 0) {
    // Not an error worth stopping a job for, but never silent.
    std::fprintf(
        stderr,
        "[dtrain] warning: environment variable DTRAIN_LOG='%s': expected error, warn, info or "
        "debug; using warn\n",
        value);
  }
  return Level::kWarn;
}

const Level kLevel = level_from_env();
std::mutex prefix_mutex;
std::string prefix = "[dtrain] ";

const char* level_name(Level level) {
  switch (level) {
    case Level::kError:
      return "error";
    case Level::kWarn:
      return "warning";
    case Level::kInfo:
      return "info";
    case Level::kDebug:
      return "debug";
  }
  return "";
}

}  // namespace

bool enabled(Level level) { return level <= kLevel; }

bool detail() {
  static const bool on = [] {
    const char* debug = std::getenv("DTRAIN_DEBUG");
    return debug && std::strcmp(debug, "detail") == 0;
  }();
  return on;
}

void set_rank(int rank, int world_size) {
  std::lock_guard<std::mutex> lock(prefix_mutex);
  prefix = "[dtrain " + detail::rank_text(rank, world_size) + "] ";
}

void write(Level level, const std::string& message) {
  std::string line;
  {
    std::lock_guard<std::mutex> lock(prefix_mutex);
    line = prefix;
  }
  line += level_name(level);
  line += ": ";
  line += message;
  line += '\n';
  // One fwrite per line keeps lines whole when several threads log at once.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace dtrain::log
