// dtrain's logger: one line per message on stderr, prefixed with the rank, filtered by DTRAIN_LOG
// (error, warn, info, debug; default warn). DTRAIN_DEBUG=detail turns on debug and logs every
// collective.
#pragma once

#include <sstream>
#include <string>

namespace dtrain::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool enabled(Level level);
void write(Level level, const std::string& message);
// Sets the "[rank R/N]" prefix once the process knows its rank.
void set_rank(int rank, int world_size);
// DTRAIN_DEBUG=detail: log each collective as it starts.
bool detail();

}  // namespace dtrain::log

#define DTRAIN_LOG(level, stream_expr)                                             \
  do {                                                                             \
    if (::dtrain::log::enabled(::dtrain::log::Level::level)) {                     \
      std::ostringstream dtrain_log_stream_;                                       \
      dtrain_log_stream_ << stream_expr;                                           \
      ::dtrain::log::write(::dtrain::log::Level::level, dtrain_log_stream_.str()); \
    }                                                                              \
  } while (0)
