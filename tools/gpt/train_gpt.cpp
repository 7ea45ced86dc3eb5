// train_gpt: the transformer of gpt.h on real text (Debian's GCIDE, bytes as tokens), in the layout
// the flags ask for (tools/gpt/parallelize.h): --dp D x --tp T x --pp P ranks on one mesh (D
// defaults to world / (T x P)): D data-parallel replicas (DDP, or ZeRO stage 1-3 with --zero; with
// --tp or --pp, each tensor rank's shards of each stage sharded again over its D replicas), each of
// P pipeline stages (one block range per stage, --schedule, --micro-batches), each stage's blocks
// split over T tensor ranks (heads and hidden features); --sp adds sequence parallelism, the norms
// and residuals on a slice of the sequence (Note [Sequence-parallel blocks] in gpt.h). --recompute
// makes every block recompute its activations in backward; --clip-grad N clips the gradient to the
// global norm N (over every shard, tensor rank and stage); --grad-accum K runs K passes of
// --batch-size windows per optimizer step, reducing once. Prints rank 0's progress and one JSON
// line at the end, with tokens/s over the timed steps (after --warmup-steps) and the model FLOP/s
// they amount to.
//
// --export-hf DIR writes the trained model as Hugging Face's LlamaForCausalLM (config.json and
// safetensors, tools/gpt/hf_export.h) for Python's transformers to load; --init-hf DIR starts from
// such a folder (dtrain's or save_pretrained's) instead of fresh weights, its sizes from its
// config.json. --logits-out FILE writes the model's logits on fixed tokens before and after
// training (safetensors: "tokens", "logits_before", "logits_after") for comparing with another
// implementation.
//
// --export-dcp DIR writes the trained model and AdamW's moments, every rank its own part, as
// torch.distributed.checkpoint's safetensors storage (dtrain/dcp.h) that PyTorch loads unsharded or
// into FSDP2; --init-dcp DIR starts from such a folder (dtrain's in any layout, FSDP2's, a plain
// dcp.save's) in any layout: its parameters, and AdamW's moments and step where it holds them.
//
// --checkpoint-dir DIR saves the run's state after the last step (and every --checkpoint-every N
// steps); --resume (or a restart by the launcher) continues from the newest checkpoint exactly, in
// every layout, and in another layout or world size too (GptCheckpoints below).
//
// --device auto (default) trains on cuda:LOCAL_RANK when every rank of the node has a GPU of its
// own, else on the CPU; --device cuda also puts several ranks on one GPU (they then need
// DTRAIN_CUDA_BACKEND=gloo, as NCCL refuses two ranks on one device). --amp bf16 runs the forward
// under autocast (the parameters and the optimizer stay float32).
//
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/train_gpt --steps 200
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/train_gpt --zero 3
//   build/bin/dtrain run --nproc-per-node 4 -- build/bin/train_gpt --pp 2 --micro-batches 4
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/train_gpt --tp 2
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/train_gpt --tp 2 --sp
//   build/bin/dtrain run --nproc-per-node 8 -- build/bin/train_gpt --dp 2 --tp 2 --pp 2
//   build/bin/dtrain run --nproc-per-node 4 -- build/bin/train_gpt --dp 2 --tp 2 --zero 3
//   build/bin/dtrain run --nproc-per-node 2 -- build/bin/train_gpt --init-hf in --export-hf out
#include <sys/resource.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "console/flag_checks.h"
#include "console/progress.h"
#include "datasets/text_corpus.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/pipeline.h"
#include "dtrain/safetensors.h"
#include "dtrain/sharded.h"
#include "dtrain/sharded_checkpoint.h"
#include "gpt/gpt.h"
#include "gpt/hf_export.h"
#include "gpt/parallelize.h"

namespace {

struct Flags {
  int dp = 0;              // data-parallel replicas; 0: world / (pp x tp)
  int pp = 1;              // pipeline stages
  int tp = 1;              // tensor-parallel ranks per block
  int zero = 0;            // 0: DDP; 1-3: ZeRO stage
  bool sp = false;         // sequence parallelism over the tensor group (with --tp > 1)
  bool recompute = false;  // every block recomputes its activations in backward
  double clip_grad = 0;    // the global gradient norm's bound (0: no clipping)
  std::string schedule = "1f1b";
  int micro_batches = 4;
  gpt::GptConfig model;
  int64_t window = 0;     // tokens per training window: --seq-len (model.seq_len without --init-hf)
  std::string init_hf;    // a Hugging Face Llama folder to start from
  std::string export_hf;  // where to write the trained model as one
  int64_t export_hf_max_shard = 0;  // bytes per safetensors file (0: one file)
  std::string logits_out;           // where to write logits before and after training
  std::string logits_tokens;        // a safetensors file whose "tokens" they are computed on
  int64_t batch_size = 8;           // windows per data-parallel rank and forward-backward pass
  int grad_accum = 1;               // passes whose gradients add up to one optimizer step
  int64_t steps = 100;              // timed steps
  int64_t warmup_steps = 0;  // untimed steps before them (CUDA's first steps pay for its set-up)
  std::string device = "auto";
  std::string amp = "none";
  double lr = 3e-3;
  int64_t max_bytes = 0;      // 0: the whole corpus
  int64_t eval_windows = 64;  // held-out windows for the validation loss
  int64_t log_every = 20;
  std::string checkpoint_dir;    // where checkpoints go (none without it)
  int64_t checkpoint_every = 0;  // also every N steps (0: only after the last)
  bool resume = false;           // continue from checkpoint_dir's newest checkpoint

  std::string init_dcp;    // a DCP safetensors folder to start from
  std::string export_dcp;  // where to write the trained state as one
};

Flags parse(int argc, char** argv) {
  Flags flags;
  CLI::App app("train_gpt: a GPT-style transformer on GCIDE's text, bytes as tokens");
  // Each bad value is one line: "train_gpt: --flag 'value': expected ...".
  const console::FlagChecks checks("train_gpt");
  app.add_option("--dp", flags.dp, "data-parallel replicas (default: world size / (tp x pp))")
      ->transform(checks.integer_in("--dp", 1, 1 << 20));
  app.add_option("--pp", flags.pp, "pipeline stages (default 1; dp x tp x pp is the world size)")
      ->transform(checks.integer_in("--pp", 1, 64));
  app.add_option("--tp", flags.tp, "tensor-parallel degree inside each block (default 1)")
      ->transform(checks.integer_in("--tp", 1, 64));
  app.add_flag("--sp", flags.sp,
               "sequence parallelism: norms and residuals on a slice of the sequence (with --tp)");
  app.add_option("--zero", flags.zero,
                 "ZeRO stage 0-3 over the data-parallel ranks (0: DDP; with --tp or --pp, each "
                 "tensor rank's shards of each stage over its replicas)")
      ->transform(checks.integer_in("--zero", 0, 3));
  app.add_flag("--recompute", flags.recompute,
               "recompute every block's activations in backward (less memory, one more forward)");
  app.add_option("--clip-grad", flags.clip_grad,
                 "clip the gradient to this global 2-norm (over every shard, tensor rank and "
                 "stage; 0: no clipping)")
      ->transform(checks.number("--clip-grad", /*zero_allowed=*/true));
  app.add_option("--schedule", flags.schedule,
                 "pipeline schedule with --pp: gpipe, 1f1b (default), interleaved (two chunks per "
                 "stage) or zbh1 (zero-bubble H1)");
  app.add_option("--micro-batches", flags.micro_batches,
                 "micro-batches per step with --pp (at most --batch-size)")
      ->transform(checks.integer_in("--micro-batches", 1, 1024));
  // The sizes, as pointers: with --init-hf the ones given must agree with its config.json.
  std::vector<std::pair<CLI::Option*, int64_t*>> sizes = {
      {app.add_option("--layers", flags.model.layers, "transformer blocks (default 2)")
           ->transform(checks.integer_in("--layers", 1, 1024)),
       &flags.model.layers},
      {app.add_option("--width", flags.model.width,
                      "model width (default 64; a multiple of --heads, width / heads even)")
           ->transform(checks.integer_in("--width", 2, 65536)),
       &flags.model.width},
      {app.add_option("--heads", flags.model.heads, "query heads (default 4)")
           ->transform(checks.integer_in("--heads", 1, 1024)),
       &flags.model.heads},
      {app.add_option("--kv-heads", flags.model.kv_heads,
                      "key/value heads (default 2; must divide --heads)")
           ->transform(checks.integer_in("--kv-heads", 1, 1024)),
       &flags.model.kv_heads}};
  CLI::Option* seq_len =
      app.add_option("--seq-len", flags.model.seq_len,
                     "tokens per window (default 64; and the model's limit without --init-hf)")
          ->transform(checks.integer_in("--seq-len", 1, 1 << 20));
  app.add_option("--init-hf", flags.init_hf,
                 "start from this Hugging Face Llama folder (config.json + safetensors); the "
                 "sizes come from its config.json");
  app.add_option("--export-hf", flags.export_hf,
                 "after training, write the model here as Hugging Face's LlamaForCausalLM");
  app.add_option("--export-hf-max-shard", flags.export_hf_max_shard,
                 "bytes per safetensors file of --export-hf (0: one file)")
      ->transform(checks.integer_in("--export-hf-max-shard", 0));
  app.add_option("--init-dcp", flags.init_dcp,
                 "start from this DCP safetensors folder (the model, and AdamW's moments if there)")
      ->excludes(app.get_option("--init-hf"));
  app.add_option("--export-dcp", flags.export_dcp,
                 "after training, write the model and AdamW's moments here as a DCP safetensors "
                 "folder (every rank its part)");
  app.add_option("--logits-out", flags.logits_out,
                 "write the logits on fixed tokens before and after training (safetensors)");
  app.add_option("--logits-tokens", flags.logits_tokens,
                 "a safetensors file whose int64 \"tokens\" [batch, seq] --logits-out uses "
                 "(default: the first two held-out windows)");
  app.add_option("--batch-size", flags.batch_size,
                 "windows per data-parallel replica and forward-backward pass (default 8)")
      ->transform(checks.integer_in("--batch-size", 1, 1 << 20));
  app.add_option("--grad-accum", flags.grad_accum,
                 "gradient accumulation: passes of --batch-size windows per optimizer step, their "
                 "gradients reduced once (default 1)")
      ->transform(checks.integer_in("--grad-accum", 1, 1 << 16));
  app.add_option("--steps", flags.steps, "timed steps (default 100)")
      ->transform(checks.integer_in("--steps", 1, 1 << 30));
  app.add_option("--warmup-steps", flags.warmup_steps,
                 "untimed steps before the timed ones (default 0)")
      ->transform(checks.integer_in("--warmup-steps", 0, 1 << 30));
  app.add_option("--device", flags.device,
                 "auto (default): cuda:LOCAL_RANK when each rank of the node has a GPU, else cpu; "
                 "cpu; or cuda (ranks may share a GPU, with DTRAIN_CUDA_BACKEND=gloo)")
      ->transform(checks.one_of("--device", {"auto", "cpu", "cuda"}, "auto, cpu or cuda"));
  app.add_option("--amp", flags.amp, "none (default), or bf16: the forward under bfloat16 autocast")
      ->transform(checks.one_of("--amp", {"none", "bf16"}, "none or bf16"));
  app.add_option("--lr", flags.lr, "AdamW's learning rate (default 3e-3)")
      ->transform(checks.number("--lr"));
  app.add_option("--max-bytes", flags.max_bytes, "read only this much of the corpus (0: all)")
      ->transform(checks.integer_in("--max-bytes", 0));
  app.add_option("--eval-windows", flags.eval_windows,
                 "held-out windows for val_loss and bits_per_byte (default 64)")
      ->transform(checks.integer_in("--eval-windows", 1, 1 << 20));
  app.add_option("--log-every", flags.log_every,
                 "print the loss every N steps on rank 0 (default 20; 0: never)")
      ->transform(checks.integer_in("--log-every", 0));
  app.add_option("--checkpoint-dir", flags.checkpoint_dir,
                 "save checkpoints there (after the last step, and every --checkpoint-every)");
  app.add_option("--checkpoint-every", flags.checkpoint_every, "also save every N steps")
      ->transform(checks.integer_in("--checkpoint-every", 0));
  app.add_flag("--resume", flags.resume,
               "continue from --checkpoint-dir's newest checkpoint (by itself after a restart by "
               "the launcher)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw dtrain::UsageError(std::string("train_gpt: ") + e.what() + " (see --help)");
  }
  // Checked here, not only where a pipeline is built: a misspelt --schedule without --pp is still a
  // mistake worth one line.
  try {
    dtrain::parse_schedule_kind(flags.schedule);
  } catch (const dtrain::UsageError& e) {
    throw dtrain::UsageError(std::string("train_gpt: --schedule: ") + e.what());
  }
  flags.window = flags.model.seq_len;
  if (!flags.init_hf.empty()) {
    // The model is the folder's: a size flag may repeat its config.json but not contradict it;
    // --seq-len is then only the training window, which must fit max_position_embeddings.
    gpt::GptConfig config;
    try {
      config = gpt::read_hf_config(flags.init_hf);
    } catch (const dtrain::UsageError& e) {
      throw dtrain::UsageError(std::string("train_gpt: --init-hf: ") + e.what());
    }
    for (auto [option, value] : sizes) {
      const int64_t from_file = option->get_name() == "--layers"  ? config.layers
                                : option->get_name() == "--width" ? config.width
                                : option->get_name() == "--heads" ? config.heads
                                                                  : config.kv_heads;
      if (option->count() > 0 && *value != from_file) {
        throw dtrain::UsageError("train_gpt: " + option->get_name() + " " + std::to_string(*value) +
                                 " conflicts with --init-hf " + flags.init_hf +
                                 "'s config.json, which says " + std::to_string(from_file) +
                                 "; drop the flag (the sizes come from config.json)");
      }
    }
    if (config.vocab < 256) {
      throw dtrain::UsageError("train_gpt: --init-hf " + flags.init_hf + ": vocab_size " +
                               std::to_string(config.vocab) +
                               " is below 256, and train_gpt's tokens are bytes");
    }
    flags.window = seq_len->count() > 0 ? flags.model.seq_len
                                        : std::min<int64_t>(flags.model.seq_len, config.seq_len);
    if (flags.window > config.seq_len) {
      throw dtrain::UsageError("train_gpt: --seq-len " + std::to_string(flags.window) +
                               " is longer than --init-hf " + flags.init_hf +
                               "'s max_position_embeddings " + std::to_string(config.seq_len));
    }
    flags.model = config;
  }
  try {
    flags.model.check();
  } catch (const dtrain::UsageError& e) {
    throw dtrain::UsageError(
        std::string("train_gpt: --layers/--width/--heads/--kv-heads/--seq-len: ") + e.what());
  }
  if (flags.sp && flags.tp < 2) {
    throw dtrain::UsageError("train_gpt: --sp with --tp " + std::to_string(flags.tp) +
                             ": sequence parallelism splits the sequence over the tensor-parallel "
                             "ranks; add --tp 2 or more, or drop --sp");
  }
  if (flags.sp && flags.window % flags.tp != 0) {
    throw dtrain::UsageError("train_gpt: --seq-len " + std::to_string(flags.window) +
                             " does not divide by --tp " + std::to_string(flags.tp) +
                             ": --sp gives every tensor rank an equal slice of the sequence; pick "
                             "a --seq-len that is a multiple of " +
                             std::to_string(flags.tp));
  }
  if (flags.checkpoint_dir.empty() && (flags.resume || flags.checkpoint_every > 0)) {
    throw dtrain::UsageError(
        "train_gpt: --resume and --checkpoint-every need --checkpoint-dir; name the folder");
  }
  return flags;
}

// --checkpoint-dir: the run's state in dtrain's sharded checkpoints, saved after every
// --checkpoint-every steps and after the last, and resumed exactly (the resumed run continues as an
// uninterrupted one would: parameters, AdamW's moments, the sampler's place in the epoch). Every
// layout saves the same form, keyed by the whole model's parameter names (Note [Layout-neutral
// checkpoints] in parallelize.cpp), so a run resumes in any other layout and world size.
class GptCheckpoints {
 public:
  GptCheckpoints(const Flags& flags, const std::shared_ptr<dtrain::ProcessGroup>& pg,
                 gpt::Parallel& layout, torch::optim::AdamW& optimizer,
                 dtrain::DistributedSampler& sampler)
      : flags_(flags), layout_(layout), optimizer_(optimizer), sampler_(sampler) {
    if (flags.checkpoint_dir.empty()) return;
    dtrain::CheckpointOptions options;
    options.dir = flags.checkpoint_dir;
    checkpointer_ = std::make_unique<dtrain::ShardedCheckpointer>(options, pg);
  }

  // The step to continue from: the newest checkpoint's with --resume or after a restart by the
  // launcher or Slurm (dtrain::LaunchInfo::restarts), else 0. A first run into a folder that holds
  // checkpoints is refused, so that they are never overwritten by a run that did not ask to
  // continue from them.
  int64_t resume() {
    if (!checkpointer_) return 0;
    const bool restarted = dtrain::launch_info_from_env().restarts > 0;
    if (!flags_.resume && !restarted) {
      if (!checkpointer_->list().empty()) {
        throw dtrain::UsageError("train_gpt: --checkpoint-dir " + flags_.checkpoint_dir +
                                 " already holds checkpoints; pass --resume to continue from "
                                 "them, or name another folder");
      }
      return 0;
    }
    return layout_.load(*checkpointer_, optimizer_, sampler_).value_or(0);
  }

  // After `step` steps: saves when --checkpoint-every says so, and after the last step.
  void maybe_save(int64_t step, bool last) {
    if (!checkpointer_) return;
    if (!last && (flags_.checkpoint_every == 0 || step % flags_.checkpoint_every != 0)) return;
    layout_.save(*checkpointer_, optimizer_, sampler_, step);
  }

 private:
  const Flags& flags_;
  gpt::Parallel& layout_;
  torch::optim::AdamW& optimizer_;
  dtrain::DistributedSampler& sampler_;
  std::unique_ptr<dtrain::ShardedCheckpointer> checkpointer_;
};

// Where this rank trains (see the top of the file). auto never puts two ranks on one GPU behind the
// user's back: that needs DTRAIN_CUDA_BACKEND=gloo, which only --device cuda asks for.
c10::Device pick_device(const std::string& device, const dtrain::LaunchInfo& launch) {
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda" && !cuda) {
    throw dtrain::UsageError(
        "train_gpt: --device cuda: this process sees no CUDA device (LibTorch built without CUDA, "
        "no GPU, or CUDA_VISIBLE_DEVICES empty); use --device cpu or auto");
  }
  const int64_t gpus = cuda ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  if (device == "cuda" || (device == "auto" && cuda && launch.local_world_size <= gpus)) {
    return {c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank % gpus)};
  }
  return c10::Device(c10::kCPU);
}

int train(const Flags& flags) {
  const c10::Device device = pick_device(flags.device, dtrain::launch_info_from_env());
  auto pg = dtrain::init_process_group();
  const bool leader = pg->rank() == 0;
  gpt::LayoutOptions layout_options;
  layout_options.dp = flags.dp;
  layout_options.tp = flags.tp;
  layout_options.pp = flags.pp;
  layout_options.zero = flags.zero;
  layout_options.recompute = flags.recompute;
  layout_options.sp = flags.sp;
  layout_options.bf16 = flags.amp == "bf16";
  layout_options.schedule = dtrain::parse_schedule_kind(flags.schedule);
  layout_options.micro_batches = flags.micro_batches;
  try {
    gpt::check_degrees(layout_options, pg->size());  // the same line on every rank
  } catch (const dtrain::UsageError& e) {
    throw dtrain::UsageError(std::string("train_gpt: ") + e.what());
  }
  dtrain::RankMesh mesh = gpt::make_mesh(layout_options, pg);

  // Every rank builds the same model under the same seed (rank 0's start is what DDP, ZeRO and the
  // stages keep; with --tp each rank keeps its shard of the same draw).
  torch::manual_seed(0);
  gpt::Gpt model = gpt::make_model(flags.model, layout_options, mesh);
  if (!flags.init_hf.empty()) gpt::load_hf(*model, flags.init_hf);  // each rank its shard
  model->to(device);  // before a layout takes its parameters
  auto corpus = datasets::load_text_corpus(datasets::default_text_corpus(), 0.05, flags.max_bytes);

  // --logits-out: the model's logits on fixed tokens now, before a layout takes the parameters
  // (ZeRO-3 frees the module's own), and after training. Every rank computes them (a tensor
  // group's forward is collective); rank 0 writes.
  at::Tensor logit_tokens, logits_before;
  auto logits_of = [&] {
    torch::NoGradGuard no_grad;
    model->eval();
    at::Tensor logits = model(logit_tokens.to(device)).to(at::kCPU, at::kFloat);
    model->train();
    return logits;
  };
  if (!flags.logits_out.empty()) {
    if (!flags.logits_tokens.empty()) {
      dtrain::TensorTable file = dtrain::load_safetensors(flags.logits_tokens);
      const at::Tensor* tokens = file.find("tokens");
      if (!tokens || tokens->scalar_type() != at::kLong || tokens->dim() != 2 ||
          tokens->size(1) > flags.model.seq_len || tokens->min().item<int64_t>() < 0 ||
          tokens->max().item<int64_t>() >= flags.model.vocab) {
        throw dtrain::UsageError("train_gpt: --logits-tokens " + flags.logits_tokens +
                                 ": expected an int64 tensor \"tokens\" [batch, seq] with seq <= " +
                                 std::to_string(flags.model.seq_len) + " and values below " +
                                 std::to_string(flags.model.vocab));
      }
      logit_tokens = *tokens;
    } else {
      datasets::ByteWindows windows(corpus.heldout, flags.window);
      logit_tokens = at::stack({windows.get(0).data, windows.get(1).data});
    }
    logits_before = logits_of();
  }

  // The layout (tools/gpt/parallelize.h): what the optimizer steps, how a step runs, which group
  // holds the data replicas.
  gpt::Parallel layout(model, layout_options, mesh, pg, device);
  const std::shared_ptr<dtrain::ProcessGroup>& data_group = layout.data_group();
  const bool pipe = layout.pipe != nullptr;
  torch::optim::AdamW optimizer(layout.parameters(), torch::optim::AdamWOptions(flags.lr));

  // Windows dealt over the data-parallel replicas (every stage and tensor rank of a replica reads
  // the same).
  auto train_set =
      datasets::ByteWindows(corpus.train, flags.window).map(torch::data::transforms::Stack<>());
  dtrain::DistributedSampler sampler(train_set.size().value(), data_group);
  // The held-out windows, made before training so that a tail too short for one window is one line
  // before the first step, not after the last.
  std::optional<datasets::ByteWindows> heldout;
  try {
    heldout.emplace(corpus.heldout, flags.window);
  } catch (const dtrain::UsageError& e) {
    throw dtrain::UsageError(std::string("train_gpt: the held-out text (the last 5% of the ") +
                             "corpus, or of --max-bytes): " + e.what());
  }
  auto loader = torch::data::make_data_loader(train_set, sampler,
                                              torch::data::DataLoaderOptions(flags.batch_size));
  if (!flags.init_dcp.empty()) layout.load_dcp(flags.init_dcp, optimizer);  // a checkpoint wins
  GptCheckpoints checkpoints(flags, pg, layout, optimizer, sampler);
  const int64_t resumed_step = checkpoints.resume();
  if (leader && resumed_step > 0) {
    std::cout << "resumed from " << flags.checkpoint_dir << " at step " << resumed_step
              << std::endl;
  }

  // The clock starts once the warm-up steps have finished on the device, and stops after the last
  // step's loss has come back to the host (item() waits for it).
  auto synchronize = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  const int64_t total_steps = flags.warmup_steps + flags.steps;
  // A resumed run times the steps it takes (after the warm-up, if it has not passed it).
  const int64_t first_timed_step = std::max(flags.warmup_steps, resumed_step);
  int64_t step = resumed_step;
  double first_loss = 0, last_loss = 0;
  // Rank 0's progress over the steps this run takes, its own loss when drawn.
  console::Progress progress("train", "tokens", total_steps - resumed_step);
  const int64_t tokens_per_step =
      flags.grad_accum * flags.batch_size * flags.window * data_group->size();
  int pass = 0;     // of the step's --grad-accum passes, those done
  at::Tensor loss;  // their losses' sum so far
  auto start = std::chrono::steady_clock::now();
  // From the resumed epoch on: set_epoch of the epoch the sampler loaded keeps its place in it. A
  // step's passes may span two epochs.
  for (int64_t epoch = sampler.state().epoch; step < total_steps; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto& batch : *loader) {
      if (step == total_steps) break;
      if (step == first_timed_step && pass == 0) {
        synchronize();
        start = std::chrono::steady_clock::now();
      }
      at::Tensor inputs = batch.data.to(device, /*non_blocking=*/true);
      at::Tensor targets = batch.target.to(device, /*non_blocking=*/true);
      // --grad-accum K: K passes add their gradients of a K-th of the loss each, and only the
      // last one reduces them over the data replicas.
      if (pass == 0) optimizer.zero_grad();
      const bool last_pass = ++pass == flags.grad_accum;
      at::Tensor pass_loss =
          layout.forward_backward(inputs, targets, 1.0 / flags.grad_accum, last_pass);
      loss = loss.defined() ? loss + pass_loss : pass_loss;
      if (!last_pass) continue;
      loss = flags.grad_accum > 1 ? loss / flags.grad_accum : loss;
      pass = 0;
      if (flags.clip_grad > 0) layout.clip_grad_norm(flags.clip_grad);
      optimizer.step();
      ++step;
      checkpoints.maybe_save(step, step == total_steps);
      // The loss over the replicas only for the steps reported (the first, the logged, the last):
      // the same steps on every rank, and no extra collective on the others. The pipeline's loss
      // already comes back averaged.
      const bool logged = flags.log_every > 0 && step % flags.log_every == 0;
      if (step == resumed_step + 1 || logged || step == total_steps) {
        loss = loss.detach();
        if (!pipe) data_group->all_reduce(loss, dtrain::ReduceOp::kAvg);
        const double value = loss.item<double>();
        if (step == resumed_step + 1) first_loss = value;
        last_loss = value;
        if (leader && logged) std::cout << "step " << step << ": loss " << value << std::endl;
      }
      if (leader) {
        progress.update(step - resumed_step, (step - resumed_step) * tokens_per_step,
                        [&] { return loss.detach().item<double>(); });
      }
      loss = at::Tensor();
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (leader) progress.done();

  const int64_t timed_steps = std::max<int64_t>(0, total_steps - first_timed_step);
  nlohmann::ordered_json result = {{"steps", flags.steps},
                                   {"warmup_steps", flags.warmup_steps},
                                   {"world_size", pg->size()},
                                   {"pp", flags.pp},
                                   {"dp", data_group->size()},
                                   {"tp", flags.tp},
                                   {"sp", flags.sp},
                                   {"zero", flags.zero},
                                   {"recompute", flags.recompute},
                                   {"clip_grad", flags.clip_grad},
                                   {"grad_accum", flags.grad_accum},
                                   {"device", device.str()},
                                   {"amp", flags.amp},
                                   {"first_loss", first_loss},
                                   {"train_loss", last_loss}};
  // Peak resident set (ru_maxrss, KiB) through training, before validation gathers the model:
  // rank 0's, and the largest over the ranks; host memory, LibTorch's own baseline included.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  at::Tensor peak_rss_mb = torch::full({1}, usage.ru_maxrss / 1024.0, at::device(device));
  result["peak_rss_mb"] = peak_rss_mb.item<double>();
  pg->all_reduce(peak_rss_mb, dtrain::ReduceOp::kMax);
  result["peak_rss_mb_max"] = peak_rss_mb.item<double>();
  if (!flags.export_dcp.empty()) {  // every rank writes its part (parallelize.h)
    layout.export_dcp(flags.export_dcp, optimizer);
    result["export_dcp"] = flags.export_dcp;
  }
  // Validation on the held-out tail, one window at a time: by the whole model on every rank, or
  // through the pipeline's stages, the last one computing the loss (Note [Pipelined evaluation] in
  // parallelize.cpp); every rank gets it.
  layout.gather_full_parameters();
  const int64_t windows =
      std::min<int64_t>(flags.eval_windows, static_cast<int64_t>(heldout->size().value()));
  double total = 0;
  for (int64_t i = 0; i < windows; ++i) {
    auto example = heldout->get(static_cast<size_t>(i));
    total += layout.evaluate(example.data.unsqueeze(0), example.target.unsqueeze(0));
  }
  const double val_loss = total / static_cast<double>(windows);
  result["val_loss"] = val_loss;
  result["bits_per_byte"] = val_loss / std::log(2.0);
  // The whole trained model on every rank: ZeRO gathered it above, a pipeline's stages broadcast
  // their blocks here (each rank built the whole model, but trained only its stage's), and a
  // tensor group gathers its shards in export_hf and runs its forward together.
  layout.gather_stages();
  if (!flags.logits_out.empty()) {
    dtrain::TensorTable logits;
    logits.insert("tokens", logit_tokens);
    logits.insert("logits_before", logits_before);
    logits.insert("logits_after", logits_of());
    if (leader) dtrain::save_safetensors_file(flags.logits_out, logits);
  }
  if (!flags.export_hf.empty()) {
    gpt::HfExportOptions options;
    options.max_shard_bytes = flags.export_hf_max_shard;
    gpt::export_hf(*model, flags.export_hf, options, /*write=*/leader);
    result["export_hf"] = flags.export_hf;
  }
  if (resumed_step > 0) result["resumed_step"] = resumed_step;
  const double tokens = static_cast<double>(timed_steps * flags.grad_accum * flags.batch_size *
                                            flags.window * data_group->size());
  const double tokens_per_s = timed_steps > 0 ? tokens / seconds : 0;
  gpt::GptConfig trained = flags.model;  // FLOPs as the windows trained, not the model's limit
  trained.seq_len = flags.window;
  result["tokens_per_s"] = tokens_per_s;
  result["params"] = gpt::parameter_count(trained);
  result["model_flops_per_token"] = gpt::model_flops_per_token(trained);
  result["model_tflops"] = tokens_per_s * gpt::model_flops_per_token(trained) / 1e12;
  if (leader) std::cout << result.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] { return train(parse(argc, argv)); });
}
