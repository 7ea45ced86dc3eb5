// Internals of sharded checkpoints: names, metadata, rank files, optimizer state of one parameter,
// and resharding (see sharded_format.h).
#include "checkpoint/sharded_format.h"

#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/checkpoint_file.h"
#include "checkpoint/state_parts.h"
#include "common/compat.h"
#include "common/log.h"
#include "dtrain/errors.h"

namespace dtrain::detail {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Bumped when the layout of the metadata or of a rank file changes incompatibly.
constexpr int64_t kShardedFormat = 1;

}  // namespace

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << at::IntArrayRef(shape);
  return out.str();
}

std::string sharded_folder(const std::string& dir, const std::string& prefix, int64_t step) {
  return (fs::path(dir) / (prefix + "-" + std::to_string(step))).string();
}

std::string sharded_rank_file(const std::string& folder, int64_t rank, int64_t world_size) {
  return (fs::path(folder) /
          ("rank-" + std::to_string(rank) + "-of-" + std::to_string(world_size) + ".ckpt"))
      .string();
}

std::string sharded_metadata_file(const std::string& folder) {
  return (fs::path(folder) / "metadata.ckpt").string();
}

OptimizerKind optimizer_kind(const torch::optim::Optimizer* optimizer, const std::string& who) {
  if (optimizer == nullptr) return OptimizerKind::kNone;
  // AdamW before Adam: neither derives from the other in LibTorch, but keep the order obvious.
  if (dynamic_cast<const torch::optim::AdamW*>(optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<const torch::optim::SGD*>(optimizer)) return OptimizerKind::kSgd;
  throw UsageError(who +
                   ": sharded checkpoints save the state of SGD, Adam and AdamW optimizers only; "
                   "this optimizer is of another type (its state cannot be cut into shards). Use "
                   "one of those, or leave ShardedTrainingState::optimizer null and rebuild its "
                   "state after loading");
}

std::string optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kNone:
      break;
  }
  return "none";
}

std::vector<std::string> optimizer_fields(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return {"momentum_buffer"};
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    case OptimizerKind::kNone:
      break;
  }
  return {};
}

namespace {

template <typename State>
void get_adam(const torch::optim::OptimizerParamState& base, ParamOptimizerState* out) {
  const auto& s = static_cast<const State&>(base);
  out->step = s.step();
  if (s.exp_avg().defined()) out->fields["exp_avg"] = s.exp_avg();
  if (s.exp_avg_sq().defined()) out->fields["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out->fields["max_exp_avg_sq"] = s.max_exp_avg_sq();
}

template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam(const ParamOptimizerState& in) {
  auto s = std::make_unique<State>();
  s->step(in.step);
  auto field = [&](const char* name) {
    auto it = in.fields.find(name);
    return it == in.fields.end() ? at::Tensor() : it->second;
  };
  s->exp_avg(field("exp_avg"));
  s->exp_avg_sq(field("exp_avg_sq"));
  s->max_exp_avg_sq(field("max_exp_avg_sq"));
  return s;
}

}  // namespace

ParamOptimizerState get_param_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                                    const at::Tensor& param) {
  ParamOptimizerState out;
  auto it = optimizer.state().find(compat::optimizer_state_key(param));
  if (it == optimizer.state().end()) return out;
  switch (kind) {
    case OptimizerKind::kSgd: {
      auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
      if (s.momentum_buffer().defined()) out.fields["momentum_buffer"] = s.momentum_buffer();
      break;
    }
    case OptimizerKind::kAdam:
      get_adam<torch::optim::AdamParamState>(*it->second, &out);
      break;
    case OptimizerKind::kAdamW:
      get_adam<torch::optim::AdamWParamState>(*it->second, &out);
      break;
    case OptimizerKind::kNone:
      break;
  }
  out.present = !out.fields.empty();
  return out;
}

void set_param_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                     const at::Tensor& param, const ParamOptimizerState& state) {
  const auto key = compat::optimizer_state_key(param);
  if (!state.present) {
    optimizer.state().erase(key);
    return;
  }
  switch (kind) {
    case OptimizerKind::kSgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(state.fields.at("momentum_buffer"));
      optimizer.state()[key] = std::move(s);
      break;
    }
    case OptimizerKind::kAdam:
      optimizer.state()[key] = make_adam<torch::optim::AdamParamState>(state);
      break;
    case OptimizerKind::kAdamW:
      optimizer.state()[key] = make_adam<torch::optim::AdamWParamState>(state);
      break;
    case OptimizerKind::kNone:
      break;
  }
}

std::vector<char> encode_metadata(const ShardedMetadata& metadata) {
  json units = json::array();
  for (const auto& unit : metadata.units) {
    json params = json::array();
    for (const auto& p : unit.params)
      params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
    json ranges = json::array();
    for (const auto& [offset, numel] : unit.ranges)
      ranges.push_back({{"offset", offset}, {"numel", numel}});
    units.push_back({{"key", unit.key},
                     {"full_numel", unit.full_numel},
                     {"dtype", unit.dtype},
                     {"params", params},
                     {"ranks", ranges}});
  }
  json root = {{"format", kShardedFormat},
               {"kind", "dtrain sharded checkpoint"},
               {"step", metadata.step},
               {"world_size", metadata.world_size},
               {"stage", metadata.stage},
               {"save_id", metadata.save_id},
               {"optimizer", optimizer_kind_name(metadata.optimizer)},
               {"units", units}};
  std::string text = root.dump(1);
  return std::vector<char>(text.begin(), text.end());
}

ShardedMetadata decode_metadata(const std::vector<char>& payload, const std::string& path) {
  ShardedMetadata metadata;
  try {
    json root = json::parse(payload.begin(), payload.end());
    if (root.at("format").get<int64_t>() != kShardedFormat) {
      throw UsageError("sharded checkpoint " + path + " is in format " + root.at("format").dump() +
                       ", this dtrain reads format " + std::to_string(kShardedFormat) +
                       "; load it with the dtrain that wrote it");
    }
    metadata.step = root.at("step").get<int64_t>();
    metadata.world_size = root.at("world_size").get<int64_t>();
    metadata.stage = root.at("stage").get<int64_t>();
    metadata.save_id = root.at("save_id").get<std::string>();
    const std::string optimizer = root.at("optimizer").get<std::string>();
    metadata.optimizer = OptimizerKind::kNone;
    for (auto kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
      if (optimizer == optimizer_kind_name(kind)) metadata.optimizer = kind;
    }
    for (const auto& u : root.at("units")) {
      SavedUnit unit;
      unit.key = u.at("key").get<std::string>();
      unit.full_numel = u.at("full_numel").get<int64_t>();
      unit.dtype = u.at("dtype").get<std::string>();
      for (const auto& p : u.at("params")) {
        unit.params.push_back({p.at("name").get<std::string>(),
                               p.at("shape").get<std::vector<int64_t>>(),
                               p.at("offset").get<int64_t>()});
      }
      for (const auto& r : u.at("ranks"))
        unit.ranges.emplace_back(r.at("offset").get<int64_t>(), r.at("numel").get<int64_t>());
      if (static_cast<int64_t>(unit.ranges.size()) != metadata.world_size) {
        throw UsageError("sharded checkpoint " + path + ": unit '" + unit.key + "' lists " +
                         std::to_string(unit.ranges.size()) + " rank ranges for world size " +
                         std::to_string(metadata.world_size));
      }
      metadata.units.push_back(std::move(unit));
    }
  } catch (const json::exception& e) {
    throw UsageError("sharded checkpoint " + path +
                     ": its checksum holds but it is not a sharded checkpoint's metadata (" +
                     e.what() + "); move the folder aside to resume from an older one");
  }
  return metadata;
}

namespace {

template <typename Value>
c10::Dict<std::string, Value> to_dict(const std::map<std::string, Value>& map) {
  c10::Dict<std::string, Value> dict;
  for (const auto& [key, value] : map) dict.insert(key, value);
  return dict;
}

template <typename Value>
std::map<std::string, Value> from_dict(const c10::IValue& value) {
  std::map<std::string, Value> map;
  for (const auto& item : c10::impl::toTypedDict<std::string, Value>(value.toGenericDict()))
    map[item.key()] = item.value();
  return map;
}

// A tensor as it is pickled: on the CPU, and alone in its storage (pickling a view writes the
// whole storage it looks into, e.g. a flat buffer N times the shard).
at::Tensor storable(const at::Tensor& t) {
  at::Tensor cpu = t.detach().cpu();
  if (!cpu.is_contiguous() || cpu.storage_offset() != 0 ||
      cpu.storage().nbytes() != static_cast<std::size_t>(cpu.numel()) * cpu.element_size()) {
    cpu = cpu.clone(at::MemoryFormat::Contiguous);
  }
  return cpu;
}

}  // namespace

std::vector<char> encode_rank_file(const RankFile& file) {
  std::map<std::string, at::Tensor> shards, tensors;
  for (const auto& [key, t] : file.shards) shards[key] = storable(t);
  for (const auto& [key, t] : file.tensors) tensors[key] = storable(t);
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("format", kShardedFormat);
  root.insert("save_id", file.save_id);
  root.insert("rank", file.rank);
  root.insert("world_size", file.world_size);
  root.insert("step", file.step);
  root.insert("shards", to_dict(shards));
  root.insert("steps", to_dict(file.steps));
  root.insert("has_sampler", file.has_sampler);
  root.insert("sampler", torch::tensor({file.sampler.epoch, file.sampler.samples_consumed}));
  root.insert("has_rng", file.rng.defined());
  root.insert("rng", file.rng.defined() ? file.rng : torch::empty({0}, torch::kUInt8));
  root.insert("tensors", to_dict(tensors));
  root.insert("values", to_dict(file.values));
  return torch::jit::pickle_save(root);
}

RankFile decode_rank_file(const std::vector<char>& payload, const std::string& path) {
  RankFile file;
  try {
    auto root = torch::jit::pickle_load(payload).toGenericDict();
    auto entry = [&](const char* key) { return root.at(key); };
    if (entry("format").toInt() != kShardedFormat) {
      throw UsageError("sharded checkpoint file " + path + " is in format " +
                       std::to_string(entry("format").toInt()) + ", this dtrain reads format " +
                       std::to_string(kShardedFormat));
    }
    file.save_id = entry("save_id").toStringRef();
    file.rank = entry("rank").toInt();
    file.world_size = entry("world_size").toInt();
    file.step = entry("step").toInt();
    file.shards = from_dict<at::Tensor>(entry("shards"));
    file.steps = from_dict<int64_t>(entry("steps"));
    file.has_sampler = entry("has_sampler").toBool();
    at::Tensor position = entry("sampler").toTensor();
    file.sampler = {position[0].item<int64_t>(), position[1].item<int64_t>()};
    if (entry("has_rng").toBool()) file.rng = entry("rng").toTensor();
    file.tensors = from_dict<at::Tensor>(entry("tensors"));
    file.values = from_dict<std::string>(entry("values"));
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw UsageError("sharded checkpoint file " + path +
                     ": its checksum holds but its contents cannot be decoded (written by another "
                     "dtrain version?)");
  }
  return file;
}

SavedShards::SavedShards(std::string folder, ShardedMetadata metadata)
    : folder_(std::move(folder)), metadata_(std::move(metadata)) {
  for (std::size_t u = 0; u < metadata_.units.size(); ++u) {
    for (std::size_t p = 0; p < metadata_.units[u].params.size(); ++p)
      where_[metadata_.units[u].params[p].name] = {u, p};
  }
}

bool SavedShards::check(int64_t rank, std::string* why) {
  if (files_.count(rank)) return true;
  const std::string path = sharded_rank_file(folder_, rank, metadata_.world_size);
  std::vector<char> payload;
  if (!read_checkpoint_file(path, &payload, why)) return false;
  try {
    RankFile file = decode_rank_file(payload, path);
    if (file.save_id != metadata_.save_id || file.rank != rank ||
        file.world_size != metadata_.world_size) {
      *why = "it belongs to another save of this step (save id " + file.save_id +
             ", the metadata's is " + metadata_.save_id +
             "): the save that wrote the metadata did not finish";
      return false;
    }
    for (const auto& unit : metadata_.units) {
      auto it = file.shards.find("param/" + unit.key);
      if (it == file.shards.end() || it->second.numel() != unit.ranges[rank].second) {
        *why = "it does not hold the " + std::to_string(unit.ranges[rank].second) +
               " elements of unit '" + unit.key + "' that the metadata lists";
        return false;
      }
    }
    files_.emplace(rank, std::move(file));
  } catch (const UsageError& e) {
    *why = e.what();
    return false;
  }
  return true;
}

const RankFile& SavedShards::file(int64_t rank) {
  std::string why;
  if (!check(rank, &why)) {
    throw UsageError("sharded checkpoint file " +
                     sharded_rank_file(folder_, rank, metadata_.world_size) +
                     " cannot be used: " + why);
  }
  return files_.at(rank);
}

std::optional<std::vector<int64_t>> SavedShards::shape(const std::string& name) {
  auto it = where_.find(name);
  if (it == where_.end()) return std::nullopt;
  return metadata_.units[it->second.first].params[it->second.second].shape;
}

std::vector<std::string> SavedShards::names() {
  std::vector<std::string> names;
  for (const auto& unit : metadata_.units)
    for (const auto& p : unit.params) names.push_back(p.name);
  return names;
}

// Note [Resharding]: a parameter's elements [begin, end) are elements [offset + begin, offset +
// end) of its saved unit's flat buffer, and saving rank r held that buffer's elements
// [ranges[r].offset, ranges[r].offset + ranges[r].numel). Every saved rank whose range intersects
// contributes its part; together they cover the whole request (the ranges tile the buffer).
bool SavedShards::read(const std::string& name, const std::string& field, int64_t begin,
                       int64_t end, at::Tensor out) {
  auto [u, p] = where_.at(name);
  const SavedUnit& unit = metadata_.units[u];
  const int64_t first = unit.params[p].offset + begin, last = unit.params[p].offset + end;
  int64_t covered = 0;
  for (int64_t r = 0; r < metadata_.world_size; ++r) {
    const auto [offset, numel] = unit.ranges[r];
    const int64_t lo = std::max(first, offset), hi = std::min(last, offset + numel);
    if (lo >= hi) continue;
    const RankFile& saved = file(r);
    auto it = saved.shards.find(field + "/" + unit.key);
    if (it == saved.shards.end()) return false;
    out.narrow(0, lo - first, hi - lo).copy_(it->second.narrow(0, lo - offset, hi - lo));
    covered += hi - lo;
  }
  if (covered != last - first) {
    throw UsageError(describe() + ": its rank ranges of unit '" + unit.key + "' do not cover '" +
                     name + "'; the metadata is inconsistent, move the folder aside");
  }
  return true;
}

std::optional<int64_t> SavedShards::optimizer_step(const std::string& name) {
  auto [u, p] = where_.at(name);
  const SavedUnit& unit = metadata_.units[u];
  const int64_t first = unit.params[p].offset;
  const int64_t last = first + std::max<int64_t>(numel_of(unit.params[p].shape), 1);
  for (int64_t r = 0; r < metadata_.world_size; ++r) {
    const auto [offset, numel] = unit.ranges[r];
    if (std::max(first, offset) >= std::min(last, offset + numel)) continue;
    const RankFile& saved = file(r);
    auto it = saved.steps.find(unit.key);
    if (it != saved.steps.end()) return it->second;
  }
  return std::nullopt;
}

FullState::FullState(torch::nn::Module& module, torch::optim::Optimizer* optimizer)
    : optimizer_(optimizer), kind_(optimizer_kind(optimizer, "the full state's optimizer")) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    params_[item.key()] = item.value();
    order_.push_back(item.key());
  }
}

std::optional<std::vector<int64_t>> FullState::shape(const std::string& name) {
  auto it = params_.find(name);
  if (it == params_.end()) return std::nullopt;
  return it->second.sizes().vec();
}

std::vector<std::string> FullState::names() { return order_; }

bool FullState::read(const std::string& name, const std::string& field, int64_t begin, int64_t end,
                     at::Tensor out) {
  const at::Tensor& param = params_.at(name);
  at::Tensor from;
  if (field == "param") {
    from = param;
  } else {
    if (!optimizer_) return false;
    auto state = get_param_state(*optimizer_, kind_, param);
    auto it = state.fields.find(field);
    if (it == state.fields.end()) return false;
    from = it->second;
  }
  out.copy_(from.detach().reshape(-1).narrow(0, begin, end - begin));
  return true;
}

std::optional<int64_t> FullState::optimizer_step(const std::string& name) {
  if (!optimizer_) return std::nullopt;
  auto state = get_param_state(*optimizer_, kind_, params_.at(name));
  if (!state.present) return std::nullopt;
  return state.step;
}

namespace {

// The destination's optimizer must be of the kind the source saved.
void check_optimizers(StateSource& source, OptimizerKind destination) {
  if (destination == OptimizerKind::kNone) return;
  if (source.optimizer() == OptimizerKind::kNone) {
    throw UsageError(source.describe() +
                     " holds no optimizer state (it was saved without an optimizer); load it "
                     "without one");
  }
  if (source.optimizer() != destination) {
    throw UsageError(source.describe() + " holds the state of a " +
                     optimizer_kind_name(source.optimizer()) + " optimizer but the optimizer is " +
                     optimizer_kind_name(destination) +
                     "; build the optimizer of the run that saved it");
  }
}

void check_param(StateSource& source, const std::string& name,
                 const std::vector<int64_t>& expected) {
  auto saved = source.shape(name);
  if (!saved) {
    throw UsageError(source.describe() + " has no parameter '" + name + "' (of shape " +
                     shape_text(expected) +
                     "); it was saved from another model: load it into the model that saved it");
  }
  if (*saved != expected) {
    throw UsageError(source.describe() + " holds '" + name + "' of shape " + shape_text(*saved) +
                     " but the model's is " + shape_text(expected) +
                     "; it was saved from another model: load it into the model that saved it");
  }
}

// Fills `out` (one flat shard's elements [offset, offset + out.numel()) of its unit) with `field`
// from source, and zeros where the source holds no such field for a parameter. Returns the names
// of those parameters; *found: whether it held the field for at least one.
std::vector<std::string> fill_flat(StateSource& source, const FlatShard& shard,
                                   const std::string& field, at::Tensor out, bool* found) {
  const int64_t first = shard.offset, last = shard.offset + out.numel();
  std::vector<std::string> missing;
  *found = false;
  for (const auto& p : shard.params) {
    const int64_t lo = std::max(first, p.offset), hi = std::min(last, p.offset + numel_of(p.shape));
    if (lo >= hi) continue;
    at::Tensor part = out.narrow(0, lo - first, hi - lo);
    if (source.read(p.name, field, lo - p.offset, hi - p.offset, part)) {
      *found = true;
    } else {
      part.zero_();  // a source may have written some of it before it found a piece missing
      missing.push_back(p.name);
    }
  }
  return missing;
}

}  // namespace

void fill_shards(StateSource& source, std::vector<FlatShard>& shards,
                 torch::optim::Optimizer* optimizer, bool warn) {
  const OptimizerKind kind = optimizer_kind(optimizer, "ShardedTrainingState::optimizer");
  check_optimizers(source, kind);
  for (const auto& shard : shards)
    for (const auto& p : shard.params) check_param(source, p.name, p.shape);

  torch::NoGradGuard no_grad;
  // Everything is read before anything is written: a read that fails half-way leaves the shards.
  std::vector<at::Tensor> values;
  std::vector<ParamOptimizerState> states;
  for (const auto& shard : shards) {
    at::Tensor value = torch::zeros({shard.shard.numel()}, shard.shard.options().device(at::kCPU));
    bool found = false;
    fill_flat(source, shard, "param", value, &found);
    values.push_back(value);
    ParamOptimizerState state;
    if (kind != OptimizerKind::kNone) {
      // A flat shard has one state for all its parameters, where PyTorch keeps none for a
      // parameter that never had a gradient: such a parameter gets zeros, which is what a fresh
      // state holds (Adam's moments; SGD's momentum_buffer, which its first step sets to the
      // gradient, the same as from zeros unless dampening), and the others keep theirs. No state
      // for any of them (not stepped yet, SGD without momentum): none for the shard.
      // A shard of padding only (a unit smaller than the world's shards) reads nothing, yet its
      // state is the unit's like the others': zeros at their step, not a restart.
      bool padding = true;
      for (const auto& p : shard.params) {
        padding =
            padding && std::max(shard.offset, p.offset) >=
                           std::min(shard.offset + value.numel(), p.offset + numel_of(p.shape));
      }
      std::vector<std::string> fresh;
      for (const auto& field : optimizer_fields(kind)) {
        at::Tensor t = torch::zeros_like(value);
        std::vector<std::string> missing = fill_flat(source, shard, field, t, &found);
        if (found || padding) {
          state.fields[field] = t.to(shard.shard.device());
          state.present = true;
        } else if (field == optimizer_fields(kind).front()) {
          break;
        }
        if (field == optimizer_fields(kind).front()) fresh = missing;
      }
      if (state.present) {
        // The shard's one step count: that of a parameter with state.
        for (const auto& p : shard.params) {
          if (std::find(fresh.begin(), fresh.end(), p.name) != fresh.end()) continue;
          if (auto step = source.optimizer_step(p.name)) {
            state.step = *step;
            break;
          }
        }
        // Its step is the others' where PyTorch's would start at 0: Adam's bias correction of
        // its first updates differs, so say so.
        if (warn && kind != OptimizerKind::kSgd) {
          for (const auto& name : fresh) {
            DTRAIN_LOG(kWarn, source.describe()
                                  << " holds no optimizer state for parameter '" << name
                                  << "' (PyTorch keeps none for a parameter that never had a "
                                     "gradient): it starts from zero moments, as a fresh state "
                                     "does, but at its flat shard's step "
                                  << state.step << ", where PyTorch's would start at 0");
          }
        }
      }
    }
    states.push_back(std::move(state));
  }
  for (std::size_t i = 0; i < shards.size(); ++i) {
    shards[i].shard.detach().view(-1).copy_(values[i]);
    if (optimizer) set_param_state(*optimizer, kind, shards[i].shard, states[i]);
  }
}

void fill_module(StateSource& source, torch::nn::Module& module,
                 torch::optim::Optimizer* optimizer) {
  const OptimizerKind kind = optimizer_kind(optimizer, "TrainingState::optimizer");
  check_optimizers(source, kind);
  auto named = module.named_parameters(/*recurse=*/true);
  for (const auto& item : named) check_param(source, item.key(), item.value().sizes().vec());
  for (const auto& name : source.names()) {
    if (!named.contains(name)) {
      throw UsageError(source.describe() + " holds '" + name +
                       "', which the model does not have; it was saved from another model: load "
                       "it into the model that saved it");
    }
  }
  std::set<c10::TensorImpl*> optimized;
  if (optimizer) {
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) optimized.insert(p.unsafeGetTensorImpl());
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : named) {
    const at::Tensor& param = item.value();
    const int64_t numel = param.numel();
    at::Tensor value = torch::empty({numel}, param.options().device(at::kCPU));
    source.read(item.key(), "param", 0, numel, value);
    param.detach().copy_(value.view(param.sizes()));
    if (!optimized.count(param.unsafeGetTensorImpl())) continue;
    ParamOptimizerState state;
    state.present = true;
    for (const auto& field : optimizer_fields(kind)) {
      at::Tensor t = torch::empty({numel}, value.options());
      if (source.read(item.key(), field, 0, numel, t)) {
        state.fields[field] = t.view(param.sizes()).to(param.device());
      } else if (field == optimizer_fields(kind).front()) {
        state.present = false;
        break;
      }
    }
    if (state.present) state.step = source.optimizer_step(item.key()).value_or(0);
    set_param_state(*optimizer, kind, param, state);
  }
}

}  // namespace dtrain::detail
