// Internals of sharded checkpoints (Note [Sharded checkpoint] in dtrain/sharded_checkpoint.h): the
// names of the files, the metadata record, one rank's file, the optimizer state of one parameter,
// and resharding: filling flat shards or a plain module from a source that can be read by parameter
// name and element range, whatever layout it was saved in.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/format.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/sharded_checkpoint.h"

namespace dtrain::detail {

// <dir>/<prefix>-<step>, and in it rank-<r>-of-<N>.ckpt and metadata.ckpt.
std::string sharded_folder(const std::string& dir, const std::string& prefix, int64_t step);
std::string sharded_rank_file(const std::string& folder, int64_t rank, int64_t world_size);
std::string sharded_metadata_file(const std::string& folder);

// The optimizers whose per-parameter state sharded checkpoints know how to cut and join.
enum class OptimizerKind { kNone, kSgd, kAdam, kAdamW };
// kNone for null; throws UsageError (naming `who`) for an optimizer of another type.
OptimizerKind optimizer_kind(const torch::optim::Optimizer* optimizer, const std::string& who);
std::string optimizer_kind_name(OptimizerKind kind);
// The state tensors of one parameter, each of the parameter's shape: the first is always there
// once the optimizer has stepped; later ones may be absent (max_exp_avg_sq without amsgrad).
std::vector<std::string> optimizer_fields(OptimizerKind kind);

// One parameter's optimizer state; present == false: the optimizer holds none (not stepped yet,
// or SGD without momentum).
struct ParamOptimizerState {
  bool present = false;
  std::map<std::string, at::Tensor> fields;  // defined tensors only
  int64_t step = 0;                          // Adam and AdamW
};
ParamOptimizerState get_param_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                                    const at::Tensor& param);
void set_param_state(torch::optim::Optimizer& optimizer, OptimizerKind kind,
                     const at::Tensor& param, const ParamOptimizerState& state);

// The metadata record, as JSON inside a checkpoint file frame.
struct SavedUnit {
  std::string key;
  int64_t full_numel = 0;
  std::string dtype;
  std::vector<ParamExtent> params;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // per saving rank: (offset, numel)
};
struct ShardedMetadata {
  int64_t step = 0;
  int64_t world_size = 1;
  int64_t stage = 0;
  std::string save_id;
  OptimizerKind optimizer = OptimizerKind::kNone;
  std::vector<SavedUnit> units;
};
std::vector<char> encode_metadata(const ShardedMetadata& metadata);
// Throws UsageError naming path when the JSON is not a sharded checkpoint's metadata.
ShardedMetadata decode_metadata(const std::vector<char>& payload, const std::string& path);

// One rank's file: tensors "param/<unit>" and "<optimizer field>/<unit>", the unit's optimizer step
// under steps["<unit>"], and the rank's sampler position, RNG and extras.
struct RankFile {
  std::string save_id;
  int64_t rank = 0, world_size = 1, step = 0;
  std::map<std::string, at::Tensor> shards;
  std::map<std::string, int64_t> steps;
  bool has_sampler = false;
  SamplerState sampler;
  at::Tensor rng;  // undefined: not saved
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> values;
};
std::vector<char> encode_rank_file(const RankFile& file);
// Throws UsageError naming path when the payload does not decode as a rank file.
RankFile decode_rank_file(const std::vector<char>& payload, const std::string& path);

// Where the values of each parameter, and of its optimizer state, can be read by the parameter's
// name and a range of its elements (flattened), whatever layout holds them.
class StateSource {
 public:
  virtual ~StateSource() = default;
  // The parameter's shape; nullopt when the source does not hold it.
  virtual std::optional<std::vector<int64_t>> shape(const std::string& name) = 0;
  virtual std::vector<std::string> names() = 0;
  virtual OptimizerKind optimizer() = 0;
  // Copies elements [begin, end) of `field` ("param" or an optimizer field) of parameter `name`
  // into out (1-D, end - begin elements). Returns false when the source holds no such field for it.
  virtual bool read(const std::string& name, const std::string& field, int64_t begin, int64_t end,
                    at::Tensor out) = 0;
  // The optimizer step count of the state that holds `name`'s; nullopt when there is none.
  virtual std::optional<int64_t> optimizer_step(const std::string& name) = 0;
  // For messages: "checkpoint <folder>", "the full state".
  virtual std::string describe() = 0;
};

// A complete sharded checkpoint on disk; rank files are read and decoded when first needed.
class SavedShards : public StateSource {
 public:
  SavedShards(std::string folder, ShardedMetadata metadata);
  const ShardedMetadata& metadata() const { return metadata_; }
  // Rank r's file, read, checked (checksum, save id, rank) and decoded once. Throws UsageError.
  const RankFile& file(int64_t rank);
  // As file(), but returns false and sets *why instead of throwing.
  bool check(int64_t rank, std::string* why);

  std::optional<std::vector<int64_t>> shape(const std::string& name) override;
  std::vector<std::string> names() override;
  OptimizerKind optimizer() override { return metadata_.optimizer; }
  bool read(const std::string& name, const std::string& field, int64_t begin, int64_t end,
            at::Tensor out) override;
  std::optional<int64_t> optimizer_step(const std::string& name) override;
  std::string describe() override { return "sharded checkpoint " + folder_; }

 private:
  std::string folder_;
  ShardedMetadata metadata_;
  std::map<std::string, std::pair<std::size_t, std::size_t>> where_;  // name -> (unit, param)
  std::map<int64_t, RankFile> files_;
};

// A plain module and (optionally) an optimizer over its parameters.
class FullState : public StateSource {
 public:
  FullState(torch::nn::Module& module, torch::optim::Optimizer* optimizer);
  std::optional<std::vector<int64_t>> shape(const std::string& name) override;
  std::vector<std::string> names() override;
  OptimizerKind optimizer() override { return kind_; }
  bool read(const std::string& name, const std::string& field, int64_t begin, int64_t end,
            at::Tensor out) override;
  std::optional<int64_t> optimizer_step(const std::string& name) override;
  std::string describe() override { return "the full state"; }

 private:
  std::map<std::string, at::Tensor> params_;
  std::vector<std::string> order_;
  torch::optim::Optimizer* optimizer_;
  OptimizerKind kind_;
};

// Resharding: fills every shard tensor (in place) and, with an optimizer, its state from source,
// after checking that everything fits (then nothing was changed when it throws UsageError). A
// parameter without optimizer state where others of its shard have some gets zeros (warn: one
// warning line per such parameter).
void fill_shards(StateSource& source, std::vector<FlatShard>& shards,
                 torch::optim::Optimizer* optimizer, bool warn = true);
// Fills a plain module's parameters and, with an optimizer over them, its state from source.
void fill_module(StateSource& source, torch::nn::Module& module,
                 torch::optim::Optimizer* optimizer);

// The element count of a shape, and its text ("[3, 4]"), for the sharded formats' checks.
int64_t numel_of(const std::vector<int64_t>& shape);
std::string shape_text(const std::vector<int64_t>& shape);

// A group's collectives, or nothing for one process without a group (a view of a checkpointer's
// group for the length of one call): the sharded checkpoints and the DCP export share it.
struct Ranks {
  ProcessGroup* group;
  int rank() const { return group ? group->rank() : 0; }
  int size() const { return group ? group->size() : 1; }
  std::string who() const { return group ? rank_text(*group) : rank_text(0, 1); }
  void all_reduce(at::Tensor& t, ReduceOp op = ReduceOp::kSum) const {
    if (group && group->size() > 1) group->all_reduce(t, op);
  }
  void broadcast(at::Tensor& t) const {
    if (group && group->size() > 1) group->broadcast(t, 0);
  }
};

}  // namespace dtrain::detail
