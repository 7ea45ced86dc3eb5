// The trainer's five strategies (--strategy) and where it trains (--device):
//   ddp       dtrain::DistributedDataParallel: one process per rank, under `dtrain run` or --spawn
//   dp        dtrain::DataParallel: --devices replicas in this one process
//   mp        dtrain::Pipeline: the model cut into --devices stages in this one process
//   pipeline  dtrain::DistributedPipeline: world / --stages data-parallel pipelines of --stages
//             processes
//   zero      dtrain::ShardedDataParallel: DDP with sharded state (--zero-stage)
// Under in-place recovery (DTRAIN_RECOVERY=in-place), ddp trains through
// dtrain::ResilientDataParallel instead (recover_in_place()): its group changes with every
// generation, so it is asked for (group()) where it is needed, never kept.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "datasets/fashion_mnist.h"
#include "dtrain/amp.h"
#include "dtrain/comm.h"
#include "dtrain/ddp.h"
#include "dtrain/dp.h"
#include "dtrain/pipeline.h"
#include "dtrain/recovery.h"
#include "dtrain/sharded.h"
#include "flags.h"
#include "models.h"

namespace trainer {

// --device: where this process trains (see place()).
struct Placement {
  c10::Device device{c10::kCPU};        // the module's (dp: the first replica's)
  std::vector<c10::Device> dp_devices;  // dp on GPUs: one per replica; empty: CPU threads
};

// Decided before the process group starts, so that a wrong flag is one line on every rank at once.
Placement place(const Flags& flags, const dtrain::LaunchInfo& launch);

// The data-parallel replicas of --strategy on `world` processes (Note [Batch size per data-parallel
// rank]). Throws UsageError when the strategy cannot run on that many processes.
int data_parallel_replicas(const Flags& flags, int world);

// A batch's rows on their way to `device`. On a GPU they are gathered straight into pinned
// (page-locked) host memory, whose copy to the device is asynchronous and overlaps the GPU's work;
// `stay_on_host`: DataParallel scatters the pinned batch to its replicas itself.
torch::Tensor batch_rows(const torch::Tensor& data, const torch::Tensor& rows,
                         const c10::Device& device, bool stay_on_host);

// How many of the test split's rows [begin, end) `forward` classifies right, in eval mode and
// without gradients (the module back in train mode after).
int64_t correct_predictions(torch::nn::Module& net,
                            const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                            const datasets::MnistSplit& test, int64_t begin, int64_t end);

// The model of --model as --strategy trains it, built in two steps around the loading of a
// checkpoint: the constructor makes the model and what owns its parameters (`trained`, which the
// optimizer steps, and `model`, which a checkpoint saves); wrap() then puts DistributedDataParallel
// or DataParallel around it, which start from the parameters as loaded.
struct Strategy {
  Strategy(const Flags& flags, const c10::Device& device,
           const std::shared_ptr<dtrain::ProcessGroup>& pg);

  // ddp, dp: wraps the model (DDP broadcasts rank 0's parameters); the others, and ddp in place:
  // nothing to do.
  void wrap(const Placement& placement);
  // ddp under in-place recovery (built with a null pg): joins the job's first generation, or waits
  // to be admitted into a running one and receives its state from a live peer (see
  // dtrain/recovery.h). `state`: the trainer's tensors that travel with the model.
  void recover_in_place(torch::optim::Optimizer& optimizer, dtrain::DistributedSampler& sampler,
                        std::vector<torch::Tensor> state);
  // The group the model trains on now: pg, or in place the current generation's (null for a
  // newcomer that came after the job finished).
  std::shared_ptr<dtrain::ProcessGroup> group() const { return rdp ? rdp->group() : pg; }
  // One step's forward and backward on a batch, the forward under --amp's autocast and the loss
  // scaled by `scaler`: the gradients of `trained` are then ready for scaler.step(). Returns the
  // batch's mean loss, unscaled. Gradient accumulation (--grad-accum): a pass over a part of the
  // step's rows adds the gradient of its mean loss times `weight` (its share of the rows), and
  // only the pass with `sync` reduces what the passes added over the data-parallel ranks.
  torch::Tensor forward_backward(const torch::Tensor& x, const torch::Tensor& y,
                                 dtrain::amp::GradScaler& scaler, double weight = 1.0,
                                 bool sync = true);
  // The whole model's accuracy on the test split, the same on every rank. In place: on the group's
  // rank 0 alone, without a collective, so that an evaluation never meets a failure; NaN elsewhere.
  double test_accuracy(const datasets::MnistSplit& test);
  // This process's index among the data-parallel replicas: the share of the data it reads.
  int data_rank() const { return pipeline ? mesh.data_index : pg->rank(); }

  const Flags& flags;
  c10::Device device;
  std::shared_ptr<dtrain::ProcessGroup> pg;
  // ddp, dp and zero train NetImpl; mp and pipeline its Sequential form, cut into chunks.
  std::shared_ptr<NetImpl> net;
  torch::nn::Sequential layers{nullptr};
  std::shared_ptr<torch::nn::Module> model;  // what is checkpointed and evaluated
  std::function<torch::Tensor(const torch::Tensor&)> model_forward;
  dtrain::PipelineOptions pipeline_options;
  std::unique_ptr<dtrain::Pipeline> mp;
  std::unique_ptr<dtrain::DistributedPipeline> pipeline;
  dtrain::RankMesh mesh;
  std::vector<torch::Tensor> trained;                 // what this process's optimizer steps
  dtrain::ShardedDataParallel<NetImpl> sdp{nullptr};  // empty holders unless that strategy
  dtrain::DistributedDataParallel<NetImpl> ddp{nullptr};
  dtrain::DataParallel<NetImpl> dp{nullptr};
  std::unique_ptr<dtrain::ResilientDataParallel<NetImpl>> rdp;  // ddp in place
};

}  // namespace trainer
