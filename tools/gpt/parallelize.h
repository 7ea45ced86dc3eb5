// The transformer of gpt.h in a layout: D data-parallel replicas x T tensor-parallel ranks per
// block x P pipeline stages on one rank mesh (dtrain::RankMesh: a tensor group's ranks are
// neighbours), with ZeRO over the data dimension, activation recomputation per block and gradient
// clipping by the global norm. train_gpt trains through it, and the tests hold it against one
// process. In the order torchtitan's parallelize applies them: the tensor split when the model is
// built (make_model), then recomputation, then the pipeline's cut and the data dimension (DDP, or
// ZeRO) around what each rank holds (Parallel).
//
//   gpt::LayoutOptions options;                    // --dp 2 --tp 2 --pp 2 at 8 ranks
//   options.dp = 2; options.tp = 2; options.pp = 2;
//   dtrain::RankMesh mesh = gpt::make_mesh(options, pg);          // collective
//   torch::manual_seed(0);                                        // the same draw on every rank
//   gpt::Gpt model = gpt::make_model(config, options, mesh);
//   gpt::Parallel layout(model, options, mesh, pg, device);
//   torch::optim::AdamW optimizer(layout.parameters(), 3e-3);
//   at::Tensor loss = layout.forward_backward(inputs, targets);  // this replica's windows
//   layout.clip_grad_norm(1.0);
//   optimizer.step();
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/pipeline.h"
#include "dtrain/sharded.h"
#include "dtrain/sharded_checkpoint.h"
#include "gpt/gpt.h"

namespace gpt {

struct LayoutOptions {
  int dp = 0;              // data-parallel replicas; 0: the world size / (tp x pp)
  int tp = 1;              // tensor-parallel ranks that split every block
  int pp = 1;              // pipeline stages (the blocks cut between them)
  int zero = 0;            // ZeRO stage over the data replicas (0: DDP)
  bool recompute = false;  // every block recomputes its activations in backward
  bool sp = false;         // sequence parallelism over the tensor group (with tp > 1)
  bool bf16 = false;       // the forward under bfloat16 autocast (parameters stay float32)
  dtrain::ScheduleKind schedule = dtrain::ScheduleKind::k1F1B;  // with pp > 1
  int micro_batches = 4;                                        // with pp > 1
};

// Checks the degrees against the world size (dp x tp x pp must equal it; an unset dp is the
// quotient, which tp x pp must divide) and returns dp. Throws dtrain::UsageError naming the flags
// (--dp, --tp, --pp, --zero) and their values: the same line on every rank, before any collective.
int check_degrees(const LayoutOptions& options, int world_size);

// The rank mesh of options (check_degrees first). Collective: every rank of `world` calls it.
dtrain::RankMesh make_mesh(const LayoutOptions& options,
                           const std::shared_ptr<dtrain::ProcessGroup>& world);

// The model as this rank builds it: split by the mesh's tensor group when tp > 1 (the sequence
// too when options.sp), its blocks recomputing when options.recompute. Draws from torch's
// generator as the unsplit model does, so every rank must build it under the same seed.
Gpt make_model(const GptConfig& config, const LayoutOptions& options, const dtrain::RankMesh& mesh);

// The model of make_model in the layout: this rank's pipeline stage (pp > 1) and the data
// dimension around it, DDP or ZeRO over the mesh's data group (with tp > 1, ZeRO shards each tensor
// rank's shards over the replicas that hold the same ones; with pp > 1 each stage's, Note [ZeRO in
// a pipeline] in dtrain/pipeline.h). Blocks on DDP's or ZeRO's set-up (rank 0 of each data group
// broadcasts its parameters).
// The whole model's parameters, by name and shape, in the model's order (whatever layout holds
// them).
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(const GptConfig& config);

class Parallel {
 public:
  Parallel(Gpt model, const LayoutOptions& options, dtrain::RankMesh mesh,
           std::shared_ptr<dtrain::ProcessGroup> world, c10::Device device);
  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  // One step's forward and backward on this replica's windows (inputs and targets [batch, seq];
  // every rank of a replica passes the same ones): the gradients averaged over the replicas.
  // Returns the loss: this replica's mean (the pipeline's: averaged over the replicas already).
  // Gradient accumulation over K calls before one optimizer step: pass loss_scale 1/K to each (the
  // gradients add up to those of the K batches' mean) and sync false to all but the last (DDP's,
  // ZeRO's and the pipeline's reductions wait for it). The loss returned is not scaled.
  at::Tensor forward_backward(const at::Tensor& inputs, const at::Tensor& targets,
                              double loss_scale = 1.0, bool sync = true);

  // After forward_backward: scales every gradient by max_norm / (norm + 1e-6) when that is below 1,
  // norm being the global 2-norm of the whole model's gradient (Note [Global gradient norm]), and
  // returns norm. Collective over the world.
  double clip_grad_norm(double max_norm);

  // What the optimizer steps: this rank's (its stage's, its tensor shards, or its ZeRO shards).
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // The model's parameters of the full model that this rank trains, by name (every one but a
  // pipeline's other stages'); with tp > 1 the split ones are this rank's shards. With ZeRO these
  // mirror its flat shards: call gather_full_parameters() first.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // ZeRO: makes the model's parameters that this rank trains hold the current shards (all-gathers
  // over the data group; collective), to evaluate, compare or export; release_full_parameters()
  // frees them again (stage 3). No-ops without ZeRO.
  void gather_full_parameters();
  void release_full_parameters();
  // True for a parameter split over the tensor group (the blocks' projections with tp > 1).
  bool tensor_split(const at::Tensor& parameter) const;

  // The model's mean next-token loss on inputs and targets [batch, seq] (held-out windows), in eval
  // mode and without gradients; every rank of a replica passes the same windows and gets the same
  // loss. With a pipeline the stages run their chunks in the model's order, each sending its
  // output to the next over the pipeline group (Note [Pipelined evaluation]), the last stage
  // computes the loss and broadcasts it over the pipeline group. Collective over the replica (its
  // tensor and pipeline groups). With ZeRO, call gather_full_parameters() first.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // After training: makes `model` the whole trained model on every rank, for export_hf and the
  // logits. Every rank builds the whole model, but a pipeline's stage trains only its own blocks;
  // here each stage broadcasts its parameters over the pipeline group, so the other stages' copies
  // (left as they were drawn or loaded) take the trained values. With tp > 1 each rank keeps its
  // tensor shards (export_hf gathers them). No-op without a pipeline. Collective over the world.
  void gather_stages();

  // Checkpoints (Note [Layout-neutral checkpoints] in parallelize.cpp): every layout saves into
  // and resumes from the same sharded checkpoints, keyed by the whole model's parameter names, so a
  // run resumes in any other layout and at any world size. `checkpointer` is over the world;
  // `optimizer` is over parameters(). Collective over the world. load returns the step of the
  // checkpoint loaded, or nullopt when there is none; it throws dtrain::UsageError when the
  // checkpoint is of another model.
  void save(dtrain::ShardedCheckpointer& checkpointer, torch::optim::AdamW& optimizer,
            dtrain::DistributedSampler& sampler, int64_t step);
  std::optional<int64_t> load(dtrain::ShardedCheckpointer& checkpointer,
                              torch::optim::AdamW& optimizer, dtrain::DistributedSampler& sampler);

  // DCP (Note [DCP export of a layout] in parallelize.cpp): the whole model's parameters and
  // AdamW's moments in the layout of torch.distributed.checkpoint's safetensors storage (Note [DCP
  // safetensors] in dtrain/dcp.h), under the names ZeRO's export uses, every rank writing the
  // ranges it saves in a checkpoint; PyTorch loads the folder into an unsharded model or FSDP2.
  // load_dcp fills this rank's parameters from such a folder, whatever wrote it (dtrain in any
  // layout, FSDP2 at any world size, a plain dcp.save), and AdamW's moments and step when the
  // folder holds them (else this rank's AdamW state is cleared: a fresh optimizer). Collective over
  // the world; throws dtrain::UsageError on every rank, naming the file or tensor, when a file is
  // damaged or missing or the folder is of another model (and load_dcp then changes nothing).
  void export_dcp(const std::string& dir, torch::optim::AdamW& optimizer);
  void load_dcp(const std::string& dir, torch::optim::AdamW& optimizer);

  const dtrain::RankMesh& mesh() const { return mesh_; }
  // The ranks that read other windows: the mesh's data group.
  const std::shared_ptr<dtrain::ProcessGroup>& data_group() const { return data_group_; }

  Gpt model;
  dtrain::DistributedDataParallel<GptImpl> ddp{nullptr};
  dtrain::ShardedDataParallel<GptImpl> sdp{nullptr};
  std::unique_ptr<dtrain::DistributedPipeline> pipe;

 private:
  struct Piece;   // one parameter's part of a checkpoint (parallelize.cpp)
  struct Ranges;  // the pieces' values and AdamW moments, as flat ranges on the CPU
  std::vector<Piece> pieces(bool saving);
  Ranges saved_ranges(torch::optim::AdamW& optimizer);
  Ranges ranges_to_load(bool every);
  void apply_loaded(const Ranges& loaded, torch::optim::AdamW& optimizer);
  // ZeRO with tp or pp > 1 saves and loads through the ranges (Note [ZeRO over a tensor layout's
  // state]).
  bool zero_saves_ranges() const;
  // ZeRO's wrappers on this rank (sdp, or the pipeline's around its chunks) and their flat shards.
  std::vector<dtrain::ShardedDataParallelBase*> zero_wrappers() const;
  std::vector<dtrain::FlatShard> zero_shards() const;
  std::unique_ptr<torch::optim::AdamW> gathered_moments(torch::optim::AdamW& optimizer);
  void scatter_to_shards(const std::map<std::string, at::Tensor>& by_name,
                         torch::optim::AdamW& gathered, torch::optim::AdamW& optimizer);
  Ranges ranges_to_save(torch::optim::AdamW& optimizer);
  Ranges ranges_to_read(bool every);
  void apply_read(const Ranges& loaded, torch::optim::AdamW& optimizer);

  LayoutOptions options_;
  dtrain::RankMesh mesh_;
  std::vector<torch::nn::Sequential> chunks_;  // with a pipeline: the whole model's, in order
  std::shared_ptr<dtrain::ProcessGroup> world_, data_group_;
  std::vector<at::Tensor> parameters_;
  c10::Device device_;
  std::set<const c10::TensorImpl*> split_;             // tensor_split's
  std::set<const c10::TensorImpl*> stage_parameters_;  // with a pipeline: this stage's
};

}  // namespace gpt
