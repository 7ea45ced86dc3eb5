// The checkpoint file on disk (Note [Checkpoint file] in dtrain/checkpoint.h): framing a payload
// with a length and a CRC-32, writing it atomically and durably, finding a folder's checkpoints,
// and reading one back with every way it can be damaged told apart.
#pragma once

#include <cstdint>
#include <string>
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

// Writes header + payload to a hidden temporary beside path, fsyncs it, renames it to path and
// fsyncs the folder. Throws UsageError naming the file and the system's reason; the temporary is
// removed and an existing file at path is left untouched.
void write_checkpoint_file(const std::string& path, const std::vector<char>& payload);

// Reads path's payload and checks the header. Returns false and sets *why (e.g. "truncated: 1000
// of 5000 payload bytes", "checksum mismatch") when the file is not an intact checkpoint.
bool read_checkpoint_file(const std::string& path, std::vector<char>* payload, std::string* why);

// After checkpoint `saved_step` was written: deletes all but the newest keep_last checkpoint files
// up to that step; logs (does not throw) what it cannot delete. Files of later steps are neither
// counted nor deleted: a run only saves below them after it resumed past them because they were
// damaged, and counting them would let them push out the intact checkpoints just written.
void prune_checkpoint_files(const std::string& dir, const std::string& prefix, int keep_last,
                            int64_t saved_step);

}  // namespace dtrain::detail
