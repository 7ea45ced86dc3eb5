// A reader for Fashion-MNIST, the data set of the main job (tools/trainer) and the examples: the
// IDX files as Debian's dataset-fashion-mnist package installs them, gzip'd or not, into normalized
// CPU tensors. Not part of libdtrain (a program brings its own data); programs in this repository
// link it as dtrain_datasets and include "datasets/fashion_mnist.h".
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace datasets {

// Fashion-MNIST as Debian's dataset-fashion-mnist package installs it.
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// Where programs look for Fashion-MNIST unless told otherwise: $DTRAIN_FASHION_MNIST_DIR when set
// (a machine without Debian's package, e.g. one with a pip LibTorch and the files copied in), else
// kDefaultFashionMnistDir.
std::string default_fashion_mnist_dir();
// Mean and standard deviation of the training images' pixels scaled to [0, 1]; load_fashion_mnist
// normalizes both splits with them, the usual torchvision Normalize((0.2860,), (0.3530,)).
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;

struct MnistSplit {
  // float32 [N, 1, 28, 28] on the CPU: x = pixel / 255, then (x - mean) / std with the constants
  // above.
  at::Tensor images;
  // int64 [N] on the CPU, class ids 0..9.
  at::Tensor labels;
};

// Reads the training split (train-*-ubyte, 60000 samples) or the test split (t10k-*-ubyte, 10000
// samples) from dir: the gzip'd IDX files <name>.gz, or uncompressed files named without .gz.
// Throws dtrain::UsageError, naming the file, if a file is missing, has the wrong magic number or
// size, holds a label outside 0..9, or the image and label counts differ.
MnistSplit load_fashion_mnist(const std::string& dir = default_fashion_mnist_dir(),
                              bool train = true);

}  // namespace datasets
