// A hash that is the same in every process and on every machine (std::hash promises neither), for
// values that ranks compare with each other: parameter fingerprints, process ids.
#pragma once

#include <cstdint>
#include <string_view>

namespace dtrain::detail {

// FNV-1a over the bytes of `text`, top bit cleared: never negative, so that -1 can stand for
// "none" beside it.
inline int64_t stable_hash(std::string_view text) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return static_cast<int64_t>(hash >> 1);
}

}  // namespace dtrain::detail
