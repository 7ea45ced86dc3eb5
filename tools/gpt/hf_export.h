// The transformer of gpt.h in Hugging Face's Llama form: its weights as safetensors under the
// names transformers' LlamaForCausalLM uses, with a config.json of a LlamaConfig, so that
// `LlamaForCausalLM.from_pretrained(dir)` in Python gives the logits dtrain gives; and such a
// folder (dtrain's, or one save_pretrained wrote) back into a Gpt to continue training.
//
//   gpt::export_hf(*model, "out");                       // out/config.json, out/model.safetensors
//   gpt::Gpt model = gpt::import_hf("out");              // the config from config.json
//
// Note [Hugging Face's Llama names]
// Gpt's tensors and LlamaForCausalLM's, one to one, values unchanged:
//   embedding.weight                    model.embed_tokens.weight
//   block<i>.attention_norm.weight      model.layers.<i>.input_layernorm.weight
//   block<i>.attention.w{q,k,v,o}.weight  model.layers.<i>.self_attn.{q,k,v,o}_proj.weight
//   block<i>.mlp_norm.weight            model.layers.<i>.post_attention_layernorm.weight
//   block<i>.mlp.w1.weight              model.layers.<i>.mlp.gate_proj.weight  (silu's input)
//   block<i>.mlp.w3.weight              model.layers.<i>.mlp.up_proj.weight
//   block<i>.mlp.w2.weight              model.layers.<i>.mlp.down_proj.weight
//   norm.weight                         model.norm.weight
//   head.weight                         lm_head.weight
// No permutation of the query and key rows: Meta's original Llama code rotates interleaved pairs
// (features 2j, 2j+1), and transformers' conversion script permutes wq and wk so that its
// rotate-half code (features j, j + d/2) computes the same; Gpt already rotates halves
// (gpt.cpp's rotate), with the same frequencies theta^(-2j/d) and the same 1/sqrt(d) scale, so
// its rows are already in transformers' order. tools/gpt/hf_export_test.cpp checks the logits
// against transformers' and shows that the permuted rows would be far off.
#pragma once

#include <ATen/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm.h"
#include "dtrain/safetensors.h"
#include "gpt/gpt.h"

namespace gpt {

// Note [Hugging Face's Llama names] for `config`: (Gpt's name, Hugging Face's name) in Gpt's
// order.
std::vector<std::pair<std::string, std::string>> hf_names(const GptConfig& config);

// config.json of a LlamaConfig for `config` (dtype: torch_dtype's, the weights' on disk).
std::string hf_config_json(const GptConfig& config, at::ScalarType dtype = at::kFloat);

// The GptConfig of a LlamaConfig's JSON (`source` names it in errors): seq_len is
// max_position_embeddings, mlp_width intermediate_size. Throws dtrain::UsageError with one line
// for what Gpt cannot honour: another model_type or architecture, rope_scaling or a rope_type
// other than "default", attention or MLP biases, tied embeddings, an activation other than silu,
// a head_dim other than hidden_size / num_attention_heads, or sizes gpt::GptConfig::check refuses.
GptConfig config_from_hf_json(const std::string& text, const std::string& source);

// <dir>/config.json read by config_from_hf_json.
GptConfig read_hf_config(const std::string& dir);

// The model's tensors under Hugging Face's names, whole and on the CPU in `dtype`. With a tensor
// group (Note [Tensor-parallel blocks] in gpt.h) every rank of the group must call it: the
// split layers are gathered with one all-reduce each.
dtrain::TensorTable hf_state_dict(GptImpl& model, at::ScalarType dtype = at::kFloat);

struct HfExportOptions {
  // The most tensor bytes per safetensors file (dtrain::SafetensorsWriteOptions); 0: one file.
  int64_t max_shard_bytes = 0;
  // The dtype written (the model's stay as they are): float32, or bfloat16/float16 to halve it.
  at::ScalarType dtype = at::kFloat;
};

// Writes `model` into `dir` as Hugging Face's save_pretrained would: config.json and
// model.safetensors, or shards with model.safetensors.index.json (dtrain::save_safetensors).
// Collective like hf_state_dict; only a rank with `write` true writes (rank 0, say). Throws
// dtrain::UsageError naming a file that cannot be written.
void export_hf(GptImpl& model, const std::string& dir, const HfExportOptions& options = {},
               bool write = true);

// Loads `dir`'s weights (a folder as export_hf or save_pretrained writes it) into `model`, whose
// config must have the sizes read_hf_config(dir) gives; with a tensor group each rank keeps its
// shard. Checks every name and shape first and converts the dtype (a bfloat16 export into a
// float32 model). Throws dtrain::UsageError naming the first missing, extra or misshaped tensor by
// Hugging Face's name. Local: no communication.
void load_hf(GptImpl& model, const std::string& dir);

// read_hf_config(dir), a Gpt of it (on `tensor_group` when given), load_hf.
Gpt import_hf(const std::string& dir, std::shared_ptr<dtrain::ProcessGroup> tensor_group = nullptr);

}  // namespace gpt
