// torch.save files beyond the round trip of torch_interop_test.cpp, each once refused or misread
// (Note [torch.save's format] in src/checkpoint/torch_archive.cpp): Python's file without CRC-32s
// loads, and one with ints beyond int32; an int beyond int64, a big-endian file, an 'rng' that is
// no generator state and a tensor reaching past its record are one clear line each, before
// anything changes; every dtype (float8, float4, uint16/32/64 and complex32 among them, which the
// two sides pickle differently) goes from dtrain to torch.load and from torch.save to dtrain with
// every byte as it was. The files come from tests/python/torch_file_variants.py. (The zip64 offsets
// near 2^64 that wrapped a bounds check read before the buffer and still came out as damage: no
// test here can see that, only a sanitizer.)
#include "checkpoint/torch_archive.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>

#include "dtrain/checkpoint.h"
#include "dtrain/data.h"
#include "dtrain/errors.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

// Writes `variant` of torch_file_variants.py (with its arguments) as <dir>/checkpoint-<step>.ckpt.
std::string write_variant(const std::string& dir, int step, const std::string& variant,
                          const std::string& arguments = "") {
  fs::create_directories(dir);
  const std::string path = dir + "/checkpoint-" + std::to_string(step) + ".ckpt";
  auto result = testing::run_command("'" + testing::python_with_torch() + "' " + DTRAIN_SOURCE_DIR +
                                     "/tests/python/torch_file_variants.py " + variant + " " +
                                     path + " " + arguments);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return path;
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// load_latest's UsageError text, or "" when it loaded.
std::string load_error(const std::string& dir, TrainingState& into) {
  CheckpointOptions options;
  options.dir = dir;
  try {
    Checkpointer(options).load_latest(into);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// set_crc32_options(False) writes 0 for every record's CRC-32; torch.load takes the file, and so
// must dtrain rather than skip it as damaged for an older one.
TEST(TorchArchive, PythonFileWithoutCrc32sIsNewestNotDamaged) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-no-crc32");
  CheckpointOptions options;
  options.dir = dir;
  TrainingState older;
  older.step = 3;
  Checkpointer(options).save(older);
  const std::string newest = write_variant(dir, 7, "no-crc32");
  std::string why;
  EXPECT_TRUE(detail::torch_archive_intact(read_bytes(newest), &why)) << why;

  TrainingState into;
  auto loaded = Checkpointer(options).load_latest(into);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->path, newest);
  EXPECT_TRUE(loaded->skipped.empty());
  EXPECT_EQ(into.step, 7);
  EXPECT_TRUE(torch::equal(into.tensors.at("w"), torch::arange(4.0)));
  fs::remove_all(dir);
}

// Python pickles an int outside int32 as LONG1 of the fewest bytes (5 for 3'000'000'000);
// LibTorch's Unpickler took 8 only ("Expected length to be 8, got 5").
TEST(TorchArchive, PythonIntsBeyondInt32Load) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-big-ints");
  const std::string path = write_variant(dir, 1, "big-ints");
  c10::IValue value = detail::load_torch_archive(read_bytes(path));
  auto root = value.toGenericDict();
  EXPECT_EQ(root.at("step").toInt(), 3'000'000'000);
  std::vector<int64_t> ints;
  for (const c10::IValue& item : root.at("ints").toListRef()) ints.push_back(item.toInt());
  const std::vector<int64_t> expected = {3'000'000'000,
                                         -3'000'000'000,
                                         int64_t{1} << 31,
                                         -(int64_t{1} << 31) - 1,
                                         int64_t{1} << 40,
                                         std::numeric_limits<int64_t>::max(),
                                         std::numeric_limits<int64_t>::min()};
  EXPECT_EQ(ints, expected);

  TrainingState into;
  EXPECT_EQ(load_error(dir, into), "");
  EXPECT_EQ(into.step, 3'000'000'000);
  fs::remove_all(dir);
}

TEST(TorchArchive, IntBeyondInt64IsOneClearLine) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-huge-int");
  const std::string path = write_variant(dir, 1, "huge-int");
  TrainingState into;
  const std::string error = load_error(dir, into);
  EXPECT_NE(error.find("checkpoint " + path + ": "), std::string::npos) << error;
  EXPECT_NE(error.find("data.pkl holds an integer of 9 bytes, beyond int64"), std::string::npos)
      << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  fs::remove_all(dir);
}

// The bytes of a file whose byteorder record says "big" are big-endian; read as they are, every
// number would be wrong.
TEST(TorchArchive, BigEndianFileIsRefused) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-big-endian");
  const std::string path = write_variant(dir, 7, "big-endian");
  TrainingState into;
  const std::string error = load_error(dir, into);
  EXPECT_NE(error.find("checkpoint " + path + ": "), std::string::npos) << error;
  EXPECT_NE(error.find("record 'byteorder' says 'big'"), std::string::npos) << error;
  EXPECT_TRUE(into.tensors.empty());
  EXPECT_EQ(into.step, 0);
  fs::remove_all(dir);
}

// apply() checks everything before it changes anything: an 'rng' that is no generator state leaves
// the sampler, the step and the generator as they were.
TEST(TorchArchive, RngThatIsNoGeneratorStateChangesNothing) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-bad-rng");
  const std::string path = write_variant(dir, 7, "bad-rng");
  DistributedSampler sampler(100, 1, 0);
  TrainingState into{nullptr, nullptr, &sampler};
  at::Tensor generator_before = at::detail::getDefaultCPUGenerator().get_state();
  const std::string error = load_error(dir, into);
  EXPECT_NE(error.find("checkpoint " + path +
                       ": its 'rng' entry is not a state of torch's CPU generator ("),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_EQ(sampler.state().epoch, 0);
  EXPECT_EQ(sampler.state().samples_consumed, 0);
  EXPECT_EQ(into.step, 0);
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), generator_before));

  into.rng = false;  // the way around it that the message names
  EXPECT_EQ(load_error(dir, into), "");
  EXPECT_EQ(sampler.state().epoch, 1);
  fs::remove_all(dir);
}

// LibTorch's Unpickler takes a storage's element count from the pickle; the copy out of a storage
// larger than its record read past the record's bytes. (A tensor past its storage, by its offset,
// size or stride, LibTorch refuses itself.)
TEST(TorchArchive, TensorReachingPastItsRecordIsRefused) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  struct Case {
    const char* arguments;  // storage numel, record numel, offset, size, stride
    const char* error;      // "" when it loads
  };
  for (const Case& c : {
           Case{"8 8 2 4 1", ""},
           Case{"1000 4 0 1000 1",
                "'s storage holds 1000 elements (4000 bytes) but its record "
                "data/0 has 16 bytes"},
       }) {
    SCOPED_TRACE(c.arguments);
    const std::string dir = testing::temp_dir("dtrain-archive-tensor");
    const std::string path = write_variant(dir, 7, "tensor", c.arguments);
    TrainingState into;
    const std::string error = load_error(dir, into);
    if (*c.error == '\0') {
      EXPECT_EQ(error, "");
      EXPECT_TRUE(torch::equal(into.tensors.at("w"), torch::arange(2.0, 6.0)));
    } else {
      EXPECT_NE(error.find("checkpoint " + path + ": "), std::string::npos) << error;
      EXPECT_NE(error.find(std::string("data.pkl: tensor root['tensors']['w']") + c.error),
                std::string::npos)
          << error;
      EXPECT_EQ(error.find('\n'), std::string::npos) << error;
      EXPECT_TRUE(into.tensors.empty());
    }
    fs::remove_all(dir);
  }
}

// The dtypes of torch_file_variants.py's DTYPES, in its order: those Python pickles with
// _rebuild_tensor_v3 over an untyped storage and LibTorch with a storage class Python lacks
// (torch.Float8_e4m3fnStorage, torch.UInt16Storage), between ones with a storage class on both
// sides.
struct DtypeCase {
  const char* name;  // Python's
  at::ScalarType type;
};
const DtypeCase kDtypes[] = {
    {"float8_e4m3fn", at::kFloat8_e4m3fn},
    {"bfloat16", at::kBFloat16},
    {"float8_e5m2", at::kFloat8_e5m2},
    {"bool", at::kBool},
    {"float8_e4m3fnuz", at::kFloat8_e4m3fnuz},
    {"complex64", at::kComplexFloat},
    {"float8_e5m2fnuz", at::kFloat8_e5m2fnuz},
    {"int8", at::kChar},
    {"float8_e8m0fnu", at::ScalarType::Float8_e8m0fnu},
    {"float32", at::kFloat},
    {"float4_e2m1fn_x2", at::ScalarType::Float4_e2m1fn_x2},
    {"uint16", at::kUInt16},
    {"uint32", at::kUInt32},
    {"uint64", at::kUInt64},
    {"complex32", at::kComplexHalf},
};

// torch_file_variants.py's dtype_tensors(): for the k-th dtype D, "kk.D" a (3, 4) tensor whose
// storage's byte i is (31 i + 7 k) % 256 (bool: i % 2), and "kk.D.view" its rows 1: transposed,
// the same storage. Made by views only: float8 and uint16 have few kernels.
std::map<std::string, at::Tensor> dtype_tensors() {
  std::map<std::string, at::Tensor> tensors;
  int k = 0;
  for (const DtypeCase& c : kDtypes) {
    const int64_t size = 12 * static_cast<int64_t>(c10::elementSize(c.type));
    at::Tensor bytes = torch::empty({size}, torch::kUInt8);
    auto* data = bytes.data_ptr<uint8_t>();
    for (int64_t i = 0; i < size; ++i) {
      data[i] = static_cast<uint8_t>(c.type == at::kBool ? i % 2 : (31 * i + 7 * k) % 256);
    }
    at::Tensor base = bytes.view(c.type).view({3, 4});
    char prefix[16];
    std::snprintf(prefix, sizeof prefix, "%02d.", k++);
    tensors[prefix + std::string(c.name)] = base;
    tensors[prefix + std::string(c.name) + ".view"] = base.slice(0, 1).t();
  }
  return tensors;
}

// Every tensor of `expected` in `actual` with its dtype, shape, strides, offset and storage bytes
// (compared as bytes: no kernel needed, and NaNs compare).
void expect_same_tensors(const std::map<std::string, at::Tensor>& actual,
                         const std::map<std::string, at::Tensor>& expected) {
  for (const auto& [name, want] : expected) {
    SCOPED_TRACE(name);
    auto found = actual.find(name);
    ASSERT_NE(found, actual.end());
    const at::Tensor& got = found->second;
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_EQ(got.strides(), want.strides());
    EXPECT_EQ(got.storage_offset(), want.storage_offset());
    ASSERT_EQ(got.storage().nbytes(), want.storage().nbytes());
    EXPECT_EQ(std::memcmp(got.storage().data(), want.storage().data(), want.storage().nbytes()), 0);
  }
}

// LibTorch's pickle names a float8 or uint16 tensor's storage torch.Float8_e4m3fnStorage,
// torch.UInt16Storage: classes Python lacks, so torch.load refused dtrain's file ("Unsupported
// global: GLOBAL torch.Float8_e4m3fnStorage").
TEST(TorchArchive, PyTorchLoadsEveryDtypeDtrainSaves) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-dtypes-out");
  CheckpointOptions options;
  options.dir = dir;
  TrainingState state;
  state.rng = false;  // the first tensor of the file is a float8 one
  state.step = 3;
  state.tensors = dtype_tensors();
  Checkpointer(options).save(state);

  TrainingState into;  // dtrain reads its own file back, shared storages included
  auto loaded = Checkpointer(options).load_latest(into);
  ASSERT_TRUE(loaded.has_value());
  expect_same_tensors(into.tensors, state.tensors);

  auto result = testing::run_command("'" + testing::python_with_torch() + "' " + DTRAIN_SOURCE_DIR +
                                     "/tests/python/torch_file_variants.py " + "check-dtypes " +
                                     dir + "/checkpoint-3.ckpt");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("dtypes ok 30"), std::string::npos) << result.output;
  fs::remove_all(dir);
}

// Python pickles a float8 or uint16 tensor as _rebuild_tensor_v3 over a
// torch.storage.UntypedStorage, which LibTorch's Unpickler does not know ("Unpickler found unknown
// type torch._utils._rebuild_tensor_v3").
TEST(TorchArchive, DtrainLoadsEveryDtypePyTorchSaves) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-dtypes-in");
  write_variant(dir, 7, "dtypes");
  TrainingState into;
  EXPECT_EQ(load_error(dir, into), "");
  EXPECT_EQ(into.step, 7);
  expect_same_tensors(into.tensors, dtype_tensors());
  EXPECT_EQ(into.tensors.size(), 2 * std::size(kDtypes));
  fs::remove_all(dir);
}

// Python memoizes a dtype: one stored as a value after a float8 tensor is a BINGET of the slot the
// tensor's dtype filled, a slot the rewrite for LibTorch empties. It is refused in one line rather
// than read as whatever the slot then holds.
TEST(TorchArchive, DtypeAsAValueIsOneClearLine) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-dtype-value");
  const std::string path = write_variant(dir, 7, "dtype-value");
  TrainingState into;
  const std::string error = load_error(dir, into);
  EXPECT_NE(error.find("checkpoint " + path + ": "), std::string::npos) << error;
  EXPECT_NE(error.find("data.pkl holds torch.float8_e4m3fn as a value (key 'dtype'), which "
                       "LibTorch cannot read; store the dtype's name as a string"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_TRUE(into.tensors.empty());
  fs::remove_all(dir);
}

// An untyped storage counts bytes; one that is not a whole number of its tensor's elements would
// have LibTorch's Unpickler drop the odd byte and read the rest as elements.
TEST(TorchArchive, UntypedStorageOfPartElementsIsOneClearLine) {
  if (testing::python_with_torch().empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-archive-odd-bytes");
  const std::string path = write_variant(dir, 7, "odd-bytes");
  TrainingState into;
  const std::string error = load_error(dir, into);
  EXPECT_NE(error.find("checkpoint " + path + ": "), std::string::npos) << error;
  EXPECT_NE(error.find("data.pkl: tensor 'w' (storage data/0) is uint16 but its storage holds 7 "
                       "bytes, not a whole number of its elements (2 bytes each); the file is "
                       "damaged or was not written by torch.save"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_TRUE(into.tensors.empty());
  fs::remove_all(dir);
}

// The pickle has one storage class per storage: a tensor viewing another's storage as another dtype
// was read back, by dtrain and by PyTorch, as the first one's dtype. It is refused, as torch.save
// refuses it; views of one dtype (kDtypes' ".view" tensors) are not.
TEST(TorchArchive, TensorsViewingOneStorageAsTwoDtypesAreRefused) {
  const std::string dir = testing::temp_dir("dtrain-archive-two-dtypes");
  CheckpointOptions options;
  options.dir = dir;
  TrainingState state;
  state.rng = false;
  at::Tensor bytes = torch::arange(8, torch::kUInt8);
  state.tensors["a"] = bytes;
  state.tensors["b"] = bytes.view(at::kFloat8_e4m3fn);
  try {
    Checkpointer(options).save(state);
    ADD_FAILURE() << "saved";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "save_torch_archive: tensor root['tensors']['b'] (Float8_e4m3fn) views the storage "
              "of tensor root['tensors']['a'] (Byte), and torch.save's format keeps one dtype per "
              "storage; save a clone() of one of them");
  }
  state.tensors["b"] = bytes.view(at::kFloat8_e4m3fn).clone();
  Checkpointer(options).save(state);
  TrainingState into;
  ASSERT_TRUE(Checkpointer(options).load_latest(into).has_value());
  EXPECT_EQ(into.tensors.at("b").scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(std::memcmp(into.tensors.at("b").data_ptr(), bytes.data_ptr(), 8), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
