// DCP safetensors folders (Note [DCP safetensors] in dtrain/dcp.h), dtrain alone: a flat range cut
// into boxes; a ZeRO run exported at N ranks and loaded at M ranks in every stage, into a plain
// module, and as whole tensors, equal to the run's state exactly; folders whose chunks do not tile
// a tensor, and damaged exports, named and not loaded; a re-export that fails leaves the earlier
// one loadable; a parameter without optimizer state loads as a fresh one. PyTorch's side is
// dcp_interop_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/dcp_format.h"
#include "checkpoint/dcp_support.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using detail::Box;
using testing::DcpSdp;

TEST(DcpBoxes, RandomRangesAreTiledByAtMost2NMinus1ContiguousBoxes) {
  std::mt19937 random(7);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(random);
  };
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int64_t> shape(uniform(0, 4));
    for (auto& d : shape) d = uniform(1, 5);
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    int64_t begin = uniform(0, numel), end = uniform(0, numel);
    if (begin > end) std::swap(begin, end);
    SCOPED_TRACE("shape " + c10::str(at::IntArrayRef(shape)) + " range [" + std::to_string(begin) +
                 ", " + std::to_string(end) + ")");
    const auto boxes = detail::boxes_of_range(shape, begin, end);
    const int64_t limit = shape.empty() ? 1 : 2 * static_cast<int64_t>(shape.size()) - 1;
    EXPECT_LE(static_cast<int64_t>(boxes.size()), limit);
    const at::Tensor index = torch::arange(numel).view(shape);
    at::Tensor times = torch::zeros({numel}, torch::kLong);
    int64_t next = begin;
    for (const Box& box : boxes) {
      ASSERT_EQ(box.offsets.size(), shape.size());
      ASSERT_GT(box.numel(), 0);
      at::Tensor elements = index;
      for (std::size_t d = 0; d < shape.size(); ++d) {
        ASSERT_LE(box.offsets[d] + box.sizes[d], shape[d]);
        elements = elements.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
      }
      // Contiguous in row-major order, starting at box.begin, in flat order.
      EXPECT_EQ(box.begin, next);
      EXPECT_TRUE(
          torch::equal(elements.reshape(-1), torch::arange(box.begin, box.begin + box.numel())));
      times.narrow(0, box.begin, box.numel()) += 1;
      next = box.begin + box.numel();
    }
    at::Tensor expected = torch::zeros({numel}, torch::kLong);
    expected.narrow(0, begin, end - begin).fill_(1);
    EXPECT_TRUE(torch::equal(times, expected)) << "the boxes do not cover the range exactly once";
  }
}

// Exports a stage-`stage` run of 2 steps at `n` ranks; returns its whole state (testing::
// whole_state).
TensorTable export_run(int n, int stage, const std::string& dir) {
  torch::manual_seed(5);
  auto initial = testing::make_dcp_model();
  TensorTable expected;
  testing::run_dcp_sharded(n, stage, initial, [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
    testing::train_dcp_steps(sdp, adam, 2);
    save_dcp_safetensors(dir, testing::dcp_shards(sdp, &adam), sdp->group());
    TensorTable whole = testing::whole_state(rank, sdp, adam, dir + "-sharded");
    if (rank == 0) expected = whole;
  });
  return expected;
}

TEST(Dcp, ExportedAtNLoadsAtMInEveryStageIntoAPlainModuleAndAsWholeTensors) {
  struct Case {
    int n, m;
  };
  for (int stage = 1; stage <= 3; ++stage) {
    for (const Case c : {Case{2, 3}, Case{3, 1}}) {
      const std::string trace = std::to_string(c.n) + " ranks -> " + std::to_string(c.m) +
                                " ranks, stage " + std::to_string(stage);
      SCOPED_TRACE(trace);
      const std::string dir = testing::temp_dir("dtrain-dcp");
      const TensorTable expected = export_run(c.n, stage, dir);
      testing::expect_same_tables(expected, load_dcp_safetensors(dir), "whole tensors");

      // Into a ZeRO run of another world size (whose own initial values differ), then exported
      // again: the same state, optimizer included.
      torch::manual_seed(99);
      testing::run_dcp_sharded(c.m, stage, testing::make_dcp_model(),
                               [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
                                 DcpShards state = testing::dcp_shards(sdp, &adam);
                                 load_dcp_safetensors(dir, state, sdp->group());
                                 sdp->shards_changed();
                                 save_dcp_safetensors(dir + "-again", state, sdp->group());
                                 sdp->gather_full_parameters();
                                 if (rank != 0) return;
                                 TensorTable loaded = testing::state_table(*sdp->module(), nullptr);
                                 for (const auto& item : loaded) {
                                   EXPECT_TRUE(torch::equal(item.value(), expected[item.key()]))
                                       << item.key() << " differs after loading";
                                 }
                               });
      testing::expect_same_tables(expected, load_dcp_safetensors(dir + "-again"),
                                  "exported again after loading at " + std::to_string(c.m));

      // Into a plain module and Adam.
      auto plain = testing::make_dcp_model();
      auto adam = testing::make_dcp_adam(plain->parameters());
      load_dcp_safetensors(dir, *plain, adam.get());
      testing::expect_same_tables(expected, testing::state_table(*plain, adam.get()),
                                  "a plain module");
      for (const auto& path : {dir, dir + "-again", dir + "-sharded"}) fs::remove_all(path);
    }
  }
}

TEST(Dcp, ExportAtFewerRanksReplacesTheEarlierExportsFiles) {
  const std::string dir = testing::temp_dir("dtrain-dcp-again");
  export_run(3, 3, dir);
  const TensorTable second = export_run(2, 2, dir);
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string().rfind("shard-00002-", 0), std::string::npos)
        << entry.path() << " of the export at 3 ranks is left";
  }
  testing::expect_same_tables(second, load_dcp_safetensors(dir), "the second export");
  fs::remove_all(dir);
  fs::remove_all(dir + "-sharded");
}

// The staging and put-aside folders beside `dir` (Note [Replacing an export] in dcp.cpp).
std::vector<std::string> export_siblings(const std::string& dir) {
  const fs::path path(dir);
  const std::string name = path.filename().string();
  return {(path.parent_path() / ("." + name + ".dtrain-export")).string(),
          (path.parent_path() / ("." + name + ".dtrain-old")).string()};
}

TEST(Dcp, AReExportThatFailsOnOneRankLeavesTheEarlierExportLoadable) {
  const std::string dir = testing::temp_dir("dtrain-dcp-replace");
  const TensorTable first = export_run(2, 3, dir);
  std::ofstream(dir + "/config.json") << "{}\n";  // the user's own file beside the weights

  // Another run's export: rank 0 writes all its files, rank 1 fails (an optimizer whose state an
  // export cannot hold), as a rank whose disk is full would.
  torch::manual_seed(8);
  std::vector<std::string> errors(2);
  testing::run_dcp_sharded(
      2, 3, testing::make_dcp_model(), [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
        testing::train_dcp_steps(sdp, adam, 1);
        torch::optim::RMSprop rmsprop(sdp->parameters());
        torch::optim::Optimizer* optimizer = &adam;
        if (rank == 1) optimizer = &rmsprop;
        try {
          save_dcp_safetensors(dir, testing::dcp_shards(sdp, optimizer), sdp->group());
        } catch (const UsageError& e) {
          errors[rank] = e.what();
        }
      });
  EXPECT_NE(errors[0].find("rank(s) {1} could not write their files"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("the folder is as it was"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("SGD, Adam and AdamW"), std::string::npos) << errors[1];
  testing::expect_same_tables(first, load_dcp_safetensors(dir), "the export before the failed one");
  for (const auto& sibling : export_siblings(dir))
    EXPECT_FALSE(fs::exists(sibling)) << sibling << " is left";

  // What an export that crashed between its two renames (where the file system cannot exchange
  // two folders) leaves: the folder put aside, part of a staging folder. The next export puts the
  // folder back first, and neither stops it nor ends up in it; the user's file stays.
  const std::string staging = export_siblings(dir)[0], old = export_siblings(dir)[1];
  fs::rename(dir, old);
  fs::create_directories(staging);
  save_safetensors_file(staging + "/shard-00007-part-0.safetensors",
                        TensorTable{{"w", torch::ones({2})}});
  const TensorTable second = export_run(3, 2, dir);
  testing::expect_same_tables(second, load_dcp_safetensors(dir), "the export after it");
  EXPECT_TRUE(fs::exists(dir + "/config.json")) << "the export removed the user's file";
  EXPECT_FALSE(fs::exists(dir + "/shard-00007-part-0.safetensors"));
  for (const auto& sibling : export_siblings(dir))
    EXPECT_FALSE(fs::exists(sibling)) << sibling << " is left";
  fs::remove_all(dir);
  fs::remove_all(dir + "-sharded");
}

TEST(Dcp, RefusesToExportIntoAFolderWithAnotherProgramsSafetensors) {
  const std::string dir = testing::temp_dir("dtrain-dcp-foreign");
  fs::create_directories(dir);
  save_safetensors_file(dir + "/model.safetensors", TensorTable{{"w", torch::ones({2})}});
  testing::run_dcp_sharded(
      1, 1, testing::make_dcp_model(), [&](int, DcpSdp& sdp, torch::optim::Adam& adam) {
        try {
          save_dcp_safetensors(dir, testing::dcp_shards(sdp, &adam), sdp->group());
          ADD_FAILURE() << "exported beside another program's file";
        } catch (const UsageError& e) {
          EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
        }
      });
  fs::remove_all(dir);
}

// A folder of hand-made chunks, as another program could write them.
struct Chunk {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> offsets;
};
void write_chunks(const std::string& path, const std::vector<Chunk>& chunks) {
  TensorTable tensors;
  nlohmann::json sharding = nlohmann::json::object();
  for (const auto& [name, tensor, offsets] : chunks) {
    tensors.insert(name, tensor);
    sharding[name] = {{"saved_offsets", offsets}};
  }
  save_safetensors_file(path, tensors, {{"DCP_SHARDING_INFO", sharding.dump()}});
}

std::string load_error(const std::string& dir) {
  try {
    load_dcp_safetensors(dir);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(loaded)";
}

TEST(Dcp, ChunksAreAssembledAndThoseThatDoNotTileATensorAreNamed) {
  const std::string dir = testing::temp_dir("dtrain-dcp-chunks");
  const at::Tensor w = torch::arange(12, torch::kFloat).view({4, 3});
  // Rows 0-1 and 2-3 in two files, an empty chunk beside (as FSDP2 writes an empty shard).
  write_chunks(dir + "/a.safetensors", {{"w", w.narrow(0, 0, 2), {0, 0}}});
  write_chunks(dir + "/b.safetensors",
               {{"w", w.narrow(0, 2, 2), {2, 0}}, {"b", torch::zeros({0}), {3}}});
  write_chunks(dir + "/c.safetensors", {{"b", torch::ones({3}), {0}}});
  TensorTable whole = load_dcp_safetensors(dir);
  EXPECT_TRUE(torch::equal(whole["w"], w));
  EXPECT_TRUE(torch::equal(whole["b"], torch::ones({3})));

  // A gap: rows 2-3 are missing, row 3 is there.
  write_chunks(dir + "/b.safetensors", {{"w", w.narrow(0, 3, 1), {3, 0}}});
  std::string error = load_error(dir);
  EXPECT_NE(error.find("tensor 'w' [4, 3]: its chunks (in a.safetensors, b.safetensors) cover 9 "
                       "of its 12 elements"),
            std::string::npos)
      << error;
  // An overlap.
  write_chunks(dir + "/b.safetensors", {{"w", w.narrow(0, 1, 3), {1, 0}}});
  error = load_error(dir);
  EXPECT_NE(error.find("tensor 'w': its chunk [0:2, 0:3] in " + dir +
                       "/a.safetensors overlaps its chunk [1:4, 0:3] in " + dir + "/b.safetensors"),
            std::string::npos)
      << error;
  // Another dtype.
  write_chunks(dir + "/b.safetensors", {{"w", w.narrow(0, 2, 2).to(torch::kDouble), {2, 0}}});
  error = load_error(dir);
  EXPECT_NE(error.find("tensor 'w' is Double [2, 3] in " + dir + "/b.safetensors but Float"),
            std::string::npos)
      << error;
  // No place for a tensor.
  save_safetensors_file(dir + "/b.safetensors", TensorTable{{"w", w.narrow(0, 2, 2)}},
                        {{"DCP_SHARDING_INFO", "{}"}});
  error = load_error(dir);
  EXPECT_NE(error.find("b.safetensors: tensor 'w' has no entry in the file's DCP_SHARDING_INFO"),
            std::string::npos)
      << error;
  fs::remove_all(dir);
}

TEST(Dcp, AParameterWithoutOptimizerStateStartsFromZerosAndTheOthersKeepTheirs) {
  // As FSDP2 saves a model one of whose parameters never had a gradient: PyTorch's Adam keeps no
  // state for '3.bias'. At 2 ranks in stage 3, rank 1's shard of the last Linear holds part of
  // '3.weight' and all of '3.bias'.
  const std::string dir = testing::temp_dir("dtrain-dcp-stateless");
  fs::create_directories(dir);
  torch::manual_seed(4);
  auto saved = testing::make_dcp_model();
  TensorTable file;
  for (const auto& item : saved->named_parameters()) {
    const at::Tensor value = item.value().detach();
    file.insert(item.key(), value.clone());
    if (item.key() == "3.bias") continue;
    file.insert("optim.state." + item.key() + ".exp_avg", torch::randn_like(value));
    file.insert("optim.state." + item.key() + ".exp_avg_sq", torch::rand_like(value));
    file.insert("optim.state." + item.key() + ".step", at::scalar_tensor(7.0, at::kFloat));
  }
  for (const auto& item : saved->named_buffers()) file.insert(item.key(), item.value().clone());
  save_safetensors_file(dir + "/model.safetensors", file);  // whole tensors: no sharding info

  ::testing::internal::CaptureStderr();
  testing::run_dcp_sharded(
      2, 3, testing::make_dcp_model(), [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
        DcpShards state = testing::dcp_shards(sdp, &adam);
        load_dcp_safetensors(dir, state, sdp->group());
        for (const auto& shard : state.shards) {
          SCOPED_TRACE("rank " + std::to_string(rank) + ", " + shard.key);
          auto it = adam.state().find(shard.shard.unsafeGetTensorImpl());
          ASSERT_NE(it, adam.state().end()) << "the shard's optimizer state was dropped";
          const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
          EXPECT_EQ(s.step(), 7);
          const int64_t first = shard.offset, last = shard.offset + shard.shard.numel();
          for (const auto& p : shard.params) {
            const int64_t lo = std::max(first, p.offset),
                          hi = std::min(last, p.offset + c10::multiply_integers(p.shape));
            if (lo >= hi) continue;
            for (const std::string field : {"exp_avg", "exp_avg_sq"}) {
              const at::Tensor loaded = (field == "exp_avg" ? s.exp_avg() : s.exp_avg_sq())
                                            .narrow(0, lo - first, hi - lo);
              const at::Tensor expected =
                  p.name == "3.bias"
                      ? torch::zeros({hi - lo})
                      : file["optim.state." + p.name + "." + field].reshape(-1).narrow(
                            0, lo - p.offset, hi - lo);
              EXPECT_TRUE(torch::equal(loaded, expected)) << p.name << " " << field;
            }
          }
        }
      });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("holds no optimizer state for parameter '3.bias'"), std::string::npos) << log;
  fs::remove_all(dir);
}

// A copy of `from` with `damage` done to it.
std::string damaged_copy(const std::string& from,
                         const std::function<void(const std::string&)>& damage) {
  const std::string dir = testing::temp_dir("dtrain-dcp-damaged");
  fs::copy(from, dir);
  damage(dir);
  return dir;
}

TEST(Dcp, DamagedExportIsNamedAndNotLoaded) {
  const std::string dir = testing::temp_dir("dtrain-dcp-damage");
  export_run(2, 3, dir);
  const std::string part = "shard-00001-part-0.safetensors";
  struct Damage {
    std::string what, expected;
    std::function<void(const std::string&)> apply;
  };
  const std::vector<Damage> damages = {
      {"truncated", part + " is truncated",
       [&](const std::string& d) {
         fs::resize_file(d + "/" + part, fs::file_size(d + "/" + part) - 4);
       }},
      {"a byte flipped", "a byte of the data is damaged",
       [&](const std::string& d) {
         std::fstream file(d + "/" + part, std::ios::in | std::ios::out | std::ios::binary);
         file.seekg(-3, std::ios::end);
         char byte = 0;
         file.read(&byte, 1);
         byte ^= 0x10;
         file.seekp(-3, std::ios::end);
         file.write(&byte, 1);
       }},
      {"a file missing",
       "the export's file " + part + " (listed in dtrain_dcp_index.json) is missing",
       [&](const std::string& d) { fs::remove(d + "/" + part); }},
      {"no index", "the export did not finish",
       [&](const std::string& d) { fs::remove(d + "/dtrain_dcp_index.json"); }},
  };
  for (const auto& damage : damages) {
    SCOPED_TRACE(damage.what);
    const std::string copy = damaged_copy(dir, damage.apply);
    std::string whole_error = load_error(copy);
    if (damage.what == "truncated") {
      EXPECT_NE(whole_error.find(copy + "/" + part + ": truncated"), std::string::npos)
          << whole_error;
    } else {
      EXPECT_NE(whole_error.find(damage.expected), std::string::npos) << whole_error;
    }
    // At 2 ranks: both refuse, one of them names the damage, nothing is loaded.
    torch::manual_seed(3);
    std::vector<std::string> errors(2);
    testing::run_dcp_sharded(
        2, 3, testing::make_dcp_model(), [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
          DcpShards state = testing::dcp_shards(sdp, &adam);
          std::vector<at::Tensor> before;
          for (const auto& shard : state.shards) before.push_back(shard.shard.detach().clone());
          try {
            load_dcp_safetensors(copy, state, sdp->group());
          } catch (const UsageError& e) {
            errors[rank] = e.what();
          }
          for (std::size_t i = 0; i < before.size(); ++i)
            EXPECT_TRUE(torch::equal(before[i], state.shards[i].shard)) << "loaded anyway";
          EXPECT_TRUE(adam.state().empty()) << "optimizer state loaded anyway";
        });
    EXPECT_FALSE(errors[0].empty() || errors[1].empty()) << "a rank loaded";
    EXPECT_TRUE(errors[0].find(part) != std::string::npos ||
                errors[1].find(part) != std::string::npos ||
                errors[0].find(damage.expected) != std::string::npos)
        << errors[0] << "\n"
        << errors[1];
    fs::remove_all(copy);
  }
  fs::remove_all(dir);
  fs::remove_all(dir + "-sharded");
}

}  // namespace
}  // namespace dtrain
