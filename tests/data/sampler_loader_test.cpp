// Tests for DistributedSampler as a torch::data sampler: torch::data::make_data_loader takes it as
// it is, its batches are this rank's split with a per-rank batch size, the position follows the
// batches handed out so that a checkpoint between two batches resumes exactly (at any world size,
// through state() or a LibTorch archive), and set_epoch after a resume keeps the loaded position.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <sstream>

#include "dtrain/data.h"
#include "dtrain/errors.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using Indices = std::vector<int64_t>;

// Sample i holds i, so a batch says which indices the loader fetched.
class IndexDataset : public torch::data::datasets::Dataset<IndexDataset> {
 public:
  explicit IndexDataset(size_t size) : size_(size) {}
  torch::data::Example<> get(size_t index) override {
    at::Tensor i = torch::tensor(static_cast<int64_t>(index));
    return {i, i};
  }
  std::optional<size_t> size() const override { return size_; }

 private:
  size_t size_;
};

auto make_loader(size_t dataset_size, const DistributedSampler& sampler, size_t batch_size,
                 size_t workers = 0) {
  return torch::data::make_data_loader(
      IndexDataset(dataset_size).map(torch::data::transforms::Stack<>()), sampler,
      torch::data::DataLoaderOptions(batch_size).workers(workers));
}

// The batches of one pass over the loader, each as its list of indices.
template <typename Loader>
std::vector<Indices> one_pass(Loader& loader, int64_t max_batches = -1) {
  std::vector<Indices> batches;
  if (max_batches == 0) return batches;
  for (auto& batch : loader) {
    at::Tensor data = batch.data.contiguous();
    batches.emplace_back(data.data_ptr<int64_t>(), data.data_ptr<int64_t>() + data.numel());
    if (static_cast<int64_t>(batches.size()) == max_batches) break;
  }
  return batches;
}

Indices flatten(const std::vector<Indices>& batches) {
  Indices all;
  for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
  return all;
}

template <typename F>
std::string usage_error_message(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UsageError";
  return "";
}

// A whole epoch through the loader is indices() cut into per-rank batches, and leaves the
// position at the end of the epoch, as advance() after every step would.
TEST(SamplerLoader, BatchesAreThisRanksSplitCutIntoPerRankBatches) {
  for (int world_size : {1, 2, 3, 5}) {
    for (int64_t n : {1, 7, 30, 101}) {
      for (size_t batch : {1, 4, 7}) {
        for (bool drop_last : {false, true}) {
          SCOPED_TRACE("world_size=" + std::to_string(world_size) + " n=" + std::to_string(n) +
                       " batch=" + std::to_string(batch) +
                       " drop_last=" + std::to_string(drop_last));
          DistributedSamplerOptions options;
          options.drop_last = drop_last;
          options.seed = 5;
          std::vector<int64_t> batches_per_rank;
          for (int rank = 0; rank < world_size; ++rank) {
            DistributedSampler sampler(n, world_size, rank, options);
            sampler.set_epoch(2);
            const Indices expected = sampler.indices();
            auto loader = make_loader(n, sampler, batch);
            const std::vector<Indices> batches = one_pass(*loader);
            EXPECT_EQ(flatten(batches), expected);
            for (size_t b = 0; b + 1 < batches.size(); ++b) EXPECT_EQ(batches[b].size(), batch);
            batches_per_rank.push_back(static_cast<int64_t>(batches.size()));
            // The program's handle sees what the loader's copy consumed.
            EXPECT_EQ(sampler.num_samples(), 0);
            EXPECT_EQ(sampler.state().epoch, 2);
            EXPECT_EQ(sampler.state().samples_consumed,
                      drop_last ? n / world_size * world_size : n);
          }
          // Every rank takes as many steps: no rank waits in a collective the others skipped.
          for (int64_t count : batches_per_rank) EXPECT_EQ(count, batches_per_rank[0]);
        }
      }
    }
  }
}

TEST(SamplerLoader, ConstructedFromAProcessGroup) {
  for (int world_size : {1, 3}) {
    std::vector<Indices> got(world_size);
    const std::string method = testing::unique_store_name("sampler-group");
    testing::run_ranks(world_size, [&](int rank) {
      InitOptions init;
      init.init_method = method;
      init.rank = rank;
      init.world_size = world_size;
      auto pg = init_process_group(init);
      DistributedSampler sampler(10, pg);
      EXPECT_EQ(sampler.rank(), rank);
      EXPECT_EQ(sampler.world_size(), world_size);
      got[rank] = sampler.indices();
    });
    for (int rank = 0; rank < world_size; ++rank) {
      EXPECT_EQ(got[rank], DistributedSampler(10, world_size, rank).indices());
    }
  }
  const std::string message =
      usage_error_message([] { DistributedSampler(10, std::shared_ptr<ProcessGroup>()); });
  EXPECT_NE(message.find("group is null"), std::string::npos) << message;
}

TEST(SamplerLoader, CopiesAndMovesShareOneSampler) {
  DistributedSampler sampler(20, 2, 1);
  DistributedSampler copy = sampler;
  DistributedSampler moved = std::move(copy);
  moved.advance(4);
  EXPECT_EQ(sampler.state().samples_consumed, 4);
  EXPECT_EQ(copy.state().samples_consumed, 4);  // a moved-from sampler stays usable
  auto loader = make_loader(20, std::move(sampler), 3);
  EXPECT_EQ(one_pass(*loader, 1)[0].size(), 3u);
  EXPECT_EQ(sampler.state().samples_consumed, 10);
}

// Runs `batches` loader batches on every rank of world `old_world`, checkpoints through a LibTorch
// archive, resumes on `new_world` ranks in a new loader and checks that the two runs together see
// every sample exactly once (n, the step and the worlds are chosen so that nothing is padded).
void check_resume_through_loader(int64_t n, int old_world, size_t batch, int64_t batches,
                                 int new_world) {
  SCOPED_TRACE("n=" + std::to_string(n) + " old_world=" + std::to_string(old_world) +
               " batch=" + std::to_string(batch) + " batches=" + std::to_string(batches) +
               " new_world=" + std::to_string(new_world));
  DistributedSamplerOptions options;
  options.seed = 3;
  std::map<int64_t, int> seen;
  std::string archive_bytes;
  for (int rank = 0; rank < old_world; ++rank) {
    DistributedSampler sampler(n, old_world, rank, options);
    sampler.set_epoch(1);
    auto loader = make_loader(n, sampler, batch);
    for (int64_t index : flatten(one_pass(*loader, batches))) ++seen[index];
    std::ostringstream bytes;
    torch::save(sampler, bytes);  // what every rank saves is the same position
    if (rank > 0) EXPECT_EQ(bytes.str(), archive_bytes);
    archive_bytes = bytes.str();
  }
  for (int rank = 0; rank < new_world; ++rank) {
    DistributedSampler sampler(n, new_world, rank, options);
    std::istringstream bytes(archive_bytes);
    torch::load(sampler, bytes);
    EXPECT_EQ(sampler.state().epoch, 1);
    EXPECT_EQ(sampler.state().samples_consumed,
              std::min<int64_t>(n, batches * static_cast<int64_t>(batch) * old_world));
    sampler.set_epoch(1);  // at the top of the resumed epoch, as a PyTorch program does
    auto loader = make_loader(n, sampler, batch + 1);
    for (int64_t index : flatten(one_pass(*loader))) ++seen[index];
  }
  ASSERT_EQ(static_cast<int64_t>(seen.size()), n) << "a sample was never seen";
  for (const auto& [index, times] : seen) EXPECT_EQ(times, 1) << "index " << index;
}

TEST(SamplerLoader, CheckpointBetweenBatchesResumesExactlyAtAnyWorldSize) {
  // 120 and every remainder below (consumed: multiples of 12) divide by 1, 2, 3, 4 and 6: no
  // padding on either side. 25 batches of 6 is more than the epoch holds: the loader stops at 20.
  for (int new_world : {1, 2, 3, 4, 6}) {
    for (int64_t batches : {0, 2, 10, 25}) {
      check_resume_through_loader(120, 2, 3, batches, new_world);
    }
    check_resume_through_loader(120, 3, 4, 5, new_world);
  }
}

TEST(SamplerLoader, SetEpochAfterLoadStateKeepsThePositionOnlyForTheLoadedEpoch) {
  DistributedSampler sampler(100, 4, 2);
  const SamplerState saved{3, 40};

  sampler.load_state(saved);
  sampler.set_epoch(3);  // the resumed epoch: continues at 40
  sampler.set_epoch(3);  // again, nothing consumed yet: still 40
  EXPECT_EQ(sampler.state().epoch, 3);
  EXPECT_EQ(sampler.state().samples_consumed, 40);
  EXPECT_EQ(sampler.num_samples(), 15);
  ASSERT_TRUE(sampler.next(5).has_value());  // consumes 20 over 4 ranks
  EXPECT_EQ(sampler.state().samples_consumed, 60);
  sampler.set_epoch(3);  // once samples were consumed, set_epoch restarts the epoch
  EXPECT_EQ(sampler.state().samples_consumed, 0);

  sampler.load_state(saved);
  sampler.set_epoch(4);  // a new epoch starts at 0
  EXPECT_EQ(sampler.state().epoch, 4);
  EXPECT_EQ(sampler.state().samples_consumed, 0);
  EXPECT_EQ(sampler.num_samples(), 25);
  sampler.set_epoch(3);  // another epoch was set in between: the loaded position is gone
  EXPECT_EQ(sampler.state().samples_consumed, 0);

  sampler.load_state(saved);
  sampler.advance(8);  // consumed through advance(), the trainer's path
  sampler.set_epoch(3);
  EXPECT_EQ(sampler.state().samples_consumed, 0);

  sampler.load_state(saved);
  sampler.advance(0);  // consumes nothing
  sampler.set_epoch(3);
  EXPECT_EQ(sampler.state().samples_consumed, 40);
}

// A checkpoint written at the end of an epoch resumes into an empty rest of that epoch, not a
// replay of it, and the next epoch is whole.
TEST(SamplerLoader, ResumeAtTheEndOfAnEpochMovesOnToTheNext) {
  DistributedSampler sampler(30, 3, 0);
  sampler.load_state({2, 30});
  auto loader = make_loader(30, sampler, 4);
  sampler.set_epoch(2);
  EXPECT_TRUE(one_pass(*loader).empty());
  sampler.set_epoch(3);
  DistributedSampler fresh(30, 3, 0);
  fresh.set_epoch(3);
  EXPECT_EQ(flatten(one_pass(*loader)), fresh.indices());
}

// Without set_epoch between two passes, the second repeats the epoch in the same order (as
// Python's sampler does), instead of yielding nothing.
TEST(SamplerLoader, IteratedAgainWithoutSetEpochRepeatsTheEpoch) {
  DistributedSampler sampler(25, 2, 1);
  auto loader = make_loader(25, sampler, 4);
  const std::vector<Indices> first = one_pass(*loader);
  EXPECT_EQ(flatten(first), DistributedSampler(25, 2, 1).indices());
  EXPECT_EQ(one_pass(*loader), first);
  // A pass broken off part-way continues where it stopped.
  sampler.set_epoch(1);
  const std::vector<Indices> part = one_pass(*loader, 2);
  std::vector<Indices> whole = part, rest = one_pass(*loader);
  whole.insert(whole.end(), rest.begin(), rest.end());
  DistributedSampler fresh(25, 2, 1);
  fresh.set_epoch(1);
  EXPECT_EQ(flatten(whole), fresh.indices());
}

// Worker threads fetch the same batches in the same order (the position then runs ahead by the
// batches in flight; see DistributedSampler::next).
TEST(SamplerLoader, WorkerThreadsFetchTheSameBatches) {
  DistributedSampler sampler(50, 3, 2);
  auto loader = make_loader(50, sampler, 3, /*workers=*/2);
  EXPECT_EQ(flatten(one_pass(*loader)), DistributedSampler(50, 3, 2).indices());
}

TEST(SamplerLoader, InvalidUseThrowsUsageError) {
  DistributedSampler sampler(10, 2, 1);
  std::string message = usage_error_message([&] { sampler.next(0); });
  EXPECT_NE(message.find("rank 1/2"), std::string::npos) << message;
  EXPECT_NE(message.find("batch_size is 0"), std::string::npos) << message;
  message = usage_error_message([&] { sampler.reset(11); });
  EXPECT_NE(message.find("new_size is 11"), std::string::npos) << message;
  EXPECT_NE(message.find("dataset_size 10"), std::string::npos) << message;
  sampler.reset(10);  // the same size is fine

  torch::serialize::OutputArchive empty;
  std::ostringstream bytes;
  empty.save_to(bytes);
  std::istringstream in(bytes.str());
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  message = usage_error_message([&] { sampler.load(archive); });
  EXPECT_NE(message.find("no int64 'epoch'"), std::string::npos) << message;
  EXPECT_EQ(sampler.state().samples_consumed, 0);  // a failed load leaves the sampler as it was
}

}  // namespace
}  // namespace dtrain
