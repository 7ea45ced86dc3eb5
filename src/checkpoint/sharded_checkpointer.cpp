// dtrain::ShardedCheckpointer: the collective save (every rank its file in parallel, then rank 0's
// metadata as the commit record), finding the newest complete checkpoint together, and the
// conversions to and from a full state (see dtrain/sharded_checkpoint.h).
#include <torch/torch.h>

#include <filesystem>
#include <random>
#include <set>

#include "checkpoint/checkpoint_file.h"
#include "checkpoint/sharded_format.h"
#include "checkpoint/state_parts.h"
#include "common/format.h"
#include "common/log.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/sharded_checkpoint.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using detail::RankFile;
using detail::SavedShards;
using detail::ShardedMetadata;

using detail::Ranks;

std::vector<detail::CheckpointFile> list_folders(const CheckpointOptions& options) {
  auto entries = detail::list_checkpoint_files(options.dir, options.prefix, /*suffix=*/"");
  std::vector<detail::CheckpointFile> folders;
  std::error_code error;
  for (auto& entry : entries)
    if (fs::is_directory(entry.path, error)) folders.push_back(std::move(entry));
  return folders;
}

void check_options(const CheckpointOptions& options) {
  // Checkpointer's constructor checks the fields both share; it starts no thread.
  Checkpointer check(options);
  if (options.async) {
    throw UsageError(
        "dtrain::ShardedCheckpointer: CheckpointOptions::async is not supported: sharded saves "
        "are synchronous (each rank writes only its 1/N of the state, all at once)");
  }
}

// After checkpoint `step` became complete: keeps the newest keep_last complete checkpoints up to
// it; deletes older folders, incomplete ones older than it (a save that crashed before its
// metadata: they can never complete), and in its own folder files of other world sizes and
// temporaries (every rank of this save has finished writing). Later folders are left alone, as
// prune_checkpoint_files leaves later files.
void prune(const CheckpointOptions& options, int64_t step, int64_t world_size) {
  auto folders = list_folders(options);
  std::vector<detail::CheckpointFile> complete;
  for (const auto& f : folders)
    if (f.step <= step && fs::exists(detail::sharded_metadata_file(f.path))) complete.push_back(f);
  const int64_t oldest_kept =
      complete.size() > static_cast<std::size_t>(options.keep_last)
          ? complete[complete.size() - static_cast<std::size_t>(options.keep_last)].step
          : (complete.empty() ? step : complete.front().step);
  for (const auto& f : folders) {
    const bool is_complete = fs::exists(detail::sharded_metadata_file(f.path));
    if (f.step < oldest_kept || (f.step < step && !is_complete)) {
      std::error_code error;
      fs::remove_all(f.path, error);
      if (error) {
        DTRAIN_LOG(kWarn, "sharded checkpoint: could not delete the old checkpoint "
                              << f.path << " (" << error.message() << "); it stays");
      }
    }
  }
  const std::string folder = detail::sharded_folder(options.dir, options.prefix, step);
  const std::string mine = "-of-" + std::to_string(world_size) + ".ckpt";
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    const std::string name = entry.path().filename().string();
    const bool other_world = name.rfind("rank-", 0) == 0 &&
                             (name.size() < mine.size() ||
                              name.compare(name.size() - mine.size(), mine.size(), mine) != 0);
    if (other_world || name[0] == '.') {
      std::error_code ignored;
      fs::remove(entry.path(), ignored);
    }
  }
}

// Tells two saves of the same step apart (Note [Sharded checkpoint]).
int64_t new_save_id() {
  std::random_device device;
  const uint64_t id = (uint64_t{device()} << 32) ^ device();
  return static_cast<int64_t>(id & ((uint64_t{1} << 62) - 1));
}

// The newest complete checkpoint of options.dir (Note [Sharded checkpoint]), found by all ranks of
// `ranks` together: rank 0 proposes folders newest first, every rank reads the metadata, the rank
// files are checked by the ranks in turn (file i by rank i mod size), and the ranks agree on the
// verdict. Damaged or missing files are warned about (by the rank that found them) and listed in
// *skipped on every rank.
std::unique_ptr<SavedShards> find_latest_complete(const CheckpointOptions& options,
                                                  const Ranks& ranks,
                                                  std::vector<std::string>* skipped) {
  std::vector<detail::CheckpointFile> folders;
  if (ranks.rank() == 0) folders = list_folders(options);
  auto candidate = folders.rbegin();
  while (true) {
    at::Tensor proposal = torch::tensor({int64_t{-1}});
    if (ranks.rank() == 0 && candidate != folders.rend()) proposal[0] = (candidate++)->step;
    ranks.broadcast(proposal);
    const int64_t step = proposal.item<int64_t>();
    if (step < 0) return nullptr;
    const std::string folder = detail::sharded_folder(options.dir, options.prefix, step);
    const std::string metadata_path = detail::sharded_metadata_file(folder);

    std::vector<char> payload;
    std::string why;
    ShardedMetadata metadata;
    bool ok = detail::read_checkpoint_file(metadata_path, &payload, &why);
    if (ok) {
      try {
        metadata = detail::decode_metadata(payload, metadata_path);
      } catch (const UsageError& e) {
        ok = false;
        why = e.what();
      }
    }
    at::Tensor metadata_bad = torch::tensor({int64_t{ok ? 0 : 1}});
    ranks.all_reduce(metadata_bad, ReduceOp::kMax);
    if (metadata_bad.item<int64_t>() != 0) {
      if (!ok) {
        DTRAIN_LOG(kWarn, "sharded checkpoint " << folder << " is skipped: its metadata "
                                                << metadata_path << " " << why
                                                << " (a save that did not finish leaves none); "
                                                   "trying the one before it");
      }
      skipped->push_back(metadata_path);
      continue;
    }
    auto saved = std::make_unique<SavedShards>(folder, metadata);
    at::Tensor bad = torch::zeros({metadata.world_size}, torch::kInt64);
    for (int64_t r = ranks.rank(); r < metadata.world_size; r += ranks.size()) {
      if (saved->check(r, &why)) continue;
      bad[r] = 1;
      DTRAIN_LOG(kWarn, "sharded checkpoint "
                            << folder << " is skipped: its rank file "
                            << detail::sharded_rank_file(folder, r, metadata.world_size)
                            << " is damaged or missing: " << why << "; trying the one before it");
    }
    ranks.all_reduce(bad);
    if (bad.sum().item<int64_t>() == 0) return saved;
    for (int64_t r = 0; r < metadata.world_size; ++r) {
      if (bad[r].item<int64_t>() != 0)
        skipped->push_back(detail::sharded_rank_file(folder, r, metadata.world_size));
    }
  }
}

// Refuses a saved rank's sampler position or RNG state that cannot be applied. Called before
// anything of the caller's state changes, so a refusal leaves the model, the optimizer, the sampler
// and the RNG as they were rather than half loaded.
template <typename State>
void check_extras(const RankFile& file, const std::string& path, const State& state) {
  if (state.sampler) {
    if (!file.has_sampler) {
      throw UsageError("sharded checkpoint " + path +
                       " holds no sampler position; it was saved without a sampler");
    }
    if (file.sampler.epoch < 0 || file.sampler.samples_consumed < 0 ||
        file.sampler.samples_consumed > state.sampler->dataset_size()) {
      throw UsageError("sharded checkpoint " + path +
                       ": its sampler position does not fit a "
                       "dataset of " +
                       std::to_string(state.sampler->dataset_size()) +
                       " samples; resume it with the dataset it was saved with");
    }
  }
  if (state.rng && file.rng.defined()) {
    try {
      detail::check_cpu_rng_state(file.rng);
    } catch (const c10::Error& e) {
      const std::string cause = e.what_without_backtrace();
      throw UsageError("sharded checkpoint " + path +
                       ": its RNG state is not a state of torch's CPU generator (" +
                       cause.substr(0, cause.find('\n')) +
                       "); load it with rng false, or move it aside to load the one before it");
    }
  }
}

// Sampler position, step, RNG and extras from one saved rank's file, checked by check_extras.
template <typename State>
void apply_extras(const RankFile& file, State& state) {
  if (state.sampler) state.sampler->load_state(file.sampler);
  if (state.rng && file.rng.defined()) detail::set_cpu_rng_state(file.rng);
  state.step = file.step;
  state.tensors = file.tensors;
  state.values = file.values;
}

}  // namespace

ShardedCheckpointer::ShardedCheckpointer(CheckpointOptions options,
                                         std::shared_ptr<ProcessGroup> group)
    : options_(std::move(options)), group_(std::move(group)) {
  check_options(options_);
}

std::vector<std::string> ShardedCheckpointer::list() const {
  std::vector<std::string> paths;
  for (const auto& folder : list_folders(options_)) paths.push_back(folder.path);
  return paths;
}

std::string ShardedCheckpointer::save(const ShardedTrainingState& state) {
  const Ranks ranks{group_.get()};
  const int rank = ranks.rank(), world = ranks.size();
  const auto kind = detail::optimizer_kind(state.optimizer, "ShardedTrainingState::optimizer");
  const int64_t units = static_cast<int64_t>(state.shards.size());

  // Rank 0's save id and step for everyone; the unit count must agree too.
  at::Tensor header = torch::tensor({int64_t{0}, state.step, units});
  if (rank == 0) header[0] = new_save_id();
  ranks.broadcast(header);
  if (header[1].item<int64_t>() != state.step || header[2].item<int64_t>() != units) {
    throw UsageError(ranks.who() + ": sharded checkpoint save: this rank saves step " +
                     std::to_string(state.step) + " with " + std::to_string(units) +
                     " flat shards, rank 0 step " + std::to_string(header[1].item<int64_t>()) +
                     " with " + std::to_string(header[2].item<int64_t>()) +
                     "; every rank must call save() with the same step and the same sharded model");
  }
  const std::string save_id = std::to_string(header[0].item<int64_t>());
  const std::string folder = detail::sharded_folder(options_.dir, options_.prefix, state.step);
  const std::string path = detail::sharded_rank_file(folder, rank, world);

  // Each rank writes its own file, all at once.
  std::string failure;
  try {
    RankFile file;
    file.save_id = save_id;
    file.rank = rank;
    file.world_size = world;
    file.step = state.step;
    for (const auto& shard : state.shards) {
      file.shards["param/" + shard.key] = shard.shard;
      if (!state.optimizer) continue;
      auto param_state = detail::get_param_state(*state.optimizer, kind, shard.shard);
      for (const auto& [field, tensor] : param_state.fields)
        file.shards[field + "/" + shard.key] = tensor.reshape(-1);
      if (param_state.present) file.steps[shard.key] = param_state.step;
    }
    if (state.sampler) {
      file.has_sampler = true;
      file.sampler = state.sampler->state();
    }
    if (state.rng) file.rng = detail::cpu_rng_state();
    file.tensors = state.tensors;
    file.values = state.values;
    detail::write_checkpoint_file(path, detail::encode_rank_file(file));
  } catch (const std::exception& e) {
    failure = e.what();
  }

  // Who failed, and every rank's range of every unit (for the metadata), in one all-reduce.
  at::Tensor report = torch::zeros({world + world * units * 2}, torch::kInt64);
  report[rank] = failure.empty() ? 0 : 1;
  for (int64_t u = 0; u < units; ++u) {
    report[world + (rank * units + u) * 2] = state.shards[u].offset;
    report[world + (rank * units + u) * 2 + 1] = state.shards[u].shard.numel();
  }
  ranks.all_reduce(report);
  std::vector<int> failed;
  for (int r = 0; r < world; ++r)
    if (report[r].item<int64_t>() != 0) failed.push_back(r);
  if (!failed.empty()) {
    std::string list;
    for (int r : failed) list += (list.empty() ? "" : ", ") + std::to_string(r);
    throw UsageError(ranks.who() + ": sharded checkpoint " + folder + " was not saved: rank(s) {" +
                     list + "} could not write their file" +
                     (failure.empty() ? " (see their log)" : ": " + failure) +
                     "; the previous checkpoints stay loadable");
  }

  // Rank 0 commits: the metadata, then pruning.
  at::Tensor committed = torch::tensor({int64_t{1}});
  if (rank == 0) {
    try {
      ShardedMetadata metadata;
      metadata.step = state.step;
      metadata.world_size = world;
      metadata.stage = state.stage;
      metadata.save_id = save_id;
      metadata.optimizer = kind;
      for (int64_t u = 0; u < units; ++u) {
        const FlatShard& shard = state.shards[u];
        detail::SavedUnit unit{shard.key,
                               shard.full_numel,
                               std::string(c10::toString(shard.shard.scalar_type())),
                               shard.params,
                               {}};
        for (int r = 0; r < world; ++r) {
          unit.ranges.emplace_back(report[world + (r * units + u) * 2].item<int64_t>(),
                                   report[world + (r * units + u) * 2 + 1].item<int64_t>());
        }
        metadata.units.push_back(std::move(unit));
      }
      detail::write_checkpoint_file(detail::sharded_metadata_file(folder),
                                    detail::encode_metadata(metadata));
      prune(options_, state.step, world);
    } catch (const std::exception& e) {
      failure = e.what();
      committed[0] = 0;
    }
  }
  ranks.broadcast(committed);
  if (committed.item<int64_t>() == 0) {
    throw UsageError(ranks.who() + ": sharded checkpoint " + folder +
                     " was not saved: rank 0 could not write its metadata" +
                     (failure.empty() ? " (see rank 0's log)" : ": " + failure) +
                     "; the previous checkpoints stay loadable");
  }
  DTRAIN_LOG(kDebug, "sharded checkpoint: saved " << folder);
  return folder;
}

std::optional<LoadedCheckpoint> ShardedCheckpointer::load_latest(ShardedTrainingState& state) {
  const Ranks ranks{group_.get()};
  LoadedCheckpoint loaded;
  auto saved = find_latest_complete(options_, ranks, &loaded.skipped);
  if (!saved) return std::nullopt;
  loaded.path = saved->describe().substr(std::string("sharded checkpoint ").size());
  // The RNG and extras of the saving rank of the same number; ranks beyond the saved world take
  // rank 0's (the sampler position is the same in all).
  const int64_t source = ranks.rank() < saved->metadata().world_size ? ranks.rank() : 0;
  check_extras(saved->file(source), loaded.path, state);
  detail::fill_shards(*saved, state.shards, state.optimizer);
  apply_extras(saved->file(source), state);
  loaded.step = state.step;
  return loaded;
}

std::optional<LoadedCheckpoint> load_sharded_as_full(const CheckpointOptions& options,
                                                     TrainingState& full) {
  check_options(options);
  LoadedCheckpoint loaded;
  auto saved = find_latest_complete(options, Ranks{nullptr}, &loaded.skipped);
  if (!saved) return std::nullopt;
  loaded.path = saved->describe().substr(std::string("sharded checkpoint ").size());
  check_extras(saved->file(0), loaded.path, full);
  if (full.model) {
    detail::fill_module(*saved, *full.model, full.optimizer);
  } else if (full.optimizer) {
    throw UsageError(
        "load_sharded_as_full: TrainingState::optimizer needs TrainingState::model "
        "(the optimizer's parameters are found by their names in the model)");
  }
  apply_extras(saved->file(0), full);
  loaded.step = full.step;
  return loaded;
}

void copy_full_into_shards(const TrainingState& full, ShardedTrainingState& sharded) {
  if (!full.model) {
    throw UsageError("copy_full_into_shards: TrainingState::model is null; pass the full model");
  }
  detail::FullState source(*full.model, full.optimizer);
  detail::fill_shards(source, sharded.shards, sharded.optimizer);
  if (sharded.sampler && full.sampler) sharded.sampler->load_state(full.sampler->state());
  sharded.step = full.step;
  sharded.tensors = full.tensors;
  sharded.values = full.values;
}

}  // namespace dtrain
