// Tier-1 tests of dtrain/safetensors.h: every dtype survives a round trip bit for bit (and through
// Python's safetensors both ways, where the project's Python has it), a folder shards with an index
// as Hugging Face writes one, every kind of damage is refused with a line naming the file and
// what is wrong, and load_into converts dtypes and refuses missing, extra and misshaped tensors.
#include "dtrain/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/errors.h"
#include "support/system.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using testing::temp_dir;

// One tensor of every dtype safetensors and LibTorch share, with odd shapes: a scalar, an empty
// tensor, and a transposed (non-contiguous) one.
TensorTable every_dtype() {
  torch::manual_seed(7);
  TensorTable table;
  table.insert("bool", torch::rand({3, 5}) > 0.5);
  table.insert("u8", torch::randint(0, 256, {7}, torch::kUInt8));
  table.insert("i8", torch::randint(-128, 128, {2, 3}, torch::kInt8));
  table.insert("i16", torch::randint(-30000, 30000, {4}, torch::kInt16));
  table.insert("u16", torch::randint(0, 60000, {5}, torch::kInt32).to(torch::kUInt16));
  table.insert("i32", torch::randint(-100000, 100000, {3, 1, 2}, torch::kInt32));
  table.insert("u32", torch::randint(0, 1 << 30, {3}, torch::kInt64).to(torch::kUInt32));
  table.insert("i64", torch::randint(-(1LL << 40), 1LL << 40, {6}, torch::kInt64));
  table.insert("u64", torch::randint(0, 1LL << 40, {2}, torch::kInt64).to(torch::kUInt64));
  table.insert("f16", torch::randn({4, 4}).to(torch::kHalf));
  table.insert("bf16", torch::randn({3, 8}).to(torch::kBFloat16));
  table.insert("f32", torch::randn({5, 3}).t());  // non-contiguous
  table.insert("f64", torch::randn({2, 2, 2}, torch::kDouble));
  table.insert("f8_e4m3", torch::randn({9}).to(torch::kFloat8_e4m3fn));
  table.insert("f8_e5m2", torch::randn({9}).to(torch::kFloat8_e5m2));
  table.insert("scalar", torch::tensor(3.5));
  table.insert("empty", torch::zeros({0, 3}));
  return table;
}

// The same names, dtypes, shapes and bytes.
void expect_same(const TensorTable& expected, const TensorTable& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& item : expected) {
    SCOPED_TRACE(item.key());
    const at::Tensor* found = actual.find(item.key());
    ASSERT_NE(found, nullptr);
    at::Tensor a = item.value().contiguous(), b = found->contiguous();
    ASSERT_EQ(a.scalar_type(), b.scalar_type());
    ASSERT_EQ(a.sizes(), b.sizes());
    EXPECT_TRUE(b.device().is_cpu());
    EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0);
  }
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A file of header `json` and `data_bytes` zero bytes, however wrong the header is.
void write_raw(const std::string& path, const std::string& json, size_t data_bytes) {
  uint64_t n = json.size();
  std::string bytes(reinterpret_cast<const char*>(&n), 8);
  write_bytes(path, bytes + json + std::string(data_bytes, '\0'));
}

// The UsageError's message from `load`, or a failure when it does not throw one.
template <typename F>
std::string error_of(F&& load) {
  try {
    load();
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

TEST(Safetensors, EveryDtypeRoundTripsBitForBit) {
  const std::string dir = temp_dir("safetensors-dtypes");
  const std::string path = dir + "/all.safetensors";
  TensorTable table = every_dtype();
  save_safetensors_file(path, table, {{"producer", "dtrain test"}});
  SafetensorsFile file = read_safetensors_file(path);
  expect_same(table, file.tensors);
  EXPECT_EQ(file.metadata["producer"], "dtrain test");
  EXPECT_EQ(file.metadata["format"], "pt");  // transformers refuses a file without it
  EXPECT_EQ(file.metadata.count("dtrain_crc32"), 1u);
  // The header as the format has it: 8-byte length, JSON padded to 8, offsets end to end.
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["f32"]["dtype"], "F32");
  EXPECT_EQ(header["f32"]["shape"], nlohmann::json::array({3, 5}));
  EXPECT_EQ(header["bf16"]["dtype"], "BF16");
  EXPECT_EQ(header["f8_e4m3"]["dtype"], "F8_E4M3");
  EXPECT_EQ(header["scalar"]["shape"], nlohmann::json::array());
  // No temporary left beside it.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  fs::remove_all(dir);
}

TEST(Safetensors, AFolderShardsWithAnIndexAsHuggingFaceWritesIt) {
  const std::string dir = temp_dir("safetensors-shards");
  TensorTable table;
  for (int i = 0; i < 10; ++i) table.insert("layer" + std::to_string(i), torch::randn({10, 10}));
  SafetensorsWriteOptions options;
  options.max_shard_bytes = 1000;  // two 400-byte tensors a shard
  auto written = save_safetensors(dir, table, options);
  ASSERT_EQ(written.size(), 6u) << "5 shards and the index";
  EXPECT_EQ(fs::path(written[0]).filename(), "model-00001-of-00005.safetensors");
  EXPECT_EQ(fs::path(written.back()).filename(), "model.safetensors.index.json");
  auto index = nlohmann::json::parse(read_bytes(written.back()));
  EXPECT_EQ(index["metadata"]["total_size"], 4000);
  EXPECT_EQ(index["weight_map"]["layer0"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["layer9"], "model-00005-of-00005.safetensors");
  EXPECT_EQ(read_safetensors_file(written[0]).tensors.size(), 2u);
  expect_same(table, load_safetensors(dir));
  expect_same(table, load_safetensors(written.back()));  // the index named directly

  // A tensor over the limit gets a shard of its own.
  TensorTable big;
  big.insert("small", torch::randn({10}));
  big.insert("big", torch::randn({1000}));
  big.insert("after", torch::randn({10}));
  written = save_safetensors(dir, big, options);
  ASSERT_EQ(written.size(), 4u);
  EXPECT_EQ(read_safetensors_file(written[1]).tensors.size(), 1u);
  EXPECT_FALSE(fs::exists(dir + "/model-00004-of-00005.safetensors")) << "a stale shard stayed";
  expect_same(big, load_safetensors(dir));

  // One file: model.safetensors, the old shards and index gone.
  written = save_safetensors(dir, table);
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(fs::path(written[0]).filename(), "model.safetensors");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  expect_same(table, load_safetensors(dir));
  fs::remove_all(dir);
}

TEST(Safetensors, EveryKindOfDamageIsNamedAndNotLoaded) {
  const std::string dir = temp_dir("safetensors-damage");
  const std::string good = dir + "/good.safetensors";
  TensorTable table;
  table.insert("a", torch::randn({4, 4}));
  table.insert("b", torch::randn({8}));
  save_safetensors_file(good, table);
  const std::string bytes = read_bytes(good);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const std::string header = bytes.substr(8, n);
  const std::string path = dir + "/damaged.safetensors";

  // Each case: a damaged copy of `good` (or a made-up file), and what the message must say.
  auto expect_refused = [&](const std::string& what, const std::string& contents,
                            const std::string& expected) {
    SCOPED_TRACE(what);
    write_bytes(path, contents);
    const std::string message = error_of([&] { read_safetensors_file(path); });
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  };
  expect_refused("truncated data", bytes.substr(0, bytes.size() - 5), "truncated");
  expect_refused("truncated header", bytes.substr(0, 8 + n / 2), "truncated");
  expect_refused("truncated length", bytes.substr(0, 5), "truncated");
  expect_refused("empty", "", "truncated");
  std::string flipped = bytes;
  flipped[8] ^= 0x20;  // the header's '{'
  expect_refused("header's first byte flipped", flipped, "not valid JSON");
  flipped = bytes;
  flipped[8 + header.find("\"shape\":[4,4]") + 9] = '5';  // a's shape [5,4]
  expect_refused("a header digit flipped", flipped, "shape [5,4] of F32 is 80 bytes");
  flipped = bytes;
  flipped[bytes.size() - 3] ^= 0x01;  // b's data
  expect_refused("a data byte flipped", flipped, "CRC-32");
  flipped = bytes;
  flipped[3] = 1;  // the header length's high bytes
  expect_refused("a length byte flipped", flipped, "header length");

  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[100,108]}})",
            16);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("[100, 108] out of range"),
            std::string::npos);
  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            16);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("overlap tensor 'a'"),
            std::string::npos);
  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
            16);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("bytes [8, 12)"),
            std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 16);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("last 8 bytes"), std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("unknown dtype \"F17\""),
            std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("non-negative"), std::string::npos);
  write_raw(path, R"([1, 2])", 0);
  EXPECT_NE(error_of([&] { read_safetensors_file(path); }).find("not a JSON object"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              read_safetensors_file(dir + "/none.safetensors");
            }).find("none.safetensors: cannot be opened"),
            std::string::npos);

  // A sharded folder whose index names a shard that is gone, or a tensor its shard lacks.
  const std::string shards = dir + "/shards";
  SafetensorsWriteOptions options;
  options.max_shard_bytes = 64;
  save_safetensors(shards, table, options);
  const std::string index_path = shards + "/model.safetensors.index.json";
  const std::string index = read_bytes(index_path);
  fs::remove(shards + "/model-00002-of-00002.safetensors");
  std::string message = error_of([&] { load_safetensors(shards); });
  EXPECT_NE(message.find(index_path), std::string::npos) << message;
  EXPECT_NE(message.find("names model-00002-of-00002.safetensors (for 'b'), which does not exist"),
            std::string::npos)
      << message;
  auto edited = nlohmann::json::parse(index);
  edited["weight_map"]["c"] = "model-00001-of-00002.safetensors";
  write_bytes(index_path, edited.dump());
  message = error_of([&] { load_safetensors(shards); });
  EXPECT_NE(message.find("maps tensor 'c' to model-00001-of-00002.safetensors, which lacks it"),
            std::string::npos)
      << message;
  fs::remove_all(dir);
}

TEST(Safetensors, LoadIntoConvertsDtypesAndRefusesWhatDoesNotFit) {
  torch::manual_seed(1);
  torch::nn::Sequential source(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
  source->forward(torch::randn({5, 4}));  // running statistics that differ from a fresh layer's
  TensorTable bf16;
  for (const auto& item : source->named_parameters()) {
    bf16.insert(item.key(), item.value().to(torch::kBFloat16));
  }
  for (const auto& item : source->named_buffers()) bf16.insert(item.key(), item.value());
  const std::string dir = temp_dir("safetensors-load-into");
  save_safetensors(dir, bf16);

  torch::nn::Sequential target(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
  TensorTable loaded = load_safetensors(dir);
  load_into(*target, loaded);
  for (const auto& item : target->named_parameters()) {
    SCOPED_TRACE(item.key());
    EXPECT_EQ(item.value().scalar_type(), torch::kFloat);  // the module's dtype stays
    EXPECT_TRUE(item.value().requires_grad());
    EXPECT_TRUE(torch::equal(item.value(), bf16[item.key()].to(torch::kFloat)));
  }
  EXPECT_TRUE(torch::equal(target->named_buffers()["1.running_mean"],
                           source->named_buffers()["1.running_mean"]));

  // Refused tables name the tensor and leave the module as it was.
  const at::Tensor before = target->named_parameters()["0.weight"].clone();
  TensorTable missing = loaded;
  missing.erase("1.bias");
  missing["0.weight"] = torch::zeros({3, 4});
  std::string message = error_of([&] { load_into(*target, missing); });
  EXPECT_NE(message.find("no tensor '1.bias' (the module's [3])"), std::string::npos) << message;
  TensorTable extra = loaded;
  extra.insert("2.weight", torch::zeros({2}));
  message = error_of([&] { load_into(*target, extra); });
  EXPECT_NE(message.find("'2.weight' [2] is not a parameter or buffer"), std::string::npos)
      << message;
  TensorTable misshaped = loaded;
  misshaped["0.weight"] = torch::zeros({4, 3});
  message = error_of([&] { load_into(*target, misshaped); });
  EXPECT_NE(message.find("'0.weight' is [4, 3] in the table but [3, 4] in the module"),
            std::string::npos)
      << message;
  EXPECT_TRUE(torch::equal(target->named_parameters()["0.weight"], before));

  LoadIntoOptions lenient;
  lenient.allow_extra = lenient.allow_missing = true;
  load_into(*target, extra, lenient);
  load_into(*target, missing, lenient);
  EXPECT_TRUE(torch::equal(target->named_parameters()["0.weight"], torch::zeros({3, 4})));
  fs::remove_all(dir);
}

// Python's safetensors (the project environment's) reads every dtype dtrain writes and writes them
// back; dtrain reads that file: the same bytes both ways.
TEST(Safetensors, PythonReadsWhatDtrainWroteAndDtrainReadsWhatPythonWrote) {
  const std::string python = testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  if (std::system(("'" + python + "' -c 'import safetensors' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << python << " lacks safetensors (scripts/bootstrap installs it)";
  }
  const std::string dir = temp_dir("safetensors-python");
  TensorTable table = every_dtype();
  save_safetensors_file(dir + "/dtrain.safetensors", table);
  const std::string command = "'" + python + "' " + DTRAIN_SOURCE_DIR +
                              "/tests/python/hf_llama.py copy " + dir + "/dtrain.safetensors " +
                              dir + "/python.safetensors";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  SafetensorsFile file = read_safetensors_file(dir + "/python.safetensors");
  expect_same(table, file.tensors);
  EXPECT_EQ(file.metadata.count("dtrain_crc32"), 0u);  // Python's own file: no CRC to check

  // Re-saved by Python with dtrain's metadata kept: the library lays the data out in another
  // order (by dtype, then name), the CRC still holds. Changed as well, it does not, and the line
  // says what may have happened.
  const std::string copy = "'" + python + "' " + DTRAIN_SOURCE_DIR +
                           "/tests/python/hf_llama.py copy --keep-metadata " + dir +
                           "/dtrain.safetensors ";
  ASSERT_EQ(std::system((copy + dir + "/kept.safetensors").c_str()), 0);
  SafetensorsFile kept = read_safetensors_file(dir + "/kept.safetensors");
  expect_same(table, kept.tensors);
  EXPECT_EQ(kept.metadata.count("dtrain_crc32"), 1u);
  ASSERT_EQ(std::system((copy + dir + "/edited.safetensors --add-one f32").c_str()), 0);
  try {
    read_safetensors_file(dir + "/edited.safetensors");
    ADD_FAILURE() << "an edited file with dtrain's CRC kept was read";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("or another program changed the tensors and kept "
                                         "dtrain's metadata (remove dtrain_crc32"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
