// The datasets' file reader: a whole file, gzip'd or not, into memory (see read_file.h).
#include "datasets/read_file.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "dtrain/errors.h"

namespace datasets {
namespace {

using dtrain::UsageError;

// The decompressed size, to allocate once: a gzip file records it (mod 2^32) in its last 4 bytes,
// little-endian; a plain file is its own size. Only a hint: a corrupt trailer costs a reallocation
// or an unused reservation, capped at 1 GiB, never a wrong result.
size_t decompressed_size_hint(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  uint8_t magic[2] = {0, 0};
  if (!file || std::fread(magic, 1, 2, file.get()) != 2) return 0;
  if (magic[0] != 0x1f || magic[1] != 0x8b) {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0 ? static_cast<size_t>(info.st_size) : 0;
  }
  uint8_t trailer[4];
  if (std::fseek(file.get(), -4, SEEK_END) != 0 || std::fread(trailer, 1, 4, file.get()) != 4)
    return 0;
  const size_t size = uint32_t{trailer[0]} | (uint32_t{trailer[1]} << 8) |
                      (uint32_t{trailer[2]} << 16) | (uint32_t{trailer[3]} << 24);
  return std::min<size_t>(size, size_t{1} << 30);
}

}  // namespace

// The whole decompressed file. zlib's gz reader passes files that are not gzip'd through unchanged,
// so one path serves both forms.
std::vector<uint8_t> read_maybe_gzip(const std::string& path, const std::string& what,
                                     const std::string& fix) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) {
    throw UsageError(what + " " + path + " could not be opened: " + std::strerror(errno) + ". " +
                     fix);
  }
  // 1 MiB reads behind a 1 MiB input buffer: Fashion-MNIST's training images inflate to 47 MB,
  // the text corpus to 40 MB, and zlib's 8 KiB default buffer costs extra system calls for nothing.
  constexpr unsigned kChunk = 1 << 20;
  gzbuffer(file.get(), kChunk);
  std::vector<uint8_t> bytes;
  // One chunk more than the expected size, so that the final read that finds the end does not
  // reallocate.
  bytes.reserve(decompressed_size_hint(path) + kChunk);
  for (;;) {
    const size_t size = bytes.size();
    bytes.resize(size + kChunk);
    const int got = gzread(file.get(), bytes.data() + size, kChunk);
    if (got < 0) break;  // gzerror below says why
    bytes.resize(size + static_cast<size_t>(got));
    if (got == 0) break;
  }
  int code = Z_OK;
  const char* message = gzerror(file.get(), &code);
  if (code != Z_OK) {
    throw UsageError(what + " " + path + " is corrupt or truncated: zlib says '" + message + "'. " +
                     fix);
  }
  return bytes;
}

}  // namespace datasets
