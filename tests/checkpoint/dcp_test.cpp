// DCP safetensors folders (Note [DCP safetensors] in dtrain/dcp.h), dtrain alone: a flat range cut
// into boxes; a ZeRO run exported at N ranks and loaded at M ranks in every stage, into a plain
// module, and as whole tensors, equal to the run's state exactly; folders whose chunks do not tile
// a tensor, and damaged exports, named and not loaded; a re-export that fails leaves the earlier
// one loadable, beside the folder or inside it, and one that crashed is put back; a parameter
// without optimizer state loads as a fresh one, a shard of padding only keeps its state. PyTorch's
// side is dcp_interop_test.cpp.
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

// The staging and put-aside folders beside `dir` and inside it (Note [Replacing an export] in
// dcp.cpp).
std::vector<std::string> export_leftovers(const std::string& dir) {
  const fs::path path(dir);
  const std::string name = path.filename().string();
  return {(path.parent_path() / ("." + name + ".dtrain-export")).string(),
          (path.parent_path() / ("." + name + ".dtrain-old")).string(),
          (path / ".dtrain-export").string(), (path / ".dtrain-old").string()};
}

void expect_no_leftovers(const std::string& dir) {
  for (const auto& leftover : export_leftovers(dir))
    EXPECT_FALSE(fs::exists(leftover)) << leftover << " is left";
}

// Another run's export into `dir`: rank 0 writes all its files, rank 1 fails (an optimizer whose
// state an export cannot hold), as a rank whose disk is full would. Returns each rank's error.
std::vector<std::string> export_failing_on_rank_1(const std::string& dir) {
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
  return errors;
}

std::string load_error(const std::string& dir) {
  try {
    load_dcp_safetensors(dir);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(loaded)";
}

TEST(Dcp, AReExportThatFailsOnOneRankLeavesTheEarlierExportLoadable) {
  const std::string dir = testing::temp_dir("dtrain-dcp-replace");
  const TensorTable first = export_run(2, 3, dir);
  // The user's own files beside the weights, one of them hidden with ".tmp-" in its name (as an
  // export's temporary files are, which the export does not keep).
  std::ofstream(dir + "/config.json") << "{}\n";
  std::ofstream(dir + "/.notes.tmp-1") << "mine\n";

  export_failing_on_rank_1(dir);
  testing::expect_same_tables(first, load_dcp_safetensors(dir), "the export before the failed one");
  expect_no_leftovers(dir);

  // What an export that crashed between its two renames (where the file system cannot exchange
  // two folders) leaves: the folder put aside, part of a staging folder. A load says where the
  // earlier export is.
  const std::string staging = export_leftovers(dir)[0], old = export_leftovers(dir)[1];
  const std::string old_name = fs::path(old).filename().string();
  fs::rename(dir, old);
  fs::create_directories(staging);
  save_safetensors_file(staging + "/shard-00007-part-0.safetensors",
                        TensorTable{{"w", torch::ones({2})}});
  std::string error = load_error(dir);
  EXPECT_NE(error.find("is not a folder; an export that stopped midway left the earlier export in"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find(old_name), std::string::npos) << error;
  // A script makes the folder again before the next export (writing its log): the folder holds
  // no export, the one put aside is still the only whole one.
  fs::create_directories(dir);
  std::ofstream(dir + "/run.log") << "step 1\n";
  error = load_error(dir);
  EXPECT_NE(error.find("holds no .safetensors file; an export that stopped midway left the "
                       "earlier export in"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find(old_name), std::string::npos) << error;

  // The next export puts it back first, and the partial staging folder neither stops it nor ends
  // up in it: even when that export fails, the earlier one loads.
  export_failing_on_rank_1(dir);
  testing::expect_same_tables(first, load_dcp_safetensors(dir), "the export put back");
  expect_no_leftovers(dir);
  const TensorTable second = export_run(3, 2, dir);
  testing::expect_same_tables(second, load_dcp_safetensors(dir), "the export after it");
  for (const auto& file : {"config.json", ".notes.tmp-1", "run.log"})
    EXPECT_TRUE(fs::exists(dir + "/" + file)) << "the export removed the user's " << file;
  EXPECT_FALSE(fs::exists(dir + "/shard-00007-part-0.safetensors"));
  expect_no_leftovers(dir);
  fs::remove_all(dir);
  fs::remove_all(dir + "-sharded");
}

// Makes `dir` the working folder for its lifetime.
class WorkingFolder {
 public:
  explicit WorkingFolder(const std::string& dir) : saved_(fs::current_path()) {
    fs::current_path(dir);
  }
  ~WorkingFolder() { fs::current_path(saved_); }

 private:
  fs::path saved_;
};

TEST(Dcp, AFolderThatCannotBeRenamedIsStagedInsideAndSwappedFileByFile) {
  // The working folder, which an export cannot rename away (as it cannot a docker volume's root):
  // the export stages in <dir>/.dtrain-export and swaps files at the end (Note [Replacing an
  // export] in dcp.cpp), with the same guarantees before the swap.
  const std::string dir = testing::temp_dir("dtrain-dcp-inside");
  fs::create_directories(dir);
  {
    const WorkingFolder working(dir);
    const TensorTable first = export_run(2, 3, dir);
    std::ofstream(dir + "/config.json") << "{}\n";
    testing::expect_same_tables(first, load_dcp_safetensors(dir), "the first export");
    EXPECT_TRUE(fs::equivalent(fs::current_path(), dir)) << "the working folder was moved";
    expect_no_leftovers(dir);

    export_failing_on_rank_1(dir);
    testing::expect_same_tables(first, load_dcp_safetensors(dir),
                                "the export before the failed one");
    expect_no_leftovers(dir);

    // A crash in the swap: the earlier index and part files moved out into .dtrain-old, some of the
    // new part files in (one of them under a name of the earlier export). A load says where the
    // earlier export is; the next export puts it back first, even when it then fails.
    const std::string old = dir + "/.dtrain-old";
    fs::create_directories(old);
    std::vector<std::string> earlier;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (name == "dtrain_dcp_index.json" || name.find(".safetensors") != std::string::npos)
        earlier.push_back(name);
    }
    for (const auto& name : earlier) fs::rename(dir + "/" + name, old + "/" + name);
    for (const auto& part : {"shard-00000-part-0.safetensors", "shard-00005-part-0.safetensors"})
      save_safetensors_file(dir + "/" + part, TensorTable{{"w", torch::ones({2})}});
    const std::string error = load_error(dir);
    EXPECT_NE(error.find("the export did not finish; export again; an export that stopped midway "
                         "left the earlier export in"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find(".dtrain-old: the next export"), std::string::npos) << error;
    export_failing_on_rank_1(dir);
    testing::expect_same_tables(first, load_dcp_safetensors(dir), "the export put back");
    EXPECT_FALSE(fs::exists(dir + "/shard-00005-part-0.safetensors"));
    expect_no_leftovers(dir);

    // A crash once the new index is in: what is left aside is only removed.
    const TensorTable second = export_run(3, 2, dir);
    fs::create_directories(old);
    fs::copy_file(dir + "/dtrain_dcp_index.json", old + "/dtrain_dcp_index.json");
    save_safetensors_file(old + "/shard-00000-part-0.safetensors",
                          TensorTable{{"w", torch::ones({2})}});
    testing::expect_same_tables(second, load_dcp_safetensors(dir), "the export after it");
    // A failed export then leaves the folder's own export: had the one aside been put back, the
    // load would see its part of ones.
    export_failing_on_rank_1(dir);
    testing::expect_same_tables(second, load_dcp_safetensors(dir), "the export kept, not put back");
    expect_no_leftovers(dir);
    const TensorTable third = export_run(2, 1, dir);
    testing::expect_same_tables(third, load_dcp_safetensors(dir), "the export after that");
    EXPECT_TRUE(fs::exists(dir + "/config.json")) << "the export removed the user's file";
    expect_no_leftovers(dir);
  }
  fs::remove_all(dir);
  fs::remove_all(dir + "-sharded");
}

// An export into `dir`, which holds another program's model.safetensors, is refused, naming it.
void expect_refused_beside_model_safetensors(const std::string& dir) {
  testing::run_dcp_sharded(
      1, 1, testing::make_dcp_model(), [&](int, DcpSdp& sdp, torch::optim::Adam& adam) {
        try {
          save_dcp_safetensors(dir, testing::dcp_shards(sdp, &adam), sdp->group());
          ADD_FAILURE() << "exported beside another program's file";
        } catch (const UsageError& e) {
          EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
        }
      });
}

TEST(Dcp, RefusesToExportIntoAFolderWithAnotherProgramsSafetensors) {
  const std::string dir = testing::temp_dir("dtrain-dcp-foreign");
  fs::create_directories(dir);
  save_safetensors_file(dir + "/model.safetensors", TensorTable{{"w", torch::ones({2})}});
  expect_refused_beside_model_safetensors(dir);
  fs::remove_all(dir);
}

// A crash between the two renames put the earlier export aside; the user then saved another
// program's checkpoint into a new folder of that name. The next export refuses the folder, and
// leaves it as the user made it: putting the earlier export back into it first would have mixed
// dtrain's parts into a folder that PyTorch's reader takes whole.
TEST(Dcp, AFolderWithAnotherProgramsFileGetsNoPutAsideExportBack) {
  const std::string dir = testing::temp_dir("dtrain-dcp-foreign-after-crash");
  export_run(2, 3, dir);
  const std::string old = export_leftovers(dir)[1];
  fs::rename(dir, old);
  fs::create_directories(dir);
  save_safetensors_file(dir + "/model.safetensors", TensorTable{{"w", torch::ones({2})}});
  expect_refused_beside_model_safetensors(dir);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"model.safetensors"});
  EXPECT_TRUE(fs::exists(old + "/dtrain_dcp_index.json")) << "the put-aside export is gone";
  fs::remove_all(dir);
  fs::remove_all(old);
  fs::remove_all(dir + "-sharded");
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

// A folder as FSDP2 saves make_dcp_model's state (whole tensors: no sharding info), Adam's state
// at step 7 for every parameter but `stateless` ("" for none). Returns what it holds.
TensorTable write_whole_state(const std::string& dir, const std::string& stateless) {
  fs::create_directories(dir);
  torch::manual_seed(4);
  auto saved = testing::make_dcp_model();
  TensorTable file;
  for (const auto& item : saved->named_parameters()) {
    const at::Tensor value = item.value().detach();
    file.insert(item.key(), value.clone());
    if (item.key() == stateless) continue;
    file.insert("optim.state." + item.key() + ".exp_avg", torch::randn_like(value));
    file.insert("optim.state." + item.key() + ".exp_avg_sq", torch::rand_like(value));
    file.insert("optim.state." + item.key() + ".step", at::scalar_tensor(7.0, at::kFloat));
  }
  for (const auto& item : saved->named_buffers()) file.insert(item.key(), item.value().clone());
  save_safetensors_file(dir + "/model.safetensors", file);
  return file;
}

// Loads `dir` (write_whole_state's `file`) into a stage-3 ZeRO run of `world` ranks: every flat
// shard has Adam's state at step 7, the file's moments where a parameter has them, and zeros for
// `stateless` and the padding.
void expect_shard_states(const std::string& dir, const TensorTable& file, int world,
                         const std::string& stateless) {
  testing::run_dcp_sharded(
      world, 3, testing::make_dcp_model(), [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
        DcpShards state = testing::dcp_shards(sdp, &adam);
        load_dcp_safetensors(dir, state, sdp->group());
        for (const auto& shard : state.shards) {
          SCOPED_TRACE("rank " + std::to_string(rank) + ", " + shard.key);
          auto it = adam.state().find(shard.shard.unsafeGetTensorImpl());
          ASSERT_NE(it, adam.state().end()) << "the shard's optimizer state was dropped";
          const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
          EXPECT_EQ(s.step(), 7);
          const int64_t first = shard.offset, last = shard.offset + shard.shard.numel();
          for (const std::string field : {"exp_avg", "exp_avg_sq"}) {
            at::Tensor expected = torch::zeros({shard.shard.numel()});
            for (const auto& p : shard.params) {
              const int64_t lo = std::max(first, p.offset),
                            hi = std::min(last, p.offset + c10::multiply_integers(p.shape));
              if (lo >= hi || p.name == stateless) continue;
              expected.narrow(0, lo - first, hi - lo)
                  .copy_(file["optim.state." + p.name + "." + field].reshape(-1).narrow(
                      0, lo - p.offset, hi - lo));
            }
            const at::Tensor loaded = field == "exp_avg" ? s.exp_avg() : s.exp_avg_sq();
            EXPECT_TRUE(torch::equal(loaded, expected)) << field;
          }
        }
      });
}

TEST(Dcp, AParameterWithoutOptimizerStateStartsFromZerosAndTheOthersKeepTheirs) {
  // As FSDP2 saves a model one of whose parameters never had a gradient: PyTorch's Adam keeps no
  // state for '3.bias'. At 2 ranks in stage 3, rank 1's shard of the last Linear holds part of
  // '3.weight' and all of '3.bias'.
  const std::string dir = testing::temp_dir("dtrain-dcp-stateless");
  const TensorTable file = write_whole_state(dir, "3.bias");
  ::testing::internal::CaptureStderr();
  expect_shard_states(dir, file, 2, "3.bias");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("holds no optimizer state for parameter '3.bias'"), std::string::npos) << log;
  fs::remove_all(dir);
}

TEST(Dcp, AShardOfPaddingOnlyKeepsItsOptimizerState) {
  // At 6 ranks in stage 3, rank 5's shards of the first Linear (25 parameters, 5 a rank) and of
  // the BatchNorm (10, 2 a rank) hold padding only: they read nothing, yet keep the unit's state
  // (zeros at its step) rather than restart it.
  const std::string dir = testing::temp_dir("dtrain-dcp-padding");
  const TensorTable file = write_whole_state(dir, "");
  expect_shard_states(dir, file, 6, "");
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
