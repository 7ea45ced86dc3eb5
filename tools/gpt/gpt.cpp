// The transformer of gpt.h, single-device: the layers as Llama's reference code has them (RMSNorm,
// rotary embeddings on the rotate-half convention, grouped key/value heads repeated to the query
// heads, SwiGLU), and LibTorch's scaled_dot_product_attention for the causal attention itself.
#include "gpt/gpt.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>

#include <initializer_list>
#include <optional>
#include <tuple>
#include <typeinfo>
#include <vector>

#include "dtrain/amp.h"
#include "dtrain/errors.h"
#include "dtrain/tensor_parallel.h"

namespace gpt {

int64_t GptConfig::hidden() const {
  if (mlp_width > 0) return mlp_width;
  const int64_t raw = (8 * width + 2) / 3;  // 8/3 x width, rounded up
  return (raw + 7) / 8 * 8;
}

void GptConfig::check() const {
  auto fail = [](const std::string& what) { throw dtrain::UsageError("gpt::GptConfig: " + what); };
  for (auto [name, value] : {std::pair<const char*, int64_t>{"vocab", vocab},
                             {"seq_len", seq_len},
                             {"layers", layers},
                             {"width", width},
                             {"heads", heads},
                             {"kv_heads", kv_heads}}) {
    if (value < 1) fail(std::string(name) + " " + std::to_string(value) + ": expected at least 1");
  }
  if (mlp_width < 0) fail("mlp_width " + std::to_string(mlp_width) + ": expected 0 or more");
  if (width % heads != 0) {
    fail("width " + std::to_string(width) + " does not divide by heads " + std::to_string(heads) +
         "; pick a width that is a multiple of the head count");
  }
  if (head_dim() % 2 != 0) {
    fail("the head dimension width / heads = " + std::to_string(head_dim()) +
         " is odd; rotary embeddings rotate pairs of features, so it must be even");
  }
  if (heads % kv_heads != 0) {
    fail("heads " + std::to_string(heads) + " does not divide by kv_heads " +
         std::to_string(kv_heads) + "; each key/value head serves a whole number of query heads");
  }
  if (!(rope_theta > 0) || !(norm_eps > 0)) fail("rope_theta and norm_eps must be positive");
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps,
                         std::shared_ptr<dtrain::ProcessGroup> sequence_group, bool gather_sequence)
    : eps_(eps), sequence_group_(std::move(sequence_group)), gather_sequence_(gather_sequence) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  if (!sequence_group_) return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
  // This rank's positions only: the weight's gradient is a partial sum, all-reduced in backward.
  at::Tensor scale = dtrain::sequence_parallel_parameter(weight, sequence_group_);
  at::Tensor y = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * scale;
  return gather_sequence_ ? dtrain::gather_from_sequence_parallel(y, sequence_group_) : y;
}

namespace {

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// The unsplit layer, or this rank's column shard of it (its output features): drawn as the
// unsplit layer would be either way (Note [Tensor-parallel blocks]). sequence_parallel: its input
// is this rank's slice of the sequence (Note [Sequence-parallel blocks]).
torch::nn::AnyModule column(int64_t in, int64_t out,
                            const std::shared_ptr<dtrain::ProcessGroup>& group,
                            bool sequence_parallel) {
  torch::nn::Linear whole = linear(in, out);
  if (!group) return torch::nn::AnyModule(whole);
  dtrain::ColumnParallelLinearOptions options;
  options.bias = false;
  options.sequence_parallel = sequence_parallel;
  return torch::nn::AnyModule(dtrain::column_parallel_from(whole, group, options));
}

// The unsplit layer, or this rank's row shard (its input features), input already split;
// sequence_parallel: its output is this rank's slice of the sequence.
torch::nn::AnyModule row(int64_t in, int64_t out,
                         const std::shared_ptr<dtrain::ProcessGroup>& group,
                         bool sequence_parallel) {
  torch::nn::Linear whole = linear(in, out);
  if (!group) return torch::nn::AnyModule(whole);
  dtrain::RowParallelLinearOptions options;
  options.bias = false;
  options.input_is_parallel = true;
  options.sequence_parallel = sequence_parallel;
  return torch::nn::AnyModule(dtrain::row_parallel_from(whole, group, options));
}

// The projections that read one input x, in order: unsplit Linears, or column-parallel shards
// that enter the tensor-parallel region once for all of them (dtrain::column_parallel_forward), so
// that backward all-reduces x's gradient once per sub-layer, not once per projection (under
// sequence parallelism: one all-gather of x forward, one reduce-scatter and one all-gather back).
std::vector<at::Tensor> project(const at::Tensor& x,
                                std::initializer_list<torch::nn::AnyModule*> layers) {
  std::vector<at::Tensor> outputs;
  if ((*layers.begin())->type_info() != typeid(dtrain::ColumnParallelLinearImpl)) {
    for (torch::nn::AnyModule* layer : layers) outputs.push_back(layer->forward(x));
    return outputs;
  }
  std::vector<dtrain::ColumnParallelLinear> split;
  for (const torch::nn::AnyModule* layer : layers)
    split.push_back(layer->get<dtrain::ColumnParallelLinear>());
  return dtrain::column_parallel_forward(x, split);
}

// The group sequence parallelism splits the sequence over, or null.
std::shared_ptr<dtrain::ProcessGroup> sequence_group_of(
    const std::shared_ptr<dtrain::ProcessGroup>& tensor_group, bool sequence_parallel) {
  return sequence_parallel ? tensor_group : nullptr;
}

// The token embedding under sequence parallelism: the whole table on every rank, its output
// scattered to this rank's slice of the sequence (Note [Sequence-parallel blocks]). A
// torch::nn::EmbeddingImpl still (the same draw, the same "embedding.weight"), whose forward the
// model's Sequential calls.
class ScatteredEmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  ScatteredEmbeddingImpl(int64_t vocab, int64_t width,
                         std::shared_ptr<dtrain::ProcessGroup> sequence_group)
      : torch::nn::EmbeddingImpl(torch::nn::EmbeddingOptions(vocab, width)),
        sequence_group_(std::move(sequence_group)) {}
  at::Tensor forward(const at::Tensor& tokens) {
    return dtrain::scatter_to_sequence_parallel(torch::nn::EmbeddingImpl::forward(tokens),
                                                sequence_group_);
  }

 private:
  std::shared_ptr<dtrain::ProcessGroup> sequence_group_;
};

int64_t tensor_size(const std::shared_ptr<dtrain::ProcessGroup>& group) {
  return group ? group->size() : 1;
}

}  // namespace

AttentionImpl::AttentionImpl(const GptConfig& config,
                             std::shared_ptr<dtrain::ProcessGroup> tensor_group,
                             bool sequence_parallel)
    : config_(config),
      sequence_group_(sequence_group_of(tensor_group, sequence_parallel)),
      heads_(config.heads / tensor_size(tensor_group)),
      kv_heads_(config.kv_heads / tensor_size(tensor_group)),
      head_dim_(config.head_dim()) {
  const int64_t q = config.heads * head_dim_, kv = config.kv_heads * head_dim_;
  wq = column(config.width, q, tensor_group, sequence_parallel);
  wk = column(config.width, kv, tensor_group, sequence_parallel);
  wv = column(config.width, kv, tensor_group, sequence_parallel);
  wo = row(q, config.width, tensor_group, sequence_parallel);
  register_module("wq", wq.ptr());
  register_module("wk", wk.ptr());
  register_module("wv", wv.ptr());
  register_module("wo", wo.ptr());
}

namespace {

// The rotate-half form of a rotary embedding: features i and i + d/2 are one pair.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

}  // namespace

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  // Under sequence parallelism x is this rank's slice of the sequence; q, k, v cover all of it.
  const int64_t batch = x.size(0),
                seq = sequence_group_ ? x.size(1) * sequence_group_->size() : x.size(1);
  if (!cos_.defined() || cos_.size(0) != seq || cos_.device() != x.device()) {
    std::tie(cos_, sin_) = rotary_tables(config_, seq, x.device());
  }
  const at::Tensor& cos = cos_;
  const at::Tensor& sin = sin_;
  // [batch, heads, seq, head_dim], as scaled_dot_product_attention takes them.
  auto split = [&](const at::Tensor& t, int64_t heads) {
    return t.view({batch, seq, heads, head_dim_}).transpose(1, 2);
  };
  // One entry into the tensor-parallel region for the three (Note [Tensor-parallel blocks]).
  const std::vector<at::Tensor> qkv = project(x, {&wq, &wk, &wv});
  at::Tensor q = rotate(split(qkv[0], heads_), cos, sin);
  at::Tensor k = rotate(split(qkv[1], kv_heads_), cos, sin);
  at::Tensor v = split(qkv[2], kv_heads_);
  if (kv_heads_ != heads_) {  // each key/value head serves heads / kv_heads query heads
    k = k.repeat_interleave(heads_ / kv_heads_, /*dim=*/1);
    v = v.repeat_interleave(heads_ / kv_heads_, /*dim=*/1);
  }
  at::Tensor attended = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{},
                                                         /*dropout_p=*/0.0, /*is_causal=*/true);
  return wo.forward(attended.transpose(1, 2).reshape({batch, seq, heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const GptConfig& config, std::shared_ptr<dtrain::ProcessGroup> tensor_group,
                 bool sequence_parallel) {
  // Drawn in the single-device order w1, w2, w3 so that every split holds the same weights.
  w1 = column(config.width, config.hidden(), tensor_group, sequence_parallel);
  w2 = row(config.hidden(), config.width, tensor_group, sequence_parallel);
  w3 = column(config.width, config.hidden(), tensor_group, sequence_parallel);
  register_module("w1", w1.ptr());
  register_module("w2", w2.ptr());
  register_module("w3", w3.ptr());
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  // One entry into the tensor-parallel region for w1 and w3 (Note [Tensor-parallel blocks]).
  const std::vector<at::Tensor> h = project(x, {&w1, &w3});
  return w2.forward(at::silu(h[0]) * h[1]);
}

BlockImpl::BlockImpl(const GptConfig& config, std::shared_ptr<dtrain::ProcessGroup> tensor_group,
                     bool sequence_parallel) {
  auto sequence_group = sequence_group_of(tensor_group, sequence_parallel);
  attention_norm =
      register_module("attention_norm", RMSNorm(config.width, config.norm_eps, sequence_group));
  attention = register_module("attention", Attention(config, tensor_group, sequence_parallel));
  mlp_norm = register_module("mlp_norm", RMSNorm(config.width, config.norm_eps, sequence_group));
  mlp = register_module("mlp", Mlp(config, std::move(tensor_group), sequence_parallel));
}

namespace {

// Note [Recomputed blocks]
// A block with recompute set runs its forward without recording the graph, keeping only its input
// x; backward runs the forward again (under the autocast state the first forward had) and takes
// the gradients of x and of the block's parameters from that graph. The parameters are inputs of
// this node, so their gradients reach their accumulators through the outer backward as any
// gradient does: DDP's and ZeRO's hooks see one gradient per parameter, in block order, and ZeRO-3
// has gathered the block's parameters again (its pre-backward runs before this node) when the
// forward is redone. A tensor-parallel block repeats its forward all-reduces in backward, in the
// same order on every rank of its group.
struct RecomputedBlock : public torch::autograd::Function<RecomputedBlock> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList parameters, BlockImpl* block) {
    ctx->save_for_backward({x});
    ctx->saved_data["block"] = reinterpret_cast<int64_t>(block);
    const c10::DeviceType type = x.device().type();
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(type);
    ctx->saved_data["dtype"] = static_cast<int64_t>(at::autocast::get_autocast_dtype(type));
    return block->forward(x);  // Function::apply runs forward without recording gradients
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* block = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    std::vector<at::Tensor> inputs = {x};
    for (const auto& p : block->parameters()) inputs.push_back(p);
    at::Tensor output;
    {
      torch::autograd::AutoGradMode grad_mode(true);
      std::optional<dtrain::amp::Autocast> autocast;
      if (ctx->saved_data["autocast"].toBool()) {
        autocast.emplace(x.device().type(),
                         static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt()));
      }
      block->recompute = false;  // this time the graph is the point
      try {
        output = block->forward(x);
      } catch (...) {
        block->recompute = true;
        throw;
      }
      block->recompute = true;
    }
    auto result = torch::autograd::grad({output}, inputs, {grads[0]}, /*retain_graph=*/false,
                                        /*create_graph=*/false, /*allow_unused=*/true);
    result.push_back(at::Tensor());  // the block pointer
    return result;
  }
};

}  // namespace

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  if (recompute && torch::autograd::GradMode::is_enabled()) {
    std::vector<at::Tensor> params = parameters();
    return RecomputedBlock::apply(x, at::TensorList(params), this);
  }
  at::Tensor h = x + attention(attention_norm(x));
  return h + mlp(mlp_norm(h));
}

GptImpl::GptImpl(GptConfig config, std::shared_ptr<dtrain::ProcessGroup> tensor_group,
                 bool sequence_parallel)
    : config_(config), sequence_group_(sequence_group_of(tensor_group, sequence_parallel)) {
  config_.check();
  if (sequence_parallel && !tensor_group) {
    throw dtrain::UsageError(
        "gpt::Gpt: sequence_parallel without a tensor group: sequence parallelism splits the "
        "sequence over the tensor-parallel ranks; pass the tensor group, or leave it off");
  }
  if (tensor_group && config_.kv_heads % tensor_group->size() != 0) {
    throw dtrain::UsageError("gpt::Gpt: kv_heads " + std::to_string(config_.kv_heads) +
                             " does not divide by the tensor-parallel degree " +
                             std::to_string(tensor_group->size()) +
                             "; a key/value head and its query heads stay on one rank, so pick "
                             "kv_heads (and heads) that are multiples of it");
  }
  if (sequence_group_) {
    auto scattered =
        std::make_shared<ScatteredEmbeddingImpl>(config_.vocab, config_.width, sequence_group_);
    embedding = torch::nn::Embedding(std::shared_ptr<torch::nn::EmbeddingImpl>(scattered));
    push_back("embedding", scattered);  // the Sequential calls the scattering forward
  } else {
    embedding = torch::nn::Embedding(config_.vocab, config_.width);
    push_back("embedding", embedding);
  }
  // The final norm works on this rank's slice and gathers the sequence for the whole head.
  norm = RMSNorm(config_.width, config_.norm_eps, sequence_group_, /*gather_sequence=*/true);
  head = torch::nn::Linear(torch::nn::LinearOptions(config_.width, config_.vocab).bias(false));
  for (int64_t i = 0; i < config_.layers; ++i)
    push_back("block" + std::to_string(i), Block(config_, tensor_group, sequence_parallel));
  push_back("norm", norm);
  push_back("head", head);
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  if (tokens.dim() != 2 || tokens.size(1) > config_.seq_len) {
    throw dtrain::UsageError("gpt::Gpt: expected tokens [batch, seq] with seq <= seq_len " +
                             std::to_string(config_.seq_len) + ", got " +
                             std::to_string(tokens.dim()) + " dimensions, sizes " +
                             c10::str(tokens.sizes()));
  }
  if (sequence_group_ && tokens.size(1) % sequence_group_->size() != 0) {
    throw dtrain::UsageError(
        "rank " + std::to_string(sequence_group_->global_rank()) + "/" +
        std::to_string(sequence_group_->global_size()) + ": gpt::Gpt: the sequence length " +
        std::to_string(tokens.size(1)) + " does not divide by the tensor-parallel degree " +
        std::to_string(sequence_group_->size()) +
        ": sequence parallelism gives every tensor rank an equal slice of the sequence; pick a "
        "sequence length (seq_len, train_gpt's --seq-len) that is a multiple of " +
        std::to_string(sequence_group_->size()));
  }
  return torch::nn::SequentialImpl::forward(tokens);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const GptConfig& config, int64_t seq,
                                                const c10::Device& device) {
  const int64_t dim = config.head_dim();
  auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  // Frequency theta^(-2i/d) for pair i, the same for both halves (rotate-half convention).
  at::Tensor inverse = at::pow(config.rope_theta, -at::arange(0, dim, 2, options) / dim);
  at::Tensor angles = at::outer(at::arange(seq, options), inverse);  // [seq, dim / 2]
  angles = at::cat({angles, angles}, -1);                            // [seq, dim]
  return {angles.cos(), angles.sin()};
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

int64_t parameter_count(const GptConfig& config) {
  const int64_t q = config.heads * config.head_dim(), kv = config.kv_heads * config.head_dim();
  const int64_t attention = config.width * (q + 2 * kv) + q * config.width;
  const int64_t mlp = 3 * config.width * config.hidden();
  const int64_t block = 2 * config.width + attention + mlp;                       // two norms
  return 2 * config.vocab * config.width + config.layers * block + config.width;  // + final norm
}

double model_flops_per_token(const GptConfig& config) {
  return 6.0 * static_cast<double>(parameter_count(config)) +
         12.0 * static_cast<double>(config.layers * config.width * config.seq_len);
}

}  // namespace gpt
