// Strict integer parsing for the launcher's flags (`dtrain run`, `dtrain scale`).
#pragma once

#include <charconv>
#include <optional>
#include <string_view>
#include <system_error>

namespace dtrain::cli {

// The whole of `text` as a decimal integer, or nothing: no sign other than '-', no spaces, no overflow.
inline std::optional<long long> parse_integer(std::string_view text) {
  long long value = 0;
  const char* end = text.data() + text.size();
  auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end) return std::nullopt;
  return value;
}

}  // namespace dtrain::cli
