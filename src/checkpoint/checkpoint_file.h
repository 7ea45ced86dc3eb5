// Checkpoint files on disk: writing them atomically and durably, finding a folder's checkpoints,
// and reading one back with every way it can be damaged told apart. The sharded checkpoints' files
// frame their payload with a length and a CRC-32 (the header below); the replicated checkpoints
// are torch.save files (Note [Checkpoint file] in dtrain/checkpoint.h) and were framed too up to
// payload format 1.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

// "DTRCKPT1", then the payload's length (uint64) and its CRC-32 (uint32), then 4 reserved bytes.
inline constexpr char kCheckpointMagic[8] = {'D', 'T', 'R', 'C', 'K', 'P', 'T', '1'};
inline constexpr std::size_t kCheckpointHeaderSize = 24;

struct CheckpointFile {
  std::string path;
  int64_t step = 0;
};

// <dir>/<prefix>-<step>.ckpt
std::string checkpoint_path(const std::string& dir, const std::string& prefix, int64_t step);

// The entries of dir named <prefix>-<digits><suffix> (files or folders), by step, oldest first. A
// missing folder has none.
std::vector<CheckpointFile> list_checkpoint_files(const std::string& dir, const std::string& prefix,
                                                  const std::string& suffix = ".ckpt");

// Writes bytes to a hidden temporary beside path, fsyncs it, renames it to path and fsyncs the
// folder: a crash leaves the old file or the new one, never a torn one under path's name. Throws
// UsageError naming the file and the system's reason; the temporary is removed and an existing
// file at path is left untouched.
void write_file_durably(const std::string& path, const std::vector<char>& bytes);

// The same for bytes in pieces, written one after another; `kind` begins the error's line
// ("safetensors <path>: fsync failed (...)").
using FilePieces = std::vector<std::pair<const char*, std::size_t>>;
void write_file_durably(const std::string& path, const FilePieces& pieces,
                        const std::string& kind = "checkpoint");

// zlib's CRC-32 of `size` bytes continuing from `crc` (0 to begin), for any size (zlib's own takes
// at most 4 GiB at once). The checksum of every dtrain file.
uint32_t crc32_update(uint32_t crc, const void* data, std::size_t size);

// The little-endian unsigned integer of `bytes` bytes at `in` (the file formats' fields).
uint64_t read_le(const char* in, int bytes);

// The same with the 24-byte header in front of the payload (the sharded checkpoints' files).
void write_checkpoint_file(const std::string& path, const std::vector<char>& payload);

// Reads path's payload and checks the header. Returns false and sets *why (e.g. "truncated: 1000
// of 5000 payload bytes", "checksum mismatch") when the file is not an intact checkpoint.
bool read_checkpoint_file(const std::string& path, std::vector<char>* payload, std::string* why);

// Reads a replicated checkpoint whole: a torch.save file (checked by torch_archive_intact), or
// the payload of a framed one (payload format 1, checked as read_checkpoint_file does). Returns
// false and sets *why when it is not intact.
bool read_replicated_checkpoint_file(const std::string& path, std::vector<char>* bytes,
                                     std::string* why);

// After checkpoint `saved_step` was written: deletes all but the newest keep_last checkpoint files
// up to that step; logs (does not throw) what it cannot delete. Files of later steps are neither
// counted nor deleted: a run only saves below them after it resumed past them because they were
// damaged, and counting them would let them push out the intact checkpoints just written.
void prune_checkpoint_files(const std::string& dir, const std::string& prefix, int keep_last,
                            int64_t saved_step);

}  // namespace dtrain::detail
