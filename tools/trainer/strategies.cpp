// The trainer's strategies and devices; see strategies.h.
#include "strategies.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "dtrain/errors.h"

namespace trainer {

int64_t correct_predictions(torch::nn::Module& net,
                            const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                            const datasets::MnistSplit& test, int64_t begin, int64_t end) {
  torch::NoGradGuard no_grad;
  net.eval();
  int64_t correct = 0;
  for (int64_t i = begin; i < end; i += 1000) {
    int64_t count = std::min<int64_t>(1000, end - i);
    auto logits = forward(test.images.narrow(0, i, count));
    correct += logits.argmax(1).eq(test.labels.narrow(0, i, count)).sum().item<int64_t>();
  }
  net.train();
  return correct;
}

namespace {

torch::Tensor mean_loss(const torch::Tensor& logits, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits, y);
}

// Before evaluating a pipeline, every rank takes each stage's trained layers from that stage (the
// stages of a pipeline hold disjoint layers of the same model), so that each rank can test the
// whole model.
void gather_stages(torch::nn::Sequential& layers, const dtrain::RankMesh& mesh,
                   int virtual_stages) {
  torch::NoGradGuard no_grad;
  const int stages = mesh.pipeline_size;
  auto chunks = dtrain::split_sequential(
      layers, dtrain::balance_by_parameters(layers, stages * virtual_stages));
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (auto& p : chunks[c]->parameters())
      mesh.pipeline_group->broadcast(p, static_cast<int>(c) % stages);
    for (auto& b : chunks[c]->buffers())
      mesh.pipeline_group->broadcast(b, static_cast<int>(c) % stages);
  }
}

// Accuracy on the test split, each rank evaluating a contiguous share and the counts summed.
double test_accuracy(torch::nn::Module& net,
                     const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const datasets::MnistSplit& test, dtrain::ProcessGroup& pg) {
  int64_t n = test.labels.size(0);
  int64_t begin = n * pg.rank() / pg.size(), end = n * (pg.rank() + 1) / pg.size();
  const int64_t correct = correct_predictions(net, forward, test, begin, end);
  at::Tensor counts = torch::tensor({correct, end - begin}, torch::kInt64);
  pg.all_reduce(counts);
  return static_cast<double>(counts[0].item<int64_t>()) / counts[1].item<int64_t>();
}

}  // namespace

// ddp: cuda:LOCAL_RANK (modulo the GPUs this process sees: ranks that share a GPU need
// DTRAIN_CUDA_BACKEND=gloo); dp: --devices replicas dealt round-robin over the GPUs (two on one GPU
// overlap through their own streams); mp, pipeline and zero stay on the CPU for now. auto: the GPUs
// when there are any and (ddp) one for each rank of this node, else the CPU.
Placement place(const Flags& flags, const dtrain::LaunchInfo& launch) {
  const bool cuda = torch::cuda::is_available();
  const bool wired = flags.strategy == "ddp" || flags.strategy == "dp";
  if (flags.device == "cuda" && !cuda) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --device cuda: this process sees no CUDA device (LibTorch built "
        "without CUDA, no GPU, or CUDA_VISIBLE_DEVICES empty); use --device cpu or auto");
  }
  if (flags.device == "cuda" && !wired) {
    throw dtrain::UsageError("train_fashion_mnist: --device cuda with --strategy " +
                             flags.strategy + ": not wired yet (ddp and dp are); use --device cpu");
  }
  Placement placement;
  const int64_t gpus = cuda ? torch::cuda::device_count() : 0;
  // auto takes the GPUs only when every rank of this node gets its own (ranks sharing one would
  // need DTRAIN_CUDA_BACKEND=gloo: asked for with --device cuda, never chosen behind the user's
  // back).
  const bool fits = flags.strategy == "dp" || launch.local_world_size <= gpus;
  if (cuda && wired && (flags.device == "cuda" || (flags.device == "auto" && fits))) {
    if (flags.strategy == "dp") {
      for (int64_t i = 0; i < flags.devices; ++i) {
        placement.dp_devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i % gpus));
      }
      placement.device = placement.dp_devices[0];
    } else {
      placement.device =
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank % gpus));
    }
  }
  if (flags.amp == "fp16" && placement.device.is_cpu()) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --amp fp16 needs a CUDA device (float16 autocast with loss scaling) "
        "but this run trains on the CPU (--device auto picks it without a GPU for each rank of a "
        "node); use --amp bf16 there");
  }
  return placement;
}

// Note [Batch size per data-parallel rank]
// --batch-size is what one data-parallel rank reads per step, as a PyTorch DataLoader's batch_size
// under torchrun: any world size trains, and the global batch is local_batch x replicas.
//   ddp, zero  every process is a replica and reads its own local_batch rows.
//   pipeline   the world / stages pipelines are the replicas; the stages of one pipeline work on
//              the same local_batch rows, cut into --micro-batches.
//   mp         one process, one pipeline: the global batch is local_batch.
//   dp         one process whose batch DataParallel scatters over its --devices replicas, as
//              torch.nn.DataParallel does: the global batch is local_batch, in slices one row apart
//              when --devices does not divide it. The gradient is still exactly that of the whole
//              batch's mean loss: DataParallel weights each slice's mean loss by its share of the
//              rows (src/dp/replica_set.cpp; tests/dp checks 13 rows on 1-4).
// A checkpoint's position is in samples (DistributedSampler), so a run resumed at another world
// size, and so with another global batch, still sees the rest of the epoch once.
int data_parallel_replicas(const Flags& flags, int world) {
  const bool one_process = flags.strategy == "dp" || flags.strategy == "mp";
  if (one_process && world != 1) {
    throw dtrain::UsageError(
        "train_fashion_mnist: --strategy " + flags.strategy +
        " runs in one process (it drives --devices replicas or stages itself); start it "
        "without `dtrain run` or with --nproc-per-node 1");
  }
  if (flags.strategy == "pipeline" && world % flags.stages != 0) {
    throw dtrain::UsageError("train_fashion_mnist: --stages " + std::to_string(flags.stages) +
                             " does not divide the " + std::to_string(world) +
                             " processes; run a multiple of --stages processes (world = "
                             "data-parallel pipelines x stages)");
  }
  return flags.strategy == "pipeline" ? world / static_cast<int>(flags.stages) : world;
}

torch::Tensor batch_rows(const torch::Tensor& data, const torch::Tensor& rows,
                         const c10::Device& device, bool stay_on_host) {
  if (device.is_cpu()) return data.index_select(0, rows);
  auto sizes = data.sizes().vec();
  sizes[0] = rows.numel();
  torch::Tensor pinned = torch::empty(sizes, data.options().pinned_memory(true));
  torch::index_select_out(pinned, data, 0, rows);
  return stay_on_host ? pinned : pinned.to(device, /*non_blocking=*/true);
}

Strategy::Strategy(const Flags& flags, const c10::Device& device,
                   const std::shared_ptr<dtrain::ProcessGroup>& pg)
    : flags(flags), device(device), pg(pg) {
  if (flags.strategy == "mp" || flags.strategy == "pipeline") {
    layers = make_sequential(flags.model);
    model = layers.ptr();
    model_forward = [layers = layers](const torch::Tensor& x) mutable {
      return layers->forward(x);
    };
  } else {
    net = std::make_shared<NetImpl>(flags.model);
    net->to(device);  // before the optimizer and the checkpoint see its parameters
    model = net;
    model_forward = [net = net, device](const torch::Tensor& x) {
      return net->forward(x.to(device)).to(torch::kCPU);
    };
  }

  pipeline_options.micro_batches = static_cast<int>(flags.micro_batches);
  pipeline_options.schedule = dtrain::parse_schedule_kind(flags.schedule);
  pipeline_options.virtual_stages = static_cast<int>(flags.virtual_stages);
  trained = model->parameters();
  if (flags.strategy == "mp") {
    const int stages = static_cast<int>(flags.devices);
    auto chunks = dtrain::split_sequential(
        layers, dtrain::balance_by_parameters(layers, stages * pipeline_options.virtual_stages));
    mp = std::make_unique<dtrain::Pipeline>(chunks, std::vector<c10::Device>{}, pipeline_options,
                                            stages);
  } else if (flags.strategy == "pipeline") {
    mesh = dtrain::make_rank_mesh(pg, static_cast<int>(flags.stages));
    const int chunks = static_cast<int>(flags.stages) * pipeline_options.virtual_stages;
    pipeline = std::make_unique<dtrain::DistributedPipeline>(
        dtrain::split_sequential(layers, dtrain::balance_by_parameters(layers, chunks)), mesh,
        pipeline_options);
    trained = pipeline->parameters();
  }
  if (flags.strategy == "zero") {
    dtrain::ShardedDataParallelOptions options;
    options.stage = static_cast<int>(flags.zero_stage);
    sdp = dtrain::ShardedDataParallel<NetImpl>(net, pg, options);
    trained = sdp->parameters();
  }
}

void Strategy::wrap(const Placement& placement) {
  if (flags.strategy == "dp") {
    dtrain::DataParallelOptions options;
    options.num_replicas = static_cast<int>(flags.devices);
    options.devices = placement.dp_devices;
    dp = dtrain::DataParallel<NetImpl>(net, options);
  } else if (flags.strategy == "ddp" && !rdp) {
    ddp = dtrain::DistributedDataParallel<NetImpl>(net, pg);
  }
}

void Strategy::recover_in_place(torch::optim::Optimizer& optimizer,
                                dtrain::DistributedSampler& sampler,
                                std::vector<torch::Tensor> state) {
  dtrain::RecoveryOptions options;
  options.state = std::move(state);
  rdp = std::make_unique<dtrain::ResilientDataParallel<NetImpl>>(net, optimizer, sampler,
                                                                 std::move(options));
}

torch::Tensor Strategy::forward_backward(const torch::Tensor& x, const torch::Tensor& y,
                                         dtrain::amp::GradScaler& scaler, double weight,
                                         bool sync) {
  // Accumulating: the reduction over the ranks waits for the pass with sync. (dp and mp run in one
  // process: their gradients add up on the module as any backward's do.)
  std::optional<dtrain::DistributedDataParallelBase::NoSyncGuard> ddp_guard;
  std::optional<dtrain::ShardedDataParallelBase::NoSyncGuard> sdp_guard;
  std::optional<dtrain::DistributedPipeline::NoSyncGuard> pipeline_guard;
  if (!sync) {
    if (ddp || rdp) ddp_guard.emplace(rdp ? *rdp->ddp() : *ddp);
    if (sdp) sdp_guard.emplace(*sdp);
    if (pipeline) pipeline_guard.emplace(*pipeline);
  }
  auto weighted_loss = [weight](const torch::Tensor& logits, const torch::Tensor& target) {
    return weight == 1.0 ? mean_loss(logits, target) : mean_loss(logits, target) * weight;
  };
  torch::Tensor loss;
  std::optional<dtrain::amp::Autocast> autocast;  // --amp: around the forward only
  if (!flags.amp.empty()) {
    autocast.emplace(device.type(), flags.amp == "fp16" ? torch::kHalf : torch::kBFloat16);
  }
  if (dp) {
    const double scale = scaler.get_scale();
    loss = dp->forward_backward(x, y,
                                [&](const torch::Tensor& logits, const torch::Tensor& target) {
                                  return scaler.scale(weighted_loss(logits, target));
                                }) /
           (scale * weight);
    autocast.reset();
  } else if (mp) {
    loss = mp->forward_backward(x, y, weighted_loss) / weight;
  } else if (pipeline) {
    loss = pipeline->forward_backward(x, y, weighted_loss) / weight;
  } else {
    loss = mean_loss(sdp ? sdp->forward(x) : rdp ? rdp->ddp()->forward(x) : ddp->forward(x), y);
    autocast.reset();
    scaler.scale(weight == 1.0 ? loss : loss * weight).backward();
  }
  return loss;
}

double Strategy::test_accuracy(const datasets::MnistSplit& test) {
  if (rdp) {
    if (rdp->group()->rank() != 0) return std::nan("");
    const int64_t n = test.labels.size(0);
    return static_cast<double>(correct_predictions(*model, model_forward, test, 0, n)) / n;
  }
  if (pipeline) gather_stages(layers, mesh, pipeline_options.virtual_stages);
  if (sdp) sdp->gather_full_parameters();  // the full model, to evaluate
  const double accuracy = trainer::test_accuracy(*model, model_forward, test, *pg);
  if (sdp) sdp->release_full_parameters();
  return accuracy;
}

}  // namespace trainer
