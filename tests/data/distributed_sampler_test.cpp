// Tests for DistributedSampler: PyTorch's order and split (reference values from Debian's Python
// torch 1.13), the rank partition over world sizes 1..5 and odd dataset sizes, and resuming at
// another world size.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "dtrain/data.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

using Indices = std::vector<int64_t>;

// Every rank's indices() for one configuration.
std::vector<Indices> all_ranks(int64_t n, int world_size, DistributedSamplerOptions options,
                               int64_t epoch = 0) {
  std::vector<Indices> result;
  for (int rank = 0; rank < world_size; ++rank) {
    DistributedSampler sampler(n, world_size, rank, options);
    sampler.set_epoch(epoch);
    result.push_back(sampler.indices());
  }
  return result;
}

// The epoch order as a world-size-1 sampler sees it.
Indices epoch_order(int64_t n, DistributedSamplerOptions options, int64_t epoch) {
  return all_ranks(n, 1, options, epoch)[0];
}

std::map<int64_t, int> count(const std::vector<Indices>& lists) {
  std::map<int64_t, int> counts;
  for (const auto& list : lists)
    for (int64_t index : list) ++counts[index];
  return counts;
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

// Expected values from /usr/bin/python3:
//   g = torch.Generator(); g.manual_seed(S); print(torch.randperm(N, generator=g).tolist())
TEST(DistributedSamplerTest, MatchesPythonPermutation) {
  DistributedSamplerOptions options;
  EXPECT_EQ(epoch_order(20, options, 0),
            (Indices{4, 5, 13, 19, 7, 14, 3, 6, 9, 17, 11, 2, 16, 18, 10, 12, 15, 8, 1, 0}));
  EXPECT_EQ(epoch_order(20, options, 1),
            (Indices{5, 13, 2, 11, 19, 18, 1, 9, 4, 7, 0, 14, 16, 10, 15, 3, 6, 17, 12, 8}));
  options.seed = 42;
  EXPECT_EQ(epoch_order(20, options, 0),
            (Indices{2, 14, 18, 15, 1, 10, 0, 4, 6, 11, 8, 3, 7, 17, 13, 12, 19, 5, 16, 9}));
  options.seed = 7;
  Indices large = epoch_order(100000, options, 0);
  EXPECT_EQ(Indices(large.begin(), large.begin() + 8),
            (Indices{41615, 23657, 92717, 16389, 28607, 45432, 45737, 59262}));
}

// Expected: list(DistributedSampler(range(n), num_replicas=W, rank=r, seed=S, drop_last=D)) after
// set_epoch(E), from /usr/bin/python3.
TEST(DistributedSamplerTest, MatchesPythonSampler) {
  struct Case {
    int64_t n;
    int world_size;
    bool drop_last;
    uint64_t seed;
    int64_t epoch;
    std::vector<Indices> expected;
  };
  const std::vector<Case> cases = {
      {10, 3, false, 0, 0, {{4, 5, 0, 2}, {1, 3, 8, 4}, {7, 9, 6, 1}}},
      {10, 3, true, 0, 0, {{4, 5, 0}, {1, 3, 8}, {7, 9, 6}}},
      {7, 4, false, 5, 2, {{5, 2}, {0, 6}, {3, 4}, {1, 5}}},
      {13, 5, true, 0, 1, {{6, 0}, {12, 5}, {7, 1}, {11, 2}, {3, 9}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("n=" + std::to_string(c.n) + " world_size=" + std::to_string(c.world_size));
    DistributedSamplerOptions options;
    options.drop_last = c.drop_last;
    options.seed = c.seed;
    EXPECT_EQ(all_ranks(c.n, c.world_size, options, c.epoch), c.expected);
    DistributedSampler sampler(c.n, c.world_size, 0, options);
    EXPECT_EQ(sampler.num_samples(), static_cast<int64_t>(c.expected[0].size()));
    EXPECT_EQ(sampler.total_size(), c.world_size * sampler.num_samples());
  }
}

// Position q of the padded (or cut) epoch order belongs to rank q % W as its (q / W)-th index.
TEST(DistributedSamplerTest, RanksPartitionTheEpochOrder) {
  for (bool drop_last : {false, true}) {
    for (bool shuffle : {true, false}) {
      for (int world_size = 1; world_size <= 5; ++world_size) {
        for (int64_t n : {1, 2, 3, 4, 7, 10, 13, 20, 101}) {
          SCOPED_TRACE("drop_last=" + std::to_string(drop_last) +
                       " shuffle=" + std::to_string(shuffle) +
                       " world_size=" + std::to_string(world_size) + " n=" + std::to_string(n));
          DistributedSamplerOptions options;
          options.drop_last = drop_last;
          options.shuffle = shuffle;
          const Indices order = epoch_order(n, options, 3);
          const std::vector<Indices> ranks = all_ranks(n, world_size, options, 3);
          const int64_t total = drop_last ? n / world_size * world_size
                                          : (n + world_size - 1) / world_size * world_size;
          for (int rank = 0; rank < world_size; ++rank) {
            DistributedSampler sampler(n, world_size, rank, options);
            sampler.set_epoch(3);
            ASSERT_EQ(static_cast<int64_t>(ranks[rank].size()), total / world_size);
            EXPECT_EQ(sampler.num_samples(), total / world_size);
            EXPECT_EQ(sampler.total_size(), total);
          }
          for (int64_t q = 0; q < total; ++q) {
            EXPECT_EQ(ranks[q % world_size][q / world_size], order[q % n]) << "q=" << q;
          }
          const auto counts = count(ranks);
          if (drop_last) {
            EXPECT_EQ(static_cast<int64_t>(counts.size()), total);  // all distinct
          } else {
            EXPECT_EQ(static_cast<int64_t>(counts.size()), n);  // every sample at least once
          }
        }
      }
    }
  }
}

TEST(DistributedSamplerTest, ShuffleFalseIsSequential) {
  DistributedSamplerOptions options;
  options.shuffle = false;
  EXPECT_EQ(epoch_order(6, options, 4), (Indices{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(all_ranks(5, 2, options), (std::vector<Indices>{{0, 2, 4}, {1, 3, 0}}));
}

TEST(DistributedSamplerTest, EpochsDifferAndRepeat) {
  DistributedSamplerOptions options;
  const Indices epoch0 = epoch_order(50, options, 0);
  const Indices epoch1 = epoch_order(50, options, 1);
  EXPECT_NE(epoch0, epoch1);
  Indices sorted0 = epoch0, sorted1 = epoch1;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  EXPECT_EQ(sorted0, sorted1);

  DistributedSampler sampler(50, 1, 0, options);
  EXPECT_EQ(sampler.indices(), epoch0);
  EXPECT_EQ(sampler.indices(), epoch0);  // indices() does not move the position
  sampler.set_epoch(1);
  EXPECT_EQ(sampler.indices(), epoch1);
  options.seed = 1;
  EXPECT_NE(epoch_order(50, options, 0), epoch0);
}

TEST(DistributedSamplerTest, AdvanceConsumesAndSetEpochResets) {
  DistributedSampler sampler(10, 3, 1, {});  // Python: rank 1 takes {1, 3, 8, 4}
  sampler.advance(3);
  EXPECT_EQ(sampler.indices(), (Indices{3, 8, 4}));
  EXPECT_EQ(sampler.num_samples(), 3);
  EXPECT_EQ(sampler.total_size(), 9);
  EXPECT_EQ(sampler.state().samples_consumed, 3);
  sampler.advance(9);
  EXPECT_TRUE(sampler.indices().empty());
  EXPECT_EQ(sampler.num_samples(), 0);
  // 12 consumed, 2 of them padding: the state counts only the 10 real samples.
  EXPECT_EQ(sampler.state().samples_consumed, 10);
  sampler.set_epoch(1);
  EXPECT_EQ(sampler.state().epoch, 1);
  EXPECT_EQ(sampler.state().samples_consumed, 0);
  EXPECT_EQ(sampler.num_samples(), 4);
}

// Runs `steps` steps of `batch` samples per rank at old_world_size, checkpoints, resumes at
// new_world_size and checks that consumed + remaining hold every sample, the only duplicates being
// the padding of either run (with drop_last: no duplicates, the cut tails are missing instead).
void check_resume(int64_t n, int old_world_size, int new_world_size, int64_t batch, int64_t steps,
                  bool drop_last) {
  SCOPED_TRACE("n=" + std::to_string(n) + " old_world_size=" + std::to_string(old_world_size) +
               " new_world_size=" + std::to_string(new_world_size) +
               " steps=" + std::to_string(steps) + " drop_last=" + std::to_string(drop_last));
  DistributedSamplerOptions options;
  options.drop_last = drop_last;
  options.seed = 11;
  std::vector<Indices> consumed(old_world_size);
  SamplerState saved;
  for (int rank = 0; rank < old_world_size; ++rank) {
    DistributedSampler sampler(n, old_world_size, rank, options);
    sampler.set_epoch(2);
    const Indices mine = sampler.indices();
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t begin = std::min<int64_t>(step * batch, mine.size());
      const int64_t end = std::min<int64_t>(begin + batch, mine.size());
      consumed[rank].insert(consumed[rank].end(), mine.begin() + begin, mine.begin() + end);
      sampler.advance((end - begin) * old_world_size);
    }
    const SamplerState state = sampler.state();
    if (rank > 0) {  // every rank checkpoints the same position
      EXPECT_EQ(state.epoch, saved.epoch);
      EXPECT_EQ(state.samples_consumed, saved.samples_consumed);
    }
    saved = state;
  }
  EXPECT_EQ(saved.epoch, 2);
  ASSERT_LE(saved.samples_consumed, n);

  std::vector<Indices> remaining(new_world_size);
  int64_t new_total = 0;
  for (int rank = 0; rank < new_world_size; ++rank) {
    DistributedSampler sampler(n, new_world_size, rank, options);
    sampler.load_state(saved);
    remaining[rank] = sampler.indices();
    EXPECT_EQ(sampler.num_samples(), static_cast<int64_t>(remaining[rank].size()));
    EXPECT_EQ(sampler.num_samples(), static_cast<int64_t>(remaining[0].size()));  // equal shares
    new_total = sampler.total_size();
  }
  const int64_t left = n - saved.samples_consumed;
  EXPECT_EQ(new_total, drop_last ? left / new_world_size * new_world_size
                                 : (left + new_world_size - 1) / new_world_size * new_world_size);

  int64_t old_taken = 0;
  for (const auto& list : consumed) old_taken += list.size();
  std::vector<Indices> both = consumed;
  both.insert(both.end(), remaining.begin(), remaining.end());
  const auto counts = count(both);
  int64_t duplicates = 0;
  for (const auto& [index, times] : counts) duplicates += times - 1;
  if (drop_last) {
    EXPECT_EQ(duplicates, 0);
  } else {
    EXPECT_EQ(static_cast<int64_t>(counts.size()), n) << "a sample was never seen";
    // The old run's padding (taken beyond the n real samples) and the new run's padding.
    EXPECT_EQ(duplicates, (old_taken - saved.samples_consumed) + (new_total - left))
        << "duplicates beyond the padding";
  }
  // The resumed ranks interleave the rest of the same epoch order.
  const Indices order = epoch_order(n, options, 2);
  for (int64_t q = 0; q < new_total; ++q) {
    EXPECT_EQ(remaining[q % new_world_size][q / new_world_size],
              order[saved.samples_consumed + q % left]);
  }
}

TEST(DistributedSamplerTest, ResumeAtAnotherWorldSizeSeesEverySampleOnce) {
  // No padding on either side: n = 120 and the remainders 120, 60 and 0 divide by 1..5, so every
  // sample is seen exactly once.
  for (int new_world_size : {1, 2, 3, 4, 5}) {
    for (int64_t steps : {0, 3, 6}) check_resume(120, 4, new_world_size, 5, steps, false);
  }
  // Sizes that divide by nothing, the old run's last step half-full and the epoch run out.
  for (int new_world_size : {1, 2, 3, 5, 7}) {
    for (int64_t steps : {1, 2, 5, 6, 7}) {
      check_resume(103, 4, new_world_size, 5, steps, false);
      check_resume(103, 4, new_world_size, 5, steps, true);
    }
  }
}

TEST(DistributedSamplerTest, ResumeExactlyOnceWithoutPadding) {
  // 4 steps of 3 at world 4 consume 48 of 120; 72 remain, divisible by 2, 3 and 4: no duplicates.
  for (int new_world_size : {2, 3, 4}) {
    DistributedSamplerOptions options;
    std::map<int64_t, int> seen;
    SamplerState saved;
    for (int rank = 0; rank < 4; ++rank) {
      DistributedSampler sampler(120, 4, rank, options);
      const Indices mine = sampler.indices();
      for (int64_t i = 0; i < 12; ++i) ++seen[mine[i]];
      for (int step = 0; step < 4; ++step) sampler.advance(12);
      saved = sampler.state();
    }
    EXPECT_EQ(saved.samples_consumed, 48);
    for (int rank = 0; rank < new_world_size; ++rank) {
      DistributedSampler sampler(120, new_world_size, rank, options);
      sampler.load_state(saved);
      for (int64_t index : sampler.indices()) ++seen[index];
    }
    ASSERT_EQ(seen.size(), 120u);
    for (const auto& [index, times] : seen) EXPECT_EQ(times, 1) << "index " << index;
  }
}

TEST(DistributedSamplerTest, ReshardDealsTheRestOverTheNewWorldSize) {
  // In-place recovery: 4 ranks take 4 steps of 3 (48 of 120), one dies, the 3 survivors reshard
  // the same sampler objects mid-epoch; with a copy that a loader would hold, which sees the new
  // split too. Every sample exactly once; the rest equals a resume at world 3.
  std::map<int64_t, int> seen;
  std::vector<DistributedSampler> samplers;
  for (int rank = 0; rank < 4; ++rank) {
    samplers.emplace_back(120, 4, rank, DistributedSamplerOptions{});
    const Indices mine = samplers.back().indices();
    for (int64_t i = 0; i < 12; ++i) ++seen[mine[i]];
    for (int step = 0; step < 4; ++step) samplers.back().advance(12);
  }
  for (int rank = 0; rank < 3; ++rank) {
    DistributedSampler loader_copy = samplers[rank];
    samplers[rank].reshard(3, rank);
    EXPECT_EQ(loader_copy.world_size(), 3);
    EXPECT_EQ(loader_copy.state().samples_consumed, 48);
    DistributedSampler resumed(120, 3, rank, {});
    resumed.load_state({0, 48});
    EXPECT_EQ(loader_copy.indices(), resumed.indices());
    for (int64_t index : loader_copy.indices()) ++seen[index];
  }
  ASSERT_EQ(seen.size(), 120u);
  for (const auto& [index, times] : seen) EXPECT_EQ(times, 1) << "index " << index;
  EXPECT_THROW(samplers[0].reshard(2, 2), UsageError);
  EXPECT_THROW(samplers[0].reshard(0, 0), UsageError);
}

TEST(DistributedSamplerTest, PaddingOfTheOldWorldSizeDoesNotLeak) {
  // n = 10 at world 4 pads to 12; after the whole epoch the state says 10 and a resume at world 3
  // has nothing left, instead of replaying the 2 padding samples.
  SamplerState saved;
  for (int rank = 0; rank < 4; ++rank) {
    DistributedSampler sampler(10, 4, rank, {});
    sampler.advance(8);
    sampler.advance(4);
    saved = sampler.state();
  }
  EXPECT_EQ(saved.samples_consumed, 10);
  DistributedSampler resumed(10, 3, 0, {});
  resumed.load_state(saved);
  EXPECT_TRUE(resumed.indices().empty());
  EXPECT_EQ(resumed.total_size(), 0);
  EXPECT_EQ(resumed.num_samples(), 0);
  resumed.advance(0);
}

TEST(DistributedSamplerTest, TheLoopByHandOfDataMdAdvancesByWhatEachStepTook) {
  // doc/data.md's loop over indices() with advance(): 10 samples, 3 ranks, 3 per rank per step.
  // The epoch pads to 12: a step of 3 per rank, then a short one of 1, and the loop advances by
  // what each took (9, then 3). It used to advance by the full global batch every step, which the
  // short step's advance(9) refuses: only 3 are left.
  const size_t batch_size = 3;
  const int world_size = 3;
  std::vector<Indices> taken(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    DistributedSampler sampler(10, world_size, rank, {});
    sampler.set_epoch(0);
    const Indices mine = sampler.indices();
    int steps = 0;
    for (size_t begin = 0; begin < mine.size(); begin += batch_size) {
      const size_t count = std::min(batch_size, mine.size() - begin);
      taken[rank].insert(taken[rank].end(), mine.begin() + begin, mine.begin() + begin + count);
      sampler.advance(static_cast<int64_t>(count) * world_size);
      ++steps;
    }
    EXPECT_EQ(steps, 2);
    EXPECT_EQ(sampler.total_size(), 0);
    EXPECT_EQ(sampler.state().samples_consumed, 10);
  }
  const auto counts = count(taken);
  EXPECT_EQ(counts.size(), 10u);  // every sample, the padding's 2 repeats besides

  DistributedSampler full_batch(10, world_size, 0, {});
  full_batch.advance(9);
  EXPECT_THROW(full_batch.advance(9), UsageError);
}

TEST(DistributedSamplerTest, InvalidArgumentsThrowUsageError) {
  std::string message = usage_error_message([] { DistributedSampler(0, 2, 0); });
  EXPECT_NE(message.find("dataset_size is 0"), std::string::npos) << message;
  EXPECT_NE(message.find(">= 1"), std::string::npos) << message;
  message = usage_error_message([] { DistributedSampler(10, 0, 0); });
  EXPECT_NE(message.find("world_size is 0"), std::string::npos) << message;
  message = usage_error_message([] { DistributedSampler(10, 4, 4); });
  EXPECT_NE(message.find("rank is 4"), std::string::npos) << message;
  EXPECT_NE(message.find("0..3"), std::string::npos) << message;
  message = usage_error_message([] { DistributedSampler(10, 4, -1); });
  EXPECT_NE(message.find("rank is -1"), std::string::npos) << message;

  DistributedSampler sampler(10, 4, 1, {});
  message = usage_error_message([&] { sampler.set_epoch(-1); });
  EXPECT_NE(message.find("epoch is -1"), std::string::npos) << message;
  message = usage_error_message([&] { sampler.advance(-4); });
  EXPECT_NE(message.find("global_samples is -4"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1/4"), std::string::npos) << message;
  message = usage_error_message([&] { sampler.advance(13); });
  EXPECT_NE(message.find("0..12"), std::string::npos) << message;
  message = usage_error_message([&] { sampler.load_state({0, 11}); });
  EXPECT_NE(message.find("samples_consumed 11"), std::string::npos) << message;
  EXPECT_NE(message.find("dataset_size (10)"), std::string::npos) << message;
  message = usage_error_message([&] { sampler.load_state({0, -1}); });
  EXPECT_NE(message.find("samples_consumed -1"), std::string::npos) << message;
  message = usage_error_message([&] { sampler.load_state({-2, 0}); });
  EXPECT_NE(message.find("epoch -2"), std::string::npos) << message;
  // A failed call leaves the sampler as it was.
  EXPECT_EQ(sampler.state().samples_consumed, 0);
  EXPECT_EQ(sampler.num_samples(), 3);
}

}  // namespace
}  // namespace dtrain
