// dtrain's data layer: DistributedSampler, which splits a dataset's indices over the ranks as
// PyTorch's torch.utils.data.DistributedSampler does, plus a position that a checkpoint saves and a
// run at another world size resumes from; and a reader for the Fashion-MNIST IDX files.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

struct DistributedSamplerOptions {
  // Visit the dataset in a fresh random order every epoch (randperm seeded with seed + epoch).
  bool shuffle = true;
  // Base seed; every rank must pass the same one so that all ranks agree on the epoch order.
  uint64_t seed = 0;
  // Cut the tail that does not divide by the world size instead of padding with repeats.
  bool drop_last = false;
};

// Where an epoch stands, as a checkpoint stores it. samples_consumed counts the samples consumed by
// ALL ranks together in this epoch; they are always a prefix of the epoch order, which does not
// depend on the world size.
struct SamplerState {
  int64_t epoch = 0;
  int64_t samples_consumed = 0;
};

// Splits the indices 0..dataset_size-1 over world_size ranks; one instance per rank, all built with
// the same dataset_size and options.
//
// Epoch order: with shuffle, at::randperm(dataset_size) from a CPU generator seeded with
// seed + epoch, the permutation Python's sampler draws:
//   g = torch.Generator(); g.manual_seed(seed + epoch); torch.randperm(n, generator=g)
// Without shuffle, 0..dataset_size-1. Without drop_last the order is padded by repeating it from
// its start up to a multiple of world_size; with drop_last it is cut down to one. Rank r takes the
// positions r, r + W, r + 2W, ... (interleaved), so for a fresh epoch indices() is exactly what
// iterating Python's DistributedSampler yields, and after every rank has taken k samples the
// samples consumed are the first k * W entries of the epoch order.
//
// Resuming: the trainer calls advance(W * per-rank batch) after every step and checkpoints state().
// Loading that state, at this or any other world size, makes indices() return the remaining
// positions [samples_consumed, dataset_size) of the epoch order, interleaved over THIS sampler's
// world size and then padded (by repeating the remainder from its start) or cut per drop_last.
// Without drop_last every sample of the epoch is therefore seen exactly once across the old and new
// runs, plus padding duplicates at the end. state() clamps samples_consumed to dataset_size:
// padding sits only at the end of the order, so a count beyond dataset_size means every real sample
// is consumed, and the old world size's padding never reaches the new run.
//
// Not thread-safe: each rank owns its sampler.
class DistributedSampler {
 public:
  // Throws UsageError unless dataset_size >= 1, world_size >= 1 and 0 <= rank < world_size.
  DistributedSampler(int64_t dataset_size, int world_size, int rank,
                     DistributedSamplerOptions options = {});

  // Starts epoch `epoch` (>= 0) from its beginning: samples_consumed goes back to 0.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  // This rank's indices of the current epoch that advance() has not yet consumed, in the order to
  // visit them. Draws the epoch's permutation on every call: call it once per epoch, not once per
  // step.
  std::vector<int64_t> indices() const;
  // The length of indices(), computed without drawing the permutation. At the start of an epoch it
  // equals len(sampler) in Python.
  int64_t num_samples() const;
  // The number of samples all ranks together have left in this epoch, padding included (a multiple
  // of world_size once every rank has taken the same number). At the start of an epoch it equals
  // Python's sampler.total_size.
  int64_t total_size() const;

  // Records that all ranks together consumed global_samples more samples of this epoch (usually
  // world_size times the per-rank batch size). Throws UsageError if global_samples is negative or
  // more than total_size().
  void advance(int64_t global_samples);

  SamplerState state() const;
  // Moves to state.epoch with state.samples_consumed samples of its order consumed. The state may
  // come from a run with another world size (see the class comment). Throws UsageError if the epoch
  // is negative or samples_consumed is outside 0..dataset_size.
  void load_state(const SamplerState& state);

  int64_t dataset_size() const { return dataset_size_; }
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  // The current pass runs over epoch order positions [pass_start_, dataset_size_), padded or cut to
  // pass_length(); pass_consumed_ of its entries are consumed. A pass starts at set_epoch (at 0)
  // and at load_state (at the loaded position).
  int64_t pass_length() const;
  int64_t rank_count_from(int64_t pass_position) const;

  int64_t dataset_size_;
  int world_size_;
  int rank_;
  DistributedSamplerOptions options_;
  int64_t epoch_ = 0;
  int64_t pass_start_ = 0;
  int64_t pass_consumed_ = 0;
};

// Fashion-MNIST as Debian's dataset-fashion-mnist package installs it.
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// Where programs look for Fashion-MNIST unless told otherwise: $DTRAIN_FASHION_MNIST_DIR when set (a
// machine without Debian's package, e.g. one with a pip LibTorch and the files copied in), else
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
// Throws UsageError, naming the file, if a file is missing, has the wrong magic number or size,
// holds a label outside 0..9, or the image and label counts differ.
MnistSplit load_fashion_mnist(const std::string& dir = default_fashion_mnist_dir(), bool train = true);

}  // namespace dtrain
