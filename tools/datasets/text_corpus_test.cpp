// The text corpus: Debian's GCIDE read whole (dictzip through gzip), a held-out tail, windows whose
// targets are their inputs moved by one byte, and one clear line for a missing file.
#include "datasets/text_corpus.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "dtrain/errors.h"
#include "support/temp_dir.h"

namespace datasets {
namespace {

TEST(TextCorpus, GcideReadsWholeWithAHeldOutTail) {
  if (default_text_corpus() != kDefaultTextCorpus || !std::filesystem::exists(kDefaultTextCorpus)) {
    GTEST_SKIP() << "needs Debian's dict-gcide at " << kDefaultTextCorpus
                 << " (scripts/bootstrap installs it) and DTRAIN_TEXT_CORPUS unset";
  }
  TextCorpus corpus = load_text_corpus(kDefaultTextCorpus, 0.05);
  const int64_t total = corpus.train.numel() + corpus.heldout.numel();
  EXPECT_GT(total, 30'000'000);  // ~40 MB of dictionary text
  EXPECT_NEAR(static_cast<double>(corpus.heldout.numel()) / total, 0.05, 1e-6);
  // The dictionary's own first words, and plain text throughout (bytes below 128 nearly always).
  std::string head(reinterpret_cast<const char*>(corpus.train.data_ptr<uint8_t>()), 200);
  EXPECT_NE(head.find("00-database-url"), std::string::npos) << head;
  EXPECT_LT(corpus.train.ge(128).sum().item<int64_t>(), total / 100);
}

TEST(TextCorpus, GzipAndPlainGiveTheSameBytesAndMaxBytesCuts) {
  std::filesystem::path dir = dtrain::testing::temp_dir("text-corpus");
  std::filesystem::create_directories(dir);
  const std::string text = "the quick brown fox jumps over the lazy dog\n";
  std::ofstream(dir / "plain.txt") << text;
  gzFile gz = gzopen((dir / "text.gz").c_str(), "wb");
  ASSERT_NE(gz, nullptr);
  gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
  gzclose(gz);
  TextCorpus plain = load_text_corpus(dir / "plain.txt", 0.0);
  TextCorpus inflated = load_text_corpus(dir / "text.gz", 0.0);
  EXPECT_TRUE(torch::equal(plain.train, inflated.train));
  EXPECT_EQ(plain.train.numel(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(load_text_corpus(dir / "text.gz", 0.0, 9).train.numel(), 9);
  std::filesystem::remove_all(dir);
}

TEST(TextCorpus, WindowsPredictEveryNextByteOnce) {
  at::Tensor bytes = torch::arange(0, 101, torch::kByte);  // 101 bytes
  ByteWindows windows(bytes, 10);
  ASSERT_EQ(windows.size().value(), 10u);  // 100 predicted bytes in windows of 10
  for (size_t i = 0; i < 10; ++i) {
    auto example = windows.get(i);
    EXPECT_EQ(example.data.scalar_type(), torch::kLong);
    EXPECT_TRUE(torch::equal(example.data, torch::arange(10 * i, 10 * i + 10, torch::kLong)));
    EXPECT_TRUE(torch::equal(example.target, example.data + 1));
  }
  EXPECT_THROW(ByteWindows(torch::zeros({5}, torch::kByte), 5), dtrain::UsageError);
}

TEST(TextCorpus, AMissingFileIsOneLineSayingWhatToInstall) {
  try {
    load_text_corpus("/nonexistent/gcide.dict.dz");
    FAIL() << "expected a UsageError";
  } catch (const dtrain::UsageError& e) {
    std::string message = e.what();
    EXPECT_NE(message.find("text corpus /nonexistent/gcide.dict.dz could not be opened"),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace datasets
