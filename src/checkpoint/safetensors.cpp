// Safetensors files and sharded folders (Note [Safetensors file] in dtrain/safetensors.h): the
// header's JSON checked entry by entry, then the offsets as a whole (in range, neither overlapping
// nor leaving holes, covering the data exactly), then the bytes read straight into CPU tensors.
#include "dtrain/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint_file.h"
#include "checkpoint/safetensors_internal.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using detail::crc32_update;
using detail::write_file_durably;
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; dtrain reads and writes it without swapping");

// The format's own cap on the header (the safetensors crate refuses longer ones): a length past it
// is a damaged file or not a safetensors file at all.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kCrcKey = "dtrain_crc32";

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
// The safetensors names of the dtypes LibTorch has.
constexpr DtypeName kDtypes[] = {{"BOOL", at::kBool},
                                 {"U8", at::kByte},
                                 {"I8", at::kChar},
                                 {"I16", at::kShort},
                                 {"U16", at::kUInt16},
                                 {"I32", at::kInt},
                                 {"U32", at::kUInt32},
                                 {"I64", at::kLong},
                                 {"U64", at::kUInt64},
                                 {"F16", at::kHalf},
                                 {"BF16", at::kBFloat16},
                                 {"F32", at::kFloat},
                                 {"F64", at::kDouble},
                                 {"F8_E4M3", at::kFloat8_e4m3fn},
                                 {"F8_E5M2", at::kFloat8_e5m2}};

std::string known_dtypes() {
  std::string names;
  for (const auto& d : kDtypes) names += std::string(names.empty() ? "" : ", ") + d.name;
  return names;
}

const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.name;
  return nullptr;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw UsageError("safetensors: " + path + ": " + what);
}

std::string hex32(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", value);
  return text;
}

// One tensor as the header describes it.
struct Entry {
  std::string name;
  at::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

// The header's integer at `value`, or a failure naming `what`.
uint64_t header_uint(const nlohmann::json& value, const std::string& path,
                     const std::string& what) {
  if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0)) {
    fail(path, what + " is " + value.dump() + ", expected a non-negative integer");
  }
  return value.get<uint64_t>();
}

Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& value) {
  const std::string what = "tensor '" + name + "'";
  if (name.empty()) fail(path, "a tensor has an empty name");
  if (!value.is_object()) fail(path, what + ": expected an object, found " + value.dump());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) fail(path, what + " has no \"" + key + "\"");
  }
  Entry entry;
  entry.name = name;
  const auto& dtype = value["dtype"];
  if (!dtype.is_string()) fail(path, what + ": dtype " + dtype.dump() + " is not a string");
  bool known = false;
  for (const auto& d : kDtypes) {
    if (dtype.get<std::string>() == d.name) {
      entry.type = d.type;
      known = true;
    }
  }
  if (!known) {
    fail(path, what + ": unknown dtype " + dtype.dump() + " (dtrain reads " + known_dtypes() + ")");
  }
  const auto& shape = value["shape"];
  if (!shape.is_array()) fail(path, what + ": shape " + shape.dump() + " is not an array");
  // The element count, refusing one that overflows: a damaged dimension must not wrap around to a
  // count that happens to match the offsets.
  uint64_t elements = 1;
  bool overflow = false;
  for (const auto& dim : shape) {
    const uint64_t size = header_uint(dim, path, what + ": a dimension of shape " + shape.dump());
    if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
    entry.shape.push_back(static_cast<int64_t>(size));
    if (size != 0 && elements > std::numeric_limits<uint64_t>::max() / 16 / size) overflow = true;
    elements *= size;
  }
  const auto& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    fail(path, what + ": data_offsets " + offsets.dump() + " is not a pair [begin, end]");
  }
  entry.begin = header_uint(offsets[0], path, what + ": data_offsets' begin");
  entry.end = header_uint(offsets[1], path, what + ": data_offsets' end");
  if (entry.begin > entry.end) {
    fail(path, what + ": data_offsets " + offsets.dump() + " end before they begin");
  }
  const uint64_t bytes = elements * at::elementSize(entry.type);
  if (overflow || bytes != entry.end - entry.begin) {
    fail(path, what + ": shape " + shape.dump() + " of " + dtype.get<std::string>() + " is " +
                   (overflow ? std::string("more bytes than a file holds")
                             : std::to_string(bytes) + " bytes") +
                   ", but its data_offsets " + offsets.dump() + " span " +
                   std::to_string(entry.end - entry.begin));
  }
  return entry;
}

class File {
 public:
  explicit File(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(path, std::string("cannot be opened (") + std::strerror(errno) + ")");
    struct stat info;
    if (::fstat(fd_, &info) != 0 || !S_ISREG(info.st_mode)) {
      ::close(fd_);
      fail(path, "is not a regular file");
    }
    size_ = static_cast<uint64_t>(info.st_size);
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint64_t size() const { return size_; }
  // Reads exactly `size` bytes at `offset`; a short read means the file shrank under us.
  void read(void* data, uint64_t size, uint64_t offset) const {
    auto* out = static_cast<char*>(data);
    while (size > 0) {
      ssize_t n = ::pread(fd_, out, size, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(path_, std::string("read failed (") + std::strerror(errno) + ")");
      if (n == 0) {
        fail(path_, "truncated: ended at byte " + std::to_string(offset) + " while reading");
      }
      out += n;
      size -= static_cast<uint64_t>(n);
      offset += static_cast<uint64_t>(n);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// "model-00001-of-00003.safetensors"
std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index, count);
  return name;
}

bool is_model_file(const std::string& name) {
  static const std::regex shard(R"(model-[0-9]{5}-of-[0-9]{5}\.safetensors)");
  return name == kSingleName || name == kIndexName || std::regex_match(name, shard);
}

TensorTable load_index(const std::string& path) {
  std::string text;
  {
    File file(path);
    text.resize(file.size());
    file.read(text.data(), file.size(), 0);
  }
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(path, std::string("the index is not valid JSON (") + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    fail(path, "the index has no \"weight_map\" object of tensor name -> file");
  }
  const fs::path dir = fs::path(path).parent_path();
  // file -> the tensors the index puts there, files in name order (the shards' order).
  std::map<std::string, std::set<std::string>> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().empty() ||
        fs::path(file.get<std::string>()).is_absolute()) {
      fail(path, "tensor '" + name + "' maps to " + file.dump() +
                     ", expected a file name relative to the index's folder");
    }
    files[file.get<std::string>()].insert(name);
  }
  TensorTable tensors;
  for (const auto& [file, names] : files) {
    const std::string shard = (dir / file).string();
    if (!fs::exists(shard)) {
      const std::string more =
          names.size() > 1 ? " and " + std::to_string(names.size() - 1) + " more" : "";
      fail(path, "the index names " + file + " (for '" + *names.begin() + "'" + more +
                     "), which does not exist; copy the whole folder");
    }
    SafetensorsFile read = read_safetensors_file(shard);
    for (const auto& item : read.tensors) {
      if (!names.count(item.key())) {
        fail(path, file + " holds tensor '" + item.key() +
                       "', which the index does not map to it; the index and shards differ");
      }
      tensors.insert(item.key(), item.value());
    }
    for (const auto& name : names) {
      if (!read.tensors.contains(name)) {
        fail(path, "the index maps tensor '" + name + "' to " + file + ", which lacks it");
      }
    }
  }
  return tensors;
}

// A file's header as parse_header() checked it.
struct ParsedHeader {
  uint64_t header_size = 0;
  std::vector<Entry> entries;  // in data order
  std::map<std::string, std::string> metadata;
};

// The header of `file`, checked entry by entry and then as a whole (Note [Safetensors file]); the
// entries in data order.
ParsedHeader parse_header(const File& file, const std::string& path) {
  if (file.size() < 8) {
    fail(path, "truncated: " + std::to_string(file.size()) +
                   " bytes, shorter than the 8-byte header length a safetensors file starts with");
  }
  uint64_t header_size = 0;
  file.read(&header_size, 8, 0);
  if (header_size > kMaxHeaderBytes) {
    fail(path, "the header length " + std::to_string(header_size) + " is over the format's limit " +
                   std::to_string(kMaxHeaderBytes) + ": damaged, or not a safetensors file");
  }
  if (header_size > file.size() - 8) {
    fail(path, "the header length " + std::to_string(header_size) + " runs past the end of the " +
                   std::to_string(file.size()) +
                   "-byte file: truncated, or not a safetensors file");
  }
  std::string text(header_size, '\0');
  file.read(text.data(), header_size, 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(path, std::string("the header is not valid JSON (") + e.what() + "): damaged");
  }
  if (!header.is_object()) fail(path, "the header is " + header.dump() + ", not a JSON object");

  ParsedHeader result;
  result.header_size = header_size;
  std::vector<Entry>& entries = result.entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail(path, "__metadata__ is not an object of strings");
      for (const auto& [key, text_value] : value.items()) {
        if (!text_value.is_string()) {
          fail(path, "__metadata__ \"" + key + "\" is " + text_value.dump() + ", not a string");
        }
        result.metadata[key] = text_value.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, value));
  }

  // The offsets as a whole. The data section must be exactly the tensors' bytes laid end to end
  // (the format allows no holes and no sharing).
  const uint64_t data_size = file.size() - 8 - header_size;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t described = 0;  // the tensors' bytes, all together
  for (const auto& entry : entries) described += entry.end - entry.begin;
  const bool laid_end_to_end =
      !entries.empty() && entries.back().end == described && entries.front().begin == 0;
  for (const auto& entry : entries) {
    if (entry.end <= data_size) continue;
    if (laid_end_to_end) {
      fail(path, "truncated: the header describes " + std::to_string(described) +
                     " bytes of tensor data, the file holds " + std::to_string(data_size) +
                     " after the header (" + std::to_string(file.size()) + " bytes in all)");
    }
    fail(path, "tensor '" + entry.name + "': data_offsets [" + std::to_string(entry.begin) + ", " +
                   std::to_string(entry.end) + "] out of range: the data after the header is " +
                   std::to_string(data_size) + " bytes");
  }
  uint64_t covered = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& entry = entries[i];
    if (entry.begin < covered) {
      fail(path, "tensor '" + entry.name + "': data_offsets [" + std::to_string(entry.begin) +
                     ", " + std::to_string(entry.end) + "] overlap tensor '" + entries[i - 1].name +
                     "' (which ends at " + std::to_string(covered) + ")");
    }
    if (entry.begin > covered) {
      fail(path, "bytes [" + std::to_string(covered) + ", " + std::to_string(entry.begin) +
                     ") of the data belong to no tensor (a hole before '" + entry.name + "')");
    }
    covered = entry.end;
  }
  if (covered != data_size) {
    fail(path,
         "the last " + std::to_string(data_size - covered) +
             " bytes of the data belong to no tensor: damaged, or written by a broken writer");
  }
  return result;
}

// Note [The CRC of a safetensors file]
// dtrain_crc32 sums the tensors' bytes in the order of their names, not the file's: Python's
// safetensors library lays a file out by dtype and name, so a file it re-saves with dtrain's
// metadata kept (safe_open's metadata() passed to save_file) has the same data in another order,
// and must not read as damaged. (Files dtrain wrote before summed in file order, which the reader
// still takes.)
uint32_t crc_by_name(const std::map<std::string, const at::Tensor*>& tensors) {
  uint32_t crc = crc32_update(0, nullptr, 0);
  for (const auto& [name, tensor] : tensors) {
    if (tensor->nbytes() > 0) crc = crc32_update(crc, tensor->data_ptr(), tensor->nbytes());
  }
  return crc;
}

}  // namespace

void save_safetensors_file(const std::string& path, const TensorTable& tensors,
                           const std::map<std::string, std::string>& metadata) {
  std::vector<at::Tensor> contiguous;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  if (!metadata.count("format")) meta["format"] = "pt";
  for (const auto& [key, value] : metadata)
    if (key != kCrcKey) meta[key] = value;
  uint64_t offset = 0;
  std::set<std::string> seen;
  std::vector<std::pair<std::string, nlohmann::ordered_json>> entries;
  for (const auto& item : tensors) {
    const at::Tensor& tensor = item.value();
    const std::string what = "tensor '" + item.key() + "'";
    if (item.key().empty() || item.key() == "__metadata__") {
      fail(path, "cannot name a tensor '" + item.key() + "'");
    }
    if (!seen.insert(item.key()).second) fail(path, what + " appears twice");
    if (!tensor.defined()) fail(path, what + " is undefined");
    if (tensor.layout() != at::kStrided) fail(path, what + " is not a dense (strided) tensor");
    const char* name = dtype_name(tensor.scalar_type());
    if (!name) {
      fail(path, what + " has dtype " + std::string(c10::toString(tensor.scalar_type())) +
                     ", which safetensors has no name for; convert it to one of " + known_dtypes());
    }
    at::Tensor bytes = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t size = static_cast<uint64_t>(bytes.nbytes());
    entries.push_back({item.key(),
                       {{"dtype", name},
                        {"shape", bytes.sizes().vec()},
                        {"data_offsets", {offset, offset + size}}}});
    offset += size;
    contiguous.push_back(std::move(bytes));
  }
  std::map<std::string, const at::Tensor*> by_name;
  for (size_t i = 0; i < entries.size(); ++i) by_name[entries[i].first] = &contiguous[i];
  meta[kCrcKey] = hex32(crc_by_name(by_name));
  header["__metadata__"] = meta;
  for (auto& [name, entry] : entries) header[name] = std::move(entry);
  std::string text = header.dump();
  // Padded with spaces to a multiple of 8, as the safetensors crate writes it, so that the data
  // starts aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  char length[8];
  uint64_t n = text.size();
  std::memcpy(length, &n, 8);

  std::vector<std::pair<const char*, size_t>> pieces = {{length, 8}, {text.data(), text.size()}};
  for (const auto& bytes : contiguous) {
    if (bytes.nbytes() > 0) {
      pieces.push_back({static_cast<const char*>(bytes.data_ptr()), bytes.nbytes()});
    }
  }
  write_file_durably(path, pieces, "safetensors");
}

SafetensorsFile read_safetensors_file(const std::string& path) {
  File file(path);
  ParsedHeader parsed = parse_header(file, path);
  const uint64_t header_size = parsed.header_size;
  SafetensorsFile result;
  result.metadata = std::move(parsed.metadata);
  const std::vector<Entry>& entries = parsed.entries;

  uint32_t in_file_order = crc32_update(0, nullptr, 0);
  for (const auto& entry : entries) {
    at::Tensor tensor = at::empty(entry.shape, at::TensorOptions().dtype(entry.type));
    const uint64_t bytes = entry.end - entry.begin;
    if (bytes > 0) {
      file.read(tensor.data_ptr(), bytes, 8 + header_size + entry.begin);
      in_file_order = crc32_update(in_file_order, tensor.data_ptr(), bytes);
    }
    result.tensors.insert(entry.name, std::move(tensor));
  }
  auto expected = result.metadata.find(kCrcKey);
  if (expected != result.metadata.end() && expected->second != hex32(in_file_order)) {
    // Before 2026-11-27 dtrain summed the data in file order; since then by name (Note [The CRC
    // of a safetensors file]).
    std::map<std::string, const at::Tensor*> by_name;
    for (const auto& item : result.tensors) by_name[item.key()] = &item.value();
    const uint32_t crc = crc_by_name(by_name);
    if (expected->second != hex32(crc)) {
      fail(path, "the tensors' data has CRC-32 " + hex32(crc) + ", the header's " + kCrcKey +
                     " says " + expected->second +
                     ": a byte of the data is damaged, or another program changed the tensors "
                     "and kept dtrain's metadata (remove " +
                     kCrcKey + " from its __metadata__ to load it unchecked)");
    }
  }
  return result;
}

std::vector<std::string> save_safetensors(const std::string& dir, const TensorTable& tensors,
                                          const SafetensorsWriteOptions& options) {
  if (options.max_shard_bytes < 0) {
    throw UsageError("safetensors: max_shard_bytes " + std::to_string(options.max_shard_bytes) +
                     ": expected 0 (one file) or a positive byte count");
  }
  // Tensors into shards in order: a new shard when the next tensor would pass the limit.
  std::vector<TensorTable> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& item : tensors) {
    const int64_t bytes = static_cast<int64_t>(item.value().defined() ? item.value().nbytes() : 0);
    if (options.max_shard_bytes > 0 && shard_bytes > 0 &&
        shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    if (shards.back().contains(item.key())) {
      throw UsageError("safetensors: " + dir + ": tensor '" + item.key() + "' appears twice");
    }
    shards.back().insert(item.key(), item.value());
    shard_bytes += bytes;
    total_bytes += bytes;
  }

  std::vector<std::string> written;
  if (shards.size() == 1) {
    written.push_back((fs::path(dir) / kSingleName).string());
    save_safetensors_file(written.back(), shards[0], options.metadata);
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name = shard_name(i + 1, shards.size());
      written.push_back((fs::path(dir) / name).string());
      save_safetensors_file(written.back(), shards[i], options.metadata);
      for (const auto& item : shards[i]) weight_map[item.key()] = name;
    }
    nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                            {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    written.push_back((fs::path(dir) / kIndexName).string());
    write_file_durably(written.back(), {{text.data(), text.size()}}, "safetensors");
  }
  // An earlier export's files this one did not write would otherwise be read with it (an old index
  // preferred to the new model.safetensors, or shards of another count lying beside these).
  std::set<std::string> current;
  for (const auto& path : written) current.insert(fs::path(path).filename().string());
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (is_model_file(name) && !current.count(name)) fs::remove(entry.path(), error);
  }
  return written;
}

TensorTable load_safetensors(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) {
    const fs::path index = fs::path(path) / kIndexName;
    const fs::path single = fs::path(path) / kSingleName;
    if (fs::exists(index)) return load_index(index.string());
    if (fs::exists(single)) return read_safetensors_file(single.string()).tensors;
    fail(path, std::string("the folder holds neither ") + kIndexName + " nor " + kSingleName);
  }
  const std::string name = fs::path(path).filename().string();
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".json") == 0) return load_index(path);
  return read_safetensors_file(path).tensors;
}

void load_into(torch::nn::Module& module, const TensorTable& tensors,
               const LoadIntoOptions& options) {
  const std::string what = "load_into " + module.name();
  TensorTable targets = module.named_parameters(/*recurse=*/true);
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined() && !targets.contains(item.key())) {
      targets.insert(item.key(), item.value());
    }
  }
  // Every check before the first copy: a refused table leaves the module as it was.
  size_t missing = 0;
  std::string first_missing;
  for (const auto& item : targets) {
    if (tensors.contains(item.key())) continue;
    if (missing++ == 0) first_missing = item.key();
  }
  if (missing > 0 && !options.allow_missing) {
    throw UsageError(what + ": no tensor '" + first_missing + "' (the module's " +
                     shape_text(targets[first_missing].sizes().vec()) + ") in the table; " +
                     std::to_string(missing) + " of the module's " +
                     std::to_string(targets.size()) +
                     " tensors are missing: is it the weights of another model?");
  }
  for (const auto& item : tensors) {
    const at::Tensor* target = targets.find(item.key());
    if (!target) {
      if (options.allow_extra) continue;
      throw UsageError(what + ": the table's tensor '" + item.key() + "' " +
                       shape_text(item.value().sizes().vec()) +
                       " is not a parameter or buffer of the module (LoadIntoOptions::allow_extra "
                       "ignores such tensors)");
    }
    if (target->sizes() != item.value().sizes()) {
      throw UsageError(what + ": tensor '" + item.key() + "' is " +
                       shape_text(item.value().sizes().vec()) + " in the table but " +
                       shape_text(target->sizes().vec()) + " in the module");
    }
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : tensors) {
    at::Tensor* target = targets.find(item.key());
    if (target) target->copy_(item.value());
  }
}

namespace detail {

SafetensorsHeader read_safetensors_header(const std::string& path) {
  File file(path);
  ParsedHeader parsed = parse_header(file, path);
  SafetensorsHeader header;
  header.metadata = std::move(parsed.metadata);
  for (const auto& entry : parsed.entries)
    header.tensors.push_back({entry.name, entry.type, entry.shape});
  return header;
}

}  // namespace detail

}  // namespace dtrain
