// Real text for the transformer (tools/gpt): a corpus from a Debian package, bytes as tokens
// (vocabulary 256), a held-out tail, and fixed-length windows as a torch::data dataset that
// dtrain's DistributedSampler deals over the ranks. Not part of libdtrain, as the Fashion-MNIST
// reader is not.
//
//   auto corpus = datasets::load_text_corpus();                 // GCIDE, ~40 MB of English
//   auto train = datasets::ByteWindows(corpus.train, 64).map(torch::data::transforms::Stack<>());
//   dtrain::DistributedSampler sampler(train.size().value(), pg);
//   auto loader = torch::data::make_data_loader(train, sampler, 16);
//   // batch.data: [16, 64] inputs; batch.target: the next byte of each
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <cstdint>
#include <optional>
#include <string>

namespace datasets {

// The Collaborative International Dictionary of English, as Debian's dict-gcide installs it
// (dictzip, which gzip reads).
inline constexpr const char* kDefaultTextCorpus = "/usr/share/dictd/gcide.dict.dz";
// $DTRAIN_TEXT_CORPUS when set, else kDefaultTextCorpus.
std::string default_text_corpus();

struct TextCorpus {
  at::Tensor train;    // uint8 [N]: the first 1 - heldout_fraction of the bytes
  at::Tensor heldout;  // uint8 [M]: the rest, for validation loss and bits per byte
};

// Reads `path` (gzip'd or plain: told by its first two bytes) into bytes; max_bytes > 0 keeps only
// the first max_bytes (for tests and short runs). Throws dtrain::UsageError naming the file when
// it is missing, unreadable or empty, or heldout_fraction is outside [0, 1).
TextCorpus load_text_corpus(const std::string& path = default_text_corpus(),
                            double heldout_fraction = 0.05, int64_t max_bytes = 0);

// Non-overlapping windows of seq_len + 1 bytes: sample i is bytes [i*seq_len, (i+1)*seq_len + 1),
// its data the first seq_len (int64 tokens) and its target the last seq_len (the next byte of
// each). Every byte but the last is predicted exactly once per epoch.
class ByteWindows : public torch::data::datasets::Dataset<ByteWindows> {
 public:
  // Throws dtrain::UsageError when seq_len < 1 or the bytes hold no whole window.
  ByteWindows(at::Tensor bytes, int64_t seq_len);
  torch::data::Example<> get(size_t index) override;
  std::optional<size_t> size() const override;

 private:
  at::Tensor bytes_;  // uint8 [N]; a window is made int64 when it is read (8x less memory)
  int64_t seq_len_;
};

}  // namespace datasets
