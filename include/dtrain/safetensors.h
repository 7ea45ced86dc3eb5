// Model weights in safetensors, the format models are shared in (Hugging Face's): reading and
// writing single files and sharded folders with an index, and loading a tensor table into a
// module's parameters and buffers in place.
//
//   dtrain::save_safetensors("out", model->named_parameters());        // out/model.safetensors
//   dtrain::SafetensorsWriteOptions options;
//   options.max_shard_bytes = 2'000'000'000;                           // shards + index.json
//   dtrain::save_safetensors("out", tensors, options);
//   dtrain::TensorTable tensors = dtrain::load_safetensors("out");      // a folder, file or index
//   dtrain::load_into(*model, tensors);                                // names, shapes, dtypes
//
// Note [Safetensors file]
// A file is an 8-byte little-endian header length N, N bytes of JSON, then the tensors' raw
// little-endian bytes. The JSON maps each name to {"dtype": "F32", "shape": [..], "data_offsets":
// [begin, end]} (offsets into the bytes after the header) plus an optional "__metadata__" of
// string pairs. The format has no checksum; dtrain writes the CRC-32 of the data as the metadata
// "dtrain_crc32" and checks it when present, so a flipped data byte in a file dtrain wrote is
// named too (files from elsewhere lack it and are checked for everything else). A sharded folder,
// as Hugging Face's save_pretrained writes one: model-00001-of-00003.safetensors .. and
// model.safetensors.index.json, {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtrain {

// Tensors by name, in the order they were written or read (module->named_parameters() is one).
using TensorTable = torch::OrderedDict<std::string, at::Tensor>;

struct SafetensorsFile {
  TensorTable tensors;                          // on the CPU, in the file's data order
  std::map<std::string, std::string> metadata;  // "__metadata__" (empty when there is none)
};

// Writes `tensors` (any device and layout: copied to contiguous CPU memory on the way) as the one
// file `path`, atomically and durably: a hidden temporary beside it, fsync, rename, fsync of the
// folder, so that `path` is either the old file or the whole new one. `metadata` becomes the
// file's "__metadata__", with "format": "pt" added unless given (transformers refuses a file
// without it) and "dtrain_crc32". Throws UsageError for a dtype safetensors has no name for, an
// empty or duplicate name, or a file that cannot be written (naming it and the system's reason).
void save_safetensors_file(const std::string& path, const TensorTable& tensors,
                           const std::map<std::string, std::string>& metadata = {});

// Reads one file and checks all of it (Note [Safetensors file]). Throws UsageError naming the file
// and what is wrong: missing, shorter than its header, a header that is not valid JSON or not the
// format's, an unknown dtype, a shape that does not match its byte count, offsets out of range,
// overlapping, or leaving bytes no tensor covers, a truncated file, a CRC-32 mismatch.
SafetensorsFile read_safetensors_file(const std::string& path);

struct SafetensorsWriteOptions {
  // The most tensor bytes in one file (Hugging Face's max_shard_size); 0: one file whatever the
  // size. A tensor larger than this gets a file of its own. With one file the folder holds
  // model.safetensors and no index.
  int64_t max_shard_bytes = 0;
  // Every file's "__metadata__" (see save_safetensors_file).
  std::map<std::string, std::string> metadata;
};

// Writes `tensors` into the folder `dir` (created if missing) as Hugging Face lays out a model:
// dir/model.safetensors, or, when they exceed options.max_shard_bytes, the shards
// model-0000i-of-0000n.safetensors (tensors in order, a new shard when the next would pass the
// limit) and then model.safetensors.index.json. Each file is written atomically (as
// save_safetensors_file); afterwards the model files of an earlier export into `dir` that this
// one did not write are removed. Returns the paths written, the index last.
std::vector<std::string> save_safetensors(const std::string& dir, const TensorTable& tensors,
                                          const SafetensorsWriteOptions& options = {});

// Reads `path`: a .safetensors file, an index .json, or a folder holding
// model.safetensors.index.json (preferred) or model.safetensors. Every file is checked as
// read_safetensors_file does, and an index must name only files that exist and only tensors they
// hold, and every tensor of those files. Throws UsageError naming the file and what is wrong.
TensorTable load_safetensors(const std::string& path);

struct LoadIntoOptions {
  // Refuse tensors the module does not have (true), or ignore them.
  bool allow_extra = false;
  // Leave the module's tensors the table lacks as they are (true), or refuse.
  bool allow_missing = false;
};

// Copies `tensors` into `module`'s parameters and buffers of the same names (named_parameters()
// and named_buffers(), recursively), in place and without autograd: their devices stay, a dtype
// that differs is converted (a bfloat16 file into a float32 model). Checks every name and shape
// before it copies anything, so a refused table leaves the module untouched. Throws UsageError
// naming the first missing, extra or misshaped tensor (expected vs found shapes).
void load_into(torch::nn::Module& module, const TensorTable& tensors,
               const LoadIntoOptions& options = {});

}  // namespace dtrain
