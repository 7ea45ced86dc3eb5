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
// - For the dtypes of untyped_dtypes() (float8 and float4, uint16/32/64, complex32, bits), Python
//   pickles _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[,
//   metadata]) over the persistent id ('storage', torch.storage.UntypedStorage, key, location,
//   count of bytes); LibTorch's Pickler writes _rebuild_tensor_v2 over "torch.<ScalarType>Storage"
//   (torch.Float8_e4m3fnStorage, torch.UInt16Storage), classes Python does not have, with a count
//   of elements, and LibTorch's Unpickler knows neither _rebuild_tensor_v3 nor UntypedStorage. So
//   each side's form becomes the other's, when the tensor's last argument is read: the dtype goes
//   from the storage's class into the arguments or back, the count from elements to bytes or back.
//   (bool, int8, bfloat16, complex64 and the other older dtypes have a storage class on both sides:
//   torch.BoolStorage, torch.CharStorage, ...) A storage that LibTorch's Pickler memoizes is
//   written once, with the dtype of its first tensor: a tensor that viewed it as another dtype
//   would be read as that one, by LibTorch and Python alike. So save_torch_archive refuses such
//   tensors, as Python's torch.save does.
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
#include <cctype>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

// The dtypes that Python's torch.save pickles as _rebuild_tensor_v3 over an untyped storage
// (torch.storage._new_dtypes() of PyTorch 2.15), by their names in Python's torch module. LibTorch
// pickles them as _rebuild_tensor_v2 over "torch.<ScalarType>Storage", a class Python lacks.
struct UntypedDtype {
  c10::ScalarType type;
  std::string python_name;
};

// Those of kUntypedDtypeNames that this LibTorch has. Found by name among c10's scalar types, not
// listed as enumerators: the supported releases (2.11 to 2.15) do not all have every one
// (bcomplex32 is new), and a dtype this LibTorch lacks is one its files cannot hold either.
const std::vector<UntypedDtype>& untyped_dtypes() {
  static const std::vector<UntypedDtype> dtypes = [] {
    constexpr std::string_view kUntypedDtypeNames[] = {
        "float8_e5m2",    "float8_e4m3fn",    "float8_e5m2fnuz", "float8_e4m3fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8",           "bits16",
        "bits1x8",        "bits2x4",          "bits4x2",         "complex32",
        "bcomplex32",     "uint16",           "uint32",          "uint64"};
    std::vector<UntypedDtype> found;
    for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
      const auto type = static_cast<c10::ScalarType>(i);
      // Python's name is c10's in lower case, but for ComplexHalf, which Python calls complex32.
      std::string name = type == c10::ScalarType::ComplexHalf ? "complex32" : c10::toString(type);
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      for (std::string_view wanted : kUntypedDtypeNames) {
        if (name == wanted) found.push_back({type, name});
      }
    }
    return found;
  }();
  return dtypes;
}

// GLOBAL arguments, "module\nname\n".
constexpr std::string_view kRebuildTensorV2 = "torch._utils\n_rebuild_tensor_v2\n";
constexpr std::string_view kRebuildTensorV3 = "torch._utils\n_rebuild_tensor_v3\n";
constexpr std::string_view kUntypedStorage = "torch.storage\nUntypedStorage\n";

// LibTorch's storage class of a dtype ("torch\nFloat8_e4m3fnStorage\n"), which its Unpickler reads.
std::string storage_class_of(c10::ScalarType type) {
  return "torch\n" + std::string(c10::toString(type)) + "Storage\n";
}

// Python's global of a dtype ("torch\nfloat8_e4m3fn\n").
std::string dtype_global_of(const UntypedDtype& dtype) {
  return "torch\n" + std::string(dtype.python_name) + "\n";
}

// The dtype of untyped_dtypes() whose LibTorch storage class (by_storage_class) or Python dtype
// global (!by_storage_class) `global` is, or nullptr.
const UntypedDtype* untyped_dtype_of(std::string_view global, bool by_storage_class) {
  for (const UntypedDtype& dtype : untyped_dtypes()) {
    if (global == (by_storage_class ? storage_class_of(dtype.type) : dtype_global_of(dtype))) {
      return &dtype;
    }
  }
  return nullptr;
}

// The value and the size of the int opcode at `at` (BININT1, BININT2, BININT, LONG1 of up to 8
// bytes), or nullopt for anything else.
std::optional<std::pair<int64_t, std::size_t>> int_opcode_at(const char* at, const char* end) {
  if (at >= end) return std::nullopt;
  auto fixed = [&](int width, bool is_signed) -> std::optional<std::pair<int64_t, std::size_t>> {
    if (end - at < 1 + width) return std::nullopt;
    uint64_t n = read_le(at + 1, width);
    if (is_signed && width < 8 && (n >> (8 * width - 1)) & 1) n |= ~uint64_t{0} << (8 * width);
    return std::make_pair(static_cast<int64_t>(n), static_cast<std::size_t>(1 + width));
  };
  switch (*at) {
    case 'K':
      return fixed(1, false);
    case 'M':
      return fixed(2, false);
    case 'J':
      return fixed(4, true);
    case '\x8a': {
      if (end - at < 2) return std::nullopt;
      const auto n = static_cast<unsigned char>(at[1]);
      if (n == 0 || n > 8 || end - at < 2 + n) return std::nullopt;
      uint64_t value = read_le(at + 2, n);
      if (n < 8 && (value >> (8 * n - 1)) & 1) value |= ~uint64_t{0} << (8 * n);
      return std::make_pair(static_cast<int64_t>(value), static_cast<std::size_t>(2 + n));
    }
    default:
      return std::nullopt;
  }
}

// The opcode of an int as LibTorch's Pickler writes it (LibTorch's Unpickler takes a LONG1 of 8
// bytes only).
std::string int_opcode(int64_t value) {
  std::string op;
  auto le = [&](uint64_t n, int width) {
    for (int i = 0; i < width; ++i) op.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  };
  if (value >= 0 && value < 256) {
    op = "K";
    le(static_cast<uint64_t>(value), 1);
  } else if (value >= 0 && value < 65536) {
    op = "M";
    le(static_cast<uint64_t>(value), 2);
  } else if (value >= INT32_MIN && value <= INT32_MAX) {
    op = "J";
    le(static_cast<uint64_t>(value), 4);
  } else {
    op = "\x8a\x08";
    le(static_cast<uint64_t>(value), 8);
  }
  return op;
}

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

// "module.name" of a GLOBAL argument "module\nname\n".
std::string global_name(std::string_view global) {
  std::string name(global.substr(0, global.empty() ? 0 : global.size() - 1));
  std::replace(name.begin(), name.end(), '\n', '.');
  return name;
}

// Whom rewrite_pickle rewrites a pickle for.
enum class PickleReader { kLibTorch, kPython };

// A stack item of rewrite_pickle's walk: where its bytes begin in the output, and what the tensor
// rewrites need to know of it.
struct WalkItem {
  static constexpr std::size_t kElsewhere = std::string::npos;
  std::size_t begins = 0;  // in out
  bool mark = false;
  bool dict = false;   // an empty dict (that SETITEM or SETITEMS fill)
  std::string global;  // "module\nname\n" of a GLOBAL, as the input says it (or a BINGET of one)
  std::string text;    // a string's characters
  // A persistent id ('storage', class, key, location, count), as a tuple or as the storage
  // BINPERSID makes of it: its class (input's), its key, its dtype where known, and where in out
  // its class and count opcodes are (kElsewhere: it came out of the memo).
  bool storage = false;
  std::string storage_class;
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::size_t class_at = kElsewhere, count_at = kElsewhere;
  std::vector<uint64_t> memo;  // the slots that hold it
};

// Note [torch.save's format]: for kLibTorch (load_torch_archive), rewrites Python's OrderedDict()
// into an empty dict, and BUILD into SETITEM under kBuildStateKey (LibTorch's Unpickler has no POP
// to drop the state with, and the state may memoize values that later parts of the pickle refer to,
// so it must stay); a LONG1 of fewer than 8 bytes becomes one of 8; _rebuild_tensor_v3 over an
// untyped storage becomes _rebuild_tensor_v2 over LibTorch's storage class of the dtype. For
// kPython (save_torch_archive), _rebuild_tensor_v2 over LibTorch's storage class of a dtype in
// untyped_dtypes() becomes Python's _rebuild_tensor_v3 over an untyped storage. Walks the opcodes
// (a byte inside a string or a number is not an opcode) keeping, for each stack item, where its
// bytes begin in the output, so that the key can go in front of a BUILD's state and a tensor's
// arguments can be rewritten when the last of them is known; and, for each memo slot, what it
// holds, for the BINGETs of globals, strings and storages. "GLOBAL collections OrderedDict [BINPUT
// n]", or later "BINGET n", followed by an empty tuple and a REDUCE (the call OrderedDict())
// becomes EMPTY_DICT. Returns the pickle as it was where it meets anything it cannot tell:
// LibTorch's Unpickler then says what it cannot read. Throws c10::Error for an int beyond int64, a
// dtype as a value, a storage read as two dtypes, or an untyped storage of a size its dtype does
// not divide.
std::vector<char> rewrite_pickle(const std::vector<char>& pickle, PickleReader reader) {
  const bool for_libtorch = reader == PickleReader::kLibTorch;
  const char* p = pickle.data();
  const char* const end = p + pickle.size();
  std::vector<char> out;
  out.reserve(pickle.size() + 1024);
  std::vector<WalkItem> stack;
  std::map<uint64_t, WalkItem> memo;        // what each memo slot holds
  std::map<uint64_t, std::string> pending;  // kPython: slots whose GLOBAL went (see below)
  std::vector<uint64_t> ordered_dict_memo;  // memo slots that hold the class OrderedDict
  static constexpr std::string_view kOrderedDict = "collections\nOrderedDict\n";
  auto push_item = [&](WalkItem item) {
    item.begins = out.size();
    stack.push_back(std::move(item));
  };
  auto append = [&](std::string_view bytes) { out.insert(out.end(), bytes.begin(), bytes.end()); };
  auto append_global = [&](std::string_view global) {
    out.push_back('c');
    append(global);
  };
  // At `at`: an empty tuple and a REDUCE (the call with no arguments)? Then past them.
  auto call_without_arguments = [&](const char* at) -> const char* {
    return end - at >= 2 && at[0] == ')' && at[1] == 'R' ? at + 2 : nullptr;
  };
  auto empty_dict = [&](const char* after) {
    WalkItem dict;
    dict.dict = true;
    push_item(dict);
    out.push_back('}');
    return after;
  };
  // The size of the opcode at out[at] with its argument.
  auto opcode_size_in_out = [&](std::size_t at) -> std::size_t {
    auto size = argument_size(static_cast<unsigned char>(out[at]), out.data() + at + 1,
                              out.data() + out.size());
    TORCH_INTERNAL_ASSERT(size.has_value(), "rewrite_pickle: an opcode it wrote is cut short");
    return 1 + *size;
  };
  // out[at, at + size) becomes `bytes`.
  auto replace_in_out = [&](std::size_t at, std::size_t size, std::string_view bytes) {
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(at),
              out.begin() + static_cast<std::ptrdiff_t>(at + size));
    out.insert(out.begin() + static_cast<std::ptrdiff_t>(at), bytes.begin(), bytes.end());
  };
  // For the messages: "'key'" when stack[i] is a value going into a dict (SETITEM: [dict, key,
  // value]; SETITEMS: [dict, MARK, key, value, ...]), else "". (A string and a dict before it in a
  // list read as a key too: a message names the key wrongly there.)
  auto key_of = [&](std::size_t i) -> std::string {
    std::size_t j = i;  // stack[j - 1]: the nearest mark below i
    while (j > 0 && !stack[j - 1].mark) --j;
    const bool in_setitem = i >= 2 && i - 2 >= j && stack[i - 2].dict;
    const bool in_setitems = j >= 2 && stack[j - 2].dict && (i - j) % 2 == 1;
    return (in_setitem || in_setitems) && !stack[i - 1].text.empty() ? "'" + stack[i - 1].text + "'"
                                                                     : "";
  };
  // A dtype of untyped_dtypes() that a tensor rewrite did not take, stack[i]: LibTorch has no value
  // for it, and its GLOBAL may have gone with the tensor whose dtype it was.
  auto refuse_dtype_value = [&](std::size_t i) {
    const WalkItem& item = stack[i];
    TORCH_CHECK(!for_libtorch || item.global.empty() || !untyped_dtype_of(item.global, false),
                "data.pkl holds ", global_name(item.global), " as a value",
                key_of(i).empty() ? "" : " (key " + key_of(i) + ")",
                ", which LibTorch cannot read; store the dtype's name as a string");
  };
  while (p < end) {
    const auto opcode = static_cast<unsigned char>(*p);
    auto size = argument_size(opcode, p + 1, end);
    auto effect = stack_effect(opcode);
    if (!size || !effect) return pickle;
    const char* next = p + 1 + *size;
    if (for_libtorch && opcode == 'c' && std::string_view(p + 1, *size) == kOrderedDict) {
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
    if (for_libtorch && (opcode == 'h' || opcode == 'j') &&
        std::find(ordered_dict_memo.begin(), ordered_dict_memo.end(),
                  read_le(p + 1, opcode == 'h' ? 1 : 4)) != ordered_dict_memo.end()) {
      const char* after = call_without_arguments(next);
      if (!after) return pickle;
      p = empty_dict(after);
      continue;
    }
    if (for_libtorch && opcode == 0x8a) {
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
      push_item({});
      out.push_back(static_cast<char>(0x8a));
      out.push_back(8);
      out.insert(out.end(), wide, wide + 8);
      p = next;
      continue;
    }
    if (opcode == 'q' || opcode == 'r') {  // BINPUT, LONG_BINPUT: the top item into the memo
      if (stack.empty()) return pickle;
      const uint64_t slot = read_le(p + 1, opcode == 'q' ? 1 : 4);
      pending.erase(slot);
      stack.back().memo.push_back(slot);
      memo[slot] = stack.back();
      out.insert(out.end(), p, next);
      p = next;
      continue;
    }
    if (opcode == 'h' || opcode == 'j') {  // BINGET, LONG_BINGET
      const uint64_t slot = read_le(p + 1, opcode == 'h' ? 1 : 4);
      WalkItem item;
      if (auto held = memo.find(slot); held != memo.end()) item = held->second;
      item.mark = false;
      item.class_at = item.count_at = WalkItem::kElsewhere;
      item.memo = {slot};
      push_item(item);
      if (auto global = pending.find(slot); global != pending.end()) {
        // kPython: the GLOBAL that filled this slot became _rebuild_tensor_v3; it fills it here.
        append_global(global->second);
        out.push_back('r');
        for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((slot >> (8 * i)) & 0xff));
        pending.erase(global);
      } else {
        out.insert(out.end(), p, next);
      }
      p = next;
      continue;
    }
    if (opcode == 'c') {
      // Rewritten where the rewrite needs no context: every _rebuild_tensor_v3 call and every
      // storage class of untyped_dtypes() is a tensor's; the items keep what the input said.
      WalkItem item;
      item.global = std::string(p + 1, *size);
      push_item(item);
      if (for_libtorch && item.global == kRebuildTensorV3) {
        append_global(kRebuildTensorV2);
      } else if (!for_libtorch && untyped_dtype_of(item.global, /*by_storage_class=*/true)) {
        append_global(kUntypedStorage);
      } else {
        out.insert(out.end(), p, next);
      }
      p = next;
      continue;
    }
    if (opcode == 'X' || opcode == 0x8c) {  // BINUNICODE, SHORT_BINUNICODE
      const int width = opcode == 'X' ? 4 : 1;
      WalkItem item;
      item.text = std::string(p + 1 + width, *size - width);
      push_item(item);
      out.insert(out.end(), p, next);
      p = next;
      continue;
    }
    if (opcode == '}') {
      WalkItem dict;
      dict.dict = true;
      push_item(dict);
      out.push_back('}');
      p = next;
      continue;
    }
    if (opcode == 't') {
      auto mark =
          std::find_if(stack.rbegin(), stack.rend(), [](const WalkItem& i) { return i.mark; });
      if (mark == stack.rend()) return pickle;
      const std::size_t m = static_cast<std::size_t>(stack.rend() - mark) - 1;
      const std::size_t count = stack.size() - m - 1;
      WalkItem* children = stack.data() + m + 1;
      WalkItem tuple;
      if (count == 5 && children[0].text == "storage" && !children[1].global.empty()) {
        // A persistent id: ('storage', class, key, location, element count).
        tuple.storage = true;
        tuple.storage_class = children[1].global;
        tuple.key = children[2].text;
        tuple.class_at = children[1].begins;
        tuple.count_at = children[4].begins;
        if (!for_libtorch) {
          if (const UntypedDtype* dtype = untyped_dtype_of(tuple.storage_class, true)) {
            // An untyped storage counts bytes.
            auto n = int_opcode_at(out.data() + tuple.count_at, out.data() + out.size());
            if (!n) return pickle;
            replace_in_out(
                tuple.count_at, n->second,
                int_opcode(n->first * static_cast<int64_t>(c10::elementSize(dtype->type))));
            tuple.dtype = dtype->type;
          }
        }
      } else if (m > 0 && (count == 6 || count == 7 || count == 8) && children[0].storage) {
        WalkItem& callable = stack[m - 1];
        WalkItem& storage = children[0];
        if (for_libtorch && callable.global == kRebuildTensorV3 && count >= 7) {
          // (storage, offset, size, stride, requires_grad, hooks, dtype[, metadata]): the dtype
          // goes into the storage's class, and the count from bytes to elements.
          const UntypedDtype* dtype = untyped_dtype_of(children[6].global, false);
          if (!dtype) return pickle;
          const std::size_t dtype_ends = count == 8 ? children[7].begins : out.size();
          out.erase(out.begin() + static_cast<std::ptrdiff_t>(children[6].begins),
                    out.begin() + static_cast<std::ptrdiff_t>(dtype_ends));
          children[6].global.clear();  // gone, not a dtype used as a value
          // For the messages: "data.pkl: tensor 'w' (storage data/3)".
          const std::string key = key_of(m - 1);
          const std::string tensor = "data.pkl: tensor" + (key.empty() ? "" : " " + key) +
                                     " (storage data/" + (storage.key.empty() ? "?" : storage.key) +
                                     ")";
          if (storage.class_at != WalkItem::kElsewhere) {
            TORCH_CHECK(storage.storage_class == kUntypedStorage, tensor,
                        " has a typed storage under _rebuild_tensor_v3, which torch.save does not "
                        "write; the file is damaged or was not written by torch.save");
            auto n = int_opcode_at(out.data() + storage.count_at, out.data() + out.size());
            if (!n) return pickle;
            const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype->type));
            TORCH_CHECK(n->first % itemsize == 0, tensor, " is ", dtype->python_name,
                        " but its storage holds ", n->first,
                        " bytes, not a whole number of its elements (", itemsize,
                        " bytes each); the file is damaged or was not written by torch.save");
            replace_in_out(storage.count_at, n->second, int_opcode(n->first / itemsize));
            replace_in_out(storage.class_at, opcode_size_in_out(storage.class_at),
                           "c" + storage_class_of(dtype->type));
            for (uint64_t slot : storage.memo) memo[slot].dtype = dtype->type;
          } else {
            // Python writes one dtype per storage that has bytes; LibTorch gives a tensor the
            // dtype of its storage.
            TORCH_CHECK(storage.dtype == dtype->type, tensor, " is ", dtype->python_name,
                        " but an earlier tensor of its storage is another dtype (",
                        storage.dtype == c10::ScalarType::Undefined
                            ? global_name(storage.storage_class)
                            : std::string(c10::toString(storage.dtype)),
                        "), and LibTorch gives each storage one; torch.save a clone() of one of "
                        "the tensors that share it");
          }
        } else if (!for_libtorch && callable.global == kRebuildTensorV2 && count <= 7 &&
                   storage.dtype != c10::ScalarType::Undefined) {
          // (storage, offset, size, stride, requires_grad, hooks[, metadata]): Python's
          // _rebuild_tensor_v3 takes the dtype after the hooks. The _rebuild_tensor_v2 GLOBAL
          // goes; where it filled a memo slot that other tensors' BINGET, the first of those
          // BINGETs fills it instead.
          const UntypedDtype* dtype = nullptr;
          for (const UntypedDtype& d : untyped_dtypes()) {
            if (d.type == storage.dtype) dtype = &d;
          }
          TORCH_INTERNAL_ASSERT(dtype != nullptr);
          const std::string dtype_global = "c" + dtype_global_of(*dtype);
          const std::size_t dtype_at = count == 7 ? children[6].begins : out.size();
          out.insert(out.begin() + static_cast<std::ptrdiff_t>(dtype_at), dtype_global.begin(),
                     dtype_global.end());
          const std::size_t callable_size = stack[m].begins - callable.begins;
          for (std::size_t at = callable.begins; at < stack[m].begins;
               at += opcode_size_in_out(at)) {
            if (out[at] == 'q' || out[at] == 'r') {
              pending[read_le(out.data() + at + 1, out[at] == 'q' ? 1 : 4)] =
                  std::string(kRebuildTensorV2);
            }
          }
          const std::string v3 = "c" + std::string(kRebuildTensorV3);
          replace_in_out(callable.begins, callable_size, v3);
          stack[m].begins = callable.begins + v3.size();
          callable.global = kRebuildTensorV3;
        }
      }
      for (std::size_t i = m + 1; i < stack.size(); ++i) refuse_dtype_value(i);
      tuple.begins = stack[m].begins;
      stack.resize(m);
      stack.push_back(std::move(tuple));
      out.push_back('t');
      p = next;
      continue;
    }
    // Where the item this opcode pushes begins: its first popped item's start, or here.
    std::size_t begins = out.size();
    if (effect->pops == kToMark) {
      while (!stack.empty() && !stack.back().mark) {
        refuse_dtype_value(stack.size() - 1);
        stack.pop_back();
      }
      if (stack.empty()) return pickle;
      begins = stack.back().begins;
      stack.pop_back();
    } else {
      if (stack.size() < static_cast<std::size_t>(effect->pops)) return pickle;
      if (effect->pops > 0) begins = stack[stack.size() - effect->pops].begins;
      for (std::size_t i = stack.size() - effect->pops; i < stack.size(); ++i) {
        refuse_dtype_value(i);
      }
      if (for_libtorch && opcode == 'b') {
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
    if (effect->pushes) {
      WalkItem item;
      item.begins = begins;
      item.mark = opcode == '(';
      stack.push_back(std::move(item));
    }
    out.insert(out.end(), p, next);
    if (opcode == '.') break;
    p = next;
  }
  return out;
}

// Drops what rewrite_pickle filed under kBuildStateKey, in every dict of value.
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

// Throws c10::Error where two tensors of value view one storage as two dtypes. The pickle has one
// storage class per storage (Note [torch.save's format]), so LibTorch and Python would read both
// as the first one's dtype; Python's torch.save refuses such a file too (where the storage has
// bytes; an empty one it pickles again for each tensor, LibTorch's Pickler once). `seen`:
// each storage's first tensor, its dtype and where it is ("root['tensors']['w']").
void check_one_dtype_per_storage(
    const c10::IValue& value, const std::string& where,
    std::map<const void*, std::pair<c10::ScalarType, std::string>>& seen) {
  if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      const c10::IValue& key = item.key();
      check_one_dtype_per_storage(
          item.value(),
          where + "[" + (key.isString() ? "'" + key.toStringRef() + "'" : "...") + "]", seen);
    }
  } else if (value.isList()) {
    std::size_t i = 0;
    for (const c10::IValue& item : value.toListRef())
      check_one_dtype_per_storage(item, where + "[" + std::to_string(i++) + "]", seen);
  } else if (value.isTuple()) {
    std::size_t i = 0;
    for (const c10::IValue& item : value.toTupleRef().elements())
      check_one_dtype_per_storage(item, where + "[" + std::to_string(i++) + "]", seen);
  } else if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (tensor.layout() != at::kStrided) return;
    auto [first, added] =
        seen.try_emplace(tensor.storage().unsafeGetStorageImpl(), tensor.scalar_type(), where);
    TORCH_CHECK(added || first->second.first == tensor.scalar_type(), "save_torch_archive: tensor ",
                where, " (", tensor.scalar_type(), ") views the storage of tensor ",
                first->second.second, " (", first->second.first,
                "), and torch.save's format keeps one dtype per storage; save a clone() of one "
                "of them");
  }
}

}  // namespace

std::vector<char> save_torch_archive(const c10::IValue& value) {
  std::map<const void*, std::pair<c10::ScalarType, std::string>> storage_dtypes;
  check_one_dtype_per_storage(value, "root", storage_dtypes);
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, std::size_t size) { pickle.insert(pickle.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  pickle = rewrite_pickle(pickle, PickleReader::kPython);

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
  const std::vector<char> pickle = rewrite_pickle(
      std::vector<char>(pickle_bytes, pickle_bytes + pickle_size), PickleReader::kLibTorch);
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
