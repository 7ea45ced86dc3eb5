// Pipeline schedules (generation, the deadlock check, simulated bubbles against theory) and model
// splitting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/pipeline.h"

namespace dtrain {
namespace {

using Kind = PipelineAction::Kind;

TEST(Schedule, EveryKindStagesAndMicroBatchesPassesTheCheck) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        for (int v = 1; v <= (kind == ScheduleKind::kInterleaved1F1B ? 3 : 1); ++v) {
          SCOPED_TRACE(std::string(to_string(kind)) + " P=" + std::to_string(p) +
                       " M=" + std::to_string(m) + " V=" + std::to_string(v));
          PipelineSchedule s = make_schedule(kind, p, m, v);
          EXPECT_NO_THROW(check_schedule(s));
          for (const auto& actions : s.actions)
            EXPECT_EQ(actions.size(), static_cast<size_t>(2 * m * v));
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
  for (const auto& a : s.actions[0])
    got += (a.kind == Kind::kForward ? "F" : "B") + std::to_string(a.micro_batch) + " ";
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
  EXPECT_THROW(parse_schedule_kind("zero-bubble"), UsageError);
  EXPECT_EQ(parse_schedule_kind("interleaved"), ScheduleKind::kInterleaved1F1B);
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
