// DistributedSampler: PyTorch's per-rank split of a dataset's indices, with a resumable position,
// usable as a torch::data sampler (include/dtrain/data.h has the contract).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <sstream>

#include "common/log.h"
#include "dtrain/comm.h"
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

std::string rank_of(int rank, int world_size) {
  return "rank " + std::to_string(rank) + "/" + std::to_string(world_size);
}

}  // namespace

// The state every copy of a DistributedSampler shares. The current pass runs over epoch order
// positions [pass_start, dataset_size), padded or cut to pass_length(); pass_consumed of its
// entries are consumed. A pass starts at set_epoch (at 0) and at load_state (at the loaded
// position).
struct DistributedSampler::Impl {
  Impl(int64_t dataset_size, int world_size, int rank, DistributedSamplerOptions options)
      : dataset_size(dataset_size), world_size(world_size), rank(rank), options(options) {}

  int64_t dataset_size;
  int world_size;
  int rank;
  DistributedSamplerOptions options;
  int64_t epoch = 0;
  int64_t pass_start = 0;
  int64_t pass_consumed = 0;
  // Set by load_state; while set, set_epoch(epoch) keeps the loaded position (see set_epoch in
  // data.h). Cleared once a sample is consumed or another epoch is set.
  bool resumed = false;
  bool warned_repeat = false;
  // The epoch order of order_epoch (-1: none drawn yet), drawn once per epoch for next() and
  // indices() instead of once per call.
  std::vector<int64_t> order;
  int64_t order_epoch = -1;

  // The pass covers the m = dataset_size - pass_start remaining entries of the epoch order; without
  // drop_last it is padded up to a multiple of the world size, with drop_last cut down to one.
  int64_t pass_length() const {
    const int64_t m = dataset_size - pass_start;
    const int64_t w = world_size;
    return options.drop_last ? (m / w) * w : (m + w - 1) / w * w;
  }

  // How many pass positions q in [pass_position, pass_length) belong to this rank (q % W == rank):
  // below(x) counts this rank's positions in [0, x).
  int64_t rank_count_from(int64_t pass_position) const {
    const int64_t w = world_size;
    auto below = [&](int64_t x) { return x / w + (x % w > rank ? 1 : 0); };
    return below(pass_length()) - below(pass_position);
  }

  // This rank's first pass position at or after pass_consumed.
  int64_t first_position() const {
    const int64_t w = world_size;
    return pass_consumed + ((rank - pass_consumed % w) % w + w) % w;
  }

  // The epoch order entry at pass position q: positions at or past m are the padding, which repeats
  // the remainder from its start as Python's `indices += indices * k` does.
  int64_t at_position(int64_t q) const {
    return order[pass_start + q % (dataset_size - pass_start)];
  }

  void draw_order() {
    if (order_epoch == epoch) return;
    order = epoch_order(dataset_size, options, epoch);
    order_epoch = epoch;
  }

  void start_epoch(int64_t e) {
    epoch = e;
    pass_start = 0;
    pass_consumed = 0;
  }
};

DistributedSampler::DistributedSampler(int64_t dataset_size, int world_size, int rank,
                                       DistributedSamplerOptions options) {
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
  impl_ = std::make_shared<Impl>(dataset_size, world_size, rank, options);
}

namespace {
const std::shared_ptr<ProcessGroup>& non_null(const std::shared_ptr<ProcessGroup>& group) {
  if (!group) {
    throw UsageError(
        "DistributedSampler: group is null; pass the group from dtrain::init_process_group() (or "
        "a RankMesh's data_group), or give world_size and rank.");
  }
  return group;
}
}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size,
                                       const std::shared_ptr<ProcessGroup>& group,
                                       DistributedSamplerOptions options)
    : DistributedSampler(dataset_size, non_null(group)->size(), non_null(group)->rank(), options) {}

DistributedSampler::~DistributedSampler() = default;

void DistributedSampler::set_epoch(int64_t epoch) {
  Impl& s = *impl_;
  if (epoch < 0) {
    throw UsageError(rank_of(s.rank, s.world_size) + ": DistributedSampler::set_epoch: epoch is " +
                     std::to_string(epoch) + "; accepted: epoch >= 0.");
  }
  // Note [set_epoch after a resume]: a PyTorch program calls set_epoch(epoch) at the top of every
  // epoch, the one it resumes in included; restarting that epoch at 0 would replay what the
  // checkpoint already trained on. So the loaded position stands for the loaded epoch until the
  // program consumes a sample or moves to another epoch.
  if (s.resumed && epoch == s.epoch) return;
  s.resumed = false;
  s.start_epoch(epoch);
}

int64_t DistributedSampler::epoch() const { return impl_->epoch; }

std::vector<int64_t> DistributedSampler::indices() const {
  Impl& s = *impl_;
  std::vector<int64_t> result;
  const int64_t length = s.pass_length();
  if (s.pass_consumed >= length) return result;
  result.reserve(static_cast<size_t>(num_samples()));
  s.draw_order();
  for (int64_t q = s.first_position(); q < length; q += s.world_size) {
    result.push_back(s.at_position(q));
  }
  return result;
}

int64_t DistributedSampler::num_samples() const {
  return impl_->rank_count_from(impl_->pass_consumed);
}

int64_t DistributedSampler::total_size() const {
  return impl_->pass_length() - impl_->pass_consumed;
}

void DistributedSampler::advance(int64_t global_samples) {
  Impl& s = *impl_;
  if (global_samples < 0 || global_samples > total_size()) {
    std::ostringstream message;
    message << rank_of(s.rank, s.world_size) << ": DistributedSampler::advance: global_samples is "
            << global_samples << " but epoch " << s.epoch << " has " << total_size()
            << " samples left over all ranks; accepted: 0.." << total_size()
            << ". Pass the samples consumed by all ranks in this step, and call set_epoch at the "
               "start of each epoch.";
    throw UsageError(message.str());
  }
  s.pass_consumed += global_samples;
  if (global_samples > 0) s.resumed = false;
}

void DistributedSampler::reshard(int world_size, int rank) {
  Impl& s = *impl_;
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError(rank_of(s.rank, s.world_size) + ": DistributedSampler::reshard: rank " +
                     std::to_string(rank) + " of world size " + std::to_string(world_size) +
                     "; accepted: world_size >= 1 and 0 <= rank < world_size.");
  }
  const SamplerState position = state();
  s.world_size = world_size;
  s.rank = rank;
  s.epoch = position.epoch;
  s.pass_start = position.samples_consumed;
  s.pass_consumed = 0;
  s.resumed = true;
}

SamplerState DistributedSampler::state() const {
  // Past dataset_size the pass has only consumed padding, which the next run must not replay.
  const Impl& s = *impl_;
  return SamplerState{s.epoch, std::min(s.pass_start + s.pass_consumed, s.dataset_size)};
}

void DistributedSampler::load_state(const SamplerState& state) {
  Impl& s = *impl_;
  if (state.epoch < 0 || state.samples_consumed < 0 || state.samples_consumed > s.dataset_size) {
    std::ostringstream message;
    message << rank_of(s.rank, s.world_size) << ": DistributedSampler::load_state: state is {epoch "
            << state.epoch << ", samples_consumed " << state.samples_consumed
            << "}; accepted: epoch >= 0 and "
            << "0 <= samples_consumed <= dataset_size (" << s.dataset_size
            << "). Likely cause: the checkpoint was written for another dataset.";
    throw UsageError(message.str());
  }
  s.epoch = state.epoch;
  s.pass_start = state.samples_consumed;
  s.pass_consumed = 0;
  s.resumed = true;
}

void DistributedSampler::reset(std::optional<size_t> new_size) {
  Impl& s = *impl_;
  if (new_size && static_cast<int64_t>(*new_size) != s.dataset_size) {
    throw UsageError(rank_of(s.rank, s.world_size) + ": DistributedSampler::reset: new_size is " +
                     std::to_string(*new_size) + " but the sampler was built for dataset_size " +
                     std::to_string(s.dataset_size) +
                     "; a DistributedSampler's dataset size is fixed: build a new sampler for "
                     "another dataset.");
  }
  // A pass that next() (or advance()) ran to its end, iterated again: the same epoch from 0, as
  // Python repeats the order. A pass loaded at its end (pass_consumed 0) stays empty: that epoch is
  // done, and the program's next set_epoch moves on.
  if (s.pass_consumed > 0 && s.pass_consumed >= s.pass_length()) {
    if (!s.warned_repeat) {
      s.warned_repeat = true;
      DTRAIN_LOG(kWarn, "DistributedSampler: epoch "
                            << s.epoch
                            << " is iterated again after it ended, in the same order; call "
                               "sampler.set_epoch(epoch) at the start of every epoch for a new "
                               "order (as with PyTorch's DistributedSampler).");
    }
    s.start_epoch(s.epoch);
  }
  s.draw_order();
}

std::optional<DistributedSampler::BatchRequestType> DistributedSampler::next(size_t batch_size) {
  Impl& s = *impl_;
  if (batch_size == 0) {
    throw UsageError(rank_of(s.rank, s.world_size) +
                     ": DistributedSampler::next: batch_size is 0; accepted: >= 1 (this rank's "
                     "batch, DataLoaderOptions::batch_size).");
  }
  const int64_t count = std::min(static_cast<int64_t>(batch_size), num_samples());
  if (count <= 0) return std::nullopt;
  s.draw_order();
  BatchRequestType batch;
  batch.reserve(static_cast<size_t>(count));
  const int64_t first = s.first_position();
  for (int64_t i = 0; i < count; ++i) {
    batch.push_back(static_cast<size_t>(s.at_position(first + i * s.world_size)));
  }
  // Every rank took `count`, so all together took count * W positions of the pass. (min: only a
  // position advance() left unaligned to W could overshoot the pass end.)
  s.pass_consumed = std::min(s.pass_consumed + count * s.world_size, s.pass_length());
  s.resumed = false;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  const SamplerState position = state();
  archive.write("epoch", at::scalar_tensor(position.epoch, at::kLong), /*is_buffer=*/true);
  archive.write("samples_consumed", at::scalar_tensor(position.samples_consumed, at::kLong),
                /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  SamplerState loaded;
  for (auto [key, value] : {std::pair<const char*, int64_t*>{"epoch", &loaded.epoch},
                            {"samples_consumed", &loaded.samples_consumed}}) {
    at::Tensor tensor;
    if (!archive.try_read(key, tensor, /*is_buffer=*/true) || tensor.numel() != 1) {
      throw UsageError(rank_of(impl_->rank, impl_->world_size) +
                       ": DistributedSampler::load: the archive has no int64 '" + key +
                       "'; expected one written by DistributedSampler::save (or torch::save of a "
                       "DistributedSampler).");
    }
    *value = tensor.item<int64_t>();
  }
  load_state(loaded);
}

int64_t DistributedSampler::dataset_size() const { return impl_->dataset_size; }
int DistributedSampler::world_size() const { return impl_->world_size; }
int DistributedSampler::rank() const { return impl_->rank; }
const DistributedSamplerOptions& DistributedSampler::options() const { return impl_->options; }

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const DistributedSampler& sampler) {
  sampler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           DistributedSampler& sampler) {
  sampler.load(archive);
  return archive;
}

}  // namespace dtrain
