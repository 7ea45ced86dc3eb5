// DCP safetensors folders (Note [DCP safetensors] in dtrain/dcp.h): a ZeRO run's shards cut into
// boxes and written as DCP chunks, a folder read back as chunks that must tile their tensors, and
// the loads into shards (any world size), into a plain module, or into whole tensors.
#include "dtrain/dcp.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint_file.h"
#include "checkpoint/dcp_format.h"
#include "checkpoint/safetensors_internal.h"
#include "checkpoint/sharded_format.h"
#include "common/format.h"
#include "common/log.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace detail {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kShardingKey = "DCP_SHARDING_INFO";  // as torch's _hf_utils.py names them
constexpr const char* kOffsetsKey = "saved_offsets";
constexpr const char* kIndexFormat = "dtrain dcp safetensors";
constexpr int64_t kIndexVersion = 1;
// Optimizer state as torch.distributed.checkpoint flattens {"optim": get_optimizer_state_dict()}.
constexpr const char* kStatePrefix = "optim.state.";

// "[3:5, 0:4]"
std::string box_text(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  std::string text = "[";
  for (std::size_t d = 0; d < offsets.size(); ++d) {
    text +=
        (d ? ", " : "") + std::to_string(offsets[d]) + ":" + std::to_string(offsets[d] + sizes[d]);
  }
  return text + "]";
}

std::string state_key(const std::string& name, const std::string& field) {
  return kStatePrefix + name + "." + field;
}

bool is_state_key(const std::string& key) { return key.rfind(kStatePrefix, 0) == 0; }

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The elements [lo, hi) of the sub-tensor of dimensions dim.. of `shape` whose first element is
// flat element `base` and whose leading indices are `prefix`.
void cut(const std::vector<int64_t>& shape, std::size_t dim, std::vector<int64_t>& prefix,
         int64_t base, int64_t lo, int64_t hi, std::vector<Box>& out) {
  if (lo >= hi) return;
  if (dim == shape.size()) {  // one element
    out.push_back({prefix, std::vector<int64_t>(prefix.size(), 1), base});
    return;
  }
  int64_t inner = 1;  // elements per index of dimension dim
  for (std::size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t first_whole = (lo + inner - 1) / inner, end_whole = hi / inner;
  auto within = [&](int64_t index, int64_t from, int64_t to) {
    prefix.push_back(index);
    cut(shape, dim + 1, prefix, base + index * inner, from, to, out);
    prefix.pop_back();
  };
  if (first_whole > end_whole) {  // inside one index of dimension dim
    within(lo / inner, lo % inner, lo % inner + (hi - lo));
    return;
  }
  if (lo % inner != 0) within(lo / inner, lo % inner, inner);
  if (end_whole > first_whole) {
    Box box{prefix, std::vector<int64_t>(prefix.size(), 1), base + first_whole * inner};
    box.offsets.push_back(first_whole);
    box.sizes.push_back(end_whole - first_whole);
    for (std::size_t d = dim + 1; d < shape.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(box));
  }
  if (hi % inner != 0) within(end_whole, 0, hi % inner);
}

bool boxes_overlap(const DcpChunk& a, const DcpChunk& b) {
  for (std::size_t d = 0; d < a.offsets.size(); ++d) {
    if (std::max(a.offsets[d], b.offsets[d]) >=
        std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]))
      return false;
  }
  return true;
}

[[noreturn]] void fail(const std::string& dir, const std::string& what) {
  throw UsageError("DCP checkpoint " + dir + ": " + what);
}

// The offsets of `name`'s chunk in `path`, from its DCP_SHARDING_INFO (all 0 without one, as
// torch's HuggingFaceStorageReader reads a file of whole tensors).
std::vector<int64_t> chunk_offsets(const std::string& dir, const std::string& path,
                                   const json* sharding, const SafetensorsEntry& entry) {
  if (!sharding) return std::vector<int64_t>(entry.shape.size(), 0);
  const std::string where = path + ": tensor '" + entry.name + "'";
  if (!sharding->contains(entry.name)) {
    fail(dir, where + " has no entry in the file's " + kShardingKey +
                  ", so its place in the whole tensor is unknown: damaged or written by another "
                  "program");
  }
  const json& info = (*sharding)[entry.name];
  if (!info.is_object() || !info.contains(kOffsetsKey) || !info[kOffsetsKey].is_array() ||
      info[kOffsetsKey].size() != entry.shape.size()) {
    fail(dir, where + ": its " + kShardingKey + " entry " + info.dump() + " is not {\"" +
                  kOffsetsKey + "\": [" + std::to_string(entry.shape.size()) +
                  " offsets]} (one per dimension of its shape " + shape_text(entry.shape) + ")");
  }
  std::vector<int64_t> offsets;
  for (const auto& value : info[kOffsetsKey]) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0) {
      fail(dir, where + ": " + kShardingKey + " offsets " + info[kOffsetsKey].dump() +
                    " are not non-negative integers");
    }
    offsets.push_back(value.get<int64_t>());
  }
  return offsets;
}

// The index dtrain's export writes: tensor -> (shape, dtype name), and the files.
struct ExportIndex {
  std::vector<std::string> files;
  std::map<std::string, std::pair<std::vector<int64_t>, std::string>> tensors;
};

ExportIndex read_index(const std::string& dir, const std::string& path) {
  std::string text;
  try {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
    json root = json::parse(text);
    if (root.at("format").get<std::string>() != kIndexFormat ||
        root.at("version").get<int64_t>() != kIndexVersion) {
      fail(dir, path + " is format " + root.at("format").dump() + " version " +
                    root.at("version").dump() + "; this dtrain reads \"" + kIndexFormat +
                    "\" version " + std::to_string(kIndexVersion));
    }
    ExportIndex index;
    index.files = root.at("files").get<std::vector<std::string>>();
    for (const auto& [name, value] : root.at("tensors").items()) {
      index.tensors[name] = {value.at("shape").get<std::vector<int64_t>>(),
                             value.at("dtype").get<std::string>()};
    }
    return index;
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    fail(dir, path + " is not the index dtrain's export writes (" + e.what() +
                  "): damaged; export again");
  }
}

// Note [Replacing an export]
// PyTorch's reader takes every *.safetensors file of the folder, so an export cannot replace an
// earlier one file by file without a moment when the folder mixes the two. So every rank writes
// into a sibling folder, .<name>.dtrain-export (the staging folder); once all have, rank 0 writes
// the index there and exchanges the two folders in one rename (renameat2's RENAME_EXCHANGE). The
// earlier export, now under the staging name, hands back what else the folder held (a config.json
// beside the weights) and is removed. Until the exchange the folder holds the earlier export,
// whatever fails. Where the file system cannot exchange (NFS), two renames do it: the folder to
// .<name>.dtrain-old, then the staging folder into its place; a crash between the two leaves the
// earlier export in .<name>.dtrain-old, which the next export puts back first.
// A folder that cannot be renamed (a mount point such as a docker volume's root, the working
// folder, one whose parent cannot be written; rank 0 decides in prepare_export, for every rank)
// stages inside itself, in <dir>/.dtrain-export, which PyTorch's reader does not look into (it
// lists the folder's own files). Where a rename of the folder fails only at the end (overlayfs
// gives EXDEV for a folder of its lower layer), the sibling staging folder is used the same way.
// Then the commit swaps files: the earlier index out into <dir>/.dtrain-old first, its part files
// after it, the staged part files in, the new index last. A failure before the commit still leaves
// the earlier export as it was; during the swap (renames only) the folder holds no whole export,
// and a crash there leaves the earlier one's index in .dtrain-old while the folder has none, which
// tells the next export to put it back (put_back). Once the folder has an index, what is left
// aside is only removed.
constexpr const char* kInsideStaging = ".dtrain-export";
constexpr const char* kInsideOld = ".dtrain-old";

struct ExportPaths {
  fs::path dir, staging, old;
  bool inside = false;  // staging is <dir>/.dtrain-export, the earlier export goes to .dtrain-old
};

// The same on every rank: the folder (symbolic links resolved, so that the exchange replaces the
// folder they lead to, not a link) and its two siblings.
ExportPaths export_paths(const std::string& dir) {
  std::error_code error;
  fs::path path = fs::weakly_canonical(fs::absolute(dir, error), error);
  if (error) fail(dir, "cannot be resolved (" + error.message() + "); check the path");
  if (!path.has_filename()) path = path.parent_path();  // "export/"
  if (path == path.root_path()) fail(dir, "is the root folder; export into a folder of its own");
  const std::string name = path.filename().string();
  return {path, path.parent_path() / ("." + name + ".dtrain-export"),
          path.parent_path() / ("." + name + ".dtrain-old")};
}

// Where an export that stopped while it replaced `dir` left the earlier one, as the end of an
// error ("" if nowhere): loading then finds no folder, or one without a whole export.
std::string put_aside_hint(const std::string& dir) {
  try {
    const ExportPaths paths = export_paths(dir);
    std::error_code error;
    for (const fs::path& aside : {paths.old, paths.dir / kInsideOld}) {
      if (fs::exists(aside / kDcpIndexName, error)) {
        return "; an export that stopped midway left the earlier export in " + aside.string() +
               ": the next export into " + dir +
               " puts it back first (or move its files back into the folder by hand)";
      }
    }
  } catch (const UsageError&) {
  }
  return "";
}

void fsync_folder(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace

int64_t Box::numel() const { return numel_of(sizes); }

std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> boxes;
  std::vector<int64_t> prefix;
  cut(shape, 0, prefix, 0, begin, end, boxes);
  return boxes;
}

std::string dcp_part_name(int64_t rank, int64_t part) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05lld-part-%lld.safetensors",
                static_cast<long long>(rank), static_cast<long long>(part));
  return name;
}

bool is_dcp_part_name(const std::string& name) {
  static const std::regex pattern(R"(shard-[0-9]{5,}-part-[0-9]+\.safetensors)");
  return std::regex_match(name, pattern);
}

DcpFolder::DcpFolder(std::string dir) : dir_(std::move(dir)) {
  std::error_code error;
  if (!fs::is_directory(dir_, error)) fail(dir_, "is not a folder" + put_aside_hint(dir_));
  // Every *.safetensors file, as HuggingFaceStorageReader takes them; by name.
  std::vector<std::string> names;
  bool ours = false;
  for (const auto& entry : fs::directory_iterator(dir_, error)) {
    const std::string name = entry.path().filename().string();
    if (!ends_with(name, ".safetensors") || !entry.is_regular_file(error)) continue;
    names.push_back(name);
    ours = ours || is_dcp_part_name(name);
  }
  std::sort(names.begin(), names.end());
  const std::string index_path = (fs::path(dir_) / kDcpIndexName).string();
  std::optional<ExportIndex> index;
  if (fs::exists(index_path, error)) {
    index = read_index(dir_, index_path);
    const std::set<std::string> listed(index->files.begin(), index->files.end());
    for (const auto& file : index->files) {
      if (!fs::exists(fs::path(dir_) / file, error)) {
        fail(dir_, "the export's file " + file + " (listed in " + kDcpIndexName +
                       ") is missing; copy the whole folder, or export again");
      }
    }
    for (const auto& name : names) {
      if (!listed.count(name)) {
        fail(dir_, name + " is not one of the files " + kDcpIndexName +
                       " lists (another program's, or an earlier export's): PyTorch's reader "
                       "would mix it in; remove it");
      }
    }
  } else if (ours) {
    fail(dir_, std::string("holds dtrain's shard files but no ") + kDcpIndexName +
                   ", which rank 0 writes after every rank has written its files: the export "
                   "did not finish; export again" +
                   put_aside_hint(dir_));
  }
  if (names.empty()) fail(dir_, "holds no .safetensors file" + put_aside_hint(dir_));

  std::vector<std::string> order;
  for (const auto& name : names) {
    const std::string path = (fs::path(dir_) / name).string();
    SafetensorsHeader header = read_safetensors_header(path);
    std::optional<json> sharding;
    auto it = header.metadata.find(kShardingKey);
    if (it != header.metadata.end()) {
      try {
        sharding = json::parse(it->second);
      } catch (const json::parse_error& e) {
        fail(dir_, path + ": its " + kShardingKey + " metadata is not valid JSON (" + e.what() +
                       "): damaged");
      }
      if (!sharding->is_object()) fail(dir_, path + ": its " + kShardingKey + " is not an object");
    }
    for (const auto& entry : header.tensors) {
      DcpChunk chunk{path, chunk_offsets(dir_, path, sharding ? &*sharding : nullptr, entry),
                     entry.shape};
      auto [found, added] = tensors_.try_emplace(entry.name);
      DcpTensor& tensor = found->second;
      if (added) {
        tensor.dtype = entry.dtype;
        tensor.shape = std::vector<int64_t>(entry.shape.size(), 0);
      } else if (tensor.dtype != entry.dtype || tensor.shape.size() != entry.shape.size()) {
        fail(dir_, "tensor '" + entry.name + "' is " + std::string(c10::toString(entry.dtype)) +
                       " " + shape_text(entry.shape) + " in " + path + " but " +
                       c10::toString(tensor.dtype) + " with " +
                       std::to_string(tensor.shape.size()) + " dimensions in " +
                       tensor.chunks.front().file + ": the files come from different saves");
      }
      // As HuggingFaceStorageReader: the whole tensor ends where its chunks end.
      for (std::size_t d = 0; d < chunk.sizes.size(); ++d)
        tensor.shape[d] = std::max(tensor.shape[d], chunk.offsets[d] + chunk.sizes[d]);
      tensor.chunks.push_back(std::move(chunk));
    }
  }

  if (index) {
    for (const auto& [name, expected] : index->tensors) {
      auto found = tensors_.find(name);
      if (found == tensors_.end()) {
        fail(dir_, "tensor '" + name + "' (listed in " + kDcpIndexName +
                       ") is in none of its files: damaged; export again");
      }
      if (c10::toString(found->second.dtype) != expected.second) {
        fail(dir_, "tensor '" + name + "' is " + c10::toString(found->second.dtype) +
                       " in its files but " + expected.second + " in " + kDcpIndexName);
      }
      for (const auto& chunk : found->second.chunks) {
        for (std::size_t d = 0; d < chunk.sizes.size(); ++d) {
          if (d >= expected.first.size() || chunk.offsets[d] + chunk.sizes[d] > expected.first[d]) {
            fail(dir_, "tensor '" + name + "': the chunk " + box_text(chunk.offsets, chunk.sizes) +
                           " in " + chunk.file + " lies outside its shape " +
                           shape_text(expected.first) + " (" + kDcpIndexName + ")");
          }
        }
      }
      found->second.shape = expected.first;
    }
    for (const auto& [name, tensor] : tensors_) {
      if (!index->tensors.count(name)) {
        fail(dir_, "tensor '" + name + "' in " + tensor.chunks.front().file + " is not in " +
                       kDcpIndexName + ": damaged; export again");
      }
    }
  }

  // Note [Tiling check]: the non-empty chunks of a tensor must not overlap, and their element
  // counts must add up to the tensor's: then they cover it exactly. Sorted by their first
  // dimension's offset, a chunk can only overlap those after it that start before it ends there.
  for (auto& [name, tensor] : tensors_) {
    std::vector<const DcpChunk*> chunks;
    int64_t covered = 0;
    for (const auto& chunk : tensor.chunks) {
      if (numel_of(chunk.sizes) == 0) continue;  // FSDP2 writes an empty chunk for an empty shard
      chunks.push_back(&chunk);
      covered += numel_of(chunk.sizes);
    }
    std::sort(chunks.begin(), chunks.end(),
              [](const DcpChunk* a, const DcpChunk* b) { return a->offsets < b->offsets; });
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      for (std::size_t j = i + 1; j < chunks.size(); ++j) {
        const DcpChunk& a = *chunks[i];
        const DcpChunk& b = *chunks[j];
        if (!a.offsets.empty() && b.offsets[0] >= a.offsets[0] + a.sizes[0]) break;
        if (boxes_overlap(a, b)) {
          fail(dir_, "tensor '" + name + "': its chunk " + box_text(a.offsets, a.sizes) + " in " +
                         a.file + " overlaps its chunk " + box_text(b.offsets, b.sizes) + " in " +
                         b.file +
                         ": the folder mixes files of two saves; save again into an "
                         "empty folder");
        }
      }
    }
    const int64_t total = numel_of(tensor.shape);
    if (covered != total) {
      std::set<std::string> files;
      for (const auto* chunk : chunks) files.insert(fs::path(chunk->file).filename().string());
      std::string list;
      for (const auto& file : files) list += (list.empty() ? "" : ", ") + file;
      fail(dir_, "tensor '" + name + "' " + shape_text(tensor.shape) + ": its chunks (in " + list +
                     ") cover " + std::to_string(covered) + " of its " + std::to_string(total) +
                     " elements: a shard file is missing; copy the whole folder");
    }
  }
}

const DcpTensor* DcpFolder::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const at::Tensor& DcpFolder::chunk_data(const DcpChunk& chunk, const std::string& name) {
  auto file = data_.find(chunk.file);
  if (file == data_.end()) {
    SafetensorsFile read = read_safetensors_file(chunk.file);  // checks the CRC-32 where present
    std::map<std::string, at::Tensor> tensors;
    for (const auto& item : read.tensors) tensors[item.key()] = item.value();
    file = data_.emplace(chunk.file, std::move(tensors)).first;
  }
  auto it = file->second.find(name);
  if (it == file->second.end() || it->second.sizes().vec() != chunk.sizes) {
    fail(dir_, chunk.file + " changed while it was read (tensor '" + name +
                   "'): is another program writing into the folder?");
  }
  return it->second;
}

void DcpFolder::read_box(const std::string& name, const Box& box, at::Tensor out) {
  const DcpTensor& tensor = tensors_.at(name);
  for (const auto& chunk : tensor.chunks) {
    if (numel_of(chunk.sizes) == 0) continue;
    std::vector<int64_t> lo(box.offsets.size()), hi(box.offsets.size());
    bool empty = false;
    for (std::size_t d = 0; d < lo.size(); ++d) {
      lo[d] = std::max(box.offsets[d], chunk.offsets[d]);
      hi[d] = std::min(box.offsets[d] + box.sizes[d], chunk.offsets[d] + chunk.sizes[d]);
      empty = empty || lo[d] >= hi[d];
    }
    if (empty) continue;
    at::Tensor from = chunk_data(chunk, name), to = out;
    for (std::size_t d = 0; d < lo.size(); ++d) {
      const int64_t dim = static_cast<int64_t>(d);
      from = from.narrow(dim, lo[d] - chunk.offsets[d], hi[d] - lo[d]);
      to = to.narrow(dim, lo[d] - box.offsets[d], hi[d] - lo[d]);
    }
    to.copy_(from);
  }
}

at::Tensor DcpFolder::read(const std::string& name) {
  const DcpTensor& tensor = tensors_.at(name);
  at::Tensor whole = at::empty(tensor.shape, at::TensorOptions().dtype(tensor.dtype));
  read_box(name, Box{std::vector<int64_t>(tensor.shape.size(), 0), tensor.shape, 0}, whole);
  return whole;
}

namespace {

// A DCP folder as the source of resharding (sharded_format.h): a parameter's value under its
// name, its optimizer state under optim.state.<name>.<field>.
class DcpSource : public StateSource {
 public:
  // destination: the optimizer being loaded (Adam and AdamW keep the same state).
  DcpSource(DcpFolder& folder, OptimizerKind destination) : folder_(folder) {
    bool adam = false, sgd = false;
    for (const auto& [key, tensor] : folder.tensors()) {
      if (!is_state_key(key)) continue;
      adam = adam || ends_with(key, ".exp_avg");
      sgd = sgd || ends_with(key, ".momentum_buffer");
    }
    kind_ =
        adam ? (destination == OptimizerKind::kAdamW ? OptimizerKind::kAdamW : OptimizerKind::kAdam)
             : (sgd ? OptimizerKind::kSgd : OptimizerKind::kNone);
  }

  std::optional<std::vector<int64_t>> shape(const std::string& name) override {
    const DcpTensor* tensor = is_state_key(name) ? nullptr : folder_.find(name);
    if (!tensor) return std::nullopt;
    return tensor->shape;
  }
  std::vector<std::string> names() override {
    std::vector<std::string> names;
    for (const auto& [key, tensor] : folder_.tensors())
      if (!is_state_key(key)) names.push_back(key);
    return names;
  }
  OptimizerKind optimizer() override { return kind_; }
  bool read(const std::string& name, const std::string& field, int64_t begin, int64_t end,
            at::Tensor out) override {
    const std::string key = field == "param" ? name : state_key(name, field);
    const DcpTensor* tensor = folder_.find(key);
    if (!tensor) return false;
    if (field != "param" && tensor->shape != *shape(name)) {
      fail(folder_.dir(), "tensor '" + key + "' is " + shape_text(tensor->shape) +
                              ", its parameter's shape is " + shape_text(*shape(name)));
    }
    for (const Box& box : boxes_of_range(tensor->shape, begin, end))
      folder_.read_box(key, box, out.narrow(0, box.begin - begin, box.numel()).view(box.sizes));
    return true;
  }
  std::optional<int64_t> optimizer_step(const std::string& name) override {
    const std::string key = state_key(name, "step");
    const DcpTensor* tensor = folder_.find(key);
    if (!tensor) return std::nullopt;
    at::Tensor step = folder_.read(key);
    if (step.numel() != 1) {
      fail(folder_.dir(), "tensor '" + key + "' is " + shape_text(tensor->shape) +
                              ", expected one number (the optimizer's step count)");
    }
    return static_cast<int64_t>(std::llround(step.item<double>()));
  }
  std::string describe() override { return "DCP checkpoint " + folder_.dir(); }

 private:
  DcpFolder& folder_;
  OptimizerKind kind_ = OptimizerKind::kNone;
};

// "{1, 3}": the ranks whose entry of `flags` (the first size() of them) is not 0.
std::string failed_ranks(const at::Tensor& flags, int world) {
  std::string list;
  for (int r = 0; r < world; ++r)
    if (flags[r].item<int64_t>() != 0) list += (list.empty() ? "" : ", ") + std::to_string(r);
  return list.empty() ? "" : "{" + list + "}";
}

// What an export writes into its folder: shard files, the index, and their temporary files
// (write_file_durably's .<file>.tmp-<pid>); a user's own hidden file is none of them.
bool is_export_file(const std::string& name) {
  if (ends_with(name, ".safetensors") || name == kDcpIndexName) return true;
  const std::size_t at = name.rfind(".tmp-");
  if (name[0] != '.' || at == std::string::npos || at < 1) return false;
  const std::string file = name.substr(1, at - 1), pid = name.substr(at + 5);
  return (is_dcp_part_name(file) || file == kDcpIndexName) && !pid.empty() &&
         std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Moves what `aside` (a folder an export put aside) holds besides an export's files back into
// `dir`, then removes it. Returns what went wrong ("" if nothing); then `aside` is kept.
std::string clear_aside(const fs::path& aside, const fs::path& dir) {
  std::error_code error;
  if (!fs::exists(aside, error)) return "";
  std::vector<std::string> names;
  for (fs::directory_iterator it(aside, error), end; !error && it != end; it.increment(error))
    names.push_back(it->path().filename().string());
  if (error) return "cannot list " + aside.string() + " (" + error.message() + ")";
  for (const auto& name : names) {
    if (is_export_file(name)) continue;
    if (fs::exists(dir / name, error)) {
      return (aside / name).string() + " and " + (dir / name).string() +
             " both exist: keep one, then remove " + aside.string();
    }
    fs::rename(aside / name, dir / name, error);
    if (error) {
      return "cannot move " + (aside / name).string() + " back into " + dir.string() + " (" +
             error.message() + "): move it by hand, then remove " + aside.string();
    }
  }
  fs::remove_all(aside, error);
  if (error) return "cannot remove " + aside.string() + " (" + error.message() + "): remove it";
  return "";
}

// The names of the export part files in `folder` into `names`. Returns what went wrong ("" if
// nothing).
std::string list_part_files(const fs::path& folder, std::vector<std::string>* names) {
  std::error_code error;
  for (fs::directory_iterator it(folder, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (is_dcp_part_name(name)) names->push_back(name);
  }
  return error ? "cannot list " + folder.string() + " (" + error.message() + ")" : "";
}

// Rank 0: `aside` holds an earlier export's index where `dir` holds none, so an export stopped
// after it took the earlier one out of the folder and before its own was in (Note [Replacing an
// export]). Puts the earlier export back: the stopped one's part files go (the earlier one's not
// yet taken out stay), the earlier one's come back, its index last, so that a put-back that stops
// is done again by the next export. Returns what went wrong ("" if nothing).
std::string put_back(const fs::path& aside, const fs::path& dir) {
  const ExportIndex index = read_index(aside.string(), (aside / kDcpIndexName).string());
  const std::set<std::string> listed(index.files.begin(), index.files.end());
  std::vector<std::string> stopped, earlier;
  std::string problem = list_part_files(dir, &stopped);
  if (problem.empty()) problem = list_part_files(aside, &earlier);
  if (!problem.empty()) return problem;
  // A part in the folder that the earlier export lists and still holds aside is the stopped one's
  // (the earlier one's copy is aside): it goes too, so that a put-back that stops midway leaves
  // part of the earlier export, never a mix of the two that PyTorch's reader would take for one.
  const std::set<std::string> held(earlier.begin(), earlier.end());
  std::error_code error;
  for (const auto& name : stopped) {
    if (listed.count(name) && !held.count(name)) continue;
    fs::remove(dir / name, error);
    if (error) return "cannot remove " + (dir / name).string() + " (" + error.message() + ")";
  }
  for (const auto& name : earlier) {
    fs::rename(aside / name, dir / name, error);
    if (error) {
      return "cannot move " + (aside / name).string() + " back (" + error.message() +
             "); move the files of " + aside.string() + " back by hand";
    }
  }
  fsync_folder(dir.string());
  fs::rename(aside / kDcpIndexName, dir / kDcpIndexName, error);
  if (error) {
    return "cannot move " + (aside / kDcpIndexName).string() + " back (" + error.message() +
           "); move it back by hand";
  }
  fsync_folder(dir.string());
  fsync_folder(aside.string());
  return "";
}

// Whether `dir` is the root of a mount (a docker volume; also a bind mount, which st_dev does not
// tell apart): it cannot be renamed, nor can a file be renamed into it from beside it.
bool is_mount_point(const fs::path& dir) {
#ifdef STATX_MNT_ID
  {
    struct statx folder = {};
    struct statx parent = {};
    if (::statx(AT_FDCWD, dir.c_str(), 0, STATX_MNT_ID, &folder) == 0 &&
        ::statx(AT_FDCWD, dir.parent_path().c_str(), 0, STATX_MNT_ID, &parent) == 0 &&
        (folder.stx_mask & parent.stx_mask & STATX_MNT_ID) != 0)
      return folder.stx_mnt_id != parent.stx_mnt_id;
  }
#endif
  struct stat folder = {};
  struct stat parent = {};
  return ::stat(dir.c_str(), &folder) == 0 && ::stat(dir.parent_path().c_str(), &parent) == 0 &&
         folder.st_dev != parent.st_dev;
}

// Rank 0, before any rank writes: the folder exists and holds no other program's .safetensors
// files, what an interrupted export put aside is back or gone, and the staging folder is empty.
// Returns whether the export stages inside the folder (Note [Replacing an export]).
bool prepare_export(const ExportPaths& paths) {
  const std::string dir = paths.dir.string();
  const fs::path inside_old = paths.dir / kInsideOld, inside_staging = paths.dir / kInsideStaging;
  std::error_code error;
  if (!fs::exists(paths.dir, error) && fs::exists(paths.old, error)) {
    fs::rename(paths.old, paths.dir, error);  // a crash between the two renames left it there
    if (error) {
      fail(dir, "is missing and an earlier export is in " + paths.old.string() +
                    ", which cannot be moved back (" + error.message() + "); move it by hand");
    }
  }
  fs::create_directories(paths.dir, error);
  if (error) {
    fail(dir, "cannot be created (" + error.message() + "); check the path and its permissions");
  }
  // Another program's .safetensors first: a put-back into such a folder would mix the two.
  for (const auto& entry : fs::directory_iterator(paths.dir, error)) {
    const std::string name = entry.path().filename().string();
    if (ends_with(name, ".safetensors") && !is_dcp_part_name(name)) {
      fail(dir, "holds " + name +
                    ", which is not a file of dtrain's export: PyTorch's reader would mix it in; "
                    "export into another folder, or remove it");
    }
  }
  // An index aside and none in the folder: the folder lost the earlier export midway (or was made
  // again after a crash between the two renames, by a script writing its config.json), and the
  // put-aside one is the only whole export there is.
  for (const auto& aside : {paths.old, inside_old}) {
    if (!fs::exists(aside / kDcpIndexName, error) || fs::exists(paths.dir / kDcpIndexName, error))
      continue;
    const std::string problem = put_back(aside, paths.dir);
    if (!problem.empty()) {
      fail(dir, "an earlier export was interrupted and is in " + aside.string() +
                    ", which could not be put back: " + problem);
    }
  }
  for (const auto& aside : {paths.old, paths.staging, inside_old, inside_staging}) {
    const std::string problem = clear_aside(aside, paths.dir);
    if (!problem.empty()) fail(dir, "an earlier export was interrupted: " + problem);
  }
  // Beside the folder where it can be renamed; otherwise inside it (why: `inside`).
  std::string inside;
  const fs::path working = fs::current_path(error);
  if (!error && fs::equivalent(paths.dir, working, error)) {
    inside = "it is the working folder";
  } else if (is_mount_point(paths.dir)) {
    inside = "it is a mount point";
  } else {
    fs::create_directory(paths.staging, error);
    if (error) inside = "a folder beside it cannot be created (" + error.message() + ")";
  }
  if (inside.empty()) {
    const fs::file_status status = fs::status(paths.dir, error);  // the folder keeps its mode
    if (!error) fs::permissions(paths.staging, status.permissions(), error);
    fsync_folder(paths.dir.parent_path().string());
    return false;
  }
  fs::create_directory(inside_staging, error);
  if (error) {
    fail(dir, "its staging folder " + inside_staging.string() + " cannot be created (" +
                  error.message() + "); check the folder's permissions");
  }
  DTRAIN_LOG(kInfo, "DCP export into " << dir << ": " << inside
                                       << ", so the export is staged inside it and its files "
                                          "swapped in at the end (Note [Replacing an export])");
  return true;
}

// Rank 0, where the export cannot replace the folder as a whole: swaps the folder's files for
// those of `staged`, which holds the whole export and its index (Note [Replacing an export]).
void swap_files(const ExportPaths& paths, const fs::path& staged) {
  const std::string dir = paths.dir.string();
  const fs::path old = paths.dir / kInsideOld;
  std::error_code error;
  fs::create_directory(old, error);  // prepare_export left none
  if (error) {
    fail(dir,
         old.string() + " cannot be created (" + error.message() + "); the folder is as it was");
  }
  std::vector<std::string> earlier, parts;
  for (const auto& [folder, names] : {std::pair{paths.dir, &earlier}, std::pair{staged, &parts}}) {
    const std::string problem = list_part_files(folder, names);
    if (!problem.empty()) fail(dir, problem + "; the folder is as it was");
  }
  const bool had_index = fs::exists(paths.dir / kDcpIndexName, error);
  // A rename that fails puts the earlier export back where it was already taken out.
  auto move = [&](const fs::path& from, const fs::path& to) {
    if (::rename(from.c_str(), to.c_str()) == 0) return;
    const std::string why = std::strerror(errno);
    std::string where = had_index
                            ? "the folder is as it was"
                            : "the folder held no finished export before either; export again";
    std::error_code ignored;
    if (fs::exists(old / kDcpIndexName, ignored)) {
      std::string problem;
      try {
        problem = put_back(old, paths.dir);
      } catch (const UsageError& e) {
        problem = e.what();
      }
      if (problem.empty()) {
        fs::remove_all(old, ignored);
      } else {
        where = "the earlier export is in " + old.string() + ", which the next export puts back (" +
                problem + ")";
      }
    }
    fail(dir, "cannot move " + from.string() + " to " + to.string() + " (" + why + "); " + where);
  };
  // The earlier index out first: from then on the folder has none and .dtrain-old has it, which
  // tells the next export to put it back if this one stops; the new index in last.
  if (had_index) move(paths.dir / kDcpIndexName, old / kDcpIndexName);
  for (const auto& name : earlier) move(paths.dir / name, old / name);
  fsync_folder(old.string());
  fsync_folder(dir);
  for (const auto& name : parts) move(staged / name, paths.dir / name);
  fsync_folder(dir);
  move(staged / kDcpIndexName, paths.dir / kDcpIndexName);
  fsync_folder(dir);
  for (const auto& aside : {old, staged}) {
    fs::remove_all(aside, error);
    if (error) {
      DTRAIN_LOG(kWarn, "DCP export into " << dir << " is complete, but " << aside.string()
                                           << " cannot be removed (" << error.message()
                                           << "): remove it");
    }
  }
}

// Rank 0, once the staging folder holds the whole export and its index: puts it in the place of
// the folder (Note [Replacing an export]), then clears what it replaced.
void replace_export(const ExportPaths& paths) {
  if (paths.inside) {
    swap_files(paths, paths.staging);
    return;
  }
  const std::string dir = paths.dir.string();
  fs::path aside = paths.staging;
  int exchanged = -1, why = ENOSYS;
#ifdef RENAME_EXCHANGE
  exchanged =
      ::renameat2(AT_FDCWD, paths.staging.c_str(), AT_FDCWD, paths.dir.c_str(), RENAME_EXCHANGE);
  why = errno;
#endif
  if (exchanged != 0 && (why == EINVAL || why == ENOSYS || why == ENOTSUP)) {
    if (::rename(paths.dir.c_str(), paths.old.c_str()) != 0) {
      why = errno;
    } else if (::rename(paths.staging.c_str(), paths.dir.c_str()) != 0) {
      why = errno;
      if (::rename(paths.old.c_str(), paths.dir.c_str()) != 0) {
        fail(dir, "the staging folder " + paths.staging.string() + " cannot be renamed to it (" +
                      std::strerror(why) + "); the folder's earlier content is in " +
                      paths.old.string() + ", which the next export puts back");
      }
    } else {
      exchanged = 0;
      aside = paths.old;
    }
  }
  if (exchanged != 0) {
    // The folder cannot be renamed after all (overlayfs gives EXDEV for a folder of its lower
    // layer), and it is as it was: its files are swapped instead.
    DTRAIN_LOG(kInfo, "DCP export into " << dir << ": the folder cannot be renamed ("
                                         << std::strerror(why)
                                         << "), so its files are swapped in instead");
    swap_files(paths, paths.staging);
    return;
  }
  fsync_folder(paths.dir.parent_path().string());
  const std::string problem = clear_aside(aside, paths.dir);
  if (!problem.empty())
    DTRAIN_LOG(kWarn, "DCP export into " << dir << " is complete, but " << problem);
}

std::unique_ptr<torch::optim::Optimizer> scratch_optimizer(OptimizerKind kind,
                                                           const std::vector<at::Tensor>& params) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.0));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(params);
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params);
    case OptimizerKind::kNone:
      break;
  }
  return nullptr;
}

// The checks of a load that resharding's own checks say less clearly: every parameter's shape
// (where its chunks end: a missing last file shortens it), every buffer, no other model's tensor.
void check_fits(DcpFolder& folder, const std::vector<FlatShard>& shards,
                const TensorTable& buffers) {
  std::set<std::string> expected;
  auto check = [&](const std::string& name, const std::vector<int64_t>& shape, const char* what) {
    expected.insert(name);
    const DcpTensor* tensor = folder.find(name);
    if (!tensor) {
      fail(folder.dir(), std::string("holds no tensor '") + name + "', the model's " + what +
                             " of shape " + shape_text(shape) +
                             ": it was saved from another model");
    }
    if (tensor->shape != shape) {
      fail(folder.dir(), "tensor '" + name + "' is " + shape_text(tensor->shape) +
                             " (where its chunks end) but the model's " + what + " is " +
                             shape_text(shape) +
                             ": a shard file is missing, or it was saved from another model");
    }
  };
  for (const auto& shard : shards)
    for (const auto& p : shard.params) check(p.name, p.shape, "parameter");
  for (const auto& item : buffers) check(item.key(), item.value().sizes().vec(), "buffer");
  for (const auto& [name, tensor] : folder.tensors()) {
    if (is_state_key(name) || expected.count(name)) continue;
    fail(folder.dir(), "holds tensor '" + name + "' " + shape_text(tensor.shape) +
                           ", which is neither a parameter nor a buffer of the model: it was "
                           "saved from another model (pass the module's buffers in "
                           "DcpShards::buffers)");
  }
}

void check_optimizer(DcpSource& source, OptimizerKind destination) {
  if (destination == OptimizerKind::kNone) return;
  if (source.optimizer() == OptimizerKind::kNone) {
    throw UsageError(source.describe() + " holds no optimizer state (no " + kStatePrefix +
                     "<name>.<field> tensors); load it without an optimizer");
  }
  const bool adam_like =
      destination == OptimizerKind::kAdam || destination == OptimizerKind::kAdamW;
  if ((source.optimizer() == OptimizerKind::kSgd) == adam_like) {
    throw UsageError(source.describe() + " holds the state of " +
                     (adam_like ? "SGD (momentum_buffer)" : "Adam or AdamW (exp_avg)") +
                     " but the optimizer is " + optimizer_kind_name(destination) +
                     "; build the optimizer of the run that saved it");
  }
}

}  // namespace
}  // namespace detail

using detail::DcpFolder;
using detail::OptimizerKind;

void save_dcp_safetensors(const std::string& dir, const DcpShards& state,
                          const std::shared_ptr<ProcessGroup>& group) {
  namespace fs = std::filesystem;
  const detail::Ranks ranks{group.get()};
  const int rank = ranks.rank(), world = ranks.size();
  const std::string what = ranks.who() + ": DCP export into " + dir;

  std::string failure;
  std::optional<detail::ExportPaths> paths;
  bool inside = false;
  try {
    paths = detail::export_paths(dir);
    if (rank == 0) inside = detail::prepare_export(*paths);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Who failed, and where every rank stages: rank 0 decides (the others add 0), as a folder every
  // rank looked at on its own could differ between hosts.
  at::Tensor prepared = torch::zeros({world + 1}, torch::kInt64);
  prepared[rank] = failure.empty() ? 0 : 1;
  prepared[world] = inside ? 1 : 0;
  ranks.all_reduce(prepared);
  if (!detail::failed_ranks(prepared, world).empty()) {
    throw UsageError(what + " failed: " +
                     (failure.empty() ? "rank(s) " + detail::failed_ranks(prepared, world) +
                                            " could not prepare the folder (see their errors)"
                                      : failure));
  }
  if (prepared[world].item<int64_t>() != 0) {
    paths->staging = paths->dir / detail::kInsideStaging;
    paths->old = paths->dir / detail::kInsideOld;
    paths->inside = true;
  }

  // This rank's files: part k holds the k-th box of each parameter's range (and of its state).
  int64_t parts_written = 0;
  try {
    const OptimizerKind kind = detail::optimizer_kind(state.optimizer, "DcpShards::optimizer");
    std::vector<TensorTable> parts;
    std::vector<nlohmann::json> sharding;
    auto add = [&](std::size_t part, const std::string& key, const at::Tensor& tensor,
                   const std::vector<int64_t>& offsets) {
      while (parts.size() <= part) {
        parts.emplace_back();
        sharding.push_back(nlohmann::json::object());
      }
      parts[part].insert(key, tensor);
      sharding[part][key] = {{detail::kOffsetsKey, offsets}};
    };
    for (const auto& shard : state.shards) {
      detail::ParamOptimizerState param_state;
      if (state.optimizer)
        param_state = detail::get_param_state(*state.optimizer, kind, shard.shard);
      const at::Tensor flat = shard.shard.detach().reshape(-1);
      const int64_t first = shard.offset, last = shard.offset + flat.numel();
      for (const auto& p : shard.params) {
        const int64_t numel = detail::numel_of(p.shape);
        if (numel == 0) {  // no element to own: rank 0 writes it, empty
          if (rank == 0)
            add(0, p.name, torch::empty(p.shape, flat.options()),
                std::vector<int64_t>(p.shape.size(), 0));
          continue;
        }
        const int64_t lo = std::max(first, p.offset), hi = std::min(last, p.offset + numel);
        if (lo >= hi) continue;
        auto boxes = detail::boxes_of_range(p.shape, lo - p.offset, hi - p.offset);
        for (std::size_t k = 0; k < boxes.size(); ++k) {
          const auto& box = boxes[k];
          const int64_t at = p.offset + box.begin - first;
          add(k, p.name, flat.narrow(0, at, box.numel()).view(box.sizes), box.offsets);
          for (const auto& [field, tensor] : param_state.fields) {
            add(k, detail::state_key(p.name, field),
                tensor.detach().reshape(-1).narrow(0, at, box.numel()).view(box.sizes),
                box.offsets);
          }
        }
      }
      // PyTorch's Adam keeps its step per parameter as a 0-dim float32 tensor.
      if (rank == 0 && param_state.present && kind != OptimizerKind::kSgd) {
        for (const auto& p : shard.params) {
          add(0, detail::state_key(p.name, "step"),
              at::scalar_tensor(static_cast<double>(param_state.step), at::kFloat), {});
        }
      }
    }
    if (rank == 0) {
      for (const auto& item : state.buffers) {
        if (!item.value().defined()) continue;
        add(0, item.key(), item.value().detach(), std::vector<int64_t>(item.value().dim(), 0));
      }
    }
    for (std::size_t k = 0; k < parts.size(); ++k) {
      save_safetensors_file(
          (paths->staging / detail::dcp_part_name(rank, k)).string(), parts[k],
          {{detail::kShardingKey, sharding[k].dump()}, {"DCP_VERSION", "1.0"}, {"format", "pt"}});
    }
    parts_written = static_cast<int64_t>(parts.size());
  } catch (const std::exception& e) {
    failure = e.what();
  }

  // Who failed, and how many files each rank wrote, in one all-reduce.
  at::Tensor report = torch::zeros({2 * world}, torch::kInt64);
  report[rank] = failure.empty() ? 0 : 1;
  report[world + rank] = parts_written;
  ranks.all_reduce(report);
  const std::string failed = detail::failed_ranks(report, world);
  if (!failed.empty()) {
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(paths->staging, ignored);
    }
    throw UsageError(what + " failed: rank(s) " + failed + " could not write their files" +
                     (failure.empty() ? " (see their errors)" : ": " + failure) +
                     "; the folder is as it was (an earlier export in it still loads)");
  }

  // Rank 0 commits: writes the index into the staging folder, then puts it in the folder's place.
  at::Tensor committed = torch::tensor({int64_t{1}});
  if (rank == 0) {
    bool replacing = false;  // replace_export's errors say what the folder holds
    try {
      nlohmann::json files = nlohmann::json::array();
      for (int r = 0; r < world; ++r) {
        for (int64_t k = 0; k < report[world + r].item<int64_t>(); ++k)
          files.push_back(detail::dcp_part_name(r, k));
      }
      nlohmann::json tensors = nlohmann::json::object();
      auto list = [&](const std::string& name, const std::vector<int64_t>& shape,
                      at::ScalarType dtype) {
        tensors[name] = {{"shape", shape}, {"dtype", c10::toString(dtype)}};
      };
      const OptimizerKind kind = detail::optimizer_kind(state.optimizer, "DcpShards::optimizer");
      for (const auto& shard : state.shards) {
        detail::ParamOptimizerState param_state;
        if (state.optimizer)
          param_state = detail::get_param_state(*state.optimizer, kind, shard.shard);
        for (const auto& p : shard.params) {
          list(p.name, p.shape, shard.shard.scalar_type());
          for (const auto& [field, tensor] : param_state.fields)
            list(detail::state_key(p.name, field), p.shape, tensor.scalar_type());
          if (param_state.present && kind != OptimizerKind::kSgd)
            list(detail::state_key(p.name, "step"), {}, at::kFloat);
        }
      }
      for (const auto& item : state.buffers) {
        if (item.value().defined())
          list(item.key(), item.value().sizes().vec(), item.value().scalar_type());
      }
      nlohmann::json index = {{"format", detail::kIndexFormat},
                              {"version", detail::kIndexVersion},
                              {"world_size", world},
                              {"files", files},
                              {"tensors", tensors}};
      const std::string text = index.dump(1) + "\n";
      detail::write_file_durably((paths->staging / detail::kDcpIndexName).string(),
                                 std::vector<char>(text.begin(), text.end()));
      replacing = true;
      detail::replace_export(*paths);
    } catch (const std::exception& e) {
      failure = std::string(e.what()) + (replacing ? "" : "; the folder is as it was");
      committed[0] = 0;
      std::error_code ignored;
      fs::remove_all(paths->staging, ignored);
    }
  }
  ranks.broadcast(committed);
  if (committed.item<int64_t>() == 0) {
    throw UsageError(what + " failed: rank 0 could not put it in place" +
                     (failure.empty() ? " (see its error)" : ": " + failure));
  }
}

void load_dcp_safetensors(const std::string& dir, DcpShards& state,
                          const std::shared_ptr<ProcessGroup>& group) {
  const detail::Ranks ranks{group.get()};
  const int rank = ranks.rank(), world = ranks.size();
  // First everything is read into copies, so that a file one rank finds damaged leaves every
  // rank's state as it was; then, once all ranks succeeded, the same reads (of the files now in
  // memory) fill the state itself.
  std::exception_ptr failure;
  std::unique_ptr<DcpFolder> folder;
  std::unique_ptr<detail::DcpSource> source;
  std::vector<at::Tensor> buffers;
  try {
    const OptimizerKind kind = detail::optimizer_kind(state.optimizer, "DcpShards::optimizer");
    folder = std::make_unique<DcpFolder>(dir);
    source = std::make_unique<detail::DcpSource>(*folder, kind);
    detail::check_fits(*folder, state.shards, state.buffers);
    detail::check_optimizer(*source, kind);
    std::vector<FlatShard> scratch = state.shards;
    std::vector<at::Tensor> scratch_tensors;
    for (auto& shard : scratch) {
      shard.shard = torch::zeros_like(shard.shard.detach());
      scratch_tensors.push_back(shard.shard);
    }
    auto scratch_optimizer = detail::scratch_optimizer(kind, scratch_tensors);
    detail::fill_shards(*source, scratch, scratch_optimizer.get(), /*warn=*/false);
    for (const auto& item : state.buffers) buffers.push_back(folder->read(item.key()));
  } catch (const UsageError& e) {
    failure = std::make_exception_ptr(UsageError(ranks.who() + ": " + e.what()));
  } catch (...) {
    failure = std::current_exception();
  }
  at::Tensor failed = torch::zeros({world}, torch::kInt64);
  failed[rank] = failure ? 1 : 0;
  ranks.all_reduce(failed);
  if (failure) std::rethrow_exception(failure);
  const std::string others = detail::failed_ranks(failed, world);
  if (!others.empty()) {
    throw UsageError(ranks.who() + ": DCP load of " + dir + " failed on rank(s) " + others +
                     " (see their errors); nothing was loaded");
  }
  detail::fill_shards(*source, state.shards, state.optimizer);
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (auto& item : state.buffers) item.value().copy_(buffers[i++]);
}

bool dcp_has_optimizer_state(const std::string& dir) {
  const DcpFolder folder(dir);
  for (const auto& [name, tensor] : folder.tensors())
    if (detail::is_state_key(name)) return true;
  return false;
}

TensorTable load_dcp_safetensors(const std::string& dir) {
  DcpFolder folder(dir);
  TensorTable tensors;
  for (const auto& [name, tensor] : folder.tensors()) tensors.insert(name, folder.read(name));
  return tensors;
}

void load_dcp_safetensors(const std::string& dir, torch::nn::Module& module,
                          torch::optim::Optimizer* optimizer) {
  const OptimizerKind kind =
      detail::optimizer_kind(optimizer, "load_dcp_safetensors: the optimizer");
  DcpFolder folder(dir);
  detail::DcpSource source(folder, kind);
  detail::check_optimizer(source, kind);
  TensorTable model;
  for (const auto& [name, tensor] : folder.tensors())
    if (!detail::is_state_key(name)) model.insert(name, folder.read(name));

  // The optimizer's state, read and checked before anything changes.
  std::vector<std::pair<at::Tensor, detail::ParamOptimizerState>> states;
  if (optimizer) {
    std::set<c10::TensorImpl*> optimized;
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) optimized.insert(p.unsafeGetTensorImpl());
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& param = item.value();
      if (!optimized.count(param.unsafeGetTensorImpl())) continue;
      detail::ParamOptimizerState state;
      state.present = true;
      const auto fields = detail::optimizer_fields(kind);
      for (const auto& field : fields) {
        const std::string key = detail::state_key(item.key(), field);
        const detail::DcpTensor* tensor = folder.find(key);
        if (!tensor) {
          if (field == fields.front()) {
            state.present = false;
            break;
          }
          continue;
        }
        if (tensor->shape != param.sizes().vec()) {
          detail::fail(dir, "tensor '" + key + "' is " + detail::shape_text(tensor->shape) +
                                " but the parameter '" + item.key() + "' is " +
                                detail::shape_text(param.sizes().vec()) +
                                ": it was saved from another model");
        }
        state.fields[field] = folder.read(key).to(param.options());
      }
      if (state.present) state.step = source.optimizer_step(item.key()).value_or(0);
      states.emplace_back(param, std::move(state));
    }
  }
  load_into(module, model);  // checks every name and shape before it copies
  for (const auto& [param, state] : states) detail::set_param_state(*optimizer, kind, param, state);
}

}  // namespace dtrain
