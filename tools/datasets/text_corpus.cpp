// The text corpus for the transformer; see datasets/text_corpus.h.
#include "datasets/text_corpus.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "datasets/read_file.h"
#include "dtrain/errors.h"

namespace datasets {

std::string default_text_corpus() {
  const char* path = std::getenv("DTRAIN_TEXT_CORPUS");
  return path != nullptr && *path != '\0' ? path : kDefaultTextCorpus;
}

TextCorpus load_text_corpus(const std::string& path, double heldout_fraction, int64_t max_bytes) {
  if (!(heldout_fraction >= 0 && heldout_fraction < 1)) {
    throw dtrain::UsageError("text corpus: heldout_fraction " + std::to_string(heldout_fraction) +
                             ": expected at least 0 and below 1");
  }
  std::vector<uint8_t> bytes = read_maybe_gzip(
      path, "text corpus",
      "Reinstall Debian's dict-gcide (apt-get install --reinstall dict-gcide) or set "
      "DTRAIN_TEXT_CORPUS to another text file.");
  if (max_bytes > 0 && static_cast<int64_t>(bytes.size()) > max_bytes) bytes.resize(max_bytes);
  if (bytes.empty()) {
    throw dtrain::UsageError("text corpus " + path +
                             " is empty; point DTRAIN_TEXT_CORPUS at a file with text in it");
  }
  const int64_t total = static_cast<int64_t>(bytes.size());
  const int64_t heldout = static_cast<int64_t>(static_cast<double>(total) * heldout_fraction);
  at::Tensor all = at::empty({total}, at::kByte);
  std::memcpy(all.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return {all.narrow(0, 0, total - heldout), all.narrow(0, total - heldout, heldout)};
}

ByteWindows::ByteWindows(at::Tensor bytes, int64_t seq_len)
    : bytes_(std::move(bytes)), seq_len_(seq_len) {
  if (seq_len < 1 || bytes_.numel() < seq_len + 1) {
    throw dtrain::UsageError("ByteWindows: " + std::to_string(bytes_.numel()) +
                             " bytes hold no window of seq_len " + std::to_string(seq_len) +
                             " + 1; use a shorter sequence or more text");
  }
}

torch::data::Example<> ByteWindows::get(size_t index) {
  const int64_t start = static_cast<int64_t>(index) * seq_len_;
  at::Tensor window = bytes_.narrow(0, start, seq_len_ + 1).to(at::kLong);
  return {window.narrow(0, 0, seq_len_), window.narrow(0, 1, seq_len_)};
}

std::optional<size_t> ByteWindows::size() const {
  return static_cast<size_t>((bytes_.numel() - 1) / seq_len_);
}

}  // namespace datasets
