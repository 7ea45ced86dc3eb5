// Fashion-MNIST reader: the gzip'd (or plain) IDX files into normalized CPU tensors; see
// datasets/fashion_mnist.h.
//
// IDX layout (big-endian): a 4-byte magic 0x000008NN where 08 means unsigned bytes and NN the
// number of dimensions, then one 4-byte size per dimension, then the bytes. Images are 0x00000803
// [N, rows, cols], labels 0x00000801 [N].
#include "datasets/fashion_mnist.h"

#include <ATen/ops/from_blob.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <memory>
#include <sstream>

#include "datasets/read_file.h"
#include "dtrain/errors.h"

namespace datasets {
namespace {

using dtrain::UsageError;

constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;
constexpr int64_t kNumClasses = 10;

bool is_regular_file(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

// <dir>/<name>.gz, else the uncompressed <dir>/<name>.
std::string find_file(const std::string& dir, const std::string& name) {
  const std::string base = dir.empty() ? name : dir + "/" + name;
  if (is_regular_file(base + ".gz")) return base + ".gz";
  if (is_regular_file(base)) return base;
  throw UsageError(
      "Fashion-MNIST file not found: " + base +
      ".gz (nor uncompressed without .gz). Install Debian's dataset-fashion-mnist "
      "(apt-get install dataset-fashion-mnist), pass --data DIR or set DTRAIN_FASHION_MNIST_DIR");
}

std::vector<uint8_t> read_file(const std::string& path) {
  return read_maybe_gzip(path, "Fashion-MNIST file",
                         "Reinstall dataset-fashion-mnist or download the file again.");
}

uint32_t read_big_endian(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Checks the magic number and the size the header implies; returns the dimension sizes.
std::vector<int64_t> parse_header(const std::vector<uint8_t>& bytes, const std::string& path,
                                  uint32_t magic, const char* what) {
  const size_t num_dims = magic & 0xff;
  const size_t header_size = 4 + 4 * num_dims;
  auto fail = [&](const std::string& found) {
    std::ostringstream message;
    message << "Fashion-MNIST file " << path << " is not a valid IDX " << what << " file: " << found
            << ". Reinstall dataset-fashion-mnist or download the file again.";
    throw UsageError(message.str());
  };
  if (bytes.size() < 4) {
    fail("expected a 4-byte magic number, found a " + std::to_string(bytes.size()) + "-byte file");
  }
  const uint32_t found_magic = read_big_endian(bytes.data());
  if (found_magic != magic) {
    std::ostringstream found;
    found << std::hex << std::setfill('0') << "expected magic number 0x" << std::setw(8) << magic
          << ", found 0x" << std::setw(8) << found_magic;
    fail(found.str());
  }
  if (bytes.size() < header_size) {
    fail("expected a " + std::to_string(header_size) + "-byte header, found a " +
         std::to_string(bytes.size()) + "-byte file (truncated)");
  }
  std::vector<int64_t> dims;
  // A corrupt header may hold any 32-bit sizes, whose product can overflow: stop at 2^62 bytes,
  // more than any file that fits in memory.
  constexpr uint64_t kSizeCap = uint64_t{1} << 62;
  uint64_t body_size = 1;
  bool too_large = false;
  for (size_t i = 0; i < num_dims; ++i) {
    dims.push_back(read_big_endian(bytes.data() + 4 + 4 * i));
    const auto dim = static_cast<uint64_t>(dims.back());
    if (dim != 0 && body_size > kSizeCap / dim) too_large = true;
    if (!too_large) body_size *= dim;
  }
  const uint64_t expected = header_size + body_size;
  if (too_large || bytes.size() != expected) {
    std::ostringstream found;
    found << "the header promises " << dims[0] << " " << what;
    if (num_dims == 3) found << " of " << dims[1] << "x" << dims[2] << " pixels";
    if (too_large) {
      found << ", more than the file's " << bytes.size() << " bytes (truncated)";
    } else {
      found << ", expected " << expected << " bytes, found " << bytes.size()
            << (bytes.size() < expected ? " (truncated)" : " (trailing bytes)");
    }
    fail(found.str());
  }
  return dims;
}

}  // namespace

std::string default_fashion_mnist_dir() {
  const char* dir = std::getenv("DTRAIN_FASHION_MNIST_DIR");
  return dir && *dir ? dir : kDefaultFashionMnistDir;
}

MnistSplit load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");

  const std::vector<uint8_t> image_bytes = read_file(images_path);
  const std::vector<int64_t> image_dims =
      parse_header(image_bytes, images_path, kImagesMagic, "images");
  const std::vector<uint8_t> label_bytes = read_file(labels_path);
  const std::vector<int64_t> label_dims =
      parse_header(label_bytes, labels_path, kLabelsMagic, "labels");
  if (image_dims[0] != label_dims[0]) {
    throw UsageError("Fashion-MNIST files disagree: " + images_path + " holds " +
                     std::to_string(image_dims[0]) + " images but " + labels_path + " holds " +
                     std::to_string(label_dims[0]) +
                     " labels; expected the same count. Reinstall dataset-fashion-mnist.");
  }

  MnistSplit split;
  // One conversion pass from the file's bytes to float, then one in-place pass for the
  // normalization (x / 255 - mean) / std, written as (x - 255 mean) / (255 std).
  const int64_t n = image_dims[0];
  auto* pixels = const_cast<uint8_t*>(image_bytes.data() + 16);
  split.images = at::from_blob(pixels, {n, 1, image_dims[1], image_dims[2]}, at::kByte)
                     .to(at::kFloat)
                     .sub_(255.0 * kFashionMnistMean)
                     .div_(255.0 * kFashionMnistStd);
  auto* labels = const_cast<uint8_t*>(label_bytes.data() + 8);
  for (int64_t i = 0; i < n; ++i) {
    if (labels[i] >= kNumClasses) {
      throw UsageError("Fashion-MNIST file " + labels_path + " is corrupt: label " +
                       std::to_string(i) + " is " + std::to_string(labels[i]) +
                       ", expected a class id 0.." + std::to_string(kNumClasses - 1) + ".");
    }
  }
  split.labels = at::from_blob(labels, {n}, at::kByte).to(at::kLong);
  return split;
}

}  // namespace datasets
