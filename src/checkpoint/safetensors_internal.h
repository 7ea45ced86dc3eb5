// Internals of safetensors files (src/checkpoint/safetensors.cpp) that DCP's safetensors storage
// (src/checkpoint/dcp.cpp) shares: a file's header alone, checked as read_safetensors_file checks
// it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtrain::detail {

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;        // in the file's data order
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// Reads and checks the header of `path` as read_safetensors_file does (Note [Safetensors file] in
// dtrain/safetensors.h): everything but the CRC-32 of the data, which only reading the data checks.
// A truncated file is refused here too (the header's offsets run past its end).
SafetensorsHeader read_safetensors_header(const std::string& path);

}  // namespace dtrain::detail
