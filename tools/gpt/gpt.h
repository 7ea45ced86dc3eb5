// A decoder-only transformer in the shape of today's open models (Llama's): token embedding; N
// blocks of RMSNorm, causal self-attention with rotary position embeddings and grouped key/value
// heads, RMSNorm, SwiGLU MLP, each with a residual; a final RMSNorm and an LM head. Sizes come from
// a GptConfig. It is the "real model" of issue 20, which every layout of dtrain must train; this
// file is the single-device model those layouts split.
//
//   gpt::GptConfig config;          // vocabulary 256: bytes as tokens
//   config.layers = 4;
//   gpt::Gpt model(config);
//   at::Tensor logits = model(tokens);                         // [batch, seq] -> [.., vocab]
//   at::Tensor loss = gpt::next_token_loss(logits, targets);   // mean over every position
//
// Note [The model is a Sequential]
// Gpt is a torch::nn::Sequential of named children, "embedding", "block0" .. "block<N-1>", "norm",
// "head", each taking and returning one tensor (every block builds its own rotary tables). So the
// layouts that cut a Sequential take it as it is: ZeRO-3 makes every child a unit (a block each,
// the embedding and the head units of their own), a pipeline cuts it between blocks (the embedding
// on the first stage, the norm and head on the last), and the parameter names say where each
// tensor lives ("block3.attention.wq.weight").
//
// Note [Tensor-parallel blocks]
// Given a tensor group of T ranks, every block is split Megatron-style: attention by heads (q, k, v
// column-parallel, o row-parallel), the MLP by hidden features (w1, w3 column-parallel, w2
// row-parallel): one all-reduce forward and one backward per sub-layer (Note [Tensor-parallel
// MLP: one all-reduce each way] in dtrain/tensor_parallel.h), 4 per block and step (6 with
// recompute, whose backward runs the forward again). q, k and v (and w1, w3) enter the
// tensor-parallel region together through dtrain::column_parallel_forward: each layer's own
// forward would all-reduce its share of the input's gradient, 3 + 2 backward all-reduces per block
// where 2 suffice. The embedding, the norms and the head
// are whole on every rank, and so are their gradients (every rank computes them from the same
// activations). Every rank must build the model under the same torch::manual_seed: each layer
// draws what the unsplit one would and keeps its shard, so the T ranks hold exactly the unsplit
// model. T must divide kv_heads (a key/value head and its query heads stay on one rank).
//
// Note [Sequence-parallel blocks]
// With sequence_parallel as well (Note [Sequence parallelism] in dtrain/tensor_parallel.h), the
// residual stream between the tensor-parallel matmuls is split along the sequence: the embedding's
// output is scattered (each rank keeps its 1/T of the positions; backward all-gathers the
// gradient, so the embedding's gradient stays whole on every rank), each block's norms and
// residual adds work on [batch, seq / T, width], the attention and the MLP all-gather the
// normalized slice once (q, k, v share one all-gather, and w1, w3 another) and reduce-scatter the
// output of wo, resp. w2. The final norm works on the slice and all-gathers its output for the
// head, which stays whole on every rank: the model's output is then the same full logits as in
// every other layout (the loss, validation and export need no change) and the head's gradient is
// whole on every rank with no all-reduce of its vocab x width; the price is that every rank
// computes all the logits, as under plain tensor parallelism (a column-parallel head would need a
// cross-entropy over vocabulary shards). The norms' weights see 1/T of the positions on a rank:
// RMSNorm passes them through dtrain::sequence_parallel_parameter, whose backward all-reduces
// their gradient over the tensor group (2 x layers + 1 all-reduces of `width` floats per
// backward). Per block and step: forward 2 all-gathers and 2 reduce-scatters of
// [batch, seq, width]; backward 2 reduce-scatters (the inputs' gradients), 4 all-gathers (the
// outputs' gradients, and the inputs again for the weights' gradients) and the norms' 2 small
// all-reduces; the recomputed forward of --recompute adds the forward's 4 again. The sequence
// length must divide by T.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "dtrain/comm.h"

namespace gpt {

struct GptConfig {
  int64_t vocab = 256;   // bytes as tokens
  int64_t seq_len = 64;  // the longest sequence (rotary tables are built for it)
  int64_t layers = 2;
  int64_t width = 64;     // the model dimension
  int64_t heads = 4;      // query heads; width must divide by it
  int64_t kv_heads = 2;   // key/value heads (grouped-query attention); heads must divide by it
  int64_t mlp_width = 0;  // SwiGLU's hidden width; 0: 8/3 x width rounded up to a multiple of 8
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;

  int64_t head_dim() const { return width / heads; }
  int64_t hidden() const;  // mlp_width, or the default above
  // Throws dtrain::UsageError naming the first size that does not fit (e.g. "width 65 does not
  // divide by heads 4").
  void check() const;
};

// x / sqrt(mean(x^2) + eps) * weight, over the last dimension.
// With a sequence group (Note [Sequence-parallel blocks]) x is this rank's slice of the sequence
// and the weight's gradient is all-reduced over the group; gather_sequence all-gathers the output
// along the sequence (the final norm, before the whole head).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps,
              std::shared_ptr<dtrain::ProcessGroup> sequence_group = nullptr,
              bool gather_sequence = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
  std::shared_ptr<dtrain::ProcessGroup> sequence_group_;
  bool gather_sequence_ = false;
};
TORCH_MODULE(RMSNorm);

// Causal self-attention over [batch, seq, width] with rotary embeddings on queries and keys; the
// key/value heads are shared by heads / kv_heads query heads each.
//
// With a tensor group of T ranks (Note [Tensor-parallel blocks]) each rank holds heads / T query
// heads and kv_heads / T key/value heads: wq, wk, wv are ColumnParallelLinear layers split by
// heads, wo a RowParallelLinear whose all-reduce sums the heads' contributions. With
// sequence_parallel the input and output are this rank's slice of the sequence (Note
// [Sequence-parallel blocks]).
class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const GptConfig& config, std::shared_ptr<dtrain::ProcessGroup> tensor_group,
                bool sequence_parallel = false);
  at::Tensor forward(const at::Tensor& x);
  // The projections ("wq", "wk", "wv", "wo"): torch::nn::Linear, or with a tensor group the
  // column- (q, k, v) and row-parallel (o) layers of dtrain/tensor_parallel.h.
  torch::nn::AnyModule wq, wk, wv, wo;

 private:
  GptConfig config_;
  std::shared_ptr<dtrain::ProcessGroup> sequence_group_;  // null without sequence parallelism
  int64_t heads_, kv_heads_, head_dim_;                   // this rank's heads
  at::Tensor cos_, sin_;  // the rotary tables of the last sequence length and device seen
};
TORCH_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x).
// With a tensor group: w1 and w3 column-parallel (each rank a slice of the hidden features, on
// which silu and the product are elementwise), w2 row-parallel. With sequence_parallel: as
// AttentionImpl.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const GptConfig& config, std::shared_ptr<dtrain::ProcessGroup> tensor_group,
          bool sequence_parallel = false);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::AnyModule w1, w2, w3;
};
TORCH_MODULE(Mlp);

// x + attention(norm(x)), then + mlp(norm(.)).
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptConfig& config, std::shared_ptr<dtrain::ProcessGroup> tensor_group,
            bool sequence_parallel = false);
  at::Tensor forward(const at::Tensor& x);
  RMSNorm attention_norm{nullptr}, mlp_norm{nullptr};
  Attention attention{nullptr};
  Mlp mlp{nullptr};
  // Activation recomputation (Note [Recomputed blocks] in gpt.cpp): a forward that records
  // gradients keeps only the block's input and runs the block again in backward.
  bool recompute = false;
};
TORCH_MODULE(Block);

// The whole model (Note [The model is a Sequential]).
class GptImpl : public torch::nn::SequentialImpl {
 public:
  // Throws dtrain::UsageError for a config that does not fit (GptConfig::check), or a tensor
  // group whose size does not divide kv_heads. tensor_group: Note [Tensor-parallel blocks]; null:
  // the whole model on this rank. sequence_parallel (with a tensor group): Note
  // [Sequence-parallel blocks].
  explicit GptImpl(GptConfig config, std::shared_ptr<dtrain::ProcessGroup> tensor_group = nullptr,
                   bool sequence_parallel = false);
  // tokens [batch, seq] (int64, seq <= config.seq_len) -> logits [batch, seq, vocab]. Throws
  // dtrain::UsageError for a longer sequence, or under sequence parallelism one whose length does
  // not divide by the tensor-parallel degree.
  at::Tensor forward(const at::Tensor& tokens);
  const GptConfig& config() const { return config_; }
  bool sequence_parallel() const { return sequence_group_ != nullptr; }
  // The model as the Sequential it is, for split_sequential and the like.
  torch::nn::Sequential sequential() {
    return torch::nn::Sequential(
        std::static_pointer_cast<torch::nn::SequentialImpl>(shared_from_this()));
  }
  BlockImpl& block(int64_t i) { return *ptr<BlockImpl>(1 + i); }
  // Every block's BlockImpl::recompute.
  void set_recompute(bool on) {
    for (int64_t i = 0; i < config_.layers; ++i) block(i).recompute = on;
  }

  torch::nn::Embedding embedding{nullptr};
  RMSNorm norm{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  GptConfig config_;
  std::shared_ptr<dtrain::ProcessGroup> sequence_group_;  // null without sequence parallelism
};
TORCH_MODULE(Gpt);

// The rotary tables for positions 0..seq-1: cos and sin, [seq, head_dim], float32 on `device`.
// (Not buffers of the model: they are a function of the config, the same on every rank, so DDP
// must not broadcast them and checkpoints need not hold them.)
std::pair<at::Tensor, at::Tensor> rotary_tables(const GptConfig& config, int64_t seq,
                                                const c10::Device& device);

// Cross-entropy of logits [batch, seq, vocab] against targets [batch, seq], the mean over every
// position: the next-token loss (targets are the tokens shifted by one).
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets);

// The unsplit model's parameter count for `config` (whatever layout holds it).
int64_t parameter_count(const GptConfig& config);

// The FLOPs one token costs in a training step, forward and backward, as the PaLM paper's
// appendix B counts them for model FLOPs utilisation: 6 per parameter (2 forward, 4 backward) plus
// 12 x layers x width x seq_len for the attention scores and their weighting. bench/gpt_peer.py
// counts the same way, so the two sides' TFLOP/s compare.
double model_flops_per_token(const GptConfig& config);

}  // namespace gpt
