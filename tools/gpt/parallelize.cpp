// The layouts of parallelize.h: the degrees' checks, the mesh, and the model wrapped per rank.
#include "gpt/parallelize.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "dtrain/amp.h"
#include "dtrain/errors.h"

namespace gpt {

namespace {

std::string degrees_text(const LayoutOptions& options, int dp) {
  return "--dp " + std::to_string(dp) + " x --tp " + std::to_string(options.tp) + " x --pp " +
         std::to_string(options.pp);
}

}  // namespace

int check_degrees(const LayoutOptions& options, int world_size) {
  const std::string world = std::to_string(world_size);
  if (options.tp < 1 || options.pp < 1 || options.dp < 0) {
    throw dtrain::UsageError("--dp " + std::to_string(options.dp) + ", --tp " +
                             std::to_string(options.tp) + ", --pp " + std::to_string(options.pp) +
                             ": the degrees must be at least 1 (--dp 0: the world size / (tp x "
                             "pp))");
  }
  const int model = options.tp * options.pp;  // each at most 64 (train_gpt's flags)
  if (world_size % model != 0) {
    throw dtrain::UsageError("--tp " + std::to_string(options.tp) + " x --pp " +
                             std::to_string(options.pp) + " = " + std::to_string(model) +
                             " does not divide the world size " + world +
                             "; run a multiple of their product, or change the degrees");
  }
  const int dp = options.dp > 0 ? options.dp : world_size / model;
  if (static_cast<int64_t>(dp) * model != world_size) {
    throw dtrain::UsageError(
        degrees_text(options, dp) + " = " + std::to_string(static_cast<int64_t>(dp) * model) +
        " ranks, but the world size is " + world +
        "; their product must equal it (leave --dp out for " + world + " / (tp x pp))");
  }
  if (options.zero > 0 && model > 1) {
    throw dtrain::UsageError("--zero " + std::to_string(options.zero) + " with --tp " +
                             std::to_string(options.tp) + " --pp " + std::to_string(options.pp) +
                             ": ZeRO over the data dimension of a tensor or pipeline layout is not "
                             "implemented; use --zero 0 (DDP over the replicas) there");
  }
  return dp;
}

dtrain::RankMesh make_mesh(const LayoutOptions& options,
                           const std::shared_ptr<dtrain::ProcessGroup>& world) {
  check_degrees(options, world->size());
  return dtrain::make_rank_mesh(world, options.pp, options.tp);
}

Gpt make_model(const GptConfig& config, const LayoutOptions& options,
               const dtrain::RankMesh& mesh) {
  Gpt model(config, options.tp > 1 ? mesh.tensor_group : nullptr);
  model->set_recompute(options.recompute);
  return model;
}

Parallel::Parallel(Gpt model_in, const LayoutOptions& options, dtrain::RankMesh mesh,
                   std::shared_ptr<dtrain::ProcessGroup> world, c10::Device device)
    : model(std::move(model_in)),
      options_(options),
      mesh_(std::move(mesh)),
      world_(std::move(world)),
      data_group_(mesh_.data_group),
      device_(device) {
  check_degrees(options_, world_->size());
  if (options_.tp > 1) {
    // The blocks' projections are split (Note [Tensor-parallel blocks]); the norms, the
    // embedding and the head are whole on every tensor rank.
    for (const auto& item : model->named_parameters()) {
      const std::string& name = item.key();
      if (name.find(".attention.w") != std::string::npos ||
          name.find(".mlp.w") != std::string::npos) {
        split_.insert(item.value().unsafeGetTensorImpl());
      }
    }
  }
  if (options_.pp > 1) {
    dtrain::PipelineOptions pipeline;
    pipeline.micro_batches = options_.micro_batches;
    pipeline.schedule = options_.schedule;
    pipeline.virtual_stages = options_.schedule == dtrain::ScheduleKind::kInterleaved1F1B ? 2 : 1;
    torch::nn::Sequential whole = model->sequential();
    std::vector<int64_t> cuts =
        dtrain::balance_by_parameters(whole, options_.pp * pipeline.virtual_stages);
    if (options_.tp > 1) {
      // Tensor ranks count their own shards, which may differ by a feature where a width does not
      // divide: every rank of a stage cuts where its tensor rank 0 does.
      at::Tensor shared = at::tensor(cuts, at::kLong);
      mesh_.tensor_group->broadcast(shared, 0);
      cuts.assign(shared.data_ptr<int64_t>(), shared.data_ptr<int64_t>() + shared.numel());
    }
    pipe = std::make_unique<dtrain::DistributedPipeline>(dtrain::split_sequential(whole, cuts),
                                                         mesh_, pipeline, device);
    parameters_ = pipe->parameters();  // this stage's
  } else if (options_.zero > 0) {
    dtrain::ShardedDataParallelOptions sharded;
    sharded.stage = options_.zero;
    data_group_ = world_;  // tp = pp = 1: the mesh's data group is the world
    sdp = dtrain::ShardedDataParallel(model, data_group_, sharded);
    parameters_ = sdp->parameters();  // this rank's shards
  } else {
    ddp = dtrain::DistributedDataParallel(model, data_group_);  // the world without --tp
    parameters_ = ddp->parameters();
  }
}

at::Tensor Parallel::forward_backward(const at::Tensor& inputs, const at::Tensor& targets) {
  at::Tensor loss;
  {
    // The forward under autocast; the pipeline's backward runs inside forward_backward, where
    // autocast leaves it alone (backward ops take the dtypes their forward ops had).
    std::optional<dtrain::amp::Autocast> autocast;
    if (options_.bf16) autocast.emplace(device_.type(), torch::kBFloat16);
    if (pipe) return pipe->forward_backward(inputs, targets, next_token_loss);
    loss = next_token_loss(ddp ? ddp(inputs) : sdp(inputs), targets);
  }
  loss.backward();
  return loss.detach();
}

// Note [Global gradient norm]
// The norm of the whole model's gradient, as one process would compute it, from the pieces the
// ranks hold: every element counted once. The world all-reduces one sum of squares, to which a
// rank adds only what it holds uniquely: a pipeline stage its own parameters (the stages hold
// disjoint ones); with tensor parallelism, a split projection's shard on every tensor rank but a
// whole tensor (a norm, the embedding, the head: the same gradient on every tensor rank) on tensor
// rank 0 only; under DDP (the replicas' averaged gradients are equal) only replica 0 adds, under
// ZeRO every rank adds its shards (disjoint; the padding's gradient is zero).
double Parallel::clip_grad_norm(double max_norm) {
  torch::NoGradGuard no_grad;
  const bool replica_adds = sdp || mesh_.data_index == 0;
  std::vector<at::Tensor> squares;
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters_) {
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    if (replica_adds && (mesh_.tensor_index == 0 || tensor_split(p))) {
      squares.push_back(grad.to(at::kDouble).square().sum());
    }
  }
  at::Tensor total = squares.empty() ? at::zeros({1}, at::kDouble)
                                     : at::stack(squares).sum().reshape({1}).to(at::kCPU);
  world_->all_reduce(total);
  const double norm = std::sqrt(total.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    for (auto& grad : grads) grad.mul_(scale);
  }
  return norm;
}

std::vector<std::pair<std::string, at::Tensor>> Parallel::named_parameters() const {
  std::set<const c10::TensorImpl*> mine;
  for (const auto& p : parameters_) mine.insert(p.unsafeGetTensorImpl());
  std::vector<std::pair<std::string, at::Tensor>> result;
  for (const auto& item : model->named_parameters()) {
    if (pipe && mine.count(item.value().unsafeGetTensorImpl()) == 0) continue;  // another stage's
    result.emplace_back(item.key(), item.value());
  }
  return result;
}

bool Parallel::tensor_split(const at::Tensor& parameter) const {
  return split_.count(parameter.unsafeGetTensorImpl()) > 0;
}

}  // namespace gpt
