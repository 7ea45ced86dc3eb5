// dtrain's data layer: DistributedSampler, which splits a dataset's indices over the ranks as
// PyTorch's torch.utils.data.DistributedSampler does, plus a position that a checkpoint saves and a
// run at another world size resumes from. (The Fashion-MNIST reader of the main job and the
// examples is tools/datasets/, outside the library.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace dtrain {

class ProcessGroup;

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
// the same dataset_size and options. A torch::data sampler as well: give it to
// torch::data::make_data_loader as it is, and the loader's batches follow the position.
//
//   auto pg = dtrain::init_process_group();
//   auto dataset = MyDataset().map(torch::data::transforms::Stack<>());
//   dtrain::DistributedSampler sampler(dataset.size().value(), pg);
//   auto loader = torch::data::make_data_loader(dataset, sampler,
//                                               torch::data::DataLoaderOptions(32));  // per rank
//   for (int64_t epoch = sampler.epoch(); epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);  // keeps a position just loaded by load_state (see set_epoch)
//     for (auto& batch : *loader) { ...one step...; checkpoint sampler.state() when you like }
//   }
//
// Batch sizes are per rank, as in PyTorch: DataLoaderOptions::batch_size and the batch_size of
// next() are this rank's share of a step, and one step of all ranks consumes world_size times as
// many samples (the global batch). The position (state(), advance()) counts samples of all ranks
// together.
//
// A DistributedSampler is a handle, as a torch::Tensor is: copies (and moves, which copy) share one
// sampler. make_data_loader keeps a copy, so set_epoch() and state() on the sampler the program
// holds act on the loader's sampler too.
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
// Resuming: the position moves as next() hands out batches (the loader's path), or by advance(W *
// the count this rank took) after every step (a loop over indices(); an epoch's last step may take
// fewer than the per-rank batch, the same fewer on every rank); a checkpoint stores state().
// Loading that state, at this or any other world size, makes indices() and next() return the
// remaining positions [samples_consumed, dataset_size) of the epoch order, interleaved
// over THIS sampler's world size and then padded (by repeating the remainder from its start) or cut
// per drop_last. Without drop_last every sample of the epoch is therefore seen exactly once across
// the old and new runs, plus padding duplicates at the end. state() clamps samples_consumed to
// dataset_size: padding sits only at the end of the order, so a count beyond dataset_size means
// every real sample is consumed, and the old world size's padding never reaches the new run.
//
// Not thread-safe: each rank owns its sampler, and LibTorch's loader calls it from the thread that
// iterates the loader only.
class DistributedSampler {
 public:
  // What next() returns: the indices that a torch::data dataset's get_batch takes.
  using BatchRequestType = std::vector<size_t>;

  // Throws UsageError unless dataset_size >= 1, world_size >= 1 and 0 <= rank < world_size.
  DistributedSampler(int64_t dataset_size, int world_size, int rank,
                     DistributedSamplerOptions options = {});
  // Takes rank and world size from `group`: the job's group from init_process_group(), or the data
  // group of a RankMesh where ranks also split the model. Throws UsageError if group is null.
  DistributedSampler(int64_t dataset_size, const std::shared_ptr<ProcessGroup>& group,
                     DistributedSamplerOptions options = {});
  // Copies share the sampler; a move copies too, so the source stays usable.
  DistributedSampler(const DistributedSampler&) = default;
  DistributedSampler& operator=(const DistributedSampler&) = default;
  ~DistributedSampler();

  // Starts epoch `epoch` (>= 0) from its beginning: samples_consumed goes back to 0. Except after a
  // resume: set_epoch with the epoch that load_state loaded keeps the loaded position, until a
  // sample is consumed or another epoch is set. So a resumed program that calls set_epoch(epoch) at
  // the top of every epoch, as PyTorch programs do, continues where the checkpoint stood instead of
  // replaying the epoch; every later set_epoch, the resumed epoch's included, starts at 0.
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  // This rank's indices of the current epoch that have not yet been consumed, in the order to visit
  // them. The epoch's permutation is drawn once per epoch and kept.
  std::vector<int64_t> indices() const;
  // The length of indices(), computed without drawing the permutation. At the start of an epoch it
  // equals len(sampler) in Python.
  int64_t num_samples() const;
  // The number of samples all ranks together have left in this epoch, padding included (a multiple
  // of world_size once every rank has taken the same number). At the start of an epoch it equals
  // Python's sampler.total_size.
  int64_t total_size() const;

  // Records that all ranks together consumed global_samples more samples of this epoch: world_size
  // times the count each rank took in the step, which an epoch's short last step makes less than
  // the per-rank batch (not clamped as next() is: more than is left is a miscount or a missing
  // set_epoch). Throws UsageError if global_samples is negative or more than total_size().
  void advance(int64_t global_samples);

  // Deals the rest of this epoch over another world size, keeping state(): indices() and next()
  // return this rank's share of the positions [samples_consumed, dataset_size) of the epoch order,
  // as after load_state(state()) in a sampler built with world_size and rank (so set_epoch with the
  // current epoch keeps the position). In-place recovery (dtrain/recovery.h) calls it when the
  // group shrinks or grows mid-epoch; every copy of the sampler sees the new split. Throws
  // UsageError unless world_size >= 1 and 0 <= rank < world_size.
  void reshard(int world_size, int rank);

  SamplerState state() const;
  // Moves to state.epoch with state.samples_consumed samples of its order consumed. The state may
  // come from a run with another world size (see the class comment); set_epoch(state.epoch) keeps
  // it (see set_epoch). Throws UsageError if the epoch is negative or samples_consumed is outside
  // 0..dataset_size.
  void load_state(const SamplerState& state);

  // The torch::data::samplers::Sampler interface, which torch::data's loaders call (declared here
  // without deriving from it, so that this header needs no LibTorch include).
  //
  // Called by the loader when a pass over it begins (loader->begin()). Keeps the position, so a
  // loader started after load_state continues from the checkpoint; except that a pass next() has
  // run to its end starts the same epoch again from 0 (with a warning: call set_epoch at the top of
  // every epoch), as Python's sampler repeats its order when iterated again without set_epoch.
  // Throws UsageError if new_size is given and differs from dataset_size.
  void reset(std::optional<size_t> new_size = std::nullopt);
  // The next up to batch_size (>= 1; per rank) of this rank's indices, or nullopt when this epoch
  // has none left. Moves the position by world_size times the count, as advance() does: a
  // checkpoint taken after a batch resumes with the batch after it. With DataLoaderOptions::workers
  // > 0 the loader asks for batches ahead of the one it hands out (max_jobs of them, 2 * workers by
  // default), so the position runs ahead by those and a checkpoint skips them on resume: keep
  // workers at 0 (the default) where a resume must be exact.
  std::optional<BatchRequestType> next(size_t batch_size);
  // state() to and from a LibTorch archive (int64 entries "epoch" and "samples_consumed"); with the
  // operators below, torch::save(sampler, path) and torch::load(sampler, path) work too. load()
  // throws UsageError if an entry is missing, and as load_state otherwise.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  int64_t dataset_size() const;
  int world_size() const;
  int rank() const;
  const DistributedSamplerOptions& options() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const DistributedSampler& sampler);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           DistributedSampler& sampler);

}  // namespace dtrain
