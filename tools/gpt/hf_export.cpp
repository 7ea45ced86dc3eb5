// Gpt <-> Hugging Face's Llama (hf_export.h): the name map, config.json both ways, and the
// tensor-parallel layers gathered for export and sliced for import.
#include "gpt/hf_export.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dtrain/errors.h"
#include "dtrain/tensor_parallel.h"

namespace gpt {
namespace {

namespace fs = std::filesystem;

// One tensor of the model: its names, the parameter holding it on this rank, and, for a
// tensor-parallel layer, which slice of the whole tensor that is.
struct Slot {
  std::string name, hf_name;
  at::Tensor local;
  std::vector<int64_t> whole_shape;
  int64_t split_dim = -1;  // -1: whole on every rank
  int64_t begin = 0, size = 0;
  std::shared_ptr<dtrain::ProcessGroup> group;
};

// A projection of a block: torch::nn::Linear, or a column- or row-parallel shard of one.
Slot linear_slot(const torch::nn::AnyModule& layer) {
  const std::shared_ptr<torch::nn::Module> module = layer.ptr();
  Slot slot;
  if (auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(module)) {
    slot.local = linear->weight;
  } else if (auto column = std::dynamic_pointer_cast<dtrain::ColumnParallelLinearImpl>(module)) {
    slot.local = column->weight;
    slot.whole_shape = {column->out_features(), column->in_features()};
    slot.split_dim = 0;
    slot.begin = column->local_begin();
    slot.size = column->local_size();
    slot.group = column->group();
  } else if (auto row = std::dynamic_pointer_cast<dtrain::RowParallelLinearImpl>(module)) {
    slot.local = row->weight;
    slot.whole_shape = {row->out_features(), row->in_features()};
    slot.split_dim = 1;
    slot.begin = row->local_begin();
    slot.size = row->local_size();
    slot.group = row->group();
  } else {
    throw dtrain::InternalError("gpt::hf_export: a projection is a " + module->name() +
                                ", expected Linear, ColumnParallelLinear or RowParallelLinear");
  }
  if (slot.whole_shape.empty()) slot.whole_shape = slot.local.sizes().vec();
  return slot;
}

Slot whole_slot(const at::Tensor& tensor) {
  Slot slot;
  slot.local = tensor;
  slot.whole_shape = tensor.sizes().vec();
  return slot;
}

// Every tensor of `model`, in hf_names' order.
std::vector<Slot> slots_of(GptImpl& model) {
  std::vector<Slot> slots;
  slots.push_back(whole_slot(model.embedding->weight));
  for (int64_t i = 0; i < model.config().layers; ++i) {
    BlockImpl& block = model.block(i);
    slots.push_back(whole_slot(block.attention_norm->weight));
    for (auto* layer :
         {&block.attention->wq, &block.attention->wk, &block.attention->wv, &block.attention->wo}) {
      slots.push_back(linear_slot(*layer));
    }
    slots.push_back(whole_slot(block.mlp_norm->weight));
    for (auto* layer : {&block.mlp->w1, &block.mlp->w3, &block.mlp->w2})
      slots.push_back(linear_slot(*layer));
  }
  slots.push_back(whole_slot(model.norm->weight));
  slots.push_back(whole_slot(model.head->weight));
  auto names = hf_names(model.config());
  if (names.size() != slots.size()) {
    throw dtrain::InternalError("gpt::hf_export: " + std::to_string(slots.size()) +
                                " tensors but " + std::to_string(names.size()) + " names");
  }
  for (size_t i = 0; i < slots.size(); ++i) std::tie(slots[i].name, slots[i].hf_name) = names[i];
  return slots;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream text;
  text << c10::IntArrayRef(shape);
  return text.str();
}

// Writes `text` to `path` through a hidden temporary and a rename, so that a reader never sees
// half a config.json.
void write_text_atomically(const std::string& path, const std::string& text) {
  const fs::path temporary =
      fs::path(path).parent_path() / (".config.json.tmp-" + std::to_string(::getpid()));
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::error_code error;
      fs::remove(temporary, error);
      throw dtrain::UsageError("gpt::export_hf: " + path +
                               ": cannot be written; check the folder is writable and has space");
    }
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  if (error) {
    fs::remove(temporary, error);
    throw dtrain::UsageError("gpt::export_hf: " + path + ": cannot be written (" + error.message() +
                             ")");
  }
}

const char* torch_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      throw dtrain::UsageError(std::string("gpt::export_hf: dtype ") + c10::toString(dtype) +
                               ": expected float32, bfloat16 or float16");
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> hf_names(const GptConfig& config) {
  std::vector<std::pair<std::string, std::string>> names;
  names.emplace_back("embedding.weight", "model.embed_tokens.weight");
  for (int64_t i = 0; i < config.layers; ++i) {
    const std::string ours = "block" + std::to_string(i) + ".";
    const std::string theirs = "model.layers." + std::to_string(i) + ".";
    names.emplace_back(ours + "attention_norm.weight", theirs + "input_layernorm.weight");
    for (const char* p : {"q", "k", "v", "o"}) {
      names.emplace_back(ours + "attention.w" + p + ".weight",
                         theirs + "self_attn." + p + "_proj.weight");
    }
    names.emplace_back(ours + "mlp_norm.weight", theirs + "post_attention_layernorm.weight");
    names.emplace_back(ours + "mlp.w1.weight", theirs + "mlp.gate_proj.weight");
    names.emplace_back(ours + "mlp.w3.weight", theirs + "mlp.up_proj.weight");
    names.emplace_back(ours + "mlp.w2.weight", theirs + "mlp.down_proj.weight");
  }
  names.emplace_back("norm.weight", "model.norm.weight");
  names.emplace_back("head.weight", "lm_head.weight");
  return names;
}

std::string hf_config_json(const GptConfig& config, at::ScalarType dtype) {
  // rope_theta both where transformers 4 reads it and inside rope_parameters, where 5 does;
  // torch_dtype and dtype likewise.
  nlohmann::ordered_json json = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", config.vocab},
      {"hidden_size", config.width},
      {"intermediate_size", config.hidden()},
      {"num_hidden_layers", config.layers},
      {"num_attention_heads", config.heads},
      {"num_key_value_heads", config.kv_heads},
      {"head_dim", config.head_dim()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", config.seq_len},
      {"rms_norm_eps", config.norm_eps},
      {"rope_theta", config.rope_theta},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", config.rope_theta}}},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"tie_word_embeddings", false},
      {"torch_dtype", torch_dtype_name(dtype)},
      {"dtype", torch_dtype_name(dtype)}};
  return json.dump(2) + "\n";
}

GptConfig config_from_hf_json(const std::string& text, const std::string& source) {
  auto refuse = [&](const std::string& what) {
    throw dtrain::UsageError("gpt::import_hf: " + source + ": " + what);
  };
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    refuse(std::string("not valid JSON (") + e.what() + ")");
  }
  if (!json.is_object()) refuse("expected a JSON object (a LlamaConfig)");
  const std::string model_type = json.value("model_type", std::string());
  if (model_type != "llama") {
    refuse("model_type \"" + model_type +
           "\": dtrain's transformer imports \"llama\" (LlamaForCausalLM) only");
  }
  if (json.contains("architectures") && json["architectures"].is_array()) {
    for (const auto& architecture : json["architectures"]) {
      if (architecture != "LlamaForCausalLM") {
        refuse("architecture " + architecture.dump() +
               ": dtrain's transformer is a LlamaForCausalLM (a language-model head)");
      }
    }
  }
  auto integer = [&](const char* key) -> int64_t {
    if (!json.contains(key) || !json[key].is_number_integer()) {
      refuse(std::string("\"") + key + "\" is missing or not an integer");
    }
    return json[key].get<int64_t>();
  };
  auto number = [&](const char* key, double fallback) -> double {
    if (!json.contains(key) || json[key].is_null()) return fallback;
    if (!json[key].is_number()) refuse(std::string("\"") + key + "\" is not a number");
    return json[key].get<double>();
  };
  auto flag = [&](const char* key) {
    return json.contains(key) && json[key].is_boolean() && json[key].get<bool>();
  };
  if (flag("attention_bias") || flag("mlp_bias")) {
    refuse("attention_bias or mlp_bias is true: dtrain's projections have no biases");
  }
  if (flag("tie_word_embeddings")) {
    refuse(
        "tie_word_embeddings is true: dtrain's head and embedding are separate tensors; untie "
        "them in Python (model.lm_head.weight = nn.Parameter(model.lm_head.weight.clone()), "
        "config.tie_word_embeddings = False) and save again");
  }
  const std::string act = json.value("hidden_act", std::string("silu"));
  if (act != "silu") refuse("hidden_act \"" + act + "\": dtrain's MLP is SwiGLU (silu)");
  if (json.contains("rope_scaling") && !json["rope_scaling"].is_null()) {
    refuse("rope_scaling " + json["rope_scaling"].dump() +
           ": dtrain's rotary embeddings have no scaling (only rope_type \"default\")");
  }
  double rope_theta = number("rope_theta", 10000.0);
  if (json.contains("rope_parameters") && !json["rope_parameters"].is_null()) {
    const auto& rope = json["rope_parameters"];
    if (!rope.is_object()) refuse("rope_parameters " + rope.dump() + " is not an object");
    const std::string type = rope.value("rope_type", std::string("default"));
    if (type != "default") {
      refuse("rope_parameters' rope_type \"" + type +
             "\": dtrain's rotary embeddings have no scaling (only \"default\")");
    }
    if (rope.contains("rope_theta") && rope["rope_theta"].is_number()) {
      rope_theta = rope["rope_theta"].get<double>();
    }
  }
  GptConfig config;
  config.vocab = integer("vocab_size");
  config.width = integer("hidden_size");
  config.mlp_width = integer("intermediate_size");
  config.layers = integer("num_hidden_layers");
  config.heads = integer("num_attention_heads");
  config.kv_heads = json.contains("num_key_value_heads") && !json["num_key_value_heads"].is_null()
                        ? integer("num_key_value_heads")
                        : config.heads;
  config.seq_len = json.contains("max_position_embeddings") ? integer("max_position_embeddings")
                                                            : 2048;  // LlamaConfig's default
  config.norm_eps = number("rms_norm_eps", 1e-6);
  config.rope_theta = rope_theta;
  if (config.heads > 0 && json.contains("head_dim") && !json["head_dim"].is_null() &&
      integer("head_dim") != config.width / config.heads) {
    refuse("head_dim " + std::to_string(integer("head_dim")) + " is not hidden_size / " +
           "num_attention_heads = " + std::to_string(config.width / config.heads) +
           ": dtrain's heads split the width evenly");
  }
  try {
    config.check();
  } catch (const dtrain::UsageError& e) {
    refuse(e.what());
  }
  return config;
}

GptConfig read_hf_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw dtrain::UsageError("gpt::import_hf: " + path +
                             ": cannot be read; expected a folder as save_pretrained or "
                             "train_gpt --export-hf writes it");
  }
  std::stringstream text;
  text << in.rdbuf();
  return config_from_hf_json(text.str(), path);
}

dtrain::TensorTable hf_state_dict(GptImpl& model, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  dtrain::TensorTable table;
  for (const Slot& slot : slots_of(model)) {
    at::Tensor whole = slot.local.detach();
    if (slot.group) {
      // Each rank's slice into a zero tensor of the whole shape; the sum over the group is the
      // whole tensor (x + 0 = x, exact in floating point).
      whole = at::zeros(slot.whole_shape, slot.local.options());
      whole.narrow(slot.split_dim, slot.begin, slot.size).copy_(slot.local);
      slot.group->all_reduce(whole);
    }
    table.insert(slot.hf_name, whole.to(at::kCPU, dtype).contiguous());
  }
  return table;
}

void export_hf(GptImpl& model, const std::string& dir, const HfExportOptions& options, bool write) {
  torch_dtype_name(options.dtype);  // refuses another dtype before the collectives
  dtrain::TensorTable table = hf_state_dict(model, options.dtype);
  if (!write) return;
  dtrain::SafetensorsWriteOptions write_options;
  write_options.max_shard_bytes = options.max_shard_bytes;
  dtrain::save_safetensors(dir, table, write_options);
  write_text_atomically((fs::path(dir) / "config.json").string(),
                        hf_config_json(model.config(), options.dtype));
}

void load_hf(GptImpl& model, const std::string& dir) {
  dtrain::TensorTable table = dtrain::load_safetensors(dir);
  std::vector<Slot> slots = slots_of(model);
  dtrain::TensorTable ours;
  for (const Slot& slot : slots) {
    const at::Tensor* found = table.find(slot.hf_name);
    if (!found) {
      throw dtrain::UsageError("gpt::import_hf: " + dir + " has no tensor '" + slot.hf_name +
                               "' (expected " + shape_text(slot.whole_shape) +
                               "); is it a LlamaForCausalLM of the config.json beside it?");
    }
    if (found->sizes() != c10::IntArrayRef(slot.whole_shape)) {
      throw dtrain::UsageError("gpt::import_hf: " + dir + ": tensor '" + slot.hf_name + "' is " +
                               shape_text(found->sizes().vec()) + ", expected " +
                               shape_text(slot.whole_shape) + " from its config.json");
    }
    ours.insert(slot.name,
                slot.group ? found->narrow(slot.split_dim, slot.begin, slot.size) : *found);
  }
  std::set<std::string> expected;
  for (const Slot& slot : slots) expected.insert(slot.hf_name);
  for (const auto& item : table) {
    // transformers before 4.31 saved each layer's rotary frequencies; they follow from the config.
    const std::string& name = item.key();
    const std::string derived = "rotary_emb.inv_freq";
    if (name.size() >= derived.size() &&
        name.compare(name.size() - derived.size(), derived.size(), derived) == 0) {
      continue;
    }
    if (!expected.count(name)) {
      throw dtrain::UsageError("gpt::import_hf: " + dir + " has tensor '" + name +
                               "', which dtrain's transformer lacks (Note [Hugging Face's Llama "
                               "names] in tools/gpt/hf_export.h lists what it has)");
    }
  }
  dtrain::load_into(model, ours);
}

Gpt import_hf(const std::string& dir, std::shared_ptr<dtrain::ProcessGroup> tensor_group) {
  Gpt model(read_hf_config(dir), std::move(tensor_group));
  load_hf(*model, dir);
  return model;
}

}  // namespace gpt
