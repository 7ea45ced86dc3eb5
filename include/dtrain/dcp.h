// Sharded checkpoints that PyTorch's Distributed Checkpoint (torch.distributed.checkpoint, DCP)
// reads and writes: a ZeRO run of dtrain exports its shards in the layout of DCP's safetensors
// storage, which Python loads into an unsharded model or into FSDP2 at any world size; and dtrain
// loads what FSDP2 saved there into its ZeRO training at any world size, or into a plain module.
//
//   dtrain::DcpShards state{sdp->flat_shards(), &optimizer, sdp->module()->named_buffers()};
//   dtrain::save_dcp_safetensors("export", state, sdp->group());      // collective
//   dtrain::load_dcp_safetensors("from-fsdp2", state, sdp->group());  // collective, any world
//   sdp->shards_changed();
//   dtrain::load_dcp_safetensors("export", *model, &plain_optimizer);  // one process, unsharded
//   dtrain::TensorTable full = dtrain::load_dcp_safetensors("export"); // every tensor, whole
//
// In Python (doc/checkpoint.md has the whole snippets):
//   dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader("export"))
//   dcp.save(model.state_dict(),
//            storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
//
// Note [DCP safetensors]
// DCP's own format keeps its metadata as a pickle of Python classes, with no promise that another
// version reads it; its safetensors storage (torch/distributed/checkpoint/hf_storage.py) needs no
// metadata file at all. Every rank writes safetensors files (Note [Safetensors file] in
// dtrain/safetensors.h); a tensor in a file is one chunk of the whole tensor, an n-D box, and the
// file's "__metadata__" key "DCP_SHARDING_INFO" is the JSON {name: {"saved_offsets": [..]}} of
// each chunk's first element. The reader takes every *.safetensors file of the folder and places
// each chunk at its offsets; the whole tensor's shape is where the chunks end. A file holds at most
// one chunk of a tensor.
// dtrain's export: rank r owns a contiguous range of each unit's flat buffer (Note [Sharded data
// parallelism] in dtrain/sharded.h), i.e. a row-major range of elements of each parameter in it.
// Such a range is at most 2*ndim-1 boxes (a partial row at each end of every dimension, and the
// whole rows between), and the k-th box of each parameter goes into the rank's k-th file,
// shard-<r>-part-<k>.safetensors (r five digits). Keys: the parameters' names as
// module->named_parameters() gives them; rank 0 adds the module's buffers, whole; with an
// optimizer, its state per parameter under the names PyTorch's get_optimizer_state_dict flattened
// as {"optim": ...} gives it: optim.state.<name>.exp_avg, .exp_avg_sq, .max_exp_avg_sq and .step (a
// 0-dim float32, from rank 0) for Adam and AdamW, optim.state.<name>.momentum_buffer for SGD.
// param_groups (learning rate, betas, ...) are not tensors, which safetensors cannot hold: the
// program builds its optimizer with them. Each file is written atomically (with dtrain's CRC-32)
// into a staging folder beside the folder, .<name>.dtrain-export; when every rank has written,
// rank 0 writes dtrain_dcp_index.json there last (the files, each tensor's shape and dtype) and
// puts the staging folder in the folder's place in one rename (Note [Replacing an export] in
// src/checkpoint/dcp.cpp), so that an export that fails leaves an earlier one in the folder as it
// was; a folder that cannot be renamed (a mount point, the working folder) stages inside itself,
// in <dir>/.dtrain-export, and swaps files at the end. A folder with dtrain's files and no index is
// a half-written export (an older dtrain's, or a swap that stopped: the next export puts the
// earlier one back), which dtrain refuses; Python's reader ignores files that are not
// *.safetensors. A folder without dtrain's files (FSDP2 wrote it) needs no index.
// Loading reads every file's header, checks that the chunks of every tensor tile it exactly (no
// gap, no overlap, one dtype, within the shape the index gives), and reads the data of only the
// files that hold a chunk this rank needs (checking their CRC-32 where dtrain wrote one).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm.h"
#include "dtrain/safetensors.h"
#include "dtrain/sharded.h"

namespace dtrain {

// One rank's part of a ZeRO run, as a DCP export writes it and a DCP import fills it. The
// pointers are not owned.
struct DcpShards {
  // This rank's flat shards (ShardedDataParallel::flat_shards()). Loading overwrites each shard
  // tensor in place; then call ShardedDataParallel::shards_changed().
  std::vector<FlatShard> shards;
  // Built over the shard tensors: SGD (momentum_buffer), Adam or AdamW (step, exp_avg, exp_avg_sq,
  // max_exp_avg_sq); another type is a UsageError. Null: no optimizer state is written or read.
  torch::optim::Optimizer* optimizer = nullptr;
  // The module's buffers (sdp->module()->named_buffers()): rank 0's are written; loading copies
  // into every one. A folder's tensor that is neither a parameter of the shards nor one of these
  // (nor optimizer state) is refused: it comes from another model.
  TensorTable buffers;
};

// Collective: every rank of `group` (null: one process holding every shard) writes its shards,
// their optimizer state and (rank 0) the buffers into `dir` (created if missing) as Note [DCP
// safetensors] lays them out; returns once rank 0 has put the export in place. The export
// replaces `dir` as a whole (other files in it, a config.json, are kept), or, where `dir` cannot
// be renamed (a mount point, the working folder, a parent that cannot be written), its export
// files, by renames at the end (Note [Replacing an export] in dcp.cpp). Throws UsageError
// on every rank, naming the rank and file that could not be written, with `dir` as it was, or
// when `dir` holds .safetensors files that another program wrote (Python's reader would mix them
// in). Blocks up to the group's timeout on the others.
void save_dcp_safetensors(const std::string& dir, const DcpShards& state,
                          const std::shared_ptr<ProcessGroup>& group = nullptr);

// Collective: fills every rank's shards, its optimizer's state and the buffers from the DCP
// safetensors folder `dir`, whatever world size and layout wrote it (dtrain's export, FSDP2's
// dcp.save with HuggingFaceStorageWriter(save_distributed=True)). Each rank reads the chunks of the
// ranges it owns. Throws UsageError on every rank, with nothing loaded anywhere, when a file is
// damaged or missing or the chunks do not tile a tensor (naming the file and tensor), or when the
// folder does not fit (a parameter or buffer missing or of another shape, no optimizer state
// for an optimizer, another model's tensors).
void load_dcp_safetensors(const std::string& dir, DcpShards& state,
                          const std::shared_ptr<ProcessGroup>& group = nullptr);

// Whether a DCP safetensors folder holds optimizer state (optim.state.<name>.<field> tensors), from
// its files' headers: a program that loads what may be a model alone passes its optimizer only
// then. Throws UsageError as load_dcp_safetensors does when the folder is damaged.
bool dcp_has_optimizer_state(const std::string& dir);

// Every tensor of a DCP safetensors folder, whole (the chunks assembled), on the CPU, ordered by
// name. Throws UsageError as above.
TensorTable load_dcp_safetensors(const std::string& dir);

// One process: a plain module's parameters and buffers (as load_into) and, if given, the state of
// its optimizer (SGD, Adam or AdamW over module's parameters) from a DCP safetensors folder.
// Checks everything before it changes anything; throws UsageError as above.
void load_dcp_safetensors(const std::string& dir, torch::nn::Module& module,
                          torch::optim::Optimizer* optimizer = nullptr);

}  // namespace dtrain
