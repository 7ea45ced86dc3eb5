// train_gpt end to end under `dtrain run`: DDP, ZeRO-3, a two-stage pipeline and two-way tensor
// parallelism each learn GCIDE's text (the loss after 40 steps well below the first step's, which
// starts near ln 256 = 5.5 for a fresh model), and flags that do not fit are one line and exit 2;
// resumed runs continue exactly, and zero-bubble pipelines end at one process's losses and export
// its tensors. Learning and equality, not speed: no time is asserted.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "datasets/text_corpus.h"
#include "dtrain/safetensors.h"
#include "support/subprocess.h"

namespace dtrain {
namespace {

using testing::bin;
using testing::json_int;
using testing::json_number;
using testing::run_command;

// A small model on the first 2 MB of the corpus: a run takes seconds on two cores.
const std::string kSmall =
    " --layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 32 --batch-size 8 --steps 40"
    " --max-bytes 2000000 --log-every 0";

void skip_without_corpus() {
  if (!std::filesystem::exists(datasets::default_text_corpus())) {
    GTEST_SKIP() << "needs the text corpus " << datasets::default_text_corpus()
                 << " (Debian's dict-gcide; scripts/bootstrap installs it)";
  }
}

// Every layout of kSmall + `extra` under `launch` (the launcher's command line, with any
// environment before it) learns the text.
void expect_every_layout_learns(const std::string& launch, const std::string& extra) {
  for (const std::string& layout :
       {std::string(""), std::string(" --zero 3"), std::string(" --pp 2 --micro-batches 4"),
        std::string(" --tp 2")}) {
    SCOPED_TRACE("layout:" + layout + extra);
    auto run = run_command(launch + " -- " + bin("train_gpt") + kSmall + layout + extra);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(json_int(run.output, "steps"), 40) << run.output;
    const double first = json_number(run.output, "first_loss");
    const double last = json_number(run.output, "train_loss");
    EXPECT_GT(first, 5.0) << run.output;  // a fresh model: about ln 256
    EXPECT_LT(last, first - 1.5) << run.output;
    EXPECT_LT(json_number(run.output, "bits_per_byte"), 6.0) << run.output;  // uniform: 8
  }
}

TEST(TrainGpt, EveryLayoutLearnsTheText) {
  skip_without_corpus();
  expect_every_layout_learns(bin("dtrain") + " run --nproc-per-node 2", " --device cpu");
}

// The same on a GPU, in bfloat16 autocast: both ranks on GPU 0 and 1, or on the one GPU there is,
// their collectives through Gloo (NCCL takes one GPU per rank).
TEST(TrainGpt, EveryLayoutLearnsTheTextOnTheGpu) {
  skip_without_corpus();
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const std::string backend =
      torch::cuda::device_count() < 2 ? "env DTRAIN_CUDA_BACKEND=gloo " : "";
  expect_every_layout_learns(backend + bin("dtrain") + " run --nproc-per-node 2",
                             " --device cuda --amp bf16 --warmup-steps 2");
}

// A run stopped after 3 of 6 steps and resumed from its checkpoint ends where an uninterrupted
// run of 6 ends, to the last bit of the losses: in DDP, ZeRO-3 (resumed at another stage, 2),
// tensor, pipeline, and ZeRO-3 over 2 pipelines' data dimension (resumed at stage 1). A resume
// that lost any part of the state (AdamW's moments, the sampler's place) would train on other
// numbers or other windows and end elsewhere.
TEST(TrainGpt, ResumedRunEndsWhereAnUninterruptedOneEnds) {
  skip_without_corpus();
  const std::string small =
      " --layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 32 "
      "--batch-size 4 --max-bytes 200000 --eval-windows 8 --log-every 0";
  for (const auto& [ranks, layout, resumed_layout] :
       {std::tuple<int, std::string, std::string>{2, "", ""},
        {2, " --zero 3", " --zero 2"},
        {2, " --tp 2", " --tp 2"},
        {2, " --pp 2 --micro-batches 2", " --pp 2 --micro-batches 2"},
        {4, " --pp 2 --micro-batches 2 --zero 3", " --pp 2 --micro-batches 2 --zero 1"}}) {
    SCOPED_TRACE("layout:" + layout);
    const std::string launch = bin("dtrain") + " run --nproc-per-node " + std::to_string(ranks) +
                               " -- " + bin("train_gpt");
    const std::string dir = "/tmp/dtrain-gpt-resume-" + std::to_string(::getpid());
    std::filesystem::remove_all(dir);
    auto whole = run_command(launch + small + layout + " --steps 6");
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    auto first = run_command(launch + small + layout + " --steps 3 --checkpoint-dir " + dir);
    ASSERT_EQ(first.exit_code, 0) << first.output;
    auto again = run_command(launch + small + layout + " --steps 6 --checkpoint-dir " + dir);
    EXPECT_EQ(again.exit_code, 2) << again.output;  // the folder holds checkpoints: no --resume
    EXPECT_NE(again.output.find("already holds checkpoints; pass --resume"), std::string::npos)
        << again.output;
    auto resumed = run_command(launch + small + resumed_layout +
                               " --steps 6 --resume "
                               "--checkpoint-dir " +
                               dir);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_EQ(json_int(resumed.output, "resumed_step"), 3) << resumed.output;
    EXPECT_EQ(json_number(resumed.output, "train_loss"), json_number(whole.output, "train_loss"))
        << whole.output << resumed.output;
    EXPECT_EQ(json_number(resumed.output, "val_loss"), json_number(whole.output, "val_loss"))
        << whole.output << resumed.output;
    std::filesystem::remove_all(dir);
  }
}

// A checkpoint saved by 2 tensor ranks x 2 stages resumes in other layouts (Note [Layout-neutral
// checkpoints] in parallelize.cpp): as one process, with the same global batch, it ends where the
// uninterrupted tensor x pipeline run ends (within float32's reduction-order noise); as DDP at 3
// ranks, ZeRO-3 at 2 and ZeRO-2 over 2 pipelines of 2 stages (other global batches) the loss goes
// on from where it was, far below a fresh model's ~5.5.
TEST(TrainGpt, ATensorPipelineCheckpointResumesInOtherLayouts) {
  skip_without_corpus();
  const std::string small =
      " --layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 32 --batch-size 4 "
      "--micro-batches 2 --max-bytes 200000 --eval-windows 8 --log-every 0 --lr 1e-2";
  auto launch = [](int ranks) {
    return bin("dtrain") + " run --nproc-per-node " + std::to_string(ranks) + " -- " +
           bin("train_gpt");
  };
  const std::string dir = "/tmp/dtrain-gpt-layouts-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto whole = run_command(launch(4) + small + " --tp 2 --pp 2 --steps 6");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = run_command(launch(4) + small + " --tp 2 --pp 2 --steps 3 --checkpoint-dir " + dir);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const double before = json_number(first.output, "train_loss");
  for (const auto& [ranks, layout] :
       {std::pair<int, std::string>{1, ""}, {3, ""}, {2, " --zero 3"}, {4, " --pp 2 --zero 2"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + layout);
    // Each resumes from the same step-3 checkpoint (and saves its own step 6 into a copy).
    const std::string copy = dir + "-" + std::to_string(ranks);
    std::filesystem::remove_all(copy);
    std::filesystem::copy(dir, copy, std::filesystem::copy_options::recursive);
    auto resumed = run_command(launch(ranks) + small + layout +
                               " --steps 6 --resume --checkpoint-dir " + copy);
    std::filesystem::remove_all(copy);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_EQ(json_int(resumed.output, "resumed_step"), 3) << resumed.output;
    EXPECT_LT(json_number(resumed.output, "first_loss"), before + 0.3)
        << first.output << resumed.output;
    if (ranks == 1) {
      const double want = json_number(whole.output, "train_loss");
      EXPECT_LT(std::abs(json_number(resumed.output, "train_loss") - want) / want, 1e-4)
          << whole.output << resumed.output;
    }
  }
  std::filesystem::remove_all(dir);
}

// Tiny runs on the first 200 kB of the corpus: 4 ranks of them take seconds on two cores.
const std::string kTiny =
    " --layers 2 --width 32 --heads 4 --kv-heads 2 --seq-len 16 --batch-size 4 --micro-batches 4 "
    "--max-bytes 200000 --eval-windows 8 --log-every 0 --lr 1e-2";

std::string launch_gpt(int ranks) {
  return bin("dtrain") + " run --nproc-per-node " + std::to_string(ranks) + " -- " +
         bin("train_gpt");
}

double relative(double value, double want) { return std::abs(value - want) / std::abs(want); }

// Zero-bubble pipelines train as one process on the same windows: --pp 2 at 2 ranks and --tp 2
// --pp 2 --sp at 4, both under ZB-H1 (backward split into input- and weight-gradient passes, the
// weight gradients deferred), end 6 AdamW steps at one process's train_loss and val_loss, the
// held-out loss computed by the pipeline's last stage (Note [Pipelined evaluation] in
// parallelize.cpp). A lost or doubled weight-gradient pass, a stage whose gradients arrive late,
// or a forward that skips a stage ends elsewhere. The bound: float32 sums over micro-batches and
// tensor shards in another order, through 6 AdamW steps (seen: 1e-7 apart); a wrong gradient
// moves the loss by 1e-3 or more within the first steps.
TEST(TrainGpt, ZeroBubblePipelinesEndAtOneProcesssLoss) {
  skip_without_corpus();
  auto one = run_command(launch_gpt(1) + kTiny + " --steps 6");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  for (const auto& [ranks, layout] : {std::pair<int, std::string>{2, " --pp 2 --schedule zbh1"},
                                      {4, " --tp 2 --pp 2 --sp --schedule zbh1"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + layout);
    auto run = run_command(launch_gpt(ranks) + kTiny + layout + " --steps 6");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    for (const char* key : {"first_loss", "train_loss", "val_loss", "bits_per_byte"}) {
      EXPECT_LT(relative(json_number(run.output, key), json_number(one.output, key)), 1e-5)
          << key << "\n"
          << one.output << run.output;
    }
  }
}

// --grad-accum 2 with half the windows per pass trains as one pass of them all: the same windows
// per optimizer step (the sampler dealt twice as often), one step per two passes, the gradients
// reduced once over the replicas (parallelize_test.cpp holds the gradients themselves against one
// process). A step per pass, or a pass that read no new windows, ends elsewhere.
TEST(TrainGpt, GradientAccumulationTrainsAsTheWholeBatch) {
  skip_without_corpus();
  std::string tiny = kTiny;  // without its batch size and micro-batches
  const std::string batch = " --batch-size 4 --micro-batches 4";
  ASSERT_NE(tiny.find(batch), std::string::npos) << tiny;
  tiny.erase(tiny.find(batch), batch.size());
  for (const auto& [ranks, layout] :
       {std::pair<int, std::string>{2, ""}, {4, " --pp 2 --zero 2 --micro-batches 2"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + layout);
    auto whole = run_command(launch_gpt(ranks) + tiny + layout + " --steps 6 --batch-size 4");
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    auto halves =
        run_command(launch_gpt(ranks) + tiny + layout + " --steps 6 --batch-size 2 --grad-accum 2");
    ASSERT_EQ(halves.exit_code, 0) << halves.output;
    EXPECT_EQ(json_int(halves.output, "grad_accum"), 2) << halves.output;
    for (const char* key : {"first_loss", "train_loss", "val_loss"}) {
      EXPECT_LT(relative(json_number(halves.output, key), json_number(whole.output, key)), 1e-5)
          << key << "\n"
          << whole.output << halves.output;
    }
  }
}

// --export-hf of a pipeline (its stages' blocks gathered; with --tp, the tensor ranks' shards too)
// writes what one process writes for the same weights: each layout trains 3 steps, saves a
// checkpoint and exports; one process resumes that checkpoint without training (--steps 3 from
// step 3) and exports it. Every tensor equal, and the validation of the same weights (the
// pipeline's stages in turn; one process whole) within float32's reduction order. The
// interleaved schedule walks two chunks per stage.
TEST(TrainGpt, APipelineExportsWhatOneProcessExports) {
  skip_without_corpus();
  const std::string base = "/tmp/dtrain-gpt-pp-export-" + std::to_string(::getpid());
  for (const auto& [ranks, layout] : {std::pair<int, std::string>{2, " --pp 2 --schedule zbh1"},
                                      {2, " --pp 2 --schedule interleaved"},
                                      {4, " --tp 2 --pp 2 --sp --schedule zbh1"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks" + layout);
    std::filesystem::remove_all(base);
    const std::string dir = base + "/ckpt", pipelined = base + "/pp", whole = base + "/one";
    auto run = run_command(launch_gpt(ranks) + kTiny + layout + " --steps 3 --checkpoint-dir " +
                           dir + " --export-hf " + pipelined);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    auto one = run_command(launch_gpt(1) + kTiny + " --steps 3 --resume --checkpoint-dir " + dir +
                           " --export-hf " + whole);
    ASSERT_EQ(one.exit_code, 0) << one.output;
    EXPECT_EQ(json_int(one.output, "resumed_step"), 3) << one.output;
    EXPECT_LT(relative(json_number(run.output, "val_loss"), json_number(one.output, "val_loss")),
              1e-6)
        << run.output << one.output;
    const TensorTable got = load_safetensors(pipelined), want = load_safetensors(whole);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& item : want) {
      const at::Tensor* tensor = got.find(item.key());
      ASSERT_NE(tensor, nullptr) << item.key();
      EXPECT_TRUE(at::equal(*tensor, item.value())) << item.key();
    }
  }
  std::filesystem::remove_all(base);
}

// Each rank says what is wrong in one line that names the flag. The value checks quote the value
// and say what is accepted, not CLI11's "Value -1 not in range 0.000000 to 1797693134862315708..."
// of a number that may not be negative.
TEST(TrainGpt, FlagsThatDoNotFitAreOneLineAndExit2) {
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {" --pp 3", "--tp 1 x --pp 3 = 3 does not divide the world size 2"},
           {" --zero 4", "--zero '4': expected an integer in 0..3"},
           {" --width 30", "width 30 does not divide by heads 4"},
           {" --steps x", "--steps 'x': expected an integer in 1.."},
           {" --amp fp16", "--amp 'fp16': expected none or bf16"},
           {" --device tpu", "--device 'tpu': expected auto, cpu or cuda"},
           {" --clip-grad -1", "--clip-grad '-1': expected a finite number of at least 0"},
           {" --dp 3", "--dp 3 x --tp 1 x --pp 1 = 3 ranks, but the world size is 2"},
           {" --tp 2 --pp 2", "--tp 2 x --pp 2 = 4 does not divide the world size 2"},
           {" --resume", "--resume and --checkpoint-every need --checkpoint-dir"}}) {
    SCOPED_TRACE(flags);
    auto run =
        run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_gpt") + flags);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    // Each rank's own lines ("[rank1]: ..."): the launcher may stop one before it says anything.
    std::map<std::string, std::vector<std::string>> by_rank;
    std::istringstream lines(run.output);
    for (std::string line; std::getline(lines, line);) {
      const auto end = line.find("]: ");
      if (line.rfind("[rank", 0) == 0 && end != std::string::npos)
        by_rank[line.substr(0, end + 1)].push_back(line.substr(end + 3));
    }
    ASSERT_FALSE(by_rank.empty()) << run.output;
    for (const auto& [rank, said] : by_rank) {
      ASSERT_EQ(said.size(), 1u) << rank << "\n" << run.output;
      EXPECT_EQ(said[0].rfind("train_gpt: ", 0), 0u) << said[0];
      EXPECT_NE(said[0].find(says), std::string::npos) << said[0];
      EXPECT_LT(said[0].size(), 250u) << said[0];
    }
  }
}

// gpt_advise's values the same way: one line, the flag, the value, what it takes; exit code 2.
// (CLI11 said "Could not convert: --devices = x" and took --top 0 for an empty table.)
TEST(GptAdvise, BadValuesAreOneLineAndExit2) {
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {" --devices x", "--devices 'x': expected an integer in 1.."},
           {" --devices 2 --top 0", "--top '0': expected an integer in 1.."},
           {" --devices 2 --layers -1", "--layers '-1': expected an integer in 1.."},
           {" --devices 2 --latency-us -1",
            "--latency-us '-1': expected a finite number of at "
            "least 0"}}) {
    SCOPED_TRACE(flags);
    auto run = run_command(bin("gpt_advise") + " --memory-gb 1 --bandwidth-gbps 1" + flags);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_EQ(run.output.rfind("gpt_advise: " + says, 0), 0u) << run.output;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << run.output;
  }
}

// A size that the tensor ranks cannot split is one line naming the size and the degree: the
// key/value heads (a head stays on one rank), and under --sp the sequence (equal slices). A hidden
// width that does not divide is split unevenly instead (parallelize_test.cpp).
TEST(TrainGpt, ASizeTheTensorRanksCannotSplitNamesItAndTheDegree) {
  for (const auto& [flags, named] :
       {std::pair<std::string, std::string>{" --tp 2 --kv-heads 1",
                                            "kv_heads 1 does not divide by the tensor-parallel "
                                            "degree 2"},
        {" --tp 2 --sp --seq-len 31", "--seq-len 31 does not divide by --tp 2"}}) {
    SCOPED_TRACE(flags);
    auto run =
        run_command(bin("dtrain") + " run --nproc-per-node 2 -- " + bin("train_gpt") + flags);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_NE(run.output.find(named), std::string::npos) << run.output;
  }
}

}  // namespace
}  // namespace dtrain
