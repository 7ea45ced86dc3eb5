// The transformer as Hugging Face's Llama (hf_export.h): the config round-trips and what Gpt cannot
// honour is refused in one line; export then import is the same model, sharded or not, bfloat16
// or not, whole or tensor-parallel; and against Python's transformers (the project environment's):
// LlamaForCausalLM loads what train_gpt exported and gives its logits (while the q/k-permuted or
// gate/up-swapped maps would be far off), and train_gpt imports a sharded save_pretrained folder,
// gives transformers' logits and trains on from it.
#include "gpt/hf_export.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "datasets/text_corpus.h"
#include "dtrain/errors.h"
#include "dtrain/safetensors.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace gpt {
namespace {

namespace fs = std::filesystem;
using dtrain::testing::bin;
using dtrain::testing::json_number;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;

GptConfig small() {
  GptConfig config;
  config.layers = 2;
  config.width = 32;
  config.heads = 4;
  config.kv_heads = 2;
  config.seq_len = 16;
  config.mlp_width = 40;
  config.rope_theta = 500000.0;
  config.norm_eps = 1e-6;
  return config;
}

template <typename F>
std::string error_of(F&& body) {
  try {
    body();
  } catch (const dtrain::UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

TEST(HfExport, TheNameMapIsLlamasAndTheConfigRoundTrips) {
  auto names = hf_names(small());
  ASSERT_EQ(names.size(), 1u + 2 * 9 + 2);
  Gpt model(small());
  auto ours = model->named_parameters();
  ASSERT_EQ(ours.size(), names.size());
  for (const auto& [name, hf_name] : names) EXPECT_TRUE(ours.contains(name)) << name;
  EXPECT_EQ(names[0].second, "model.embed_tokens.weight");
  EXPECT_EQ(names[1], std::make_pair(std::string("block0.attention_norm.weight"),
                                     std::string("model.layers.0.input_layernorm.weight")));
  EXPECT_EQ(names[6].second, "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(names[7], std::make_pair(std::string("block0.mlp.w1.weight"),
                                     std::string("model.layers.0.mlp.gate_proj.weight")));
  EXPECT_EQ(names.back().second, "lm_head.weight");

  const std::string json = hf_config_json(small(), at::kBFloat16);
  auto parsed = nlohmann::json::parse(json);
  EXPECT_EQ(parsed["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(parsed["intermediate_size"], 40);
  EXPECT_EQ(parsed["torch_dtype"], "bfloat16");
  GptConfig back = config_from_hf_json(json, "config.json");
  EXPECT_EQ(back.vocab, 256);
  EXPECT_EQ(back.layers, 2);
  EXPECT_EQ(back.width, 32);
  EXPECT_EQ(back.heads, 4);
  EXPECT_EQ(back.kv_heads, 2);
  EXPECT_EQ(back.seq_len, 16);
  EXPECT_EQ(back.hidden(), 40);
  EXPECT_EQ(back.rope_theta, 500000.0);
  EXPECT_EQ(back.norm_eps, 1e-6);

  // transformers 4's form: rope_theta at the top, no head_dim, no num_key_value_heads (MHA).
  GptConfig v4 = config_from_hf_json(
      R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 1234.0,
          "rope_scaling": null, "rms_norm_eps": 1e-5, "max_position_embeddings": 32})",
      "v4.json");
  EXPECT_EQ(v4.kv_heads, 4);
  EXPECT_EQ(v4.rope_theta, 1234.0);
}

TEST(HfExport, AConfigGptCannotHonourIsOneLineNamingIt) {
  auto with = [](const std::string& key, nlohmann::json value) {
    auto json = nlohmann::json::parse(hf_config_json(small()));
    json[key] = std::move(value);
    return json.dump();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with("rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}), "rope_scaling"},
      {with("rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 1e4}}), "rope_type \"yarn\""},
      {with("attention_bias", true), "attention_bias"},
      {with("mlp_bias", true), "mlp_bias"},
      {with("tie_word_embeddings", true), "tie_word_embeddings"},
      {with("model_type", "mistral"), "model_type \"mistral\""},
      {with("architectures", {"LlamaForSequenceClassification"}), "LlamaForSequenceClassification"},
      {with("hidden_act", "gelu"), "hidden_act \"gelu\""},
      {with("head_dim", 16), "head_dim 16"},
      {with("num_key_value_heads", 3), "kv_heads 3"},
      {with("hidden_size", "64"), "\"hidden_size\" is missing or not an integer"},
      {"{", "not valid JSON"}};
  for (const auto& [json, expected] : cases) {
    SCOPED_TRACE(expected);
    const std::string message = error_of([&] { config_from_hf_json(json, "dir/config.json"); });
    EXPECT_NE(message.find("dir/config.json: "), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

void expect_same_parameters(GptImpl& a, GptImpl& b, at::ScalarType via = at::kFloat) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value().to(via).to(at::kFloat), pb[item.key()])) << item.key();
  }
}

TEST(HfExport, ExportThenImportIsTheSameModelShardedOrNotInEitherDtype) {
  const std::string dir = temp_dir("hf-export");
  torch::manual_seed(5);
  Gpt model(small());
  HfExportOptions options;
  options.max_shard_bytes = 10'000;  // 2 x ~26 KB blocks, 32 KB embedding and head: several files
  export_hf(*model, dir, options);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_GT(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 4);
  Gpt imported = import_hf(dir);
  expect_same_parameters(*model, *imported);
  at::Tensor tokens = torch::randint(256, {2, 16});
  EXPECT_TRUE(torch::equal(model(tokens), imported(tokens)));

  // bfloat16 on disk, float32 again in the model: the values rounded once.
  options.max_shard_bytes = 0;
  options.dtype = at::kBFloat16;
  export_hf(*model, dir, options);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2)
      << "config.json and model.safetensors, the shards gone";
  EXPECT_EQ(dtrain::read_safetensors_file(dir + "/model.safetensors")
                .tensors["lm_head.weight"]
                .scalar_type(),
            at::kBFloat16);
  Gpt rounded = import_hf(dir);
  expect_same_parameters(*model, *rounded, at::kBFloat16);

  // A folder of another model is refused by name before anything is loaded.
  GptConfig wider = small();
  wider.mlp_width = 48;
  Gpt other(wider);
  std::string message = error_of([&] { load_hf(*other, dir); });
  EXPECT_NE(message.find("'model.layers.0.mlp.gate_proj.weight' is [40, 32], expected [48, 32]"),
            std::string::npos)
      << message;
  dtrain::TensorTable table = dtrain::load_safetensors(dir);
  table.erase("model.norm.weight");
  table.insert("model.layers.0.self_attn.q_norm.weight", torch::ones({8}));
  dtrain::save_safetensors(dir, table);
  message = error_of([&] { import_hf(dir); });
  EXPECT_NE(message.find("has no tensor 'model.norm.weight' (expected [32])"), std::string::npos)
      << message;
  fs::remove_all(dir);
}

// Tensor-parallel ranks export the whole tensors the single-device model of the same seed has,
// and import slices them back.
TEST(HfExport, TensorParallelRanksGatherOnExportAndSliceOnImport) {
  GptConfig config = small();
  config.mlp_width = 42;  // 21 hidden features per rank
  const std::string whole_dir = temp_dir("hf-export-whole"), split_dir = temp_dir("hf-export-tp");
  torch::manual_seed(9);
  Gpt reference(config);
  export_hf(*reference, whole_dir);
  std::mutex seed_mutex;
  dtrain::testing::run_group(2, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    Gpt model{nullptr}, fresh{nullptr};
    {
      std::lock_guard<std::mutex> lock(seed_mutex);
      torch::manual_seed(9);
      model = Gpt(config, pg);
      fresh = Gpt(config, pg);  // other weights: the next draw
    }
    export_hf(*model, split_dir, {}, /*write=*/rank == 0);
    load_hf(*fresh, whole_dir);
    auto want = model->named_parameters();
    for (const auto& item : fresh->named_parameters()) {
      EXPECT_TRUE(torch::equal(item.value(), want[item.key()])) << rank << " " << item.key();
    }
  });
  auto whole = dtrain::load_safetensors(whole_dir), split = dtrain::load_safetensors(split_dir);
  ASSERT_EQ(whole.size(), split.size());
  for (const auto& item : whole) {
    EXPECT_TRUE(torch::equal(item.value(), split[item.key()])) << item.key();
  }
  fs::remove_all(whole_dir);
  fs::remove_all(split_dir);
}

// ---- train_gpt against Python's transformers

// The test's Python, or the reason to skip.
std::string python_with_transformers(std::string* why) {
  const std::string& python = dtrain::testing::python_with_torch();
  if (python.empty()) {
    *why = dtrain::testing::kNoPythonWithTorch;
    return "";
  }
  if (run_command("'" + python + "' -c 'import transformers, safetensors'").exit_code != 0) {
    *why = python + " lacks transformers or safetensors (scripts/bootstrap installs them)";
    return "";
  }
  return python;
}

std::string script() { return DTRAIN_SOURCE_DIR "/tests/python/hf_llama.py"; }

const std::string kSmall =
    " --layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 32 --batch-size 8"
    " --max-bytes 2000000 --log-every 0 --device cpu";

bool have_corpus() { return fs::exists(datasets::default_text_corpus()); }

// float32 logits of a few units computed by two implementations: about 1e-6 apart. A wrong map
// moves them by 1e-1 or more (the script measures two).
constexpr double kLogitTolerance = 1e-4;

TEST(TrainGptHf, TransformersLoadsTheExportAndGivesTheSameLogits) {
  if (!have_corpus()) GTEST_SKIP() << "needs the text corpus " << datasets::default_text_corpus();
  std::string why;
  const std::string python = python_with_transformers(&why);
  if (python.empty()) GTEST_SKIP() << why;
  const std::string dir = temp_dir("hf-train-export");
  const std::vector<std::string> layouts = {"", " --tp 2", " --zero 3 --export-hf-max-shard 60000",
                                            " --pp 2 --schedule zbh1"};
  std::string pairs;  // "DIR LOGITS" of each layout, for one Python start
  for (size_t i = 0; i < layouts.size(); ++i) {
    SCOPED_TRACE("layout:" + layouts[i]);
    const std::string model = dir + "/model" + std::to_string(i);
    const std::string logits = dir + "/logits" + std::to_string(i) + ".safetensors";
    auto run = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_gpt") +
                           kSmall + " --steps 30" + layouts[i] + " --export-hf " + model +
                           " --logits-out " + logits);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    pairs += " " + model + " " + logits;
  }
  EXPECT_TRUE(fs::exists(dir + "/model2/model.safetensors.index.json")) << "--zero 3 sharded";
  auto compare = run_command("'" + python + "' " + script() + " compare" + pairs + " --tolerance " +
                                 std::to_string(kLogitTolerance),
                             300);
  ASSERT_EQ(compare.exit_code, 0) << compare.output;
  // One JSON line per layout, in order.
  std::istringstream lines(compare.output);
  std::string line;
  size_t i = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("{\"dir\"", 0) != 0) continue;
    ASSERT_LT(i, layouts.size()) << compare.output;
    SCOPED_TRACE("layout:" + layouts[i++] + " " + line);
    EXPECT_LT(json_number(line, "max_abs_diff"), kLogitTolerance);
    EXPECT_GT(json_number(line, "max_abs_logit"), 1.0);  // trained: logits of a few units
    EXPECT_GT(json_number(line, "max_abs_diff_permuted_qk"), 100 * kLogitTolerance);
    EXPECT_GT(json_number(line, "max_abs_diff_swapped_gate_up"), 100 * kLogitTolerance);
  }
  EXPECT_EQ(i, layouts.size()) << compare.output;
  fs::remove_all(dir);
}

// The largest |a - b|.
double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(TrainGptHf, ImportsASavePretrainedFolderAndTrainsOn) {
  if (!have_corpus()) GTEST_SKIP() << "needs the text corpus " << datasets::default_text_corpus();
  std::string why;
  const std::string python = python_with_transformers(&why);
  if (python.empty()) GTEST_SKIP() << why;
  const std::string dir = temp_dir("hf-train-import");
  auto make = run_command(
      "'" + python + "' " + script() + " make " + dir + "/model " + dir + "/reference.safetensors",
      300);
  ASSERT_EQ(make.exit_code, 0) << make.output;
  EXPECT_GT(json_number(make.output, "shards"), 1) << make.output;  // sharded, with an index
  auto reference = dtrain::load_safetensors(dir + "/reference.safetensors");

  const std::string init =
      " --max-bytes 2000000 --log-every 0 --device cpu --batch-size 8"
      " --seq-len 32 --steps 20 --init-hf " +
      dir + "/model --logits-tokens " + dir + "/reference.safetensors";
  // With --pp every rank loads the whole model and its stage trains its own blocks.
  for (const std::string& layout :
       {std::string(""), std::string(" --tp 2"), std::string(" --pp 2 --schedule zbh1")}) {
    SCOPED_TRACE("layout:" + layout);
    auto run = run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_gpt") + init +
                           layout + " --logits-out " + dir + "/logits.safetensors");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    auto logits = dtrain::load_safetensors(dir + "/logits.safetensors");
    EXPECT_TRUE(torch::equal(logits["tokens"], reference["tokens"]));
    EXPECT_LT(max_abs_diff(logits["logits_before"], reference["logits"]), kLogitTolerance);
    EXPECT_GT(reference["logits"].abs().max().item<double>(), 1.0);
    const double first = json_number(run.output, "first_loss");
    const double last = json_number(run.output, "train_loss");
    EXPECT_TRUE(std::isfinite(first) && first > 0) << run.output;
    EXPECT_LT(last, first - 0.5) << run.output;
  }

  // Size flags that contradict config.json, and a folder that is not there: one line, 2.
  for (const std::string& flags : {std::string(" --init-hf " + dir + "/model --width 32"),
                                   std::string(" --init-hf " + dir + "/model --seq-len 4096"),
                                   std::string(" --init-hf " + dir + "/nowhere")}) {
    SCOPED_TRACE(flags);
    auto run =
        run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_gpt") + flags);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_NE(run.output.find("train_gpt: "), std::string::npos) << run.output;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gpt
