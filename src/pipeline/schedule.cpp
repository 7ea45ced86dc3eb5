// Pipeline schedules: generation by list scheduling, simulation, and the deadlock check. See
// Note [Pipeline schedules] in dtrain/pipeline.h.
#include <algorithm>
#include <limits>
#include <sstream>

#include "dtrain/pipeline.h"

namespace dtrain {
namespace {

using Kind = PipelineAction::Kind;

const char* name(Kind kind) {
  switch (kind) {
    case Kind::kForward:
      return "forward";
    case Kind::kBackward:
      return "backward";
    case Kind::kBackwardInput:
      return "input-gradient backward (B)";
    case Kind::kBackwardWeight:
      return "weight-gradient backward (W)";
  }
  return "?";
}

std::string describe(const PipelineAction& a) {
  std::ostringstream out;
  out << name(a.kind) << " of micro-batch " << a.micro_batch << " through chunk " << a.chunk;
  return out.str();
}

// Micro-batches whose activations a stage holds more (+1) or fewer (-1) after the action: a split
// backward keeps them until its W.
int held_change(Kind kind) {
  return kind == Kind::kForward ? 1 : kind == Kind::kBackwardInput ? 0 : -1;
}

// Completion times of every action, indexed [micro_batch][chunk]; infinity until it has run.
// backward_done is when the input gradient exists: the end of a whole backward or of a B.
struct Timeline {
  static constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> forward_done, backward_done;
  Timeline(int micro_batches, int chunks)
      : forward_done(micro_batches, std::vector<double>(chunks, kNever)),
        backward_done(micro_batches, std::vector<double>(chunks, kNever)) {}

  // When the inputs of `a` exist: the previous chunk's activation for a forward; the action's own
  // forward and the next chunk's input gradient for a backward or a B; the action's own B for a W.
  double inputs_ready(const PipelineAction& a, int chunks) const {
    const int m = a.micro_batch, c = a.chunk;
    if (a.kind == Kind::kForward) return c == 0 ? 0.0 : forward_done[m][c - 1];
    if (a.kind == Kind::kBackwardWeight) return backward_done[m][c];
    double ready = forward_done[m][c];
    if (c + 1 < chunks) ready = std::max(ready, backward_done[m][c + 1]);
    return ready;
  }
  void finish(const PipelineAction& a, double at) {
    if (a.kind == Kind::kBackwardWeight) return;  // nothing waits for a W
    (a.kind == Kind::kForward ? forward_done : backward_done)[a.micro_batch][a.chunk] = at;
  }
};

// The fixed order in which stage s takes its forwards (and, mirrored over virtual stages, its
// backwards). Interleaved: micro-batches in groups of P; within a group every virtual stage in turn
// (Megatron's order, which lets chunk v+1 of a micro-batch start soon after chunk v of it). The
// last group may be partial.
std::vector<PipelineAction> order(Kind kind, int stage, int stages, int micro_batches,
                                  int virtual_stages) {
  std::vector<PipelineAction> result;
  for (int group_start = 0; group_start < micro_batches; group_start += stages) {
    int group_end = std::min(micro_batches, group_start + stages);
    for (int step = 0; step < virtual_stages; ++step) {
      int v = kind == Kind::kForward ? step : virtual_stages - 1 - step;
      for (int m = group_start; m < group_end; ++m) result.push_back({kind, m, v * stages + stage});
    }
  }
  return result;
}

}  // namespace

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGPipe;
  if (name == "1f1b") return ScheduleKind::k1F1B;
  if (name == "interleaved") return ScheduleKind::kInterleaved1F1B;
  if (name == "zbh1") return ScheduleKind::kZeroBubbleH1;
  throw UsageError("schedule '" + name + "': expected gpipe, 1f1b, interleaved or zbh1");
}

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved";
    case ScheduleKind::kZeroBubbleH1:
      return "zbh1";
  }
  return "?";
}

PipelineSchedule make_schedule(ScheduleKind kind, int stages, int micro_batches,
                               int virtual_stages) {
  if (stages < 1 || micro_batches < 1 || virtual_stages < 1) {
    throw UsageError("pipeline schedule: stages=" + std::to_string(stages) +
                     ", micro_batches=" + std::to_string(micro_batches) + ", virtual_stages=" +
                     std::to_string(virtual_stages) + ": each must be at least 1");
  }
  if (virtual_stages > 1 && kind != ScheduleKind::kInterleaved1F1B) {
    throw UsageError(std::string("pipeline schedule: virtual_stages=") +
                     std::to_string(virtual_stages) + " needs the interleaved schedule, not " +
                     to_string(kind) + "; use --schedule interleaved or one virtual stage");
  }
  PipelineSchedule schedule;
  schedule.kind = kind;
  schedule.stages = stages;
  schedule.micro_batches = micro_batches;
  schedule.virtual_stages = virtual_stages;
  schedule.actions.resize(stages);
  const int chunks = schedule.chunks();
  const int per_stage = micro_batches * virtual_stages;

  // A split backward (ZB-H1) runs each backward as B then W; the stage's W passes follow its B
  // passes in the same order.
  const bool split = kind == ScheduleKind::kZeroBubbleH1;
  const Kind backward_kind = split ? Kind::kBackwardInput : Kind::kBackward;
  struct StageState {
    std::vector<PipelineAction> forwards, backwards;
    size_t next_forward = 0, next_backward = 0, next_weight = 0;
    int busy_until = 0;
    // Forwards done minus backwards (B) done: micro-batches waiting for their input gradient.
    int in_flight = 0;
    int limit = 0;
    // Forwards done minus the passes that free their activations (a whole backward, or a W): the
    // micro-batches it holds. Bounded for ZB-H1 only (else in_flight bounds it).
    int held = 0;
    int held_limit = 0;
  };
  std::vector<StageState> state(stages);
  for (int s = 0; s < stages; ++s) {
    state[s].forwards = order(Kind::kForward, s, stages, micro_batches, virtual_stages);
    state[s].backwards = order(backward_kind, s, stages, micro_batches, virtual_stages);
    switch (kind) {
      case ScheduleKind::kGPipe:
        state[s].limit = per_stage;
        break;
      case ScheduleKind::k1F1B:
      case ScheduleKind::kZeroBubbleH1:
        state[s].limit = stages - s;
        break;
      case ScheduleKind::kInterleaved1F1B:
        // Megatron's warm-up: enough forwards that the first backward's gradient can arrive in
        // time.
        state[s].limit = (stages - s - 1) * 2 + (virtual_stages - 1) * stages + 1;
        break;
    }
    state[s].limit = std::min(state[s].limit, per_stage);
    state[s].held_limit = split ? std::min(stages, per_stage) : per_stage;
  }

  // List scheduling in integer time: a forward takes 1, a backward 2 (its usual cost), B and W 1
  // each. Only the resulting orders are kept; any real timing of them is deadlock-free (Note
  // [Pipeline schedules]).
  Timeline timeline(micro_batches, chunks);
  int remaining = (split ? 3 : 2) * per_stage * stages;
  for (int now = 0; remaining > 0; ++now) {
    bool started = false, busy = false;
    for (int s = 0; s < stages; ++s) {
      StageState& st = state[s];
      if (st.busy_until > now) {
        busy = true;
        continue;
      }
      bool forwards_left = st.next_forward < st.forwards.size();
      bool backwards_left = st.next_backward < st.backwards.size();
      bool forward_ready =
          forwards_left && timeline.inputs_ready(st.forwards[st.next_forward], chunks) <= now;
      bool backward_ready =
          backwards_left && timeline.inputs_ready(st.backwards[st.next_backward], chunks) <= now;
      if (kind == ScheduleKind::kGPipe) backward_ready = backward_ready && !forwards_left;
      const bool forward_allowed = st.in_flight < st.limit && st.held < st.held_limit;
      PipelineAction weight;
      const PipelineAction* chosen = nullptr;
      if (backward_ready && (st.in_flight >= st.limit || !forwards_left)) {
        chosen = &st.backwards[st.next_backward];
      } else if (forward_ready && forward_allowed) {
        chosen = &st.forwards[st.next_forward];
      } else if (backward_ready) {
        chosen = &st.backwards[st.next_backward];
      } else if (split && st.next_weight < st.next_backward) {
        // Nothing else can run: the oldest W fills the gap.
        weight = st.backwards[st.next_weight];
        weight.kind = Kind::kBackwardWeight;
        chosen = &weight;
      }
      if (!chosen) continue;
      int duration = chosen->kind == Kind::kBackward ? 2 : 1;
      timeline.finish(*chosen, now + duration);
      schedule.actions[s].push_back(*chosen);
      if (chosen->kind == Kind::kForward) {
        ++st.next_forward;
        ++st.in_flight;
        ++st.held;
      } else if (chosen->kind == Kind::kBackwardWeight) {
        ++st.next_weight;
        --st.held;
      } else {
        ++st.next_backward;
        --st.in_flight;
        if (!split) --st.held;
      }
      st.busy_until = now + duration;
      started = busy = true;
      --remaining;
    }
    if (!started && !busy && remaining > 0) {
      // Every stage waits on its bound (possible for interleaved orders with a partial last group):
      // let the first stage that has a forward ready exceed it, so generation always completes.
      bool unblocked = false;
      for (auto& st : state) {
        if (st.next_forward < st.forwards.size() &&
            timeline.inputs_ready(st.forwards[st.next_forward], chunks) <= now) {
          ++st.limit;
          unblocked = true;
          break;
        }
      }
      if (!unblocked)
        throw InternalError("pipeline schedule generation made no progress (a dtrain bug)");
    }
  }
  return schedule;
}

namespace {

// Runs the stages' orders with blocking receives. Returns the cost, or fills `stuck` (one line per
// waiting stage) when no stage can go on.
ScheduleCost run_orders(const PipelineSchedule& schedule, double forward_time, double backward_time,
                        std::string* stuck) {
  const int stages = schedule.stages, chunks = schedule.chunks();
  Timeline timeline(schedule.micro_batches, chunks);
  std::vector<size_t> next(stages, 0);
  std::vector<double> free_at(stages, 0.0);
  std::vector<int> in_flight(stages, 0);
  ScheduleCost cost;
  cost.peak_in_flight.assign(stages, 0);
  double busy = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      // Run this stage as far as its inputs allow.
      while (next[s] < schedule.actions[s].size()) {
        const PipelineAction& a = schedule.actions[s][next[s]];
        double ready = timeline.inputs_ready(a, chunks);
        if (ready == Timeline::kNever) break;
        double duration = a.kind == Kind::kForward    ? forward_time
                          : a.kind == Kind::kBackward ? backward_time
                                                      : backward_time / 2;
        double start = std::max(ready, free_at[s]);
        free_at[s] = start + duration;
        busy += duration;
        timeline.finish(a, free_at[s]);
        in_flight[s] += held_change(a.kind);
        cost.peak_in_flight[s] = std::max(cost.peak_in_flight[s], in_flight[s]);
        ++next[s];
        progress = true;
      }
    }
  }
  std::ostringstream waits;
  for (int s = 0; s < stages; ++s) {
    if (next[s] == schedule.actions[s].size()) continue;
    const PipelineAction& a = schedule.actions[s][next[s]];
    waits << (waits.tellp() > 0 ? "; " : "") << "stage " << s << " waits at its action #" << next[s]
          << " (" << describe(a) << ") for ";
    if (a.kind == Kind::kForward) {
      waits << "chunk " << a.chunk - 1 << "'s output from stage " << schedule.stage_of(a.chunk - 1);
    } else if (a.kind == Kind::kBackwardWeight) {
      waits << "its own input-gradient backward (B) of that micro-batch, which it never ran before";
    } else if (timeline.forward_done[a.micro_batch][a.chunk] == Timeline::kNever) {
      waits << "its own forward of that micro-batch, which it never ran before";
    } else {
      waits << "chunk " << a.chunk + 1 << "'s input gradient from stage "
            << schedule.stage_of(a.chunk + 1);
    }
  }
  if (waits.tellp() > 0) {
    if (stuck) *stuck = waits.str();
    return cost;
  }
  for (double t : free_at) cost.makespan = std::max(cost.makespan, t);
  cost.bubble_fraction = cost.makespan > 0 ? 1.0 - busy / (stages * cost.makespan) : 0.0;
  return cost;
}

}  // namespace

void check_schedule(const PipelineSchedule& schedule) {
  const int stages = schedule.stages, chunks = schedule.chunks(),
            micro_batches = schedule.micro_batches;
  if (stages < 1 || micro_batches < 1 || schedule.virtual_stages < 1 ||
      static_cast<int>(schedule.actions.size()) != stages) {
    throw UsageError("pipeline schedule: expected one action list per stage (" +
                     std::to_string(stages) + "), got " + std::to_string(schedule.actions.size()));
  }
  constexpr int kKinds = 4;  // PipelineAction::Kind's values
  for (int s = 0; s < stages; ++s) {
    // seen[kind][micro_batch][chunk]
    std::vector<std::vector<std::vector<int>>> seen(
        kKinds, std::vector<std::vector<int>>(micro_batches, std::vector<int>(chunks, 0)));
    for (const auto& a : schedule.actions[s]) {
      if (a.micro_batch < 0 || a.micro_batch >= micro_batches || a.chunk < 0 || a.chunk >= chunks ||
          schedule.stage_of(a.chunk) != s || static_cast<int>(a.kind) >= kKinds) {
        throw UsageError("pipeline schedule: stage " + std::to_string(s) + " lists " + describe(a) +
                         ", which is not one of its actions (micro-batches 0.." +
                         std::to_string(micro_batches - 1) + ", chunks c with c % " +
                         std::to_string(stages) + " == " + std::to_string(s) + ")");
      }
      if (++seen[static_cast<int>(a.kind)][a.micro_batch][a.chunk] > 1) {
        throw UsageError("pipeline schedule: stage " + std::to_string(s) + " lists " + describe(a) +
                         " twice");
      }
    }
    auto count = [&](Kind kind, int m, int c) { return seen[static_cast<int>(kind)][m][c]; };
    for (int m = 0; m < micro_batches; ++m) {
      for (int c = s; c < chunks; c += stages) {
        // A forward, and a backward either whole or as its B and its W.
        std::vector<Kind> missing;
        if (count(Kind::kForward, m, c) == 0) missing.push_back(Kind::kForward);
        const bool whole = count(Kind::kBackward, m, c) == 1;
        const int halves = count(Kind::kBackwardInput, m, c) + count(Kind::kBackwardWeight, m, c);
        if (whole && halves > 0) {
          throw UsageError("pipeline schedule: stage " + std::to_string(s) + " lists both the " +
                           describe({Kind::kBackward, m, c}) + " and a split one (B or W); list " +
                           "either the backward or its B and its W");
        }
        if (!whole) {
          if (halves == 0) missing.push_back(Kind::kBackward);
          if (halves > 0 && count(Kind::kBackwardInput, m, c) == 0)
            missing.push_back(Kind::kBackwardInput);
          if (halves > 0 && count(Kind::kBackwardWeight, m, c) == 0)
            missing.push_back(Kind::kBackwardWeight);
        }
        if (!missing.empty()) {
          throw UsageError("pipeline schedule: stage " + std::to_string(s) + " never runs " +
                           describe({missing.front(), m, c}) +
                           (missing.front() == Kind::kBackwardWeight
                                ? "; its parameters would miss that micro-batch's gradient"
                                : "; its neighbours would wait for it forever"));
        }
      }
    }
  }
  std::string stuck;
  run_orders(schedule, 1, 2, &stuck);
  if (!stuck.empty()) {
    throw UsageError("pipeline schedule (" + std::string(to_string(schedule.kind)) +
                     ") would deadlock: " + stuck + ". Every send must meet a receive in order.");
  }
}

ScheduleCost simulate_schedule(const PipelineSchedule& schedule, double forward_time,
                               double backward_time) {
  std::string stuck;
  ScheduleCost cost = run_orders(schedule, forward_time, backward_time, &stuck);
  if (!stuck.empty()) throw UsageError("pipeline schedule would deadlock: " + stuck);
  return cost;
}

double theoretical_bubble_fraction(ScheduleKind kind, int stages, int micro_batches,
                                   int virtual_stages) {
  double p = stages, m = micro_batches,
         v = kind == ScheduleKind::kInterleaved1F1B ? virtual_stages : 1;
  if (kind == ScheduleKind::kZeroBubbleH1) {
    // F = B = W = 1, each stage busy 3M. Stage 0 sits idle only until the first B reaches it, 2P
    // - 1 units into the step (P forwards down, P - 1 Bs up), having run min(M, P) forwards by
    // then; from then on a B or a W is always ready for it.
    double step = 3 * m + p - 1 + std::max(0.0, p - m);
    return 1 - 3 * m / step;
  }
  return (p - 1) / (v * m + p - 1);
}

}  // namespace dtrain
