// The layouts of parallelize.h: the degrees' checks, the mesh, the model wrapped per rank, the
// global gradient norm and the layout-neutral checkpoints.
#include "gpt/parallelize.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <optional>

#include "dtrain/amp.h"
#include "dtrain/dcp.h"
#include "dtrain/errors.h"

namespace gpt {

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The parameters tensor parallelism splits (Note [Tensor-parallel blocks] in gpt.h): the blocks'
// projections. The norms, the embedding and the head are whole on every tensor rank.
bool split_over_tensor_ranks(const std::string& name) {
  return name.find(".attention.w") != std::string::npos || name.find(".mlp.w") != std::string::npos;
}

// The features of `size` that tensor rank t of T holds, {first, count}: as the tensor-parallel
// layers cut (Note [Tensor-parallel blocks] in gpt.h), the first size % T ranks one more.
std::pair<int64_t, int64_t> tensor_share(int64_t size, int64_t tp, int64_t t) {
  const int64_t base = size / tp, extra = size % tp;
  return {t * base + std::min(t, extra), base + (t < extra ? 1 : 0)};
}

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
  return dp;
}

dtrain::RankMesh make_mesh(const LayoutOptions& options,
                           const std::shared_ptr<dtrain::ProcessGroup>& world) {
  check_degrees(options, world->size());
  return dtrain::make_rank_mesh(world, options.pp, options.tp);
}

Gpt make_model(const GptConfig& config, const LayoutOptions& options,
               const dtrain::RankMesh& mesh) {
  Gpt model(config, options.tp > 1 ? mesh.tensor_group : nullptr, options.tp > 1 && options.sp);
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
    for (const auto& item : model->named_parameters()) {
      if (split_over_tensor_ranks(item.key())) split_.insert(item.value().unsafeGetTensorImpl());
    }
  }
  if (options_.pp > 1) {
    dtrain::PipelineOptions pipeline;
    pipeline.micro_batches = options_.micro_batches;
    pipeline.schedule = options_.schedule;
    pipeline.virtual_stages = options_.schedule == dtrain::ScheduleKind::kInterleaved1F1B ? 2 : 1;
    pipeline.zero_stage = options_.zero;  // over the replicas of each stage (and tensor rank)
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
    chunks_ = dtrain::split_sequential(whole, cuts);
    for (size_t c = mesh_.pipeline_index; c < chunks_.size(); c += options_.pp) {
      for (const auto& p : chunks_[c]->parameters())
        stage_parameters_.insert(p.unsafeGetTensorImpl());
    }
    pipe = std::make_unique<dtrain::DistributedPipeline>(chunks_, mesh_, pipeline, device);
    parameters_ = pipe->parameters();  // this stage's, or with --zero their shards
  } else if (options_.zero > 0) {
    // ZeRO over the mesh's data group (the world when tp = 1): the replicas that hold the same
    // tensor shards split those once more, each rank keeping 1/D of its tensor rank's units.
    dtrain::ShardedDataParallelOptions sharded;
    sharded.stage = options_.zero;
    sdp = dtrain::ShardedDataParallel(model, data_group_, sharded);
    parameters_ = sdp->parameters();  // this rank's shards
  } else {
    ddp = dtrain::DistributedDataParallel(model, data_group_);  // the world without --tp
    parameters_ = ddp->parameters();
  }
}

at::Tensor Parallel::forward_backward(const at::Tensor& inputs, const at::Tensor& targets,
                                      double loss_scale, bool sync) {
  // Accumulating: the data dimension's reductions wait for the call with sync.
  std::optional<dtrain::DistributedDataParallelBase::NoSyncGuard> ddp_guard;
  std::optional<dtrain::ShardedDataParallelBase::NoSyncGuard> sdp_guard;
  std::optional<dtrain::DistributedPipeline::NoSyncGuard> pipe_guard;
  if (!sync) {
    if (pipe) {
      pipe_guard.emplace(*pipe);
    } else if (ddp) {
      ddp_guard.emplace(*ddp);
    } else {
      sdp_guard.emplace(*sdp);
    }
  }
  at::Tensor loss;
  {
    // The forward under autocast; the pipeline's backward runs inside forward_backward, where
    // autocast leaves it alone (backward ops take the dtypes their forward ops had).
    std::optional<dtrain::amp::Autocast> autocast;
    if (options_.bf16) autocast.emplace(device_.type(), torch::kBFloat16);
    if (pipe) {
      if (loss_scale == 1.0) return pipe->forward_backward(inputs, targets, next_token_loss);
      auto scaled = [loss_scale](const at::Tensor& logits, const at::Tensor& next) {
        return next_token_loss(logits, next) * loss_scale;
      };
      return pipe->forward_backward(inputs, targets, scaled) / loss_scale;
    }
    loss = next_token_loss(ddp ? ddp(inputs) : sdp(inputs), targets);
  }
  (loss * loss_scale).backward();
  return loss.detach();
}

// Note [Global gradient norm]
// The norm of the whole model's gradient, as one process would compute it, from the pieces the
// ranks hold: every element counted once. The world all-reduces one sum of squares, to which a
// rank adds only what it holds uniquely: a pipeline stage its own parameters (the stages hold
// disjoint ones); with tensor parallelism, a split projection's shard on every tensor rank but a
// whole tensor (a norm, the embedding, the head: the same gradient on every tensor rank) on tensor
// rank 0 only; under DDP (the replicas' averaged gradients are equal) only replica 0 adds, under
// ZeRO every rank adds its shards (disjoint over the data group; the padding's gradient is zero).
// A ZeRO shard is a range of a unit's flat buffer, which holds a block's split projections and its
// whole norms end to end: the range is added parameter by parameter, by the names in its unit.
double Parallel::clip_grad_norm(double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> squares;
  std::vector<at::Tensor> grads;
  auto add = [&](const at::Tensor& grad) {
    squares.push_back(grad.to(at::kDouble).square().sum());
  };
  if (options_.zero > 0) {
    for (const dtrain::FlatShard& unit : zero_shards()) {
      const at::Tensor& grad = unit.shard.grad();
      if (!grad.defined()) continue;
      grads.push_back(grad);
      const int64_t begin = unit.offset, end = unit.offset + grad.numel();
      for (const dtrain::ParamExtent& p : unit.params) {
        if (mesh_.tensor_index != 0 && !split_over_tensor_ranks(p.name)) continue;
        const int64_t from = std::max(begin, p.offset);
        const int64_t to = std::min(end, p.offset + numel_of(p.shape));
        if (from < to) add(grad.narrow(0, from - begin, to - from));
      }
    }
  } else {
    for (const auto& p : parameters_) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      grads.push_back(grad);
      if (mesh_.data_index == 0 && (mesh_.tensor_index == 0 || tensor_split(p))) add(grad);
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
  std::vector<std::pair<std::string, at::Tensor>> result;
  for (const auto& item : model->named_parameters()) {
    if (pipe && stage_parameters_.count(item.value().unsafeGetTensorImpl()) == 0)
      continue;  // another stage's
    result.emplace_back(item.key(), item.value());
  }
  return result;
}

std::vector<dtrain::ShardedDataParallelBase*> Parallel::zero_wrappers() const {
  if (sdp) return {sdp.ptr().get()};
  std::vector<dtrain::ShardedDataParallelBase*> result;
  if (pipe) {
    for (const auto& wrapper : pipe->sharded_chunks()) result.push_back(wrapper.get());
  }
  return result;
}

std::vector<dtrain::FlatShard> Parallel::zero_shards() const {
  std::vector<dtrain::FlatShard> result;
  for (auto* wrapper : zero_wrappers()) {
    for (dtrain::FlatShard& unit : wrapper->flat_shards()) result.push_back(std::move(unit));
  }
  return result;
}

void Parallel::gather_full_parameters() {
  for (auto* wrapper : zero_wrappers()) wrapper->gather_full_parameters();
}

void Parallel::release_full_parameters() {
  for (auto* wrapper : zero_wrappers()) wrapper->release_full_parameters();
}

bool Parallel::tensor_split(const at::Tensor& parameter) const {
  return split_.count(parameter.unsafeGetTensorImpl()) > 0;
}

// Note [Pipelined evaluation]
// The pipeline's schedules train; held-out windows need only a forward, which here walks the
// chunks in the model's order (chunk c lives on stage c % P, as in dtrain's schedules, so the
// interleaved schedule's two chunks per stage are visited in turn): the owner of chunk c receives
// its input from the owner of chunk c - 1 (stage 0 starts from the tokens), runs it and sends the
// output on. An activation goes as two messages, a header (its rank, sizes and dtype) and the
// values: under --sp its sequence is a slice, and the last chunk's logits never travel. The last
// chunk's owner computes the loss and broadcasts it over the pipeline group. Each stage's tensor
// ranks run their chunk together (its collectives are the tensor group's) and talk to their own
// peers of the neighbouring stages (the pipeline group is one tensor rank's stages).
namespace {

// Above the tags of dtrain's pipeline (its schedule's, and its pre-flight's from 1 << 24).
constexpr int kEvalTag = 1 << 25;
constexpr int64_t kHeaderLength = 8;  // rank, up to 6 sizes, dtype

void send_activation(const at::Tensor& x, const std::shared_ptr<dtrain::ProcessGroup>& group,
                     int dst) {
  TORCH_INTERNAL_ASSERT(x.dim() <= kHeaderLength - 2, "an activation of rank ", x.dim());
  at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
  header[0] = x.dim();
  for (int64_t d = 0; d < x.dim(); ++d) header[1 + d] = x.size(d);
  header[kHeaderLength - 1] = static_cast<int64_t>(x.scalar_type());
  group->send(header.to(x.device()), dst, kEvalTag);
  group->send(x.contiguous(), dst, kEvalTag);
}

at::Tensor recv_activation(const std::shared_ptr<dtrain::ProcessGroup>& group, int src,
                           c10::Device device) {
  at::Tensor header = at::empty({kHeaderLength}, at::TensorOptions(at::kLong).device(device));
  group->recv(header, src, kEvalTag);
  header = header.to(at::kCPU);
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < header[0].item<int64_t>(); ++d)
    sizes.push_back(header[1 + d].item<int64_t>());
  const auto dtype = static_cast<at::ScalarType>(header[kHeaderLength - 1].item<int64_t>());
  at::Tensor x = at::empty(sizes, at::TensorOptions(dtype).device(device));
  group->recv(x, src, kEvalTag);
  return x;
}

}  // namespace

double Parallel::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  torch::NoGradGuard no_grad;
  model->eval();
  double value = 0;
  if (!pipe) {
    value = next_token_loss(model(inputs.to(device_)), targets.to(device_)).item<double>();
  } else {
    const std::shared_ptr<dtrain::ProcessGroup>& group = mesh_.pipeline_group;
    const int stages = mesh_.pipeline_size, stage = mesh_.pipeline_index;
    const int chunks = static_cast<int>(chunks_.size());
    at::Tensor x = inputs.to(device_);
    for (int c = stage; c < chunks; c += stages) {
      if (c > 0) x = recv_activation(group, (c - 1) % stages, device_);
      x = chunks_[c]->forward(x);
      if (c + 1 < chunks) send_activation(x, group, (c + 1) % stages);
    }
    const int last = (chunks - 1) % stages;
    at::Tensor loss = at::zeros({1}, at::TensorOptions(at::kDouble).device(device_));
    if (stage == last) loss.fill_(next_token_loss(x, targets.to(device_)).item<double>());
    group->broadcast(loss, last);
    value = loss.item<double>();
  }
  model->train();
  return value;
}

void Parallel::gather_stages() {
  if (!pipe) return;
  torch::NoGradGuard no_grad;
  const int stages = mesh_.pipeline_size;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    for (at::Tensor p : chunks_[c]->parameters()) {
      at::Tensor value = p.detach();
      mesh_.pipeline_group->broadcast(value, static_cast<int>(c) % stages);
    }
  }
}

// ---- checkpoints ----

std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(
    const GptConfig& config) {
  const int64_t width = config.width, q = config.heads * config.head_dim();
  const int64_t kv = config.kv_heads * config.head_dim(), hidden = config.hidden();
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"embedding.weight", {config.vocab, width}}};
  for (int64_t i = 0; i < config.layers; ++i) {
    const std::string block = "block" + std::to_string(i) + ".";
    shapes.push_back({block + "attention_norm.weight", {width}});
    shapes.push_back({block + "attention.wq.weight", {q, width}});
    shapes.push_back({block + "attention.wk.weight", {kv, width}});
    shapes.push_back({block + "attention.wv.weight", {kv, width}});
    shapes.push_back({block + "attention.wo.weight", {width, q}});
    shapes.push_back({block + "mlp_norm.weight", {width}});
    shapes.push_back({block + "mlp.w1.weight", {hidden, width}});
    shapes.push_back({block + "mlp.w2.weight", {width, hidden}});
    shapes.push_back({block + "mlp.w3.weight", {hidden, width}});
  }
  shapes.push_back({"norm.weight", {width}});
  shapes.push_back({"head.weight", {config.vocab, width}});
  return shapes;
}

// Note [Layout-neutral checkpoints]
// A checkpoint is dtrain's sharded checkpoint (Note [Sharded checkpoint] in
// dtrain/sharded_checkpoint.h) with one unit per parameter of the whole model, keyed by its name:
// every rank of the world saves one contiguous range of each parameter's flattened elements (an
// empty one for what it does not hold, or what another rank saves) and AdamW's moments over the
// same range, plus the sampler's position and the step. A tensor whole on this rank is saved by
// replica 0's tensor rank 0 of its stage; a column-parallel shard (rows of the whole tensor) is a
// contiguous range already and saved by replica 0's tensor ranks; a row-parallel shard (columns)
// is not, so the tensor group gathers the whole tensor and each tensor rank of replica 0 saves a
// 1/T of its elements. A width that does not divide by T is split as the layers split it (the
// first ranks one feature more), so the ranges stay contiguous. Loading reads by name and range,
// whatever layout saved: a rank reads its whole tensors, its rows, and the whole of a row-parallel
// tensor whose columns it keeps. ZeRO saves
// its flat shards as they are (units of several parameters, read by name too), so every layout
// loads every other's checkpoints, at any world size and degrees. The sampler's position counts
// the windows of all replicas, so a run resumed with another number of replicas goes on with the
// next unseen windows (its global batch is then another size).
struct Parallel::Piece {
  enum class Split { kWhole, kRows, kColumns };
  std::string name;
  std::vector<int64_t> shape;  // the whole parameter's
  at::Tensor param;            // this rank's; undefined: another stage's
  Split split = Split::kWhole;
  int64_t first = 0;              // a shard's first row (kRows) or column (kColumns) of the whole
  int64_t offset = 0, numel = 0;  // the range of the flattened whole tensor saved or loaded
};

std::vector<Parallel::Piece> Parallel::pieces(bool saving) {
  std::map<std::string, at::Tensor> mine;
  for (const auto& [name, p] : named_parameters()) mine[name] = p;
  const int64_t tp = options_.tp, t = mesh_.tensor_index;
  std::vector<Piece> result;
  for (const auto& [name, shape] : parameter_shapes(model->config())) {
    Piece piece;
    piece.name = name;
    piece.shape = shape;
    const int64_t whole = numel_of(shape);
    auto it = mine.find(name);
    if (it != mine.end()) {
      piece.param = it->second;
      const at::Tensor& p = piece.param;
      if (!p.sizes().equals(shape)) {
        piece.split = p.size(0) != shape[0] ? Piece::Split::kRows : Piece::Split::kColumns;
        const int64_t d = piece.split == Piece::Split::kRows ? 0 : 1;
        const auto [first, count] = tensor_share(shape[d], tp, t);
        if (p.size(d) != count) {
          throw dtrain::UsageError("gpt checkpoint: '" + name + "' is " + c10::str(p.sizes()) +
                                   " on tensor rank " + std::to_string(t) + " of " +
                                   std::to_string(tp) + ", not its share (" +
                                   std::to_string(count) + ") of dimension " + std::to_string(d) +
                                   " of the whole " + c10::str(c10::IntArrayRef(shape)));
        }
        piece.first = first;
      }
      const bool owner =
          !saving || (mesh_.data_index == 0 && (piece.split != Piece::Split::kWhole || t == 0));
      if (owner) {
        switch (piece.split) {
          case Piece::Split::kWhole:
            piece.numel = whole;
            break;
          case Piece::Split::kRows:  // a block of whole rows: a range already
            piece.offset = piece.first * (whole / shape[0]);
            piece.numel = p.numel();
            break;
          case Piece::Split::kColumns: {
            // Saved as the rank's 1/T of the gathered whole's elements, read whole.
            const auto [offset, numel] = tensor_share(whole, tp, t);
            piece.offset = saving ? offset : 0;
            piece.numel = saving ? numel : whole;
            break;
          }
        }
      }
    }
    result.push_back(std::move(piece));
  }
  return result;
}

namespace {

// The whole tensor of `columns` columns from a row-parallel shard: every tensor rank's columns
// gathered (padded to the largest share for the all-gather, where they do not divide).
at::Tensor gather_columns(const at::Tensor& shard, int64_t columns,
                          const std::shared_ptr<dtrain::ProcessGroup>& g) {
  const int64_t tp = g->size(), widest = tensor_share(columns, tp, 0).second;
  at::Tensor padded = shard.size(1) == widest
                          ? shard.contiguous()
                          : at::constant_pad_nd(shard, {0, widest - shard.size(1)});
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < tp; ++r) parts.push_back(at::empty_like(padded));
  g->all_gather(parts, padded);
  for (int64_t r = 0; r < tp; ++r)
    parts[r] = parts[r].narrow(1, 0, tensor_share(columns, tp, r).second);
  return at::cat(parts, 1);
}

torch::optim::AdamWParamState* adamw_state(torch::optim::Optimizer& optimizer,
                                           const at::Tensor& p) {
  auto it = optimizer.state().find(p.unsafeGetTensorImpl());
  if (it == optimizer.state().end()) return nullptr;
  return static_cast<torch::optim::AdamWParamState*>(it->second.get());
}

dtrain::FlatShard unit_of(const std::string& name, const std::vector<int64_t>& shape,
                          const at::Tensor& range, int64_t offset) {
  dtrain::FlatShard shard;
  shard.key = name;
  shard.shard = range;
  shard.offset = offset;
  shard.full_numel = numel_of(shape);
  shard.params = {dtrain::ParamExtent{name, shape, 0}};
  return shard;
}

}  // namespace

// This rank's pieces (every parameter's when saving, else those it reads), each piece's range of
// the flattened whole tensor on the CPU, and an AdamW over the ranges that holds their moments: the
// units a checkpoint or a DCP export writes, or that a load fills.
struct Parallel::Ranges {
  std::vector<Piece> pieces;
  std::vector<at::Tensor> ranges;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  std::vector<dtrain::FlatShard> units() const {
    std::vector<dtrain::FlatShard> result;
    for (size_t i = 0; i < pieces.size(); ++i)
      result.push_back(unit_of(pieces[i].name, pieces[i].shape, ranges[i], pieces[i].offset));
    return result;
  }
};

Parallel::Ranges Parallel::saved_ranges(torch::optim::AdamW& optimizer) {
  torch::NoGradGuard no_grad;
  Ranges result;
  result.pieces = pieces(/*saving=*/true);
  struct Moments {
    at::Tensor exp_avg, exp_avg_sq;
    int64_t step = 0;
  };
  std::vector<std::optional<Moments>> moments;
  for (const Piece& piece : result.pieces) {
    at::Tensor value;
    std::optional<Moments> saved;
    if (piece.param.defined()) {
      value = piece.param.detach();
      if (auto* s = adamw_state(optimizer, piece.param)) {
        saved = Moments{s->exp_avg(), s->exp_avg_sq(), s->step()};
      }
      if (piece.split == Piece::Split::kColumns) {  // every tensor rank of every replica gathers
        const int64_t columns = piece.shape[1];
        value = gather_columns(value, columns, mesh_.tensor_group);
        if (saved) {
          saved->exp_avg = gather_columns(saved->exp_avg, columns, mesh_.tensor_group);
          saved->exp_avg_sq = gather_columns(saved->exp_avg_sq, columns, mesh_.tensor_group);
        }
      }
    }
    // The range within `value`: a row-parallel tensor's block of the gathered whole, else all.
    const int64_t start = piece.split == Piece::Split::kColumns ? piece.offset : 0;
    auto cut = [&](const at::Tensor& t) {
      return piece.numel == 0 ? at::empty({0}, at::kFloat)
                              : t.reshape(-1).narrow(0, start, piece.numel).to(at::kCPU).clone();
    };
    result.ranges.push_back(cut(value));
    if (saved && piece.numel > 0) {
      saved->exp_avg = cut(saved->exp_avg);
      saved->exp_avg_sq = cut(saved->exp_avg_sq);
    } else {
      saved.reset();
    }
    moments.push_back(std::move(saved));
  }
  // The ranges in an AdamW of their own, holding the moments, for the checkpointer to read.
  result.optimizer =
      std::make_unique<torch::optim::AdamW>(result.ranges, torch::optim::AdamWOptions(1.0));
  for (size_t i = 0; i < result.pieces.size(); ++i) {
    if (!moments[i]) continue;
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(moments[i]->step);
    s->exp_avg(moments[i]->exp_avg);
    s->exp_avg_sq(moments[i]->exp_avg_sq);
    result.optimizer->state()[result.ranges[i].unsafeGetTensorImpl()] = std::move(s);
  }
  return result;
}

Parallel::Ranges Parallel::ranges_to_load(bool every) {
  Ranges result;
  for (Piece& piece : pieces(/*saving=*/false))
    if (every || piece.param.defined()) result.pieces.push_back(std::move(piece));
  for (const Piece& piece : result.pieces)
    result.ranges.push_back(at::zeros({piece.numel}, at::kFloat));
  result.optimizer =
      std::make_unique<torch::optim::AdamW>(result.ranges, torch::optim::AdamWOptions(1.0));
  return result;
}

// From the ranges read to this rank's tensors (a row-parallel one keeps its columns) and AdamW's
// state (cleared where the ranges have none).
void Parallel::apply_loaded(const Ranges& loaded, torch::optim::AdamW& optimizer) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < loaded.pieces.size(); ++i) {
    const Piece& piece = loaded.pieces[i];
    const at::Tensor& p = piece.param;
    if (!p.defined()) continue;  // another stage's
    auto mine = [&](const at::Tensor& range) {
      if (piece.split == Piece::Split::kColumns) {
        return range.view(piece.shape).narrow(1, piece.first, p.size(1)).to(p.device());
      }
      return range.view(p.sizes()).to(p.device());
    };
    p.detach().copy_(mine(loaded.ranges[i]));
    optimizer.state().erase(p.unsafeGetTensorImpl());
    if (auto* s = adamw_state(*loaded.optimizer, loaded.ranges[i])) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(s->step());
      state->exp_avg(mine(s->exp_avg()).clone());
      state->exp_avg_sq(mine(s->exp_avg_sq()).clone());
      optimizer.state()[p.unsafeGetTensorImpl()] = std::move(state);
    }
  }
}

// Note [ZeRO over a tensor layout's state]
// ZeRO saves its flat shards as they are, keyed by unit and by the names of the parameters in them;
// under tensor parallelism every tensor rank's units would go under the same names (its own rows or
// columns as the whole tensor), and a pipeline's stages each have units of their own under the
// same keys. So ZeRO over a tensor or pipeline layout saves the ranges of Note [Layout-neutral
// checkpoints] instead, as DDP over it would: the data group gathers its tensor rank's (and
// stage's) parameters (gather_full_parameters) and AdamW's moments (all-gathered unit by unit, cut
// by the units' parameter extents), the ranges are cut from those, and a load fills the gathered
// parameters and moments, from which each rank copies its ZeRO slice back into its shards. While a
// save or load runs, a rank holds its tensor rank's and stage's whole training state, as DDP would.
bool Parallel::zero_saves_ranges() const {
  return options_.zero > 0 && (options_.tp > 1 || options_.pp > 1);
}

std::unique_ptr<torch::optim::AdamW> Parallel::gathered_moments(torch::optim::AdamW& optimizer) {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> by_name;
  for (const auto& item : model->named_parameters()) by_name[item.key()] = item.value();
  auto gathered =
      std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1.0));
  auto all_gather = [&](const at::Tensor& shard) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < data_group_->size(); ++r) parts.push_back(at::empty_like(shard));
    data_group_->all_gather(parts, shard.contiguous());
    return at::cat(parts);
  };
  for (const dtrain::FlatShard& unit : zero_shards()) {
    // AdamW steps every shard of the data group together: all of them have a state, or none.
    auto* s = adamw_state(optimizer, unit.shard);
    if (!s) continue;
    const at::Tensor exp_avg = all_gather(s->exp_avg()), exp_avg_sq = all_gather(s->exp_avg_sq());
    for (const dtrain::ParamExtent& p : unit.params) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(s->step());
      state->exp_avg(exp_avg.narrow(0, p.offset, numel_of(p.shape)).view(p.shape));
      state->exp_avg_sq(exp_avg_sq.narrow(0, p.offset, numel_of(p.shape)).view(p.shape));
      gathered->state()[by_name.at(p.name).unsafeGetTensorImpl()] = std::move(state);
    }
  }
  return gathered;
}

void Parallel::scatter_to_shards(const std::map<std::string, at::Tensor>& by_name,
                                 torch::optim::AdamW& gathered, torch::optim::AdamW& optimizer) {
  torch::NoGradGuard no_grad;
  for (const dtrain::FlatShard& unit : zero_shards()) {
    at::Tensor shard = unit.shard.detach();
    const int64_t begin = unit.offset, end = unit.offset + shard.numel();
    at::Tensor exp_avg = at::zeros_like(shard), exp_avg_sq = at::zeros_like(shard);
    std::optional<int64_t> step;
    for (const dtrain::ParamExtent& p : unit.params) {
      const at::Tensor& param = by_name.at(p.name);
      auto* s = adamw_state(gathered, param);
      if (s) step = s->step();
      const int64_t from = std::max(begin, p.offset);
      const int64_t to = std::min(end, p.offset + numel_of(p.shape));
      if (from >= to) continue;
      auto mine = [&](const at::Tensor& whole) {
        return whole.reshape(-1).narrow(0, from - p.offset, to - from);
      };
      shard.narrow(0, from - begin, to - from).copy_(mine(param.detach()));
      if (s) {
        exp_avg.narrow(0, from - begin, to - from).copy_(mine(s->exp_avg()));
        exp_avg_sq.narrow(0, from - begin, to - from).copy_(mine(s->exp_avg_sq()));
      }
    }
    optimizer.state().erase(unit.shard.unsafeGetTensorImpl());
    if (step) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(*step);
      state->exp_avg(exp_avg);
      state->exp_avg_sq(exp_avg_sq);
      optimizer.state()[unit.shard.unsafeGetTensorImpl()] = std::move(state);
    }
  }
  for (auto* wrapper : zero_wrappers()) wrapper->shards_changed();
}

Parallel::Ranges Parallel::ranges_to_save(torch::optim::AdamW& optimizer) {
  if (!zero_saves_ranges()) return saved_ranges(optimizer);
  gather_full_parameters();
  Ranges saved = saved_ranges(*gathered_moments(optimizer));
  release_full_parameters();
  return saved;
}

// With ZeRO the pieces read into copies of the gathered parameters: ZeRO refuses full parameters
// changed in place (they only mirror its shards).
Parallel::Ranges Parallel::ranges_to_read(bool every) {
  if (!zero_saves_ranges()) return ranges_to_load(every);
  gather_full_parameters();  // their shapes, and where to read
  Ranges result = ranges_to_load(every);
  for (Piece& piece : result.pieces) {
    if (piece.param.defined()) piece.param = piece.param.detach().clone();
  }
  release_full_parameters();
  return result;
}

void Parallel::apply_read(const Ranges& loaded, torch::optim::AdamW& optimizer) {
  if (!zero_saves_ranges()) return apply_loaded(loaded, optimizer);
  std::map<std::string, at::Tensor> values;
  std::vector<at::Tensor> tensors;
  for (const Piece& piece : loaded.pieces) {
    values[piece.name] = piece.param;
    tensors.push_back(piece.param);
  }
  torch::optim::AdamW gathered(tensors, torch::optim::AdamWOptions(1.0));
  apply_loaded(loaded, gathered);
  scatter_to_shards(values, gathered, optimizer);
}

void Parallel::save(dtrain::ShardedCheckpointer& checkpointer, torch::optim::AdamW& optimizer,
                    dtrain::DistributedSampler& sampler, int64_t step) {
  dtrain::ShardedTrainingState state;
  state.sampler = &sampler;
  state.step = step;
  if (sdp && !zero_saves_ranges()) {
    state.shards = sdp->flat_shards();
    state.stage = options_.zero;
    state.optimizer = &optimizer;
    checkpointer.save(state);
    return;
  }
  Ranges saved = ranges_to_save(optimizer);
  state.shards = saved.units();
  state.optimizer = saved.optimizer.get();
  checkpointer.save(state);
}

std::optional<int64_t> Parallel::load(dtrain::ShardedCheckpointer& checkpointer,
                                      torch::optim::AdamW& optimizer,
                                      dtrain::DistributedSampler& sampler) {
  dtrain::ShardedTrainingState state;
  state.sampler = &sampler;
  if (sdp && !zero_saves_ranges()) {
    state.shards = sdp->flat_shards();
    state.stage = options_.zero;
    state.optimizer = &optimizer;
    if (!checkpointer.load_latest(state)) return std::nullopt;
    sdp->shards_changed();
    return state.step;
  }
  Ranges loaded = ranges_to_read(/*every=*/false);  // what this rank reads: what it holds
  state.shards = loaded.units();
  state.optimizer = loaded.optimizer.get();
  if (!checkpointer.load_latest(state)) return std::nullopt;
  apply_read(loaded, optimizer);
  return state.step;
}

// Note [DCP export of a layout]
// A DCP export writes what a checkpoint would (Note [Layout-neutral checkpoints]): every rank its
// range of each parameter and of AdamW's moments over it, cut into DCP chunks by
// save_dcp_safetensors (a column-parallel shard is one chunk of rows; a row-parallel tensor's 1/T
// of the gathered whole's elements is one, or up to three where it does not start and end on a
// row: a part row, whole rows, a part row). ZeRO
// exports its flat shards, as ShardedDataParallel's export does. Two things differ from a
// checkpoint: rank 0 writes each parameter's AdamW step (a 0-dim tensor, as PyTorch keeps it) and
// lists every tensor in the folder's index, so it needs a state for every parameter, where a
// pipeline's rank 0 holds only its stage's moments: it gets an empty range's state for the others,
// with the step the world agrees on (AdamW steps every parameter together; the maximum over the
// ranks). And the sampler's position and the training step are not exported: DCP's storage holds
// tensors only, so a run that starts from a folder (--init-dcp) starts at step 0 of its data.
// Loading reads by name and range as a checkpoint's load does, into units for every parameter
// (empty for another stage's), so that the folder's every tensor is one of the model's.
void Parallel::export_dcp(const std::string& dir, torch::optim::AdamW& optimizer) {
  if (sdp && !zero_saves_ranges()) {
    dtrain::save_dcp_safetensors(
        dir, dtrain::DcpShards{sdp->flat_shards(), &optimizer, dtrain::TensorTable()}, world_);
    return;
  }
  Ranges saved = ranges_to_save(optimizer);
  int64_t step = 0;
  for (const auto& [impl, s] : saved.optimizer->state())
    step = std::max(step, static_cast<torch::optim::AdamWParamState&>(*s).step());
  at::Tensor steps = at::tensor({step}, at::kLong);
  world_->all_reduce(steps, dtrain::ReduceOp::kMax);
  step = steps.item<int64_t>();
  if (world_->rank() == 0 && step > 0) {
    for (const at::Tensor& range : saved.ranges) {
      if (adamw_state(*saved.optimizer, range)) continue;
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(step);
      s->exp_avg(at::empty({0}, at::kFloat));
      s->exp_avg_sq(at::empty({0}, at::kFloat));
      saved.optimizer->state()[range.unsafeGetTensorImpl()] = std::move(s);
    }
  }
  dtrain::save_dcp_safetensors(
      dir, dtrain::DcpShards{saved.units(), saved.optimizer.get(), dtrain::TensorTable()}, world_);
}

void Parallel::load_dcp(const std::string& dir, torch::optim::AdamW& optimizer) {
  // A damaged folder here is named by the load below, on every rank together.
  bool moments = true;
  try {
    moments = dtrain::dcp_has_optimizer_state(dir);
  } catch (const dtrain::UsageError&) {
  }
  if (sdp && !zero_saves_ranges()) {
    dtrain::DcpShards state{sdp->flat_shards(), moments ? &optimizer : nullptr,
                            dtrain::TensorTable()};
    dtrain::load_dcp_safetensors(dir, state, world_);
    if (!moments) optimizer.state().clear();
    sdp->shards_changed();
    return;
  }
  Ranges loaded = ranges_to_read(/*every=*/true);
  dtrain::DcpShards state{loaded.units(), moments ? loaded.optimizer.get() : nullptr,
                          dtrain::TensorTable()};
  dtrain::load_dcp_safetensors(dir, state, world_);
  apply_read(loaded, optimizer);
}

}  // namespace gpt
