// The trainer's run (see train.h): the set-up, the checkpoints it resumes from and saves, the
// training loop and the final report: one loop for both kinds of recovery (Note [The trainer in
// place]).
#include "train.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoints.h"
#include "console/progress.h"
#include "datasets/fashion_mnist.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/cuda_graph.h"
#include "dtrain/errors.h"
#include "dtrain/recovery.h"
#include "dtrain/sharded_checkpoint.h"
#include "dtrain/stop.h"
#include "strategies.h"

namespace trainer {

namespace {

// A measurement as the final line reports it: six significant digits (more would be noise).
double six_digits(double x) {
  if (!std::isfinite(x)) return x;
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", x);
  return std::strtod(text, nullptr);
}

using Clock = std::chrono::steady_clock;

// Note [The trainer in place]
// Under DTRAIN_RECOVERY=in-place (`dtrain run --recovery in-place`) --strategy ddp trains through
// dtrain::ResilientDataParallel (Strategy::recover_in_place); the loop is the same, and the
// difference is one seam: each step's body runs inside rdp.step, which abandons it when a rank dies
// and runs it again at the new size, instead of directly. What follows from it:
// - The group changes with every generation: the loop asks Strategy::group() for it every time.
//   Checkpoints are saved by the current generation's rank 0 (whichever job rank that is), and only
//   while no later generation is forming (ResilientDataParallel::generation_current), so a rank of
//   an abandoned generation never writes one. The first generation's group loads the checkpoint
//   (rank 0 reads it, as in the restart path); a newcomer loads nothing, it receives the state.
// - The step count and epoch_samples travel with the model to a laggard or a newcomer
//   (RecoveryOptions::state): they count committed steps only, as the sampler's position does, so
//   a checkpoint holds the same position, step and counts whichever rank writes it, and a restart
//   of the whole job resumes from it as from any other.
// - The agreement to stop on SIGTERM is a collective like the gradient's, so in place it happens
//   inside the body, before anything of the step changes (otherwise after the step, as before);
//   nothing else collective runs outside rdp.step (the test accuracy is computed by rank 0 alone,
//   Strategy::test_accuracy) until the end.
// - The loop follows the sampler's epoch. A laggard (its last step failed where the others'
//   finished) receives the sampler as it stood right after that step, so at an epoch's end its
//   run_step returns false and it moves to the next epoch here, as the others did (Note [Where the
//   sampler stands], src/recovery/resilient_data_parallel.cpp).
// - The end goes through rdp->finish(), not a barrier of the loop's own (end_together below).
// - --amp is refused in place (in_place_unsupported_reason): the loss scaler agrees on skipped
//   steps over one fixed group.

// The counters that travel with the model in place: [steps, epoch_samples[0..epochs)].
void write_counters(at::Tensor& counters, int64_t steps,
                    const std::vector<int64_t>& epoch_samples) {
  auto c = counters.accessor<int64_t, 1>();
  c[0] = steps;
  for (int64_t e = 0; e + 1 < c.size(0) && e < static_cast<int64_t>(epoch_samples.size()); ++e)
    c[e + 1] = epoch_samples[e];
}
void read_counters(const at::Tensor& counters, int64_t& steps,
                   std::vector<int64_t>& epoch_samples) {
  auto c = counters.accessor<int64_t, 1>();
  steps = c[0];
  for (int64_t e = 0; e + 1 < c.size(0) && e < static_cast<int64_t>(epoch_samples.size()); ++e)
    epoch_samples[e] = c[e + 1];
}

// Under DTRAIN_RECOVERY=in-place: why this job cannot recover in place ("" when it can).
std::string in_place_unsupported_reason(const Flags& flags) {
  if (flags.strategy != "ddp") return "--strategy " + flags.strategy + " (in place: ddp only)";
  // (A CUDA device recovers in place: NCCL's waits ask the heartbeats and a failed generation's
  // communicator is aborted, Note [Waiting for NCCL] in src/comm/work.cpp.)
  if (!flags.amp.empty()) {
    return "--amp (its loss scaler agrees on skipped steps over one fixed group, which in-place "
           "recovery replaces with every generation)";
  }
  // (--spawn needs no case: dtrain::spawn gives its ranks DTRAIN_RECOVERY=restart, as it restarts
  // nothing.)
  return "";
}

// --cuda-graph: why this run cannot capture its step ("" when it can). A captured step may not
// wait on the host: DDP's all-reduce over several ranks does, and so does the fp16 loss scaler's
// inf/NaN check; bf16 autocast's cast cache would be captured stale.
std::string cuda_graph_unsupported_reason(const Flags& flags, const c10::Device& device,
                                          bool in_place, int world) {
  if (!device.is_cuda()) return "the CPU as its device (pass --device cuda on a GPU)";
  if (flags.strategy != "ddp") return "--strategy " + flags.strategy + " (ddp only)";
  if (in_place) return "in-place recovery (its steps are redone at a new size)";
  if (world != 1) return std::to_string(world) + " ranks (one only: DDP's all-reduce waits)";
  if (!flags.amp.empty()) return "--amp " + flags.amp;
  if (flags.grad_accum > 1) return "--grad-accum " + std::to_string(flags.grad_accum);
  return "";
}

}  // namespace

int train(const Flags& flags) {
  const std::string recovery = std::getenv("DTRAIN_RECOVERY") ? std::getenv("DTRAIN_RECOVERY") : "";
  if (recovery != "" && recovery != "restart" && recovery != "in-place") {
    throw dtrain::UsageError("train_fashion_mnist: DTRAIN_RECOVERY is '" + recovery +
                             "'; accepted: restart or in-place (as `dtrain run --recovery` sets "
                             "it), or unset");
  }
  const dtrain::LaunchInfo launch = dtrain::launch_info_from_env();
  const Placement placement = place(flags, launch);
  const c10::Device device = placement.device;
  bool in_place = false;
  if (recovery == "in-place") {
    const std::string reason = in_place_unsupported_reason(flags);
    in_place = reason.empty();
    if (!in_place && launch.rank == 0) {
      std::cout << "in-place recovery: not for " << reason
                << "; a failure restarts the job from its last checkpoint" << std::endl;
    }
  }
  const int64_t restarts = restart_count();
  const auto kill_at = kill_at_step_from_env();
  // Before the group forms and the data loads: a run that cannot capture says so at once.
  if (flags.cuda_graph) {
    const std::string why =
        cuda_graph_unsupported_reason(flags, device, in_place, in_place ? 0 : launch.world_size);
    if (!why.empty()) {
      throw dtrain::UsageError(
          "train_fashion_mnist: --cuda-graph captures the step of --strategy ddp on one rank on "
          "a GPU without --amp or --grad-accum; this run has " +
          why + "; drop --cuda-graph");
    }
  }
  check_checkpoint_dir(flags, launch.rank, restarts > 0);
  // In place the group is the recovery's, a new one with every generation (Strategy::group()).
  const std::shared_ptr<dtrain::ProcessGroup> pg =
      in_place ? nullptr : dtrain::init_process_group();
  const int job_rank = pg ? pg->rank() : launch.rank;  // the fault-injection hook's rank
  // Note [Batch size per data-parallel rank] (strategies.cpp); in place the recovery deals the data
  // over each generation.
  const int replicas = in_place ? 1 : data_parallel_replicas(flags, pg->size());
  // One core per rank; `dtrain run` sets OMP_NUM_THREADS=1 for the same reason.
  torch::set_num_threads(1);

  const std::string data = flags.data.empty() ? datasets::default_fashion_mnist_dir() : flags.data;
  auto train_set = datasets::load_fashion_mnist(data, /*train=*/true);
  auto test_set = datasets::load_fashion_mnist(data, /*train=*/false);

  // --cuda-graph: the model, DDP and the loop on a stream of their own (dtrain::CudaStreamScope
  // says why); the checks of the flag come once the group's size is known, below.
  std::optional<dtrain::CudaStreamScope> capture_stream;
  if (flags.cuda_graph && device.is_cuda()) capture_stream.emplace(device);

  torch::manual_seed(flags.seed);
  Strategy strategy(flags, device, pg);
  torch::optim::SGD optimizer(strategy.trained, torch::optim::SGDOptions(flags.lr).momentum(0.9));
  // --amp: autocast around each forward; fp16 also scales the loss (a disabled scaler passes
  // through). DDP's ranks agree on every skipped step through the group.
  dtrain::amp::GradScalerOptions scaler_options;
  scaler_options.enabled = flags.amp == "fp16";
  dtrain::amp::GradScaler scaler(scaler_options, flags.strategy == "ddp" ? pg : nullptr);
  int64_t skipped_steps = 0;

  // On a GPU under ddp the training split lives there (188 MB for Fashion-MNIST): a step gathers
  // its rows with one kernel each instead of a gather on the host and a copy of the batch.
  const bool on_host = flags.strategy == "dp";  // DataParallel scatters the batch itself
  const bool data_on_device = device.is_cuda() && !on_host;
  const at::Tensor train_images = data_on_device ? train_set.images.to(device) : train_set.images;
  const at::Tensor train_labels = data_on_device ? train_set.labels.to(device) : train_set.labels;

  // The sampler deals the data over the data-parallel replicas (every stage of a pipeline reads the
  // same); in place the recovery deals it over each generation.
  // This rank's rows per step: --batch-size per pass, --grad-accum passes.
  const int64_t step_rows = flags.batch_size * flags.grad_accum;
  dtrain::DistributedSamplerOptions sampler_options;
  sampler_options.seed = static_cast<uint64_t>(flags.seed);
  dtrain::DistributedSampler sampler(train_set.labels.size(0), replicas,
                                     in_place ? 0 : strategy.data_rank(), sampler_options);

  // epoch_samples[e]: training samples of epoch e whose gradients are in the model (padding repeats
  // included), kept in the checkpoint so that work rolled back by a restart is not counted.
  std::vector<int64_t> epoch_samples(flags.epochs, 0);
  Position at;
  // In place: the step count and epoch_samples as they travel with the model (Note [The trainer in
  // place]).
  at::Tensor counters = torch::zeros({1 + flags.epochs}, torch::kInt64);
  bool newcomer = false;  // in place: admitted into a running job, with the state of a live peer
  if (in_place) {
    // Before a newcomer waits to be admitted: SIGTERM while it waits then makes it leave (Note
    // [Leaving in place] in dtrain/recovery.h) instead of ending it by the signal.
    if (!flags.checkpoint_dir.empty()) dtrain::install_stop_handler();
    strategy.recover_in_place(optimizer, sampler, {counters});
    if (strategy.rdp->job_finished()) return 0;  // a replacement that came after the end
    if (strategy.rdp->left()) return dtrain::kLeftExitCode;  // asked to stop before it joined
    newcomer = strategy.rdp->admitted_as_newcomer();
  }
  auto leader = [&] { return strategy.group()->rank() == 0; };
  Checkpoints checkpoints(flags, strategy.group(), strategy.model.get(),
                          strategy.sdp ? strategy.sdp.get() : nullptr, optimizer, sampler, scaler);
  std::string resumed_from;
  if (newcomer) {
    read_counters(counters, at.steps, epoch_samples);
    at.epoch = sampler.epoch();
    at.samples_consumed = sampler.state().samples_consumed;
  } else {
    resumed_from = checkpoints.resume(restarts, at, epoch_samples, device);
    sampler.load_state({at.epoch, at.samples_consumed});
  }
  if (in_place) checkpoints.forget_group();
  const bool checkpointing = checkpoints.checkpointing;
  // Resumed on any world size: DDP broadcasts rank 0's (loaded) parameters; every rank loaded the
  // same optimizer state.
  strategy.wrap(placement);

  if (leader() && !resumed_from.empty()) {
    std::cout << (restarts > 0 ? "restart " + std::to_string(restarts) + ": " : std::string())
              << "resumed from " << resumed_from << " at epoch " << at.epoch + 1 << ", "
              << at.samples_consumed << " samples into it, step " << at.steps << std::endl;
  }
  if (checkpointing) dtrain::install_stop_handler();  // preemption: dtrain/stop.h

  // Saves a checkpoint of the state after at.steps: rank 0 of the group that trains now.
  auto save = [&]() -> std::string {
    const auto group = strategy.group();
    if (strategy.rdp) {
      const int64_t generation = strategy.rdp->stats().generation;
      checkpoints.checkpoint_state.values["generation"] = std::to_string(generation);
      if (group->rank() == 0 && !strategy.rdp->generation_current()) {
        std::cout << "in-place recovery: checkpoint of step " << at.steps
                  << " not saved: generation " << generation
                  << " is being re-formed, and only the current one saves" << std::endl;
        return std::string();
      }
    }
    return checkpoints.save(at, epoch_samples, *group);
  };

  // One step, the same in both kinds of recovery: what the body took, and whether the ranks agreed
  // to stop instead (SIGTERM, Note [Agreeing to stop] in dtrain/stop.h).
  int64_t step_samples = 0, step_epoch = 0;
  bool stop_agreed = false;
  // In place: this rank left on SIGTERM and the others go on (Note [Leaving in place]).
  bool left = false;
  at::Tensor loss;
  // --cuda-graph: the whole step (the rows' gather, forward, backward, SGD) captured once and
  // replayed (dtrain/cuda_graph.h); its only input is the batch's row numbers.
  std::unique_ptr<dtrain::CudaGraphStep> graphed;
  if (flags.cuda_graph) {
    graphed = std::make_unique<dtrain::CudaGraphStep>(
        [&](const std::vector<at::Tensor>& in) {
          at::Tensor step_loss = strategy.forward_backward(
              train_images.index_select(0, in[0]), train_labels.index_select(0, in[0]), scaler);
          optimizer.step();
          return step_loss;
        },
        optimizer);
  }
  auto agree_to_stop = [&] { return checkpointing && dtrain::should_stop(strategy.group()); };
  auto body = [&]() -> bool {
    // In place the agreement is a collective that may fail like the gradient's: inside the body,
    // before anything of the step changes. Otherwise after the step, below.
    // Some ranks' SIGTERM (one node taken back) lets them leave while the others go on, re-formed
    // (Note [Leaving in place] in dtrain/recovery.h); everyone's stops the job with a checkpoint.
    if (strategy.rdp && checkpointing) {
      const dtrain::StopAgreement agreed = strategy.rdp->agree_to_stop();
      left = agreed == dtrain::StopAgreement::kLeave;
      stop_agreed = agreed == dtrain::StopAgreement::kStopAll;
      if (left || stop_agreed) return false;
    }
    auto batch = sampler.next(static_cast<size_t>(step_rows));
    if (!batch) return false;  // the epoch is over (on every rank at once)
    at::Tensor rows = torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()));
    if (data_on_device) rows = rows.pin_memory();  // its copy to the GPU does not wait
    if (graphed) {
      loss = (*graphed)({rows});
    } else {
      optimizer.zero_grad();
      // --grad-accum K: the step's rows in K passes, each adding the gradient of its share of the
      // mean loss; the last one reduces over the ranks. An epoch's short last step takes fewer
      // passes: a row each at least, and a row per micro-batch in a pipeline.
      const int64_t total = rows.size(0);
      const bool pipelined = flags.strategy == "mp" || flags.strategy == "pipeline";
      const int64_t pass_count = std::min<int64_t>(
          flags.grad_accum, std::max<int64_t>(1, pipelined ? total / flags.micro_batches : total));
      const std::vector<at::Tensor> passes = rows.tensor_split(pass_count);
      loss = at::Tensor();
      for (int64_t p = 0; p < pass_count; ++p) {
        const at::Tensor& part = passes[static_cast<size_t>(p)];
        at::Tensor x, y;
        if (data_on_device) {
          const at::Tensor on_device = part.to(device, /*non_blocking=*/true);
          x = train_images.index_select(0, on_device);
          y = train_labels.index_select(0, on_device);
        } else {
          x = batch_rows(train_images, part, device, /*stay_on_host=*/on_host);
          y = batch_rows(train_labels, part, device, /*stay_on_host=*/on_host);
        }
        const double weight = static_cast<double>(part.size(0)) / static_cast<double>(total);
        at::Tensor pass_loss =
            strategy.forward_backward(x, y, scaler, weight, /*sync=*/p + 1 == pass_count);
        // The step's mean loss: the passes' means weighted by their rows (one pass: its own).
        if (pass_count == 1) {
          loss = pass_loss;
        } else {
          loss = p == 0 ? pass_loss * weight : loss + pass_loss * weight;
        }
      }
      if (!scaler.step(optimizer)) ++skipped_steps;  // fp16: an inf/NaN gradient on any rank
      scaler.update();
    }
    step_samples = static_cast<int64_t>(batch->size()) * sampler.world_size();
    step_epoch = sampler.epoch();
    return true;
  };
  // The seam (Note [The trainer in place]): in place the body runs inside rdp.step, which redoes it
  // at the new size after a failure, and the counters travel with the state; otherwise directly.
  auto run_step = [&]() -> bool {
    if (!strategy.rdp) return body();
    write_counters(counters, at.steps, epoch_samples);
    const bool stepped = strategy.rdp->step([&](auto&) { return body(); });
    read_counters(counters, at.steps, epoch_samples);
    return stepped;
  };
  auto steps_left = [&] { return (sampler.num_samples() + step_rows - 1) / step_rows; };

  int64_t samples_processed = 0;  // this run, over all ranks
  double train_seconds = 0, accuracy = 0, last_loss = 0;
  at::Tensor last_loss_tensor;  // read only when shown (console::Progress) and at the end
  bool stopped_early = false, preempted = false;
  while (!stopped_early && sampler.epoch() < flags.epochs) {
    console::Progress progress(
        "epoch " + std::to_string(sampler.epoch() + 1) + "/" + std::to_string(flags.epochs),
        "samples", steps_left());
    int64_t epoch_steps = 0, epoch_run_samples = 0;  // of this epoch in this run
    auto start = Clock::now();
    while (run_step()) {
      epoch_samples.at(static_cast<size_t>(step_epoch)) += step_samples;
      samples_processed += step_samples;
      epoch_run_samples += step_samples;
      ++at.steps;
      ++epoch_steps;
      if (leader()) {
        last_loss_tensor = loss.detach();
        auto read_loss = [&] { return last_loss = last_loss_tensor.item<double>(); };
        progress.set_total(epoch_steps + steps_left());
        progress.update(epoch_steps, epoch_run_samples, read_loss);
        if (flags.log_every > 0 && at.steps % flags.log_every == 0) {
          std::cout << "step " << at.steps << " loss " << read_loss();
          // In place the group's size too (bench/compare_recovery.sh reads it).
          if (strategy.rdp) std::cout << " world " << strategy.group()->size();
          std::cout << std::endl;
        }
      }
      if (job_rank == kill_at.rank && at.steps == kill_at.step && restarts == 0 && !newcomer) {
        std::raise(kill_at.signal);
      }
      if (!strategy.rdp && agree_to_stop()) {
        stop_agreed = true;
        break;
      }
      if (flags.checkpoint_every > 0 && at.steps % flags.checkpoint_every == 0 && checkpointing) {
        save();
      }
      if (flags.max_steps > 0 && at.steps >= flags.max_steps) {
        stopped_early = true;
        break;
      }
    }
    if (last_loss_tensor.defined()) last_loss = last_loss_tensor.item<double>();
    train_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    if (left) break;
    if (leader()) progress.done();
    if (stop_agreed) {
      preempted = true;
      break;
    }
    accuracy = strategy.test_accuracy(test_set);
    if (leader()) {
      char line[120];
      std::snprintf(line, sizeof line, "epoch %lld: test accuracy %.4f",
                    static_cast<long long>(sampler.epoch() + 1), accuracy);
      std::cout << line << std::endl;
    }
    // A finished epoch is saved as the start of the next one.
    if (!stopped_early) sampler.set_epoch(sampler.epoch() + 1);
    if (checkpointing) save();
  }
  if (left) {
    checkpoints.wait();  // a checkpoint this rank was writing is whole before it goes
    std::cout << "rank " << job_rank << " left on SIGTERM after step " << at.steps
              << "; the others go on without it and hold the whole state" << std::endl;
    return dtrain::kLeftExitCode;
  }
  // In place the end is agreed like a step (ResilientDataParallel::finish, Note [The end of
  // training]): a rank whose last step failed is healed and ends with the others, a dead one is not
  // waited for, and newcomers still waiting are told the job is over. A barrier of our own could
  // not re-form: a rank dying after the last step would fail every survivor's.
  auto end_together = [&] {
    if (strategy.rdp) {
      strategy.rdp->finish();
    } else {
      strategy.group()->barrier();
    }
  };
  if (preempted) {
    std::string path = save();
    checkpoints.wait();
    end_together();  // every rank exits once the checkpoint is on disk
    if (leader()) {
      std::cout << "stopped by SIGTERM after step " << at.steps << ": saved " << path
                << "; a restart by the launcher, or --resume, continues from it" << std::endl;
    }
    return dtrain::kStopExitCode;
  }
  checkpoints.wait();
  end_together();  // rank 0's checkpoint is on disk before anyone reports success
  const auto group = strategy.group();  // in place: the final generation's
  if (at.epoch >= flags.epochs && samples_processed == 0) {
    // Resumed from a checkpoint that already finished --epochs: nothing to train, but report the
    // model.
    if (leader()) {
      std::cout << "nothing to train: the checkpoint has finished " << at.epoch
                << " epoch(s) and --epochs is " << flags.epochs << std::endl;
    }
    accuracy = strategy.test_accuracy(test_set);
  }
  if (group->rank() == 0) {
    // In place the job's data-parallel size is the last generation's.
    const int replicas_now = in_place ? group->size() : replicas;
    // The final JSON line, its keys in this order. nlohmann::json writes a diverged (non-finite)
    // loss as null: JSON has no NaN or infinity.
    nlohmann::ordered_json result = {
        {"test_accuracy", six_digits(accuracy)},
        {"epochs", flags.epochs},
        {"world_size", group->size()},
        {"strategy", flags.strategy},
        {"replicas", strategy.dp ? flags.devices : replicas_now},
        {"model", flags.model},
        {"global_batch", step_rows * replicas_now},
        {"per_rank_batch", step_rows},
        {"grad_accum", flags.grad_accum},
        {"train_samples", samples_processed},
        {"train_time_s", six_digits(train_seconds)},
        {"samples_per_s", six_digits(train_seconds > 0 ? samples_processed / train_seconds : 0.0)},
        {"final_loss", six_digits(last_loss)},
        {"steps", at.steps},
        {"restarts", restarts}};
    if (strategy.rdp) {
      // A newcomer's own counts start where it joined (train_samples, train_time_s); the job's
      // travel with the model (steps, epoch_samples) or with the recovery (these).
      const auto stats = strategy.rdp->stats();
      result["recovery"] = "in-place";
      result["recoveries"] = stats.recoveries;
      result["steps_redone"] = stats.steps_redone;
      result["admitted"] = stats.admitted;
      result["departed"] = stats.departed;
      // What being ready cost this rank, nothing failing (dtrain::ReadinessCost); against
      // train_time_s it is bench/recovery_overhead.sh's share.
      const dtrain::ReadinessCost cost = strategy.rdp->readiness_cost();
      result["readiness"] = {{"admission_checks", cost.admission_checks},
                             {"admission_s", cost.admission_s},
                             {"admission_carried", cost.admission_carried},
                             {"heartbeat_cpu_s", cost.heartbeat_cpu_s}};
    }
    result["epoch_samples"] = epoch_samples;
    if (strategy.sdp) result["zero_stage"] = strategy.sdp->stage();
    result["device"] = device.str();
    if (graphed) result["cuda_graph_replays"] = graphed->replayed_steps();
    result["amp"] = flags.amp.empty() ? "none" : flags.amp;
    if (scaler.is_enabled()) {
      result["amp_skipped_steps"] = skipped_steps;
      result["amp_scale"] = scaler.get_scale();
    }
    if (strategy.mp || strategy.pipeline) {
      result["stages"] = strategy.mp ? strategy.mp->stages() : strategy.pipeline->stages();
      result["data_parallel"] = replicas;
      result["micro_batches"] = flags.micro_batches;
      result["schedule"] = flags.schedule;
      result["virtual_stages"] = flags.virtual_stages;
    }
    std::cout << result.dump() << std::endl;
  }
  // (In place, where rank 0 hosts the store, finish() kept it until the others were done with it.)
  return 0;
}

}  // namespace trainer
