// Test helper: a fresh path under the system's temporary folder, unique per process and call; the
// folder itself is not created (callers that need it empty or absent get exactly that).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace dtrain::testing {

inline std::string temp_dir(const std::string& stem) {
  static int counter = 0;
  auto dir = std::filesystem::temp_directory_path() /
             (stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(dir);
  return dir.string();
}

}  // namespace dtrain::testing
