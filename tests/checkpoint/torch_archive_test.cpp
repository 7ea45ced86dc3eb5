// torch.save files beyond the round trip of torch_interop_test.cpp, each once refused or misread
// (Note [torch.save's format] in src/checkpoint/torch_archive.cpp): Python's file without CRC-32s
// loads, and one with ints beyond int32; an int beyond int64, a big-endian file, an 'rng' that is
// no generator state and a tensor reaching past its record are one clear line each, before
// anything changes. The files come from tests/python/torch_file_variants.py. (The zip64 offsets
// near 2^64 that wrapped a bounds check read before the buffer and still came out as damage: no
// test here can see that, only a sanitizer.)
#include "checkpoint/torch_archive.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

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

}  // namespace
}  // namespace dtrain
