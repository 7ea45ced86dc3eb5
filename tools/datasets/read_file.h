// The datasets' one file reader: a whole file into memory, inflated when it is gzip'd (dictzip
// too), passed through when it is not.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace datasets {

// Throws dtrain::UsageError "<what> <path> could not be opened: <why>. <fix>" or "... is corrupt
// or truncated: zlib says '...'. <fix>".
std::vector<uint8_t> read_maybe_gzip(const std::string& path, const std::string& what,
                                     const std::string& fix);

}  // namespace datasets
