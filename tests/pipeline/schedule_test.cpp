// Pipeline schedules (generation, the deadlock check, simulated bubbles against theory, the
// zero-bubble schedule's order table) and model splitting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "dtrain/pipeline.h"

namespace dtrain {
namespace {

using Kind = PipelineAction::Kind;

TEST(Schedule, EveryKindStagesAndMicroBatchesPassesTheCheck) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                    ScheduleKind::kZeroBubbleH1}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        for (int v = 1; v <= (kind == ScheduleKind::kInterleaved1F1B ? 3 : 1); ++v) {
          SCOPED_TRACE(std::string(to_string(kind)) + " P=" + std::to_string(p) +
                       " M=" + std::to_string(m) + " V=" + std::to_string(v));
          PipelineSchedule s = make_schedule(kind, p, m, v);
          EXPECT_NO_THROW(check_schedule(s));
          const int passes = kind == ScheduleKind::kZeroBubbleH1 ? 3 : 2;  // F, B (, W)
          for (const auto& actions : s.actions)
            EXPECT_EQ(actions.size(), static_cast<size_t>(passes * m * v));
        }
      }
    }
  }
}

TEST(Schedule, GPipeAnd1F1BBubblesMatchTheory) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        SCOPED_TRACE(std::string(to_string(kind)) + " P=" + std::to_string(p) +
                     " M=" + std::to_string(m));
        ScheduleCost cost = simulate_schedule(make_schedule(kind, p, m), 1, 2);
        EXPECT_NEAR(cost.bubble_fraction, theoretical_bubble_fraction(kind, p, m), 1e-9);
      }
    }
  }
}

TEST(Schedule, InterleavedShrinksTheBubble) {
  // With M a multiple of P, interleaving V virtual stages divides the bubble's share as theory
  // says.
  for (int p = 2; p <= 4; ++p) {
    for (int v = 2; v <= 3; ++v) {
      int m = 2 * p;
      SCOPED_TRACE("P=" + std::to_string(p) + " V=" + std::to_string(v));
      double simulated =
          simulate_schedule(make_schedule(ScheduleKind::kInterleaved1F1B, p, m, v), 1, 2)
              .bubble_fraction;
      double theory = theoretical_bubble_fraction(ScheduleKind::kInterleaved1F1B, p, m, v);
      double plain = theoretical_bubble_fraction(ScheduleKind::k1F1B, p, m);
      EXPECT_LT(simulated, plain);
      EXPECT_NEAR(simulated, theory, 0.1 * theory);
    }
  }
}

TEST(Schedule, OneF1BBoundsActivationsByStagesGPipeByMicroBatches) {
  const int p = 4, m = 8;
  auto gpipe = simulate_schedule(make_schedule(ScheduleKind::kGPipe, p, m));
  auto one_f_one_b = simulate_schedule(make_schedule(ScheduleKind::k1F1B, p, m));
  for (int s = 0; s < p; ++s) {
    EXPECT_EQ(gpipe.peak_in_flight[s], m);
    EXPECT_EQ(one_f_one_b.peak_in_flight[s], p - s);
  }
}

TEST(Schedule, OneF1BSteadyStateAlternates) {
  // Stage 0 of 2 with 4 micro-batches: warm-up F0 F1, then B0 F2 B1 F3 B2, then B3.
  auto s = make_schedule(ScheduleKind::k1F1B, 2, 4);
  std::string got;
  for (const auto& a : s.actions[0]) {
    got += a.kind == Kind::kForward ? 'F' : 'B';
    got += std::to_string(a.micro_batch) + ' ';
  }
  EXPECT_EQ(got, "F0 F1 B0 F2 B1 F3 B2 B3 ");
}

TEST(Schedule, CheckNamesTheDeadlock) {
  // Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 1; stage 1 insists on 1
  // first.
  PipelineSchedule s;
  s.kind = ScheduleKind::k1F1B;
  s.stages = 2;
  s.micro_batches = 2;
  s.actions = {{{Kind::kForward, 0, 0},
                {Kind::kBackward, 0, 0},
                {Kind::kForward, 1, 0},
                {Kind::kBackward, 1, 0}},
               {{Kind::kForward, 1, 1},
                {Kind::kBackward, 1, 1},
                {Kind::kForward, 0, 1},
                {Kind::kBackward, 0, 1}}};
  try {
    check_schedule(s);
    FAIL() << "a deadlocking schedule passed the check";
  } catch (const UsageError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("would deadlock"), std::string::npos) << what;
    EXPECT_NE(what.find("stage 1 waits at its action #0 (forward of micro-batch 1 through chunk 1) "
                        "for chunk 0's "
                        "output from stage 0"),
              std::string::npos)
        << what;
  }
}

TEST(Schedule, CheckRejectsMissingDuplicateAndForeignActions) {
  auto good = make_schedule(ScheduleKind::kGPipe, 2, 2);
  auto missing = good;
  missing.actions[1].pop_back();
  EXPECT_THROW(check_schedule(missing), UsageError);
  auto duplicate = good;
  duplicate.actions[0].push_back(duplicate.actions[0].front());
  EXPECT_THROW(check_schedule(duplicate), UsageError);
  auto foreign = good;
  foreign.actions[0][0].chunk = 1;  // chunk 1 lives on stage 1
  EXPECT_THROW(check_schedule(foreign), UsageError);
}

TEST(Schedule, BadParametersAreUsageErrors) {
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 0, 4), UsageError);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 2, 0), UsageError);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 2, 4, 2),
               UsageError);  // virtual stages need interleaved
  EXPECT_THROW(make_schedule(ScheduleKind::kZeroBubbleH1, 2, 4, 2), UsageError);
  EXPECT_THROW(parse_schedule_kind("zero-bubble"), UsageError);
  EXPECT_EQ(parse_schedule_kind("interleaved"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(parse_schedule_kind("zbh1"), ScheduleKind::kZeroBubbleH1);
  EXPECT_STREQ(to_string(ScheduleKind::kZeroBubbleH1), "zbh1");
}

// ---- The zero-bubble schedule (ZB-H1) ----

std::string letters(const std::vector<PipelineAction>& actions) {
  std::string out;
  for (const auto& a : actions) {
    out += out.empty() ? "" : " ";
    out += a.kind == Kind::kForward          ? "F"
           : a.kind == Kind::kBackwardInput  ? "B"
           : a.kind == Kind::kBackwardWeight ? "W"
                                             : "b";  // a whole backward: none in ZB-H1
    out += std::to_string(a.micro_batch);
  }
  return out;
}

TEST(ZeroBubble, OrderTableIsZbH1) {
  // P = 4, M = 8: each stage's warm-up is 1F1B's, then F B W; stage s holds s W passes back (the
  // paper's ZB-H1; the order torch.distributed.pipelining's ScheduleInterleavedZeroBubble gives
  // with one chunk per rank, checked against torch 2.15's _calculate_single_rank_operations).
  auto s = make_schedule(ScheduleKind::kZeroBubbleH1, 4, 8);
  EXPECT_EQ(letters(s.actions[0]),
            "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7");
  EXPECT_EQ(letters(s.actions[1]),
            "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7");
  EXPECT_EQ(letters(s.actions[2]),
            "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7");
  EXPECT_EQ(letters(s.actions[3]),
            "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7");
}

TEST(ZeroBubble, EveryPassOnceBBeforeItsWAndMessagesMatch) {
  for (int p = 1; p <= 5; ++p) {
    for (int m = 1; m <= 9; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      auto s = make_schedule(ScheduleKind::kZeroBubbleH1, p, m);
      // What each stage sends to and receives from each neighbour, in its own order:
      // sent[from][to] and received[at][from], as (kind, micro-batch).
      std::map<std::pair<int, int>, std::vector<std::pair<char, int>>> sent, received;
      for (int stage = 0; stage < p; ++stage) {
        std::vector<int> forward_at(m, -1), input_at(m, -1), weight_at(m, -1);
        const auto& actions = s.actions[stage];
        for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
          const auto& a = actions[i];
          ASSERT_EQ(a.chunk, stage);
          ASSERT_NE(a.kind, Kind::kBackward) << "a whole backward in a split schedule";
          auto& at = a.kind == Kind::kForward         ? forward_at
                     : a.kind == Kind::kBackwardInput ? input_at
                                                      : weight_at;
          EXPECT_EQ(at[a.micro_batch], -1) << letters({a}) << " twice on stage " << stage;
          at[a.micro_batch] = i;
          if (a.kind == Kind::kForward) {
            if (stage > 0) received[{stage, stage - 1}].push_back({'F', a.micro_batch});
            if (stage + 1 < p) sent[{stage, stage + 1}].push_back({'F', a.micro_batch});
          } else if (a.kind == Kind::kBackwardInput) {
            if (stage + 1 < p) received[{stage, stage + 1}].push_back({'B', a.micro_batch});
            if (stage > 0) sent[{stage, stage - 1}].push_back({'B', a.micro_batch});
          }
        }
        for (int mb = 0; mb < m; ++mb) {
          EXPECT_GE(forward_at[mb], 0) << "stage " << stage << " never runs F" << mb;
          EXPECT_GT(input_at[mb], forward_at[mb]) << "stage " << stage << ": B" << mb;
          EXPECT_GT(weight_at[mb], input_at[mb]) << "stage " << stage << ": W" << mb;
        }
      }
      // Every message one stage sends, its neighbour receives, in the same order.
      for (int stage = 0; stage + 1 < p; ++stage) {
        EXPECT_EQ((sent[{stage, stage + 1}]), (received[{stage + 1, stage}]));
        EXPECT_EQ((sent[{stage + 1, stage}]), (received[{stage, stage + 1}]));
        EXPECT_EQ((sent[{stage, stage + 1}].size()), static_cast<size_t>(m));
      }
      EXPECT_NO_THROW(check_schedule(s));
    }
  }
}

TEST(ZeroBubble, BubbleBelow1F1BAndAsTheoryMemoryAsItsStageZero) {
  for (int p = 2; p <= 5; ++p) {
    for (int m = 1; m <= 9; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      // Backward twice the forward, split evenly: F = B = W, as in the paper's analysis.
      auto zb = simulate_schedule(make_schedule(ScheduleKind::kZeroBubbleH1, p, m), 1, 2);
      auto one_f_one_b = simulate_schedule(make_schedule(ScheduleKind::k1F1B, p, m), 1, 2);
      EXPECT_LT(zb.bubble_fraction, one_f_one_b.bubble_fraction);
      EXPECT_NEAR(zb.bubble_fraction,
                  theoretical_bubble_fraction(ScheduleKind::kZeroBubbleH1, p, m), 1e-9);
      if (m >= p) {
        EXPECT_NEAR(zb.bubble_fraction, (p - 1.0) / (3 * m + p - 1), 1e-9);
      }
      const int most =
          *std::max_element(one_f_one_b.peak_in_flight.begin(), one_f_one_b.peak_in_flight.end());
      for (int stage = 0; stage < p; ++stage) EXPECT_LE(zb.peak_in_flight[stage], most);
    }
  }
}

TEST(ZeroBubble, CheckRejectsMissingDoubledAndEarlyWeightPasses) {
  auto good = make_schedule(ScheduleKind::kZeroBubbleH1, 2, 3);
  auto expect_error = [](const PipelineSchedule& s, const std::string& expected) {
    try {
      check_schedule(s);
      ADD_FAILURE() << "passed the check; expected: " << expected;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  auto skipped = good;  // stage 1 never runs W of its last micro-batch
  skipped.actions[1].pop_back();
  expect_error(skipped,
               "stage 1 never runs weight-gradient backward (W) of micro-batch 2 through chunk 1; "
               "its parameters would miss that micro-batch's gradient");
  auto doubled = good;
  doubled.actions[0].push_back(doubled.actions[0].back());
  expect_error(doubled,
               "stage 0 lists weight-gradient backward (W) of micro-batch 2 through "
               "chunk 0 twice");
  auto early = good;  // W0 first on stage 1, before its B0
  auto& actions = early.actions[1];
  auto w0 = std::find_if(actions.begin(), actions.end(), [](const PipelineAction& a) {
    return a.kind == Kind::kBackwardWeight && a.micro_batch == 0;
  });
  std::rotate(actions.begin(), w0, w0 + 1);
  expect_error(early,
               "stage 1 waits at its action #0 (weight-gradient backward (W) of micro-batch "
               "0 through chunk 1) for its own input-gradient backward (B)");
  auto mixed = good;  // a whole backward beside the split one
  mixed.actions[0].push_back({Kind::kBackward, 0, 0});
  expect_error(mixed, "lists both the backward of micro-batch 0 through chunk 0 and a split one");
}

torch::nn::Sequential layered_model() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(4, 100), torch::nn::ReLU(),
                               torch::nn::Linear(100, 100), torch::nn::ReLU(),
                               torch::nn::Linear(100, 3));
}

TEST(Split, ChunksShareTheModelsLayersUnderTheirNames) {
  auto model = layered_model();
  auto chunks = split_sequential(model, {2, 4});
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]->size(), 2u);
  EXPECT_EQ(chunks[2]->size(), 1u);
  EXPECT_TRUE(
      chunks[1]->named_parameters()["2.weight"].is_same(model->named_parameters()["2.weight"]));
  auto x = torch::randn({5, 4});
  auto y = chunks[2]->forward(chunks[1]->forward(chunks[0]->forward(x)));
  EXPECT_TRUE(torch::equal(y, model->forward(x)));
}

TEST(Split, BadBoundariesAndPartsAreUsageErrors) {
  auto model = layered_model();
  EXPECT_THROW(split_sequential(model, {0}), UsageError);
  EXPECT_THROW(split_sequential(model, {3, 2}), UsageError);
  EXPECT_THROW(split_sequential(model, {5}), UsageError);
  EXPECT_THROW(balance_by_parameters(model, 6), UsageError);
  EXPECT_THROW(balance_by_parameters(model, 0), UsageError);
}

TEST(Split, BalanceByParametersEvensOutTheHeavyLayers) {
  // Parameters per layer: 500, 0, 10100, 0, 303: the 10100-parameter layer must sit alone-ish.
  auto model = layered_model();
  EXPECT_EQ(balance_by_parameters(model, 2), (std::vector<int64_t>{2}));
  auto three = balance_by_parameters(model, 3);
  ASSERT_EQ(three.size(), 2u);
  auto chunks = split_sequential(model, three);
  for (auto& chunk : chunks) EXPECT_GE(chunk->size(), 1u);
}

// The heaviest run as light as can be, the later of equal cuts, and counts that cannot be cut are
// one error.
TEST(Split, BalanceByWeightsMinimizesTheHeaviestRun) {
  EXPECT_EQ(balance_by_weights({1, 1, 1, 5}, 2), (std::vector<int64_t>{3}));
  EXPECT_EQ(balance_by_weights({4, 1, 1, 1, 1, 4}, 3), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(balance_by_weights({1, 1}, 1), (std::vector<int64_t>{}));
  EXPECT_EQ(balance_by_weights({2, 2, 2}, 3), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(balance_by_weights({1, 0, 1}, 2), (std::vector<int64_t>{2}));  // the tie: later
  EXPECT_THROW(balance_by_weights({1, 2}, 3), UsageError);
  EXPECT_THROW(balance_by_weights({1, 2}, 0), UsageError);
}

TEST(Split, BalanceByTimeGivesValidBoundariesAndKeepsGradients) {
  auto model = layered_model();
  auto first = model->parameters()[0];
  first.mutable_grad() = torch::full_like(first, 7.0);
  auto boundaries = balance_by_time(model, 3, torch::randn({16, 4}), 2);
  ASSERT_EQ(boundaries.size(), 2u);
  EXPECT_LT(boundaries[0], boundaries[1]);
  EXPECT_TRUE(torch::equal(first.grad(), torch::full_like(first, 7.0)));
  EXPECT_FALSE(model->parameters()[2].grad().defined());
}

}  // namespace
}  // namespace dtrain
