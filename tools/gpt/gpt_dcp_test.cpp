// The GPT layouts and torch.distributed.checkpoint's safetensors storage (Note [DCP export of a
// layout] in parallelize.cpp). Tier 1 (thread-ranks): DDP, ZeRO-3, tensor, pipeline, tensor x
// pipeline and ZeRO-3 over tensor layouts export, after two AdamW steps, exactly the whole state
// their layout-neutral checkpoint holds; tensor, tensor x pipeline and ZeRO-3 over tensor layouts
// load such a folder exactly (exported again, it is the same) and train on as one process does
// from it; a folder of the model alone
// starts AdamW afresh; a damaged folder is named on every rank and loads nothing. With PyTorch
// 2.15 (tests/python/gpt_dcp_interop.py): what train_gpt --tp 2 --pp 2 exports loads in Python into
// an unsharded model and AdamW, exactly; what FSDP2 at 2 ranks saves loads into a tensor x pipeline
// layout exactly, and into train_gpt, which trains on from it as one process does.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "datasets/text_corpus.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data.h"
#include "dtrain/dcp.h"
#include "dtrain/errors.h"
#include "dtrain/safetensors.h"
#include "dtrain/sharded_checkpoint.h"
#include "gpt/parallelize.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace gpt {
namespace {

namespace fs = std::filesystem;

GptConfig tiny() {
  GptConfig config;
  config.seq_len = 16;
  config.layers = 2;
  config.width = 32;
  config.heads = 4;
  config.kv_heads = 2;
  return config;
}

constexpr int64_t kRows = 4;  // windows per step (every layout here has one replica, or DDP's 2)
constexpr double kLr = 0.01;

LayoutOptions layout(int dp, int tp, int pp, int zero = 0) {
  LayoutOptions options;
  options.dp = dp;
  options.tp = tp;
  options.pp = pp;
  options.zero = zero;
  options.micro_batches = 2;
  return options;
}

std::string name_of(const LayoutOptions& o) {
  return "dp" + std::to_string(o.dp) + "-tp" + std::to_string(o.tp) + "-pp" + std::to_string(o.pp) +
         "-zero" + std::to_string(o.zero);
}

// A module's parameters and AdamW's state under the names of a DCP folder (as ZeRO's export and
// PyTorch's get_optimizer_state_dict flattened: optim.state.<name>.exp_avg, .exp_avg_sq, .step).
dtrain::TensorTable state_table(torch::nn::Module& module, torch::optim::AdamW& adamw) {
  dtrain::TensorTable table;
  for (const auto& item : module.named_parameters()) table.insert(item.key(), item.value().clone());
  for (const auto& item : module.named_parameters()) {
    auto it = adamw.state().find(item.value().unsafeGetTensorImpl());
    if (it == adamw.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    const std::string prefix = "optim.state." + item.key() + ".";
    table.insert(prefix + "exp_avg", s.exp_avg().clone());
    table.insert(prefix + "exp_avg_sq", s.exp_avg_sq().clone());
    table.insert(prefix + "step", at::scalar_tensor(static_cast<double>(s.step()), at::kFloat));
  }
  return table;
}

// The whole state of the layout-neutral checkpoint in `dir`, as one process loads it.
dtrain::TensorTable checkpoint_table(const GptConfig& config, const std::string& dir) {
  Gpt model(config);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(kLr));
  dtrain::CheckpointOptions options;
  options.dir = dir;
  dtrain::TrainingState full;
  full.model = model.get();
  full.optimizer = &adamw;
  full.rng = false;
  EXPECT_TRUE(dtrain::load_sharded_as_full(options, full).has_value()) << dir;
  return state_table(*model, adamw);
}

// tolerance 0: equal exactly; else every tensor within that relative 2-norm of its difference.
void expect_tables(const dtrain::TensorTable& expected, const dtrain::TensorTable& actual,
                   const std::string& what, double tolerance = 0) {
  const std::vector<std::string> want = expected.keys(), got = actual.keys();
  EXPECT_EQ(std::set<std::string>(want.begin(), want.end()),
            std::set<std::string>(got.begin(), got.end()))
      << what;
  for (const auto& item : expected) {
    const at::Tensor* got = actual.find(item.key());
    if (!got) continue;
    ASSERT_EQ(got->sizes(), item.value().sizes()) << what << ": " << item.key();
    if (tolerance == 0) {
      EXPECT_TRUE(torch::equal(*got, item.value())) << what << ": " << item.key() << " differs";
    } else {
      const double error = (*got - item.value()).norm().item<double>() /
                           std::max(item.value().norm().item<double>(), 1e-12);
      EXPECT_LT(error, tolerance) << what << ": " << item.key();
    }
  }
}

// Runs `body` on `world` thread-ranks, each with the model of `config` (drawn under `seed`) in
// `options` and an AdamW over what it holds.
void run_layout(const LayoutOptions& options, int world, uint64_t seed,
                const std::function<void(Parallel&, torch::optim::AdamW&,
                                         const std::shared_ptr<dtrain::ProcessGroup>&)>& body,
                const GptConfig& config = tiny()) {
  std::mutex seed_mutex;  // the thread-ranks share one generator
  dtrain::testing::run_group(world, [&](int rank, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    dtrain::RankMesh mesh = make_mesh(options, pg);
    Gpt model{nullptr};
    {
      std::lock_guard<std::mutex> lock(seed_mutex);
      torch::manual_seed(seed);
      model = make_model(config, options, mesh);
    }
    Parallel parallel(model, options, mesh, pg, c10::Device(c10::kCPU));
    torch::optim::AdamW adamw(parallel.parameters(), torch::optim::AdamWOptions(kLr));
    body(parallel, adamw, pg);
  });
}

// `steps` AdamW steps on the rows of `data` ([steps, replicas * kRows, seq + 1]) of this replica.
void train(Parallel& parallel, torch::optim::AdamW& adamw, const at::Tensor& data,
           int64_t first_step, int64_t steps) {
  const int64_t seq = tiny().seq_len;
  for (int64_t s = first_step; s < first_step + steps; ++s) {
    at::Tensor mine = data[s].narrow(0, parallel.mesh().data_index * kRows, kRows);
    adamw.zero_grad();
    parallel.forward_backward(mine.narrow(1, 0, seq), mine.narrow(1, 1, seq));
    adamw.step();
  }
}

at::Tensor fixed_data() {
  torch::manual_seed(7);
  return torch::randint(256, {3, 2 * kRows, tiny().seq_len + 1});
}

void save_checkpoint(Parallel& parallel, torch::optim::AdamW& adamw,
                     const std::shared_ptr<dtrain::ProcessGroup>& pg, const std::string& dir) {
  dtrain::CheckpointOptions options;
  options.dir = dir;
  dtrain::ShardedCheckpointer checkpointer(options, pg);
  dtrain::DistributedSampler sampler(64, parallel.data_group());
  parallel.save(checkpointer, adamw, sampler, 2);
}

// Also with a hidden width that does not divide by the tensor ranks (91: 46 and 45 features; the
// row-parallel w2's columns gathered unevenly), and ZeRO-3 over 2 pipelines' replicas. The
// checkpoint, read back whole by one process, holds every tensor rank's trained parameters in its
// place; an uneven export loads into tensor 2 x pipeline 2 of the same width and exports again as
// the same folder (every rank reading its rows, or its columns of the whole).
TEST(GptDcp, EveryLayoutExportsExactlyWhatItsCheckpointHolds) {
  const std::string dir = dtrain::testing::temp_dir("dtrain-gpt-dcp-export");
  const at::Tensor data = fixed_data();
  GptConfig uneven = tiny();
  uneven.mlp_width = 91;
  for (const auto& [options, world, config] :
       {std::tuple{layout(2, 1, 1), 2, tiny()}, std::tuple{layout(2, 1, 1, 3), 2, tiny()},
        std::tuple{layout(1, 2, 1), 2, tiny()}, std::tuple{layout(1, 1, 2), 2, tiny()},
        std::tuple{layout(1, 2, 2), 4, tiny()}, std::tuple{layout(2, 2, 1, 3), 4, tiny()},
        std::tuple{layout(2, 1, 2, 3), 4, tiny()}, std::tuple{layout(1, 2, 1), 2, uneven},
        std::tuple{layout(1, 2, 2), 4, uneven}, std::tuple{layout(2, 2, 1, 3), 4, uneven}}) {
    const std::string name = name_of(options) + (config.mlp_width ? "-hidden91" : "");
    SCOPED_TRACE(name);
    const std::string exported = dir + "/" + name, checkpoint = exported + "-ckpt";
    // Replica 0's parameters, by tensor rank and name.
    std::map<std::pair<int, std::string>, at::Tensor> trained;
    std::mutex mutex;
    run_layout(
        options, world, 3,
        [&](Parallel& parallel, torch::optim::AdamW& adamw, auto& pg) {
          train(parallel, adamw, data, 0, 2);
          save_checkpoint(parallel, adamw, pg, checkpoint);
          parallel.export_dcp(exported, adamw);
          parallel.gather_full_parameters();
          std::lock_guard<std::mutex> lock(mutex);
          if (parallel.mesh().data_index != 0) return;
          for (const auto& [key, p] : parallel.named_parameters()) {
            trained[{parallel.mesh().tensor_index, key}] = p.detach().clone();
          }
        },
        config);
    const dtrain::TensorTable expected = checkpoint_table(config, checkpoint);
    EXPECT_EQ(expected.size(), (3 + 9 * 2) * 4u);  // 21 parameters and 3 AdamW tensors each
    expect_tables(expected, dtrain::load_dcp_safetensors(exported), "the export");
    ASSERT_EQ(trained.size(), 21u * options.tp);
    for (const auto& [where, p] : trained) {
      const auto& [t, key] = where;
      // A split projection's share: as the layers cut it, the first size % T ranks one more.
      at::Tensor whole = *expected.find(key);
      if (!whole.sizes().equals(p.sizes())) {
        const int64_t dim = p.size(0) != whole.size(0) ? 0 : 1, size = whole.size(dim);
        const int64_t base = size / options.tp, extra = size % options.tp;
        whole = whole.narrow(dim, t * base + std::min<int64_t>(t, extra), p.size(dim));
      }
      EXPECT_TRUE(torch::equal(whole, p)) << key << " on tensor rank " << t;
    }
    if (config.mlp_width != 0 && options.pp == 1 && options.zero == 0) {
      const std::string again = exported + "-again";
      run_layout(
          layout(1, 2, 2), 4, 99,
          [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
            parallel.load_dcp(exported, adamw);
            parallel.export_dcp(again, adamw);
          },
          config);
      expect_tables(dtrain::load_dcp_safetensors(exported), dtrain::load_dcp_safetensors(again),
                    "loaded into tp 2 x pp 2 and exported again");
    }
  }
  fs::remove_all(dir);
}

// A folder of another layout (ZeRO-3 at 2 ranks) loads into tensor and tensor x pipeline layouts
// whose own draw differs, exactly: exported again it is the same folder. One more AdamW step there
// ends where one process that loaded the folder ends (within float32's reduction-order noise).
TEST(GptDcp, TensorAndPipelineLayoutsLoadAFolderExactlyAndTrainOn) {
  const std::string dir = dtrain::testing::temp_dir("dtrain-gpt-dcp-load");
  const at::Tensor data = fixed_data();
  const std::string from = dir + "/zero3";
  run_layout(layout(2, 1, 1, 3), 2, 3, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
    train(parallel, adamw, data, 0, 2);
    parallel.export_dcp(from, adamw);
  });
  const dtrain::TensorTable folder = dtrain::load_dcp_safetensors(from);
  // One process: the whole batch of step 2 (both replicas' rows).
  const std::string one = dir + "/one";
  run_layout(layout(1, 1, 1), 1, 11, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
    parallel.load_dcp(from, adamw);
    const int64_t seq = tiny().seq_len;
    adamw.zero_grad();
    parallel.forward_backward(data[2].narrow(1, 0, seq), data[2].narrow(1, 1, seq));
    adamw.step();
    parallel.export_dcp(one, adamw);
  });
  for (const auto& [options, world] : {std::pair{layout(1, 2, 1), 2}, std::pair{layout(1, 2, 2), 4},
                                       std::pair{layout(2, 2, 1, 3), 4}}) {
    SCOPED_TRACE(name_of(options));
    const std::string again = dir + "/" + name_of(options), on = again + "-on";
    run_layout(options, world, 99, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
      parallel.load_dcp(from, adamw);
      parallel.export_dcp(again, adamw);
      // Every replica takes the whole batch, as the one process did (with two, the same gradient).
      const int64_t seq = tiny().seq_len;
      adamw.zero_grad();
      parallel.forward_backward(data[2].narrow(1, 0, seq), data[2].narrow(1, 1, seq));
      adamw.step();
      parallel.export_dcp(on, adamw);
    });
    expect_tables(folder, dtrain::load_dcp_safetensors(again), "loaded and exported again");
    expect_tables(dtrain::load_dcp_safetensors(one), dtrain::load_dcp_safetensors(on),
                  "one more step", 1e-4);
  }
  fs::remove_all(dir);
}

// A folder of the model alone (a plain dcp.save of model.state_dict() is one; here an export before
// the first step) loads into a tensor x pipeline layout that has stepped: the parameters exactly,
// and AdamW starts afresh (its moments cleared, not kept from before).
TEST(GptDcp, AFolderOfTheModelAloneStartsAdamWAfresh) {
  const std::string dir = dtrain::testing::temp_dir("dtrain-gpt-dcp-model");
  const std::string model = dir + "/model", again = dir + "/again";
  run_layout(layout(1, 1, 1), 1, 3, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
    parallel.export_dcp(model, adamw);
  });
  EXPECT_FALSE(dtrain::dcp_has_optimizer_state(model));
  run_layout(layout(1, 2, 2), 4, 99, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
    train(parallel, adamw, fixed_data(), 0, 1);
    EXPECT_FALSE(adamw.state().empty());
    parallel.load_dcp(model, adamw);
    EXPECT_TRUE(adamw.state().empty()) << "AdamW kept the moments of before the load";
    parallel.export_dcp(again, adamw);
  });
  expect_tables(dtrain::load_dcp_safetensors(model), dtrain::load_dcp_safetensors(again),
                "the model loaded at tp 2 x pp 2 and exported again");
  fs::remove_all(dir);
}

// A tensor x pipeline export with a rank's file truncated, a byte of its data flipped, or the file
// missing: a tensor layout refuses it on both ranks, naming the file, and keeps its parameters.
TEST(GptDcp, DamagedFolderIsNamedAndNotLoaded) {
  const std::string dir = dtrain::testing::temp_dir("dtrain-gpt-dcp-damage");
  const std::string good = dir + "/good";
  run_layout(layout(1, 2, 2), 4, 3, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto&) {
    train(parallel, adamw, fixed_data(), 0, 1);
    parallel.export_dcp(good, adamw);
  });
  const std::string part = "shard-00003-part-0.safetensors";
  struct Damage {
    std::string what, expected;
    std::function<void(const std::string&)> apply;
  };
  const std::vector<Damage> damages = {
      {"truncated", part + ": truncated",
       [&](const std::string& file) { fs::resize_file(file, fs::file_size(file) - 4); }},
      {"a byte flipped", part + ": the tensors' data has CRC-32",
       [&](const std::string& file) {
         std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
         stream.seekg(-3, std::ios::end);
         char byte = 0;
         stream.read(&byte, 1);
         byte ^= 0x10;
         stream.seekp(-3, std::ios::end);
         stream.write(&byte, 1);
       }},
      {"missing", "the export's file " + part + " (listed in dtrain_dcp_index.json) is missing",
       [&](const std::string& file) { fs::remove(file); }},
  };
  for (const auto& damage : damages) {
    SCOPED_TRACE(damage.what);
    const std::string copy = dir + "/broken";
    fs::remove_all(copy);
    fs::copy(good, copy);
    damage.apply(copy + "/" + part);
    std::vector<std::string> errors(2);
    run_layout(
        layout(1, 2, 1), 2, 99, [&](Parallel& parallel, torch::optim::AdamW& adamw, auto& pg) {
          std::vector<at::Tensor> before;
          for (const auto& p : parallel.parameters()) before.push_back(p.detach().clone());
          try {
            parallel.load_dcp(copy, adamw);
          } catch (const dtrain::UsageError& e) {
            errors[pg->rank()] = e.what();
          }
          for (size_t i = 0; i < before.size(); ++i)
            EXPECT_TRUE(torch::equal(before[i], parallel.parameters()[i])) << "loaded anyway";
          EXPECT_TRUE(adamw.state().empty()) << "optimizer state loaded anyway";
        });
    EXPECT_FALSE(errors[0].empty() || errors[1].empty()) << "a rank loaded";
    EXPECT_TRUE(errors[0].find(damage.expected) != std::string::npos ||
                errors[1].find(damage.expected) != std::string::npos)
        << errors[0] << "\n"
        << errors[1];
  }
  fs::remove_all(dir);
}

// ---- with PyTorch 2.15 and train_gpt ----

using dtrain::testing::bin;
using dtrain::testing::json_number;
using dtrain::testing::run_command;

const std::string kSmall =
    " --layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 32 --batch-size 4 --micro-batches 2 "
    "--max-bytes 200000 --eval-windows 8 --log-every 0 --device cpu";

GptConfig small() {
  GptConfig config;
  config.layers = 2;
  config.width = 64;
  config.heads = 4;
  config.kv_heads = 2;
  config.seq_len = 32;
  return config;
}

std::string launch(int ranks) {
  return bin("dtrain") + " run --nproc-per-node " + std::to_string(ranks) + " -- ";
}

TEST(GptDcpInterop, PyTorchLoadsATensorPipelineExportAndTrainGptLoadsWhatFsdp2Saved) {
  const std::string python = dtrain::testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << dtrain::testing::kNoPythonWithTorch;
  if (!fs::exists(datasets::default_text_corpus())) {
    GTEST_SKIP() << "needs the text corpus " << datasets::default_text_corpus();
  }
  const std::string dir = dtrain::testing::temp_dir("dtrain-gpt-dcp-interop");
  const std::string exported = dir + "/export", fsdp = dir + "/fsdp";

  // train_gpt at 2 tensor ranks x 2 stages: 3 steps, a checkpoint and a DCP export of the same
  // state; the checkpoint's whole state is what Python compares its load with.
  auto run = run_command(launch(4) + bin("train_gpt") + kSmall + " --tp 2 --pp 2 --steps 3" +
                         " --checkpoint-dir " + dir + "/ckpt --export-dcp " + exported);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  dtrain::save_safetensors_file(dir + "/expected.safetensors",
                                checkpoint_table(small(), dir + "/ckpt"));

  auto peer =
      run_command(launch(2) + python + " " + DTRAIN_SOURCE_DIR +
                      "/tests/python/gpt_dcp_interop.py " + exported + " " + dir +
                      "/expected.safetensors " + fsdp + " " + dir + "/fsdp-expected.safetensors",
                  300);
  ASSERT_EQ(peer.exit_code, 0) << peer.output;
  EXPECT_NE(peer.output.find("[rank0]: gpt dcp interop ok"), std::string::npos) << peer.output;
  EXPECT_NE(peer.output.find("[rank1]: gpt dcp interop ok"), std::string::npos) << peer.output;

  // FSDP2's folder into a tensor x pipeline layout, exactly: exported again, it is FSDP2's state.
  const dtrain::TensorTable from_fsdp =
      dtrain::load_safetensors(dir + "/fsdp-expected.safetensors");
  std::mutex seed_mutex;
  dtrain::testing::run_group(4, [&](int, const std::shared_ptr<dtrain::ProcessGroup>& pg) {
    const LayoutOptions options = layout(1, 2, 2);
    dtrain::RankMesh mesh = make_mesh(options, pg);
    Gpt model{nullptr};
    {
      std::lock_guard<std::mutex> lock(seed_mutex);
      model = make_model(small(), options, mesh);
    }
    Parallel parallel(model, options, mesh, pg, c10::Device(c10::kCPU));
    torch::optim::AdamW adamw(parallel.parameters());
    parallel.load_dcp(fsdp, adamw);
    parallel.export_dcp(dir + "/again", adamw);
  });
  expect_tables(from_fsdp, dtrain::load_dcp_safetensors(dir + "/again"),
                "FSDP2's folder loaded at tp 2 x pp 2 and exported again");

  // train_gpt trains on from it: at tp 2 x pp 2 as at one process (the same global batch), and
  // not as from a fresh model.
  const std::string steps = " --steps 2 --lr 1e-3";
  auto fresh = run_command(launch(1) + bin("train_gpt") + kSmall + steps);
  auto whole = run_command(launch(1) + bin("train_gpt") + kSmall + steps + " --init-dcp " + fsdp);
  auto mesh = run_command(launch(4) + bin("train_gpt") + kSmall + steps + " --tp 2 --pp 2" +
                          " --init-dcp " + fsdp);
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_EQ(mesh.exit_code, 0) << mesh.output;
  for (const char* key : {"first_loss", "train_loss"}) {
    const double want = json_number(whole.output, key);
    EXPECT_LT(std::abs(json_number(mesh.output, key) - want) / want, 1e-4)
        << key << "\n"
        << whole.output << mesh.output;
    EXPECT_GT(std::abs(json_number(fresh.output, key) - want), 1e-2)
        << key << ": the folder changed nothing\n"
        << fresh.output << whole.output;
  }

  // FSDP2's files carry no checksum: a truncated one, or a missing one, is named and train_gpt
  // stops with exit code 2 before its first step.
  const std::string first = "shard-00001-model-00001-of-00001.safetensors";
  for (const auto& [what, expected] :
       {std::pair<std::string, std::string>{"truncated", first + ": truncated"},
        {"missing", "a shard file is missing"}}) {
    SCOPED_TRACE(what);
    const std::string broken = dir + "/broken";
    fs::remove_all(broken);
    fs::copy(fsdp, broken);
    if (what == "truncated") {
      fs::resize_file(broken + "/" + first, fs::file_size(broken + "/" + first) - 1);
    } else {
      fs::remove(broken + "/" + first);
    }
    auto refused = run_command(launch(4) + bin("train_gpt") + kSmall + steps + " --tp 2 --pp 2" +
                               " --init-dcp " + broken);
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_NE(refused.output.find(expected), std::string::npos) << refused.output;
    EXPECT_EQ(refused.output.find("first_loss"), std::string::npos) << refused.output;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gpt
