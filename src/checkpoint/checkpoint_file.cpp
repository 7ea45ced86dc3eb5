// The checkpoint file on disk: framing, atomic durable writes, listing, checked reads (see
// checkpoint_file.h).
#include "checkpoint/checkpoint_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/torch_archive.h"
#include "common/log.h"
#include "dtrain/errors.h"

namespace dtrain::detail {
namespace {

namespace fs = std::filesystem;

uint32_t crc32_of(const char* data, std::size_t size) { return crc32_update(0, data, size); }

void put_le(char* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

[[noreturn]] void write_failed(const std::string& kind, const std::string& path,
                               const std::string& what, int error) {
  throw UsageError(kind + " " + path + ": " + what + " failed (" + std::strerror(error) +
                   "); free space or fix the folder's permissions; what was there before is "
                   "left as it was");
}

void write_all(int fd, const char* data, std::size_t size, const std::string& kind,
               const std::string& path) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) write_failed(kind, path, "writing", n < 0 ? errno : EIO);
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

}  // namespace

std::string checkpoint_path(const std::string& dir, const std::string& prefix, int64_t step) {
  return (fs::path(dir) / (prefix + "-" + std::to_string(step) + ".ckpt")).string();
}

std::vector<CheckpointFile> list_checkpoint_files(const std::string& dir, const std::string& prefix,
                                                  const std::string& suffix) {
  std::vector<CheckpointFile> files;
  std::error_code error;
  if (!fs::is_directory(dir, error)) return files;
  const std::string head = prefix + "-", tail = suffix;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    std::string name = entry.path().filename().string();
    if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
      continue;
    }
    std::string digits = name.substr(head.size(), name.size() - head.size() - tail.size());
    if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    files.push_back({entry.path().string(), std::stoll(digits)});
  }
  std::sort(files.begin(), files.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.step < b.step; });
  return files;
}

uint32_t crc32_update(uint32_t crc, const void* data, std::size_t size) {
  // zlib's crc32 takes a uInt length: feed it in chunks so payloads over 4 GiB work.
  const auto* bytes = static_cast<const Bytef*>(data);
  while (size > 0) {
    const uInt chunk = static_cast<uInt>(std::min<std::size_t>(size, 1u << 30));
    crc = static_cast<uint32_t>(::crc32(crc, bytes, chunk));
    bytes += chunk;
    size -= chunk;
  }
  return crc;
}

uint64_t read_le(const char* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return value;
}

void write_file_durably(const std::string& path, const FilePieces& parts, const std::string& kind) {
  fs::path final_path(path);
  fs::path dir = final_path.parent_path().empty() ? fs::path(".") : final_path.parent_path();
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) write_failed(kind, path, "creating its folder", error.value());
  // Hidden and unique per process, so that a listing never mistakes it for a checkpoint and two
  // writers never share one.
  std::string temporary_name = ".";  // appended, not "." + ...: GCC 12 warns falsely on the latter
  temporary_name += final_path.filename().string();
  temporary_name += ".tmp-" + std::to_string(::getpid());
  fs::path temporary = dir / temporary_name;

  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) write_failed(kind, path, "creating " + temporary.string(), errno);
  try {
    for (const auto& [data, size] : parts) write_all(fd, data, size, kind, path);
    // The data must be on disk before the rename makes it the checkpoint: otherwise a power loss
    // can leave a renamed file of zeros.
    if (::fsync(fd) != 0) write_failed(kind, path, "fsync", errno);
  } catch (...) {
    ::close(fd);
    fs::remove(temporary, error);
    throw;
  }
  if (::close(fd) != 0) {
    int saved = errno;
    fs::remove(temporary, error);
    write_failed(kind, path, "closing", saved);
  }
  if (::rename(temporary.c_str(), final_path.c_str()) != 0) {
    int saved = errno;
    fs::remove(temporary, error);
    write_failed(kind, path, "renaming " + temporary.string() + " to it", saved);
  }
  // The rename itself lives in the folder: fsync the folder so that it survives a crash too.
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void write_file_durably(const std::string& path, const std::vector<char>& bytes) {
  write_file_durably(path, {{bytes.data(), bytes.size()}});
}

void write_checkpoint_file(const std::string& path, const std::vector<char>& payload) {
  char header[kCheckpointHeaderSize] = {};
  std::memcpy(header, kCheckpointMagic, sizeof kCheckpointMagic);
  put_le(header + 8, payload.size(), 8);
  put_le(header + 16, crc32_of(payload.data(), payload.size()), 4);
  write_file_durably(path, {{header, sizeof header}, {payload.data(), payload.size()}});
}

bool read_checkpoint_file(const std::string& path, std::vector<char>* payload, std::string* why) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *why = std::string("cannot be opened (") + std::strerror(errno) + ")";
    return false;
  }
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < kCheckpointHeaderSize) {
    *why = "truncated: " + std::to_string(file_size) + " bytes, shorter than the header";
    return false;
  }
  char header[kCheckpointHeaderSize];
  in.read(header, sizeof header);
  if (std::memcmp(header, kCheckpointMagic, sizeof kCheckpointMagic) != 0) {
    *why = "not a dtrain checkpoint (its first bytes are not DTRCKPT1)";
    return false;
  }
  const uint64_t size = read_le(header + 8, 8);
  const uint32_t crc = static_cast<uint32_t>(read_le(header + 16, 4));
  if (file_size - kCheckpointHeaderSize != size) {
    *why = (file_size - kCheckpointHeaderSize < size ? "truncated: " : "has trailing bytes: ") +
           std::to_string(file_size - kCheckpointHeaderSize) +
           " payload bytes where the header "
           "says " +
           std::to_string(size);
    return false;
  }
  payload->resize(size);
  in.read(payload->data(), static_cast<std::streamsize>(size));
  if (!in) {
    *why = "could not be read to its end";
    return false;
  }
  if (crc32_of(payload->data(), payload->size()) != crc) {
    *why = "checksum mismatch (the contents changed after it was written)";
    return false;
  }
  return true;
}

bool read_replicated_checkpoint_file(const std::string& path, std::vector<char>* bytes,
                                     std::string* why) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *why = std::string("cannot be opened (") + std::strerror(errno) + ")";
    return false;
  }
  char magic[sizeof kCheckpointMagic] = {};
  in.read(magic, sizeof magic);
  if (in.gcount() == sizeof magic && std::memcmp(magic, kCheckpointMagic, sizeof magic) == 0) {
    return read_checkpoint_file(path, bytes, why);  // payload format 1
  }
  in.clear();
  in.seekg(0, std::ios::end);
  bytes->resize(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  in.read(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  if (!in) {
    *why = "could not be read to its end";
    return false;
  }
  return torch_archive_intact(*bytes, why);
}

void prune_checkpoint_files(const std::string& dir, const std::string& prefix, int keep_last,
                            int64_t saved_step) {
  // Temporaries left by a writer that was killed mid-write (.<prefix>-<step>.ckpt.tmp-<pid>): never
  // loaded, but they take space. Only those whose process is gone on this host are removed, so a
  // live writer's file is never pulled from under it.
  std::error_code error;
  const std::string head = "." + prefix + "-", marker = ".ckpt.tmp-";
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    std::string name = entry.path().filename().string();
    auto at = name.rfind(marker);
    if (name.compare(0, head.size(), head) != 0 || at == std::string::npos) continue;
    char* end = nullptr;
    long pid = std::strtol(name.c_str() + at + marker.size(), &end, 10);
    if (*end != '\0' || pid <= 0 || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      fs::remove(entry.path(), ignored);
    }
  }
  auto files = list_checkpoint_files(dir, prefix);
  files.erase(std::remove_if(files.begin(), files.end(),
                             [&](const CheckpointFile& file) { return file.step > saved_step; }),
              files.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep_last) < files.size(); ++i) {
    std::error_code error;
    if (!fs::remove(files[i].path, error) && error) {
      DTRAIN_LOG(kWarn, "checkpoint: could not delete the old checkpoint "
                            << files[i].path << " (" << error.message() << "); it stays");
    }
  }
}

}  // namespace dtrain::detail
