// parse_flags over CLI11 (Debian: libcli11-dev), included by this file alone: its headers double
// the compile time of a file that includes them (doc/benchmarks.md, "Build time of one benchmark
// with CLI11's headers").
#include "flags.h"

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "console/flag_checks.h"
#include "dtrain/errors.h"

namespace trainer {
namespace {

constexpr const char* kProgram = "train_fashion_mnist";

// The value checks, each one line: "train_fashion_mnist: --flag 'value': expected ...".
const console::FlagChecks kChecks(kProgram);

// What no single flag can check: flags that do not go together.
void check_combinations(const Flags& flags) {
  const std::string program = kProgram;
  if (flags.virtual_stages > 1 && flags.schedule != "interleaved") {
    throw dtrain::UsageError(
        program + ": --virtual-stages " + std::to_string(flags.virtual_stages) +
        " needs --schedule interleaved (gpipe and 1f1b run one chunk per stage)");
  }
  if (flags.strategy == "pipeline" && !flags.checkpoint_dir.empty()) {
    throw dtrain::UsageError(
        program +
        ": --checkpoint-dir is not supported with --strategy pipeline yet (each stage holds its "
        "own optimizer state); use ddp, dp or mp for checkpointed runs");
  }
  if (flags.strategy == "zero" && flags.async_checkpoints) {
    throw dtrain::UsageError(
        program +
        ": --async-checkpoints is not supported with --strategy zero (every rank writes its own "
        "shards, synchronously); drop it");
  }
  if (flags.spawn > 0 && (flags.strategy == "dp" || flags.strategy == "mp")) {
    throw dtrain::UsageError(program + ": --spawn " + std::to_string(flags.spawn) +
                             " with --strategy " + flags.strategy + ": " + flags.strategy +
                             " runs in one process (use --devices N); --spawn starts ranks for "
                             "ddp, zero or pipeline");
  }
  if (!flags.amp.empty() && flags.strategy != "ddp" && flags.strategy != "dp") {
    throw dtrain::UsageError(program + ": --amp " + flags.amp + " with --strategy " +
                             flags.strategy + ": mixed precision is wired for ddp and dp only");
  }
  if (flags.resume && flags.checkpoint_dir.empty()) {
    throw dtrain::UsageError(program +
                             ": --resume needs --checkpoint-dir DIR (where to resume from)");
  }
}

}  // namespace

Flags parse_flags(int argc, char** argv) {
  Flags flags;
  CLI::App app(
      "Trains an MLP or a CNN on Fashion-MNIST with one of dtrain's strategies; rank 0 ends with "
      "one JSON line.\n  dtrain run --nproc-per-node 2 -- train_fashion_mnist --epochs 1   (DDP)",
      kProgram);
  // A flag given twice takes its last value, as a flag appended to a script's defaults expects.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Unknown flags are collected and named below, in the trainer's words.
  app.allow_extras();

  auto integer = [&](const std::string& name, int64_t& value, const std::string& help, int64_t min,
                     int64_t max = int64_t{1} << 40) {
    app.add_option(name, value, help)
        ->transform(kChecks.integer_in(name, min, max))
        ->capture_default_str();
  };
  auto choice = [&](const std::string& name, std::string& value, const std::string& help,
                    const std::vector<std::string>& choices, const std::string& accepted) {
    app.add_option(name, value, help + " (" + accepted + ")")
        ->transform(kChecks.one_of(name, choices, accepted))
        ->capture_default_str();
  };

  choice("--model", flags.model, "the network", {"mlp", "cnn"}, "mlp or cnn");
  choice("--strategy", flags.strategy, "how to train it", {"ddp", "dp", "mp", "pipeline", "zero"},
         "ddp, dp, mp, pipeline or zero");
  integer("--devices", flags.devices, "dp: replicas; mp: stages, in this process", 1, 1024);
  integer("--zero-stage", flags.zero_stage,
          "zero: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters", 1, 3);
  integer("--stages", flags.stages, "pipeline: stages per pipeline (world / P pipelines)", 1, 1024);
  integer("--micro-batches", flags.micro_batches, "mp, pipeline: micro-batches per step", 1,
          1 << 20);
  choice("--schedule", flags.schedule, "mp, pipeline: the pipeline schedule",
         {"gpipe", "1f1b", "interleaved", "zbh1"}, "gpipe, 1f1b, interleaved or zbh1");
  integer("--virtual-stages", flags.virtual_stages, "chunks per stage (--schedule interleaved)", 1,
          64);
  integer("--epochs", flags.epochs, "passes over the training split", 1);
  integer("--batch-size", flags.batch_size, "rows per pass of each data-parallel rank", 1);
  integer("--grad-accum", flags.grad_accum,
          "passes per step: their gradients add up, and are reduced over the ranks once", 1,
          1 << 16);
  app.add_option("--lr", flags.lr, "SGD's learning rate (momentum 0.9)")
      ->transform(kChecks.number("--lr"))
      ->capture_default_str();
  integer("--seed", flags.seed, "the initial weights and the shuffle order", 0);
  app.add_option("--data", flags.data,
                 "Fashion-MNIST's folder (default: $DTRAIN_FASHION_MNIST_DIR, else "
                 "/usr/share/datasets/fashion-mnist)")
      ->check(kChecks.non_empty("--data", "a folder"));
  app.add_option("--checkpoint-dir", flags.checkpoint_dir,
                 "save checkpoints there after every epoch and on SIGTERM; a restart by the "
                 "launcher resumes from them");
  app.add_flag("--resume", flags.resume, "continue from --checkpoint-dir's newest checkpoint");
  integer("--checkpoint-every", flags.checkpoint_every,
          "also save every N steps (0: only after each epoch)", 0);
  integer("--keep-checkpoints", flags.keep_checkpoints, "the newest K checkpoints stay on disk", 1,
          1 << 20);
  app.add_flag("--async-checkpoints", flags.async_checkpoints,
               "write checkpoints on a background thread while training goes on");
  integer("--max-steps", flags.max_steps, "stop after N steps in all (0: no limit)", 0);
  integer("--log-every", flags.log_every,
          "rank 0 prints \"step S loss L\" every N steps (0: never)", 0);
  integer("--spawn", flags.spawn, "start N DDP ranks of this program itself, without a launcher", 1,
          1024);
  choice("--device", flags.device, "where to train, auto: the GPUs when each rank has one",
         {"cpu", "cuda", "auto"}, "cpu, cuda or auto");
  choice("--amp", flags.amp, "ddp, dp: mixed precision (fp16 needs CUDA)", {"bf16", "fp16"},
         "bf16 or fp16");
  app.add_flag("--cuda-graph", flags.cuda_graph,
               "ddp on one GPU, one rank, no --amp: capture the whole step in a CUDA graph and "
               "replay it (one launch a step instead of dozens)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw dtrain::UsageError(std::string(kProgram) + ": " + e.what() + "; see --help");
  }
  if (const auto extra = app.remaining(); !extra.empty()) {
    throw dtrain::UsageError(std::string(kProgram) + ": unknown flag '" + extra.front() +
                             "'; see --help");
  }
  check_combinations(flags);
  return flags;
}

}  // namespace trainer
