// c10d stores hold byte vectors; dtrain keeps strings in them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::detail {

inline std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }

}  // namespace dtrain::detail
