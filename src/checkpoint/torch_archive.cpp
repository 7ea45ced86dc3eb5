// torch.save's file format from C++ (see torch_archive.h).
//
// Note [torch.save's format]
// A zip (stored, not compressed, records aligned to 64 bytes) with "<name>/data.pkl", a pickle
// whose tensors are persistent ids ('storage', torch.FloatStorage, key, 'cpu', numel) naming the
// records "<name>/data/<key>", plus "version" and "byteorder". LibTorch writes and reads the zip
// (caffe2::serialize) and the pickle (torch::jit::Pickler, Unpickler), with gaps that this file
// closes:
// - Pickler tags every dict and list with torch.jit._pickle.restore_type_tag unless told not to,
//   and pickles an int/float/bool/tensor list through torch.jit._pickle.build_*list: globals that
//   torch.load(weights_only=True) refuses. So aggregates are not tagged, and callers build lists
//   as generic lists (element type Any).
// - Python pickles a state dict (an OrderedDict with a _metadata attribute) as OrderedDict() +
//   items + BUILD(state). LibTorch's Unpickler turns OrderedDict() into None (it expects one only
//   as a tensor's empty backward hooks) and takes BUILD for a call of a TorchScript class: both
//   fail. So OrderedDict() becomes an empty dict, and BUILD a SETITEM under a key no state dict
//   has, removed after unpickling: a weights_only file has no BUILD but these, and _metadata
//   (module versions) means nothing to LibTorch.
// - Python pickles an int outside int32 as LONG1 of the fewest bytes that hold it; LibTorch's
//   Unpickler takes only 8. So a shorter LONG1 is widened to 8 bytes.
// - LibTorch's Unpickler trusts a storage's element count; nothing checks it against the bytes of
//   the record. So load_torch_archive does.
// Neither LibTorch nor Python checks the zip's CRC-32s when reading (LibTorch builds miniz without
// its CRC checks), and those do not cover the zip's own headers and padding anyway. So dtrain
// seals what it writes with a CRC-32 of every byte before it, in the zip's comment (which zip
// readers skip): "dtrain-crc32=<8 hex digits>". A file without that comment (one Python wrote) is
// checked record by record against the zip's CRC-32s, except where a record's is 0: Python
// writes 0 for every record after torch.serialization.set_crc32_options(False).
#include "checkpoint/torch_archive.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string_view>

#include "checkpoint/checkpoint_file.h"

namespace dtrain::detail {
namespace {

// The zip comment that seals a file dtrain wrote: the prefix and 8 hex digits.
constexpr char kSealPrefix[] = "dtrain-crc32=";
constexpr std::size_t kSealSize = sizeof kSealPrefix - 1 + 8;

uint32_t crc32_of(const char* data, std::size_t size) { return crc32_update(0, data, size); }

// The bytes of a pickle opcode's argument at `at` (just after the opcode byte), or nullopt for an
// opcode this scanner does not know or an argument that runs past the end.
std::optional<std::size_t> argument_size(unsigned char opcode, const char* at, const char* end) {
  auto counted = [&](int width) -> std::optional<std::size_t> {
    if (end - at < width) return std::nullopt;
    uint64_t n = read_le(at, width);
    if (n > static_cast<uint64_t>(end - at - width)) return std::nullopt;
    return width + n;
  };
  auto lines = [&](int count) -> std::optional<std::size_t> {
    const char* p = at;
    for (int i = 0; i < count; ++i) {
      p = static_cast<const char*>(std::memchr(p, '\n', end - p));
      if (p == nullptr) return std::nullopt;
      ++p;
    }
    return p - at;
  };
  // Pickle's opcodes (Python's pickletools has the table) by the argument they take.
  static constexpr std::string_view kNone =
      "(.012NRabd}el]ost)uQ\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98";
  static constexpr std::string_view kOne = "\x80Khq\x82", kTwo = "M\x83", kFour = "Jjr\x84",
                                    kEight = "G\x95";
  static constexpr std::string_view kCounted1 = "\x8aUC\x8c", kCounted4 = "\x8bXTB",
                                    kCounted8 = "\x8d\x8e\x96";
  static constexpr std::string_view kOneLine = "ILFSVPpg", kTwoLines = "ci";
  const char c = static_cast<char>(opcode);
  auto in = [c](std::string_view set) { return set.find(c) != std::string_view::npos; };
  if (in(kNone)) return 0;
  if (in(kOne)) return 1;
  if (in(kTwo)) return 2;
  if (in(kFour)) return 4;
  if (in(kEight)) return 8;
  if (in(kCounted1)) return counted(1);
  if (in(kCounted4)) return counted(4);
  if (in(kCounted8)) return counted(8);
  if (in(kOneLine)) return lines(1);
  if (in(kTwoLines)) return lines(2);
  return std::nullopt;
}

// The key under which a BUILD's state lands (Note [torch.save's format]); no state dict has it.
constexpr std::string_view kBuildStateKey = "\x01pickle-build-state";

// The stack effect of a pickle opcode, for the rewrite below: how many items it pops (kToMark:
// down to and with the topmost MARK) and whether it pushes one. nullopt: not expected in a
// weights_only pickle.
constexpr int kToMark = -1;
struct StackEffect {
  int pops;
  bool pushes;
};
std::optional<StackEffect> stack_effect(unsigned char opcode) {
  // "\x8d" "BC" apart: inside one literal, \x8dBC is a single (out of range) escape, and BINBYTES,
  // SHORT_BINBYTES and BINUNICODE8 would read as opcodes this walk cannot tell.
  static constexpr std::string_view kPushOne =
      "}])NKMJ\x8a\x8bGXT\x8cU\x8d"
      "BC\x8e\x88\x89hjILFSVgc";
  static constexpr std::string_view kNeutral = "qrp\x94\x80\x95.Q\x85";  // BINPERSID, TUPLE1: 1->1
  const char c = static_cast<char>(opcode);
  auto in = [c](std::string_view set) { return set.find(c) != std::string_view::npos; };
  if (in(kPushOne)) return StackEffect{0, true};
  if (in(kNeutral)) return StackEffect{0, false};
  switch (c) {
    case '(':
      return StackEffect{0, true};  // the mark itself is a stack entry here
    case 't':
    case 'l':
    case 'd':
      return StackEffect{kToMark, true};
    case 'e':
    case 'u':
      return StackEffect{kToMark, false};
    case 'a':
    case 'b':
      return StackEffect{1, false};
    case 's':
      return StackEffect{2, false};
    case 'R':
    case '\x81':
    case '\x86':
    case '\x93':
      return StackEffect{2, true};
    case '\x87':
      return StackEffect{3, true};
    default:
      return std::nullopt;
  }
}

// Note [torch.save's format]: rewrites Python's OrderedDict() into an empty dict, and BUILD into
// SETITEM under kBuildStateKey (LibTorch's Unpickler has no POP to drop the state with, and the
// state may memoize values that later parts of the pickle refer to, so it must stay). Walks the
// opcodes (a byte inside a string or a number is not an opcode) keeping, for each stack item, where
// its bytes begin in the output, so that the key can go in front of the state. "GLOBAL collections
// OrderedDict [BINPUT n]", or later "BINGET n", followed by an empty tuple and a REDUCE (the call
// OrderedDict()) becomes EMPTY_DICT. A LONG1 of fewer than 8 bytes becomes one of 8. Returns the
// pickle as it was where it meets anything it cannot tell: LibTorch's Unpickler then says what it
// cannot read. Throws c10::Error for an int beyond int64.
std::vector<char> readable_by_libtorch(const std::vector<char>& pickle) {
  const char* p = pickle.data();
  const char* const end = p + pickle.size();
  std::vector<char> out;
  out.reserve(pickle.size() + 1024);
  struct Item {
    std::size_t begins;  // in out
    bool mark;
  };
  std::vector<Item> stack;
  std::vector<uint64_t> ordered_dict_memo;  // memo slots that hold the class OrderedDict
  static constexpr std::string_view kOrderedDict = "collections\nOrderedDict\n";
  // At `at`: an empty tuple and a REDUCE (the call with no arguments)? Then past them.
  auto call_without_arguments = [&](const char* at) -> const char* {
    return end - at >= 2 && at[0] == ')' && at[1] == 'R' ? at + 2 : nullptr;
  };
  auto empty_dict = [&](const char* after) {
    stack.push_back({out.size(), false});
    out.push_back('}');
    return after;
  };
  while (p < end) {
    const auto opcode = static_cast<unsigned char>(*p);
    auto size = argument_size(opcode, p + 1, end);
    auto effect = stack_effect(opcode);
    if (!size || !effect) return pickle;
    const char* next = p + 1 + *size;
    if (opcode == 'c' && std::string_view(p + 1, *size) == kOrderedDict) {
      if (next < end && (*next == 'q' || *next == 'r')) {  // memoized for later calls
        const int width = *next == 'q' ? 1 : 4;
        if (end - next <= width) return pickle;
        ordered_dict_memo.push_back(read_le(next + 1, width));
        next += 1 + width;
      }
      const char* after = call_without_arguments(next);
      if (!after) return pickle;
      p = empty_dict(after);
      continue;
    }
    if ((opcode == 'h' || opcode == 'j') &&
        std::find(ordered_dict_memo.begin(), ordered_dict_memo.end(),
                  read_le(p + 1, opcode == 'h' ? 1 : 4)) != ordered_dict_memo.end()) {
      const char* after = call_without_arguments(next);
      if (!after) return pickle;
      p = empty_dict(after);
      continue;
    }
    if (opcode == 0x8a) {
      // LONG1: Python writes an int outside int32 in as few bytes as its two's complement needs
      // (5 for 3'000'000'000); LibTorch's Unpickler takes 8 bytes only. So it gets 8,
      // sign-extended.
      const auto n = static_cast<unsigned char>(p[1]);
      TORCH_CHECK(n <= 8, "data.pkl holds an integer of ", static_cast<int>(n),
                  " bytes, beyond int64, which LibTorch cannot hold; store it as a float or a "
                  "string in Python");
      char wide[8];
      std::memcpy(wide, p + 2, n);
      std::memset(wide + n, n > 0 && (p[1 + n] & 0x80) ? 0xff : 0, 8 - n);
      stack.push_back({out.size(), false});
      out.push_back(static_cast<char>(0x8a));
      out.push_back(8);
      out.insert(out.end(), wide, wide + 8);
      p = next;
      continue;
    }
    // Where the item this opcode pushes begins: its first popped item's start, or here.
    std::size_t begins = out.size();
    if (effect->pops == kToMark) {
      while (!stack.empty() && !stack.back().mark) stack.pop_back();
      if (stack.empty()) return pickle;
      begins = stack.back().begins;
      stack.pop_back();
    } else {
      if (stack.size() < static_cast<std::size_t>(effect->pops)) return pickle;
      if (effect->pops > 0) begins = stack[stack.size() - effect->pops].begins;
      if (opcode == 'b') {
        // [.., dict, state] BUILD -> [.., dict, key, state] SETITEM.
        const std::size_t state_begins = stack.back().begins;
        char key[5 + kBuildStateKey.size()] = {'X'};
        const auto key_size = static_cast<uint32_t>(kBuildStateKey.size());
        for (int i = 0; i < 4; ++i) key[1 + i] = static_cast<char>((key_size >> (8 * i)) & 0xff);
        std::memcpy(key + 5, kBuildStateKey.data(), kBuildStateKey.size());
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(state_begins), key, key + sizeof key);
        out.push_back('s');
        stack.pop_back();
        p = next;
        continue;
      }
      stack.resize(stack.size() - effect->pops);
    }
    if (effect->pushes) stack.push_back({begins, opcode == '('});
    out.insert(out.end(), p, next);
    if (opcode == '.') break;
    p = next;
  }
  return out;
}

// Drops what readable_by_libtorch filed under kBuildStateKey, in every dict of value.
void drop_build_states(const c10::IValue& value) {
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    static_cast<void>(dict.erase(std::string(kBuildStateKey)));  // absent is as good
    for (const auto& item : dict) drop_build_states(item.value());
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) drop_build_states(item);
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) drop_build_states(item);
  }
}

// A storage record read for the Unpickler: its key (record "data/<key>") and size.
struct StorageRecord {
  std::string key;
  std::size_t bytes;
};

// Throws c10::Error unless every CPU tensor's storage in value lies within the record it was read
// from (records: by the address of their bytes; a storage of no elements has none). LibTorch's
// Unpickler takes a storage's element count from the pickle and never compares it with the
// record's bytes: a damaged or crafted file would have the copy into the model read past them.
// (A tensor's offset, sizes and strides it does check against the storage, when it rebuilds the
// tensor: "... require a storage of at least 40 bytes, but storage only has 32 bytes".)
// `where` names value for the message ("root['model']['0.weight']").
void check_tensors_within_records(const c10::IValue& value, const std::string& where,
                                  const std::map<const void*, StorageRecord>& records) {
  if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      const c10::IValue& key = item.key();
      check_tensors_within_records(
          item.value(),
          where + "[" + (key.isString() ? "'" + key.toStringRef() + "'" : "...") + "]", records);
    }
  } else if (value.isList()) {
    std::size_t i = 0;
    for (const c10::IValue& item : value.toListRef())
      check_tensors_within_records(item, where + "[" + std::to_string(i++) + "]", records);
  } else if (value.isTuple()) {
    std::size_t i = 0;
    for (const c10::IValue& item : value.toTupleRef().elements())
      check_tensors_within_records(item, where + "[" + std::to_string(i++) + "]", records);
  } else if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    // The Unpickler's sparse tensors (_rebuild_sparse_tensor) are made of dense ones.
    if (tensor.layout() == at::kSparse) {
      check_tensors_within_records(tensor._indices(), where + " (indices)", records);
      check_tensors_within_records(tensor._values(), where + " (values)", records);
      return;
    }
    if (tensor.layout() == at::kSparseCsr) {
      check_tensors_within_records(tensor.crow_indices(), where + " (crow_indices)", records);
      check_tensors_within_records(tensor.col_indices(), where + " (col_indices)", records);
      check_tensors_within_records(tensor.values(), where + " (values)", records);
      return;
    }
    TORCH_CHECK(tensor.layout() == at::kStrided, "data.pkl: tensor ", where, " has layout ",
                tensor.layout(), ", which dtrain does not read");
    const at::Storage& storage = tensor.storage();
    auto record = records.find(storage.data());
    const std::string key = record != records.end() ? "data/" + record->second.key : "(none)";
    const std::size_t record_bytes = record != records.end() ? record->second.bytes : 0;
    const auto itemsize = static_cast<int64_t>(tensor.element_size());
    TORCH_CHECK(storage.nbytes() <= record_bytes, "data.pkl: tensor ", where, "'s storage holds ",
                storage.nbytes() / itemsize, " elements (", storage.nbytes(),
                " bytes) but its record ", key, " has ", record_bytes,
                " bytes; the file is damaged or was not written by torch.save");
  }
}

}  // namespace

std::vector<char> save_torch_archive(const c10::IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, std::size_t size) { pickle.insert(pickle.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();

  std::vector<char> archive;
  archive.reserve(pickle.size() + 4096);
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t size) {
    const char* bytes = static_cast<const char*>(data);
    archive.insert(archive.end(), bytes, bytes + size);
    return size;
  });
  // Python's torch.load reads the tensors' bytes in this order (a big-endian reader swaps them).
  writer.writeRecord("byteorder", "little", 6);
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();

  // The seal: the end record's comment length, then a CRC-32 of everything up to the comment.
  const std::size_t comment_length_at = archive.size() - 2;
  TORCH_CHECK(read_le(archive.data() + archive.size() - 22, 4) == 0x06054b50 &&
                  read_le(archive.data() + comment_length_at, 2) == 0,
              "save_torch_archive: the zip does not end in an end record without a comment");
  archive[comment_length_at] = static_cast<char>(kSealSize);
  char seal[kSealSize + 1];
  std::snprintf(seal, sizeof seal, "%s%08x", kSealPrefix, crc32_of(archive.data(), archive.size()));
  archive.insert(archive.end(), seal, seal + kSealSize);
  return archive;
}

bool torch_archive_intact(const std::vector<char>& bytes, std::string* why) {
  const char* data = bytes.data();
  const uint64_t size = bytes.size();
  constexpr uint64_t kEndSize = 22;  // the end-of-central-directory record without its comment
  // The end record sits in the last 22 + 65535 bytes (after it, only its comment).
  std::optional<uint64_t> end_at;
  for (uint64_t at = size >= kEndSize ? size - kEndSize + 1 : 0; at-- > 0;) {
    if (size - at > kEndSize + 0xffff) break;
    if (read_le(data + at, 4) == 0x06054b50 && at + kEndSize + read_le(data + at + 20, 2) == size) {
      end_at = at;
      break;
    }
  }
  if (!end_at) {
    *why = "truncated: no zip directory at its end (or not a torch.save file)";
    return false;
  }
  const uint64_t comment_size = read_le(data + *end_at + 20, 2);
  if (comment_size == kSealSize &&
      std::memcmp(data + size - kSealSize, kSealPrefix, sizeof kSealPrefix - 1) == 0) {
    char expected[kSealSize + 1];
    std::snprintf(expected, sizeof expected, "%s%08x", kSealPrefix,
                  crc32_of(data, size - kSealSize));
    if (std::memcmp(expected, data + size - kSealSize, kSealSize) == 0) return true;
    *why = "checksum mismatch (the contents changed after it was written)";
    return false;
  }
  // Not sealed by dtrain: each record against its CRC-32 in the zip's directory.
  uint64_t entries = read_le(data + *end_at + 10, 2);
  uint64_t directory_size = read_le(data + *end_at + 12, 4);
  uint64_t directory_at = read_le(data + *end_at + 16, 4);
  if (entries == 0xffff || directory_size == 0xffffffff || directory_at == 0xffffffff) {
    // Zip64: a locator just before the end record points to the zip64 end record.
    if (*end_at < 20 || read_le(data + *end_at - 20, 4) != 0x07064b50) {
      *why = "its zip64 directory locator is missing";
      return false;
    }
    uint64_t end64_at = read_le(data + *end_at - 12, 8);
    // Offsets come from the file: `end64_at + 56 > size` would wrap for one near 2^64.
    if (end64_at > size || size - end64_at < 56 || read_le(data + end64_at, 4) != 0x06064b50) {
      *why = "its zip64 directory record is damaged";
      return false;
    }
    entries = read_le(data + end64_at + 32, 8);
    directory_size = read_le(data + end64_at + 40, 8);
    directory_at = read_le(data + end64_at + 48, 8);
  }
  if (directory_at > size || directory_size > size - directory_at) {
    *why = "its zip directory points outside the file";
    return false;
  }
  uint64_t at = directory_at;
  for (uint64_t i = 0; i < entries; ++i) {
    if (at + 46 > directory_at + directory_size || read_le(data + at, 4) != 0x02014b50) {
      *why = "its zip directory is damaged at entry " + std::to_string(i);
      return false;
    }
    const uint64_t method = read_le(data + at + 10, 2);
    const auto crc = static_cast<uint32_t>(read_le(data + at + 16, 4));
    uint64_t record_size = read_le(data + at + 24, 4);
    const uint64_t name_size = read_le(data + at + 28, 2), extra_size = read_le(data + at + 30, 2),
                   comment_size = read_le(data + at + 32, 2);
    uint64_t local_at = read_le(data + at + 42, 4);
    if (at + 46 + name_size + extra_size + comment_size > directory_at + directory_size) {
      *why = "its zip directory is damaged at entry " + std::to_string(i);
      return false;
    }
    const std::string name(data + at + 46, name_size);
    // Zip64 sizes and offsets live in the extra field (id 1), in this order, for each field that
    // says 0xffffffff.
    const bool big_size = record_size == 0xffffffff,
               big_compressed = read_le(data + at + 20, 4) == 0xffffffff,
               big_offset = local_at == 0xffffffff;
    for (uint64_t e = at + 46 + name_size; e + 4 <= at + 46 + name_size + extra_size;) {
      const uint64_t id = read_le(data + e, 2), field_size = read_le(data + e + 2, 2);
      if (id == 1) {
        uint64_t f = e + 4;
        if (big_size && f + 8 <= e + 4 + field_size) record_size = read_le(data + f, 8), f += 8;
        if (big_compressed && f + 8 <= e + 4 + field_size) f += 8;
        if (big_offset && f + 8 <= e + 4 + field_size) local_at = read_le(data + f, 8);
      }
      e += 4 + field_size;
    }
    if (method != 0) {
      *why = "record '" + name + "' is compressed (method " + std::to_string(method) +
             "); torch.save stores records uncompressed";
      return false;
    }
    if (local_at > size || size - local_at < 30 || read_le(data + local_at, 4) != 0x04034b50) {
      *why = "record '" + name + "': its local header is damaged";
      return false;
    }
    const uint64_t data_at =
        local_at + 30 + read_le(data + local_at + 26, 2) + read_le(data + local_at + 28, 2);
    if (data_at > size || record_size > size - data_at) {
      *why = "record '" + name + "' runs past the end of the file (truncated?)";
      return false;
    }
    // 0: not computed (torch.serialization.set_crc32_options(False)); torch.load takes it.
    if (crc != 0 && crc32_of(data + data_at, record_size) != crc) {
      *why = "record '" + name + "': checksum mismatch (the contents changed after it was written)";
      return false;
    }
    at += 46 + name_size + extra_size + comment_size;
  }
  return true;
}

c10::IValue load_torch_archive(const std::vector<char>& bytes) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(),
                                                             static_cast<off_t>(bytes.size())));
  if (reader.hasRecord("byteorder")) {
    // dtrain runs on little-endian machines only (x86-64, AArch64) and copies records as they are;
    // Python's torch.load swaps the bytes of a "big" file instead.
    auto [order_data, order_size] = reader.getRecord("byteorder");
    const std::string order(static_cast<const char*>(order_data.get()), order_size);
    TORCH_CHECK(order == "little", "record 'byteorder' says '", order,
                "', dtrain reads little-endian files only; open it with torch.load on any "
                "machine and torch.save it again on a little-endian one");
  }
  auto [pickle_data, pickle_size] = reader.getRecord("data.pkl");
  const char* pickle_bytes = static_cast<const char*>(pickle_data.get());
  const std::vector<char> pickle =
      readable_by_libtorch(std::vector<char>(pickle_bytes, pickle_bytes + pickle_size));
  std::size_t read = 0;
  std::map<const void*, StorageRecord> records;
  torch::jit::Unpickler unpickler(
      [&](char* out, std::size_t n) {
        n = std::min(n, pickle.size() - read);
        std::memcpy(out, pickle.data() + read, n);
        read += n;
        return n;
      },
      /*type_resolver=*/nullptr, /*obj_loader=*/nullptr,
      [&](const std::string& key) {
        auto [record, record_size] = reader.getRecord("data/" + key);
        records[record.get()] = {key, record_size};
        return std::move(record);
      },
      at::Device(at::kCPU));
  unpickler.set_version(reader.version());
  c10::IValue value = unpickler.parse_ivalue();
  drop_build_states(value);
  check_tensors_within_records(value, "root", records);
  return value;
}

}  // namespace dtrain::detail
