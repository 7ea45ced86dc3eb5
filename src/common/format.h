// The text that dtrain's messages share, for the library and the launcher alike (no LibTorch, no
// dtrain type): the "rank R/N" that begins every error message, durations in seconds, lists.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace dtrain::detail {

// "rank 3/8": a rank of the job and the job's size.
inline std::string rank_text(int rank, int world_size) {
  return "rank " + std::to_string(rank) + "/" + std::to_string(world_size);
}

// The same for this process in a process group: its rank in the job and the job's size, whatever
// sub-group the message comes from, so that every message names a rank the same way. A template
// only so that this header needs no dtrain type (anything with global_rank() and global_size()).
template <typename Group>
std::string rank_text(const Group& group) {
  return rank_text(group.global_rank(), group.global_size());
}

// "0.15 s", "2 s", "12.3 s", "600 s": three significant digits (whole seconds from 100 s on),
// never an exponent, no trailing zeros.
inline std::string seconds_text(double seconds) {
  const double magnitude = seconds < 0 ? -seconds : seconds;
  const int decimals = magnitude >= 100 ? 0 : magnitude >= 10 ? 1 : magnitude >= 1 ? 2 : 3;
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, seconds);
  std::string result = text;
  if (result.find('.') != std::string::npos) {
    result.erase(result.find_last_not_of('0') + 1);
    if (result.back() == '.') result.pop_back();
  }
  if (result == "-0") result = "0";
  return result + " s";
}

inline std::string seconds_text(std::chrono::duration<double> duration) {
  return seconds_text(duration.count());
}

// "a, b, c": the first `most` items, then ", ... (N in all)" if there are more (the parameters an
// error names, say).
inline std::string list_text(const std::vector<std::string>& items, size_t most = 10) {
  std::string text;
  for (size_t i = 0; i < items.size() && i < most; ++i) text += (i ? ", " : "") + items[i];
  if (items.size() > most) text += ", ... (" + std::to_string(items.size()) + " in all)";
  return text;
}

}  // namespace dtrain::detail
