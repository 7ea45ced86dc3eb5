// Tests for the Fashion-MNIST reader (datasets/fashion_mnist.h): Debian's real files (skipped where
// dataset-fashion-mnist is not installed), uncompressed files, and the error for every kind of
// broken file.
#include "datasets/fashion_mnist.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "support/system.h"

namespace datasets {
namespace {

using dtrain::UsageError;
using dtrain::testing::have_fashion_mnist;
using dtrain::testing::kNoFashionMnist;
using Bytes = std::vector<uint8_t>;

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void put_big_endian(Bytes& bytes, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8)
    bytes.push_back(static_cast<uint8_t>(value >> shift));
}

// An uncompressed IDX images file of n 28x28 images whose pixels are all fill(i), and its labels.
Bytes idx_images(uint32_t n, uint8_t first_fill = 0) {
  Bytes bytes;
  put_big_endian(bytes, 0x803);
  put_big_endian(bytes, n);
  put_big_endian(bytes, 28);
  put_big_endian(bytes, 28);
  for (uint32_t i = 0; i < n; ++i) bytes.insert(bytes.end(), 28 * 28, i == 0 ? first_fill : 255);
  return bytes;
}

Bytes idx_labels(const Bytes& labels) {
  Bytes bytes;
  put_big_endian(bytes, 0x801);
  put_big_endian(bytes, static_cast<uint32_t>(labels.size()));
  bytes.insert(bytes.end(), labels.begin(), labels.end());
  return bytes;
}

class FashionMnistFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "dtrain_fashion_mnist_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  // Asserts that loading the test split throws a UsageError naming `file` and containing `detail`.
  void expect_error(const std::string& file, const std::string& detail) {
    try {
      load_fashion_mnist(dir_, /*train=*/false);
      ADD_FAILURE() << "expected a UsageError about " << file;
    } catch (const UsageError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(dir_ + "/" + file), std::string::npos) << message;
      EXPECT_NE(message.find(detail), std::string::npos) << message;
    }
  }

  std::string dir_;
};

TEST(FashionMnistTest, LoadsDebianTrainingSplit) {
  if (!have_fashion_mnist()) GTEST_SKIP() << kNoFashionMnist;
  const MnistSplit split = load_fashion_mnist(default_fashion_mnist_dir(), /*train=*/true);
  EXPECT_EQ(split.images.sizes(), (at::IntArrayRef{60000, 1, 28, 28}));
  EXPECT_EQ(split.images.scalar_type(), at::kFloat);
  EXPECT_EQ(split.labels.sizes(), (at::IntArrayRef{60000}));
  EXPECT_EQ(split.labels.scalar_type(), at::kLong);
  EXPECT_EQ(split.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(split.labels.max().item<int64_t>(), 9);
  // python3: list(gzip.open('.../train-labels-idx1-ubyte.gz').read()[8:13])
  const std::vector<int64_t> first(split.labels.data_ptr<int64_t>(),
                                   split.labels.data_ptr<int64_t>() + 5);
  EXPECT_EQ(first, (std::vector<int64_t>{9, 0, 0, 3, 0}));
  // Normalized with the training set's own statistics: mean ~0, std ~1.
  EXPECT_NEAR(split.images.mean().item<double>(), 0.0, 1e-3);
  EXPECT_NEAR(split.images.std().item<double>(), 1.0, 1e-3);
  // sum(img[:784]) of the first image is 76247 (python3, gzip).
  const double first_sum = split.images[0].sum().item<double>();
  EXPECT_NEAR((first_sum * kFashionMnistStd + 784 * kFashionMnistMean) * 255.0, 76247.0, 0.5);
}

TEST(FashionMnistTest, LoadsDebianTestSplit) {
  if (!have_fashion_mnist()) GTEST_SKIP() << kNoFashionMnist;
  const MnistSplit split = load_fashion_mnist(default_fashion_mnist_dir(), /*train=*/false);
  EXPECT_EQ(split.images.sizes(), (at::IntArrayRef{10000, 1, 28, 28}));
  EXPECT_EQ(split.labels.sizes(), (at::IntArrayRef{10000}));
  const std::vector<int64_t> first(split.labels.data_ptr<int64_t>(),
                                   split.labels.data_ptr<int64_t>() + 5);
  EXPECT_EQ(first, (std::vector<int64_t>{9, 2, 1, 1, 6}));
  EXPECT_EQ(at::bincount(split.labels).min().item<int64_t>(), 1000);  // 1000 of each class
}

TEST(FashionMnistTest, MissingDirectoryNamesThePackage) {
  try {
    load_fashion_mnist("/nonexistent/dtrain-data", true);
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("/nonexistent/dtrain-data/train-images-idx3-ubyte.gz"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("apt-get install dataset-fashion-mnist"), std::string::npos) << message;
    EXPECT_NE(message.find("--data DIR"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

TEST_F(FashionMnistFilesTest, ReadsUncompressedFilesAndNormalizes) {
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_images(3, /*first_fill=*/0));
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({7, 0, 9}));
  const MnistSplit split = load_fashion_mnist(dir_, /*train=*/false);
  EXPECT_EQ(split.images.sizes(), (at::IntArrayRef{3, 1, 28, 28}));
  EXPECT_EQ(split.labels.sizes(), (at::IntArrayRef{3}));
  EXPECT_EQ(split.labels[0].item<int64_t>(), 7);
  EXPECT_EQ(split.labels[2].item<int64_t>(), 9);
  EXPECT_NEAR(split.images[0][0][5][5].item<float>(), -kFashionMnistMean / kFashionMnistStd, 1e-5);
  EXPECT_NEAR(split.images[1][0][27][0].item<float>(), (1 - kFashionMnistMean) / kFashionMnistStd,
              1e-5);
}

TEST_F(FashionMnistFilesTest, MissingLabelsFile) {
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_images(3));
  expect_error("t10k-labels-idx1-ubyte.gz", "dataset-fashion-mnist");
}

TEST_F(FashionMnistFilesTest, TruncatedGzipFile) {
  if (!have_fashion_mnist()) GTEST_SKIP() << kNoFashionMnist;
  Bytes gz = read_bytes(default_fashion_mnist_dir() + "/t10k-labels-idx1-ubyte.gz");
  gz.resize(gz.size() / 2);
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_images(3));
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte.gz", gz);
  expect_error("t10k-labels-idx1-ubyte.gz", "truncated");
}

TEST_F(FashionMnistFilesTest, CorruptGzipFile) {
  if (!have_fashion_mnist()) GTEST_SKIP() << kNoFashionMnist;
  Bytes gz = read_bytes(default_fashion_mnist_dir() + "/t10k-labels-idx1-ubyte.gz");
  for (size_t i = 100; i < 200; ++i) gz[i] ^= 0x5a;
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_images(3));
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte.gz", gz);
  expect_error("t10k-labels-idx1-ubyte.gz", "corrupt");
}

TEST_F(FashionMnistFilesTest, TruncatedImagesFile) {
  Bytes images = idx_images(3);
  images.resize(images.size() - 100);
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", images);
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({1, 2, 3}));
  expect_error("t10k-images-idx3-ubyte",
               "3 images of 28x28 pixels, expected 2368 bytes, found 2268");
}

TEST_F(FashionMnistFilesTest, HeaderPromisingHugeSizes) {
  Bytes images = idx_images(1);
  // 2^32 - 1 images of 2^32 - 1 x 28 pixels: the byte count overflows 64 bits.
  images[4] = images[5] = images[6] = images[7] = 0xff;
  images[8] = images[9] = images[10] = images[11] = 0xff;
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", images);
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({1}));
  expect_error("t10k-images-idx3-ubyte", "more than the file's 800 bytes (truncated)");
}

TEST_F(FashionMnistFilesTest, ShortHeader) {
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", Bytes{0, 0, 8, 3, 0, 0});
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({1}));
  expect_error("t10k-images-idx3-ubyte", "expected a 16-byte header, found a 6-byte file");
}

TEST_F(FashionMnistFilesTest, WrongMagicNumber) {
  // Labels where images belong: the classic mix-up.
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_labels({1, 2, 3}));
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({1, 2, 3}));
  expect_error("t10k-images-idx3-ubyte", "expected magic number 0x00000803, found 0x00000801");
}

TEST_F(FashionMnistFilesTest, CountMismatch) {
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_images(3));
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({1, 2}));
  expect_error("t10k-labels-idx1-ubyte", "3 images");
  expect_error("t10k-images-idx3-ubyte", "2 labels");
}

TEST_F(FashionMnistFilesTest, LabelOutOfRange) {
  write_bytes(dir_ + "/t10k-images-idx3-ubyte", idx_images(3));
  write_bytes(dir_ + "/t10k-labels-idx1-ubyte", idx_labels({1, 12, 3}));
  expect_error("t10k-labels-idx1-ubyte", "label 1 is 12, expected a class id 0..9");
}

}  // namespace
}  // namespace datasets
