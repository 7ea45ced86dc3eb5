// DCP safetensors folders and PyTorch 2.15 (Note [DCP safetensors] in dtrain/dcp.h): a ZeRO-3 run
// of dtrain at 3 ranks exports; PyTorch's torch.distributed.checkpoint (HuggingFaceStorageReader)
// loads it into an unsharded model and Adam and into FSDP2 at 2 ranks, equal exactly; FSDP2 steps
// and saves with HuggingFaceStorageWriter(save_distributed=True), and dtrain loads that into ZeRO-3
// at 3 ranks and into a plain module, equal exactly; FSDP2's folder with a file truncated or
// missing is named and not loaded. The PyTorch side is tests/python/dcp_interop.py.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "checkpoint/dcp_support.h"
#include "dtrain/errors.h"
#include "support/subprocess.h"
#include "support/system.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using testing::DcpSdp;

std::string load_error(const std::function<void()>& load) {
  try {
    load();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(loaded)";
}

TEST(DcpInterop, PyTorchLoadsTheExportUnshardedAndIntoFsdp2AndDtrainLoadsWhatFsdp2Saved) {
  const std::string python = testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dir = testing::temp_dir("dtrain-dcp-interop");
  const std::string exported = dir + "/export", fsdp = dir + "/fsdp";

  // dtrain: ZeRO-3 at 3 ranks, 2 steps of Adam, exported; its whole state for Python to compare.
  torch::manual_seed(5);
  auto initial = testing::make_dcp_model();
  TensorTable expected;
  testing::run_dcp_sharded(3, 3, initial, [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
    testing::train_dcp_steps(sdp, adam, 2);
    save_dcp_safetensors(exported, testing::dcp_shards(sdp, &adam), sdp->group());
    TensorTable whole = testing::whole_state(rank, sdp, adam, dir + "/sharded");
    if (rank == 0) expected = whole;
  });
  save_safetensors_file(dir + "/expected.safetensors", expected);

  auto result = testing::run_command(
      std::string(DTRAIN_BIN_DIR) + "/dtrain run --nproc-per-node 2 -- " + python + " " +
          DTRAIN_SOURCE_DIR + "/tests/python/dcp_interop.py " + exported + " " + dir +
          "/expected.safetensors " + fsdp + " " + dir + "/fsdp-expected.safetensors",
      180);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("[rank0]: dcp interop ok"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("[rank1]: dcp interop ok"), std::string::npos) << result.output;

  // FSDP2's folder (2 ranks) into ZeRO-3 at 3 ranks, whose own initial values differ.
  const TensorTable from_fsdp = load_safetensors(dir + "/fsdp-expected.safetensors");
  testing::expect_same_tables(from_fsdp, load_dcp_safetensors(fsdp), "whole tensors");
  torch::manual_seed(99);
  testing::run_dcp_sharded(
      3, 3, testing::make_dcp_model(), [&](int rank, DcpSdp& sdp, torch::optim::Adam& adam) {
        DcpShards state = testing::dcp_shards(sdp, &adam);
        load_dcp_safetensors(fsdp, state, sdp->group());
        sdp->shards_changed();
        save_dcp_safetensors(dir + "/again", state, sdp->group());
        sdp->gather_full_parameters();
        if (rank != 0) return;
        for (const auto& item : testing::state_table(*sdp->module(), nullptr)) {
          EXPECT_TRUE(torch::equal(item.value(), from_fsdp[item.key()]))
              << item.key() << " differs after loading FSDP2's folder into ZeRO-3";
        }
      });
  testing::expect_same_tables(from_fsdp, load_dcp_safetensors(dir + "/again"),
                              "FSDP2's state loaded into ZeRO-3 and exported again");
  auto plain = testing::make_dcp_model();
  auto adam = testing::make_dcp_adam(plain->parameters());
  load_dcp_safetensors(fsdp, *plain, adam.get());
  testing::expect_same_tables(from_fsdp, testing::state_table(*plain, adam.get()),
                              "FSDP2's state loaded into a plain module");

  // FSDP2's files carry no checksum (a flipped data byte there goes unseen: dcp_test.cpp flips one
  // in dtrain's export); a truncated or missing one is named, and nothing is loaded.
  const std::string first = "shard-00001-model-00001-of-00001.safetensors";
  const std::string broken = dir + "/broken";
  fs::copy(fsdp, broken);
  fs::resize_file(broken + "/" + first, fs::file_size(broken + "/" + first) - 1);
  std::string error = load_error([&] { load_dcp_safetensors(broken); });
  EXPECT_NE(error.find(broken + "/" + first + ": truncated"), std::string::npos) << error;
  fs::remove(broken + "/" + first);
  auto untouched = testing::make_dcp_model();
  const TensorTable before = testing::state_table(*untouched, nullptr);
  error = load_error([&] { load_dcp_safetensors(broken, *untouched); });
  EXPECT_NE(error.find("tensor '0.bias' [5]: its chunks (in "
                       "shard-00002-model-00001-of-00001.safetensors) cover 2 of its 5 elements"),
            std::string::npos)
      << error;
  testing::expect_same_tables(before, testing::state_table(*untouched, nullptr),
                              "a plain module after a refused load");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
