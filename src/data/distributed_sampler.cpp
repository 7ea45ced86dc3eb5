// DistributedSampler: PyTorch's per-rank split of a dataset's indices, with a resumable position
// (include/dtrain/data.h has the contract).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randperm.h>

#include <algorithm>
#include <sstream>

#include "dtrain/data.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

// The epoch order: the permutation Python's sampler draws for this epoch, or the identity.
std::vector<int64_t> epoch_order(int64_t dataset_size, const DistributedSamplerOptions& options,
                                 int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size));
  if (!options.shuffle) {
    for (int64_t i = 0; i < dataset_size; ++i) order[i] = i;
    return order;
  }
  // Python's sampler seeds with seed + epoch (an unbounded int); uint64 arithmetic wraps only past
  // 2^64, where manual_seed would refuse the value anyway.
  at::Generator generator =
      at::detail::createCPUGenerator(options.seed + static_cast<uint64_t>(epoch));
  at::Tensor permutation = at::randperm(dataset_size, generator, at::kLong);
  const int64_t* data = permutation.data_ptr<int64_t>();
  std::copy(data, data + dataset_size, order.begin());
  return order;
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, int world_size, int rank,
                                       DistributedSamplerOptions options)
    : dataset_size_(dataset_size), world_size_(world_size), rank_(rank), options_(options) {
  if (dataset_size < 1) {
    throw UsageError(
        "DistributedSampler: dataset_size is " + std::to_string(dataset_size) +
        "; accepted: dataset_size >= 1. An empty dataset usually means the data was not "
        "found or failed to load.");
  }
  if (world_size < 1) {
    throw UsageError("DistributedSampler: world_size is " + std::to_string(world_size) +
                     "; accepted: world_size >= 1 (the number of ranks, WORLD_SIZE).");
  }
  if (rank < 0 || rank >= world_size) {
    throw UsageError("DistributedSampler: rank is " + std::to_string(rank) + " with world_size " +
                     std::to_string(world_size) + "; accepted: 0 <= rank < world_size (0.." +
                     std::to_string(world_size - 1) + ").");
  }
}

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch < 0) {
    throw UsageError("rank " + std::to_string(rank_) + "/" + std::to_string(world_size_) +
                     ": DistributedSampler::set_epoch: epoch is " + std::to_string(epoch) +
                     "; accepted: epoch >= 0.");
  }
  epoch_ = epoch;
  pass_start_ = 0;
  pass_consumed_ = 0;
}

// The pass covers the m = dataset_size - pass_start remaining entries of the epoch order; without
// drop_last it is padded up to a multiple of the world size, with drop_last cut down to one.
int64_t DistributedSampler::pass_length() const {
  const int64_t m = dataset_size_ - pass_start_;
  const int64_t w = world_size_;
  return options_.drop_last ? (m / w) * w : (m + w - 1) / w * w;
}

// How many pass positions q in [pass_position, pass_length) belong to this rank (q % W == rank):
// below(x) counts this rank's positions in [0, x).
int64_t DistributedSampler::rank_count_from(int64_t pass_position) const {
  const int64_t w = world_size_;
  auto below = [&](int64_t x) { return x / w + (x % w > rank_ ? 1 : 0); };
  return below(pass_length()) - below(pass_position);
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> result;
  const int64_t length = pass_length();
  if (pass_consumed_ >= length) return result;
  result.reserve(static_cast<size_t>(num_samples()));
  const std::vector<int64_t> order = epoch_order(dataset_size_, options_, epoch_);
  // Pass position q holds order[pass_start + q % m]: positions at or past m are the padding, which
  // repeats the remainder from its start as Python's `indices += indices * k` does.
  const int64_t m = dataset_size_ - pass_start_;
  const int64_t w = world_size_;
  int64_t first = pass_consumed_ + ((rank_ - pass_consumed_ % w) % w + w) % w;
  for (int64_t q = first; q < length; q += w) result.push_back(order[pass_start_ + q % m]);
  return result;
}

int64_t DistributedSampler::num_samples() const { return rank_count_from(pass_consumed_); }

int64_t DistributedSampler::total_size() const { return pass_length() - pass_consumed_; }

void DistributedSampler::advance(int64_t global_samples) {
  if (global_samples < 0 || global_samples > total_size()) {
    std::ostringstream message;
    message << "rank " << rank_ << "/" << world_size_
            << ": DistributedSampler::advance: global_samples is " << global_samples
            << " but epoch " << epoch_ << " has " << total_size()
            << " samples left over all ranks; accepted: 0.." << total_size()
            << ". Pass the samples consumed by all ranks in this step, and call set_epoch at the "
               "start of "
               "each epoch.";
    throw UsageError(message.str());
  }
  pass_consumed_ += global_samples;
}

SamplerState DistributedSampler::state() const {
  // Past dataset_size the pass has only consumed padding, which the next run must not replay.
  return SamplerState{epoch_, std::min(pass_start_ + pass_consumed_, dataset_size_)};
}

void DistributedSampler::load_state(const SamplerState& state) {
  if (state.epoch < 0 || state.samples_consumed < 0 || state.samples_consumed > dataset_size_) {
    std::ostringstream message;
    message << "rank " << rank_ << "/" << world_size_
            << ": DistributedSampler::load_state: state is {epoch " << state.epoch
            << ", samples_consumed " << state.samples_consumed << "}; accepted: epoch >= 0 and "
            << "0 <= samples_consumed <= dataset_size (" << dataset_size_
            << "). Likely cause: the checkpoint was written for another dataset.";
    throw UsageError(message.str());
  }
  epoch_ = state.epoch;
  pass_start_ = state.samples_consumed;
  pass_consumed_ = 0;
}

}  // namespace dtrain
