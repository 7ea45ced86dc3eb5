// parse_flags: the trainer's command line, read by hand.
#include "flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

#include "dtrain/errors.h"

namespace trainer {
namespace {

const char* kUsage =
    "usage: train_fashion_mnist [--model mlp|cnn] [--strategy ddp|dp|mp|pipeline|zero]\n"
    "                           [--devices N (dp, mp)] [--zero-stage 1|2|3 (zero)]\n"
    "                           [--stages P (pipeline)] [--micro-batches M (mp, pipeline)]\n"
    "                           [--schedule gpipe|1f1b|interleaved] [--virtual-stages V "
    "(interleaved)]\n"
    "                           [--epochs N] [--batch-size N (per data-parallel rank)]\n"
    "                           [--lr X] [--seed N] [--data DIR] [--checkpoint-dir DIR] "
    "[--resume]\n"
    "                           [--checkpoint-every STEPS] [--keep-checkpoints K] "
    "[--async-checkpoints]\n"
    "                           [--max-steps N] [--log-every N] [--spawn N (start N DDP ranks "
    "itself)]\n"
    "                           [--device cpu|cuda|auto] [--amp bf16|fp16 (ddp, dp)]";

[[noreturn]] void bad_flag(const std::string& flag, const std::string& value,
                           const std::string& accepted) {
  throw dtrain::UsageError("train_fashion_mnist: " + flag + " '" + value + "': expected " +
                           accepted);
}

int64_t parse_int(const std::string& flag, const std::string& value, int64_t min,
                  int64_t max = int64_t{1} << 40) {
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE || parsed < min || parsed > max) {
    bad_flag(flag, value, "an integer in " + std::to_string(min) + ".." + std::to_string(max));
  }
  return parsed;
}

const char* const kValueFlags[] = {"--model",
                                   "--strategy",
                                   "--devices",
                                   "--stages",
                                   "--micro-batches",
                                   "--schedule",
                                   "--virtual-stages",
                                   "--epochs",
                                   "--batch-size",
                                   "--lr",
                                   "--seed",
                                   "--data",
                                   "--checkpoint-dir",
                                   "--checkpoint-every",
                                   "--max-steps",
                                   "--keep-checkpoints",
                                   "--log-every",
                                   "--zero-stage",
                                   "--spawn",
                                   "--device",
                                   "--amp"};

}  // namespace

Flags parse_flags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage << std::endl;
      std::exit(0);
    }
    if (flag == "--resume") {
      flags.resume = true;
      continue;
    }
    if (flag == "--async-checkpoints") {
      flags.async_checkpoints = true;
      continue;
    }
    if (std::find(std::begin(kValueFlags), std::end(kValueFlags), flag) == std::end(kValueFlags)) {
      throw dtrain::UsageError("train_fashion_mnist: unknown flag '" + flag + "'; see --help");
    }
    if (i + 1 >= argc)
      throw dtrain::UsageError("train_fashion_mnist: " + flag + ": missing its value; see --help");
    std::string value = argv[++i];
    if (flag == "--model") {
      if (value != "mlp" && value != "cnn") bad_flag(flag, value, "mlp or cnn");
      flags.model = value;
    } else if (flag == "--strategy") {
      if (value != "ddp" && value != "dp" && value != "mp" && value != "pipeline" &&
          value != "zero") {
        bad_flag(flag, value, "ddp, dp, mp, pipeline or zero");
      }
      flags.strategy = value;
    } else if (flag == "--devices") {
      flags.devices = parse_int(flag, value, 1, 1024);
    } else if (flag == "--stages") {
      flags.stages = parse_int(flag, value, 1, 1024);
    } else if (flag == "--micro-batches") {
      flags.micro_batches = parse_int(flag, value, 1, 1 << 20);
    } else if (flag == "--schedule") {
      if (value != "gpipe" && value != "1f1b" && value != "interleaved")
        bad_flag(flag, value, "gpipe, 1f1b or interleaved");
      flags.schedule = value;
    } else if (flag == "--virtual-stages") {
      flags.virtual_stages = parse_int(flag, value, 1, 64);
    } else if (flag == "--epochs") {
      flags.epochs = parse_int(flag, value, 1);
    } else if (flag == "--batch-size") {
      flags.batch_size = parse_int(flag, value, 1);
    } else if (flag == "--lr") {
      char* end = nullptr;
      flags.lr = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(flags.lr > 0) || !std::isfinite(flags.lr)) {
        bad_flag(flag, value, "a positive finite number");
      }
    } else if (flag == "--seed") {
      flags.seed = parse_int(flag, value, 0);
    } else if (flag == "--data") {
      flags.data = value;
    } else if (flag == "--checkpoint-dir") {
      flags.checkpoint_dir = value;
    } else if (flag == "--checkpoint-every") {
      flags.checkpoint_every = parse_int(flag, value, 0);
    } else if (flag == "--keep-checkpoints") {
      flags.keep_checkpoints = parse_int(flag, value, 1, 1 << 20);
    } else if (flag == "--max-steps") {
      flags.max_steps = parse_int(flag, value, 0);
    } else if (flag == "--log-every") {
      flags.log_every = parse_int(flag, value, 0);
    } else if (flag == "--zero-stage") {
      flags.zero_stage = parse_int(flag, value, 1, 3);
    } else if (flag == "--spawn") {
      flags.spawn = parse_int(flag, value, 1, 1024);
    } else if (flag == "--device") {
      if (value != "cpu" && value != "cuda" && value != "auto")
        bad_flag(flag, value, "cpu, cuda or auto");
      flags.device = value;
    } else if (flag == "--amp") {
      if (value != "bf16" && value != "fp16") bad_flag(flag, value, "bf16 or fp16");
      flags.amp = value;
    } else {
      bad_flag(flag, value, "a known flag. " + std::string(kUsage));
    }
  }
  if (flags.virtual_stages > 1 && flags.schedule != "interleaved") {
    throw dtrain::UsageError(
        "train_fashion_mnist: --virtual-stages " + std::to_string(flags.virtual_stages) +
        " needs --schedule interleaved (gpipe and 1f1b run one chunk per stage)");
  }
  if (flags.strategy == "pipeline" && !flags.checkpoint_dir.empty()) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --checkpoint-dir is not supported with --strategy pipeline yet "
        "(each stage holds its own optimizer state); use ddp, dp or mp for checkpointed runs");
  }
  if (flags.strategy == "zero" && flags.async_checkpoints) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --async-checkpoints is not supported with --strategy zero (every "
        "rank writes its own shards, synchronously); drop it");
  }
  if (flags.spawn > 0 && (flags.strategy == "dp" || flags.strategy == "mp")) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --spawn " + std::to_string(flags.spawn) + " with --strategy " +
        flags.strategy + ": " + flags.strategy +
        " runs in one process (use --devices N); --spawn starts ranks for ddp, zero or "
        "pipeline");
  }
  if (!flags.amp.empty() && flags.strategy != "ddp" && flags.strategy != "dp") {
    throw dtrain::UsageError("train_fashion_mnist: --amp " + flags.amp + " with --strategy " +
                             flags.strategy + ": mixed precision is wired for ddp and dp only");
  }
  if (flags.resume && flags.checkpoint_dir.empty()) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --resume needs --checkpoint-dir DIR (where to resume from)");
  }
  return flags;
}

}  // namespace trainer
