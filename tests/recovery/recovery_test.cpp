// In-place recovery (dtrain/recovery.h) with real processes: three workers of
// tests/workers/recovery_worker.cpp train DDP; one kills itself (SIGKILL) after a step; the
// survivors go on without a restart; in the later tests a newcomer then takes its place (started by
// the test, or by `dtrain run --recovery in-place`, static or the agents of an elastic rendezvous)
// and receives the state from a live peer. Each test replays the committed global batches the
// workers recorded in one process, from the same initial model, and requires the same parameters
// (relative error < 1e-4), and requires every sample of every epoch to be used exactly once (plus
// the sampler's padding at an epoch's end), every process's own count of committed steps, which
// travels with the model (RecoveryOptions::state), to equal the job's, and no worker to outlive the
// job; a newcomer's random draws must continue the others' stream.
#include "dtrain/recovery.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "dtrain/errors.h"
#include "support/equivalence.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "workers/recovery_model.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using testing::bin;
using testing::free_port;
using testing::json_int;
using testing::run_command;

using recovery_model::kEpochs;
using recovery_model::kSamples;

struct Step {
  int world = 0;
  std::vector<int64_t> indices;  // every rank's, in the order of the files read
};

// step number -> the union of what the processes recorded for it.
std::map<int64_t, Step> read_steps(const std::string& dir) {
  std::map<int64_t, Step> steps;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("steps-", 0) != 0) continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      std::istringstream fields(line);
      int64_t step;
      int world;
      fields >> step >> world;
      Step& s = steps[step];
      s.world = world;
      for (int64_t i; fields >> i;) s.indices.push_back(i);
    }
  }
  return steps;
}

// One process, the same global batches: the mean loss over a step's samples is the mean of the
// ranks' means when every rank holds as many samples, which the sampler guarantees.
std::vector<torch::Tensor> replay(const std::map<int64_t, Step>& steps) {
  const auto [x, y] = recovery_model::make_data();
  auto net = recovery_model::make_net();
  auto optimizer = recovery_model::make_optimizer(net);
  for (const auto& [number, step] : steps) {
    auto rows = torch::tensor(step.indices);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x.index_select(0, rows)),
                                         y.index_select(0, rows))
        .backward();
    optimizer.step();
  }
  return net->parameters();
}

// The parameters the job's rank 0 saved at the end (OUT/final.pt) equal one process's after the
// same steps.
void expect_final_equals_replay(const std::string& dir, const std::map<int64_t, Step>& steps) {
  std::vector<torch::Tensor> final_params;
  torch::load(final_params, dir + "/final.pt");
  EXPECT_LT(testing::relative_error(final_params, replay(steps)), 1e-4);
}

// How often `needle` occurs in `text` (a launcher line per failure, say).
size_t occurrences(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = 0; (at = text.find(needle, at)) != std::string::npos; at += needle.size()) {
    ++count;
  }
  return count;
}

// Every epoch uses each sample once, plus fewer than `world` repeats (padding) at its end.
void expect_exactly_once(const std::map<int64_t, Step>& steps) {
  std::vector<int64_t> count(kSamples, 0);
  int64_t seen = 0, epoch = 0, repeats = 0;
  for (const auto& [number, step] : steps) {
    for (int64_t i : step.indices) {
      if (count[i]++ > 0) ++repeats;
      ++seen;
    }
    if (seen - repeats == kSamples) {  // the epoch is complete
      EXPECT_LT(repeats, step.world) << "epoch " << epoch << ": " << repeats << " samples twice";
      count.assign(kSamples, 0);
      seen = repeats = 0;
      ++epoch;
    }
  }
  EXPECT_EQ(epoch, kEpochs) << "samples were lost: " << seen - repeats
                            << " of the last epoch's recorded";
}

// The committed steps are numbered 1, 2, ... without a gap.
void expect_no_step_missing(const std::map<int64_t, Step>& steps) {
  int64_t last = 0;
  for (const auto& [number, step] : steps) EXPECT_EQ(number, ++last) << "a step is missing";
}

// Every process that finished counted, in its RecoveryOptions::state tensor, as many committed
// steps as the job did: a newcomer's count arrived with the model.
void expect_counts_travelled(const std::string& dir, int processes) {
  int seen = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("counted-", 0) != 0) continue;
    std::ifstream in(entry.path());
    int64_t counted = -1, job_steps = -2;
    in >> counted >> job_steps;
    EXPECT_EQ(counted, job_steps) << entry.path();
    ++seen;
  }
  EXPECT_EQ(seen, processes);
}

// No worker outlives its job: every process that recorded steps (OUT/steps-<pid>.txt) is gone once
// the job's command returned (given a moment for an orphan's reaping).
void expect_no_worker_left(const std::string& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("steps-", 0) != 0) continue;
    const pid_t pid = std::stoi(name.substr(6));
    // A zombie (exited, not yet reaped: an orphan waits for PID 1) is gone too.
    auto running = [pid] {
      std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
      std::string line;
      if (!std::getline(stat, line)) return false;
      const size_t name_end = line.rfind(')');
      return name_end != std::string::npos && name_end + 2 < line.size() &&
             line[name_end + 2] != 'Z';
    };
    bool alive = true;
    for (int i = 0; i < 50 && alive; ++i) {
      alive = running();
      if (alive) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_FALSE(alive) << "worker " << pid << " outlived its job";
  }
}

// What every in-place job must come out with: every sample once, no step missing, the parameters of
// one process replaying the steps, the step count in every one of the `finished` processes, and no
// worker left over.
void expect_sound_job(const std::string& dir, const std::map<int64_t, Step>& steps, int finished) {
  expect_exactly_once(steps);
  expect_no_step_missing(steps);
  expect_final_equals_replay(dir, steps);
  expect_counts_travelled(dir, finished);
  expect_no_worker_left(dir);
}

// After every committed step every process drew from its default generator (OUT/random-<pid>.txt):
// the draws of a step are the same in every process, a newcomer's too, whose generator came with
// the model.
void expect_one_random_stream(const std::string& dir) {
  std::map<int64_t, std::set<std::string>> draws;  // step -> the distinct draws
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("random-", 0) != 0) continue;
    ++files;
    std::ifstream in(entry.path());
    int64_t step;
    for (std::string draw; in >> step >> draw;) draws[step].insert(draw);
  }
  EXPECT_GT(files, 1);
  for (const auto& [step, distinct] : draws) {
    EXPECT_EQ(distinct.size(), 1u) << "step " << step << ": the processes drew different numbers";
  }
}

enum class Launch {
  kSurvivorsOnly,   // three workers started by the test; rank 2 dies and is not replaced
  kNewcomer,        // ...and the test starts a replacement with DTRAIN_RECOVERY_JOIN=1
  kUnderDtrainRun,  // `dtrain run --recovery in-place`, which restarts rank 2 alone as a newcomer
  kRankZeroUnderDtrainRun,  // the same with rank 0 killed: the launcher hosts the store
  // Two agents of an elastic c10d rendezvous, --recovery in-place: 2 + 1 workers, rank 2 (on node
  // 1, the agent that does not host the rendezvous store, whichever that is) is restarted alone by
  // its node's launcher.
  kUnderElasticDtrainRun,
  // Note [Rounds in place]: two agents of 2 workers each, --nnodes 1:2; rank 3 kills its agent and
  // so the whole of node 1 (ranks 2 and 3). The survivors go on in the same round; a third agent
  // started afterwards is admitted into it, into the lost node's ranks, and its workers join as
  // newcomers: the job ends at full size without any worker restarted.
  kElasticNodeLostAndReplaced,
  // Note [Leaving in place]: the same two agents; rank 3 sends SIGTERM to its agent, which passes
  // it on to ranks 2 and 3 and leaves the rendezvous: they leave at a step boundary, and ranks 0
  // and 1 go on in the same round without a failure, a restart or a checkpoint.
  kElasticNodeLeavesOnSigterm,
};

std::string launch_script(const std::string& dir, Launch launch) {
  const std::string worker = bin("recovery_worker") + " " + dir;
  const std::string victim = launch == Launch::kRankZeroUnderDtrainRun       ? "0"
                             : launch == Launch::kElasticNodeLostAndReplaced ? "3"
                                                                             : "2";
  const std::string flags =
      " --kill-rank " + victim + " --kill-after 5" +
      (launch == Launch::kSurvivorsOnly ? "" : " --slow-until-admitted") +
      (launch == Launch::kElasticNodeLostAndReplaced ? " --kill-launcher-too --newcomers 2" : "");
  if (launch == Launch::kUnderDtrainRun || launch == Launch::kRankZeroUnderDtrainRun) {
    return bin("dtrain") + " run --nproc-per-node 3 --recovery in-place --max-restarts 1 -- " +
           worker + flags;
  }
  if (launch == Launch::kUnderElasticDtrainRun) {
    const std::string agent = bin("dtrain") +
                              " run --nnodes 2:2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" +
                              std::to_string(free_port()) +
                              " --rdzv-conf last_call_timeout=1 --recovery in-place "
                              "--max-restarts 1 --nproc-per-node ";
    return "bash -c '" + agent + "2 -- " + worker + flags + " > " + dir + "/agent0 2>&1 & a=$!; " +
           agent + "1 -- " + worker + flags + " > " + dir + "/agent1 2>&1; b=$?; wait $a; " +
           "echo agents=$?,$b; cat " + dir + "/agent0 " + dir + "/agent1'";
  }
  if (launch == Launch::kElasticNodeLeavesOnSigterm) {
    // Taken back at step 5, a quarter of a second in, and node 0's agent looks only every 3 s
    // (--monitor-interval): the node leaves before that agent has marked the round in place, which
    // its own agent finds out from the workers' store (Note [Rounds in place]). Before it asked,
    // this made a new round every time (and, at the default 0.5 s, once in a CI run).
    const std::string agent =
        bin("dtrain") + " run --nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" +
        std::to_string(free_port()) +
        " --rdzv-conf last_call_timeout=30 --monitor-interval 3 --recovery in-place "
        "--nproc-per-node 2 -- " +
        worker + " --term-launcher-rank 3 --term-after 5 --step-ms 50";
    // The first agent to end is node 1's, the one taken back.
    return "bash -c '" + agent + " > " + dir + "/agent0 2>&1 & a=$!; " + agent + " > " + dir +
           "/agent1 2>&1 & b=$!; wait -n -p first $a $b; echo node_left=$?; if [ $first = $a ]; " +
           "then wait $b; else wait $a; fi; echo survivor=$?; cat " + dir + "/agent0 " + dir +
           "/agent1'";
  }
  if (launch == Launch::kElasticNodeLostAndReplaced) {
    // MAX 2, so the third agent waits until node 1 is found lost (a heartbeat timeout of 1.5 s)
    // and then takes its place; the first round closes as soon as both first agents are there.
    const std::string agent =
        bin("dtrain") + " run --nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" +
        std::to_string(free_port()) +
        " --rdzv-conf last_call_timeout=30,keep_alive_interval=0.5 --recovery in-place "
        "--nproc-per-node 2 -- " +
        worker + flags;
    // Node 1 is whichever agent did not host the rendezvous store (it takes node rank 0): the
    // first agent to end is the one killed.
    return "bash -c '" + agent + " > " + dir + "/agent0 2>&1 & a=$!; " + agent + " > " + dir +
           "/agent1 2>&1 & b=$!; wait -n -p lost $a $b; echo node_lost=$?; " + agent + " > " + dir +
           "/agent2 2>&1; c=$?; if [ $lost = $a ]; then wait $b; else wait $a; fi; " +
           "echo agents=$?,$c; cat " + dir + "/agent0 " + dir + "/agent1 " + dir + "/agent2'";
  }
  std::string env = "WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                    std::to_string(free_port()) + " DTRAIN_RECOVERY=in-place ";
  std::string script;
  for (int r = 0; r < 3; ++r) {
    script += env + "RANK=" + std::to_string(r) + " LOCAL_RANK=" + std::to_string(r) + " " +
              worker + flags + " > " + dir + "/out" + std::to_string(r) + " 2>&1 & p" +
              std::to_string(r) + "=$!; ";
  }
  script += "wait $p2; echo victim=$?; ";
  if (launch == Launch::kNewcomer) {
    script += env + "RANK=2 LOCAL_RANK=2 DTRAIN_RECOVERY_JOIN=1 " + worker + flags + " > " + dir +
              "/out3 2>&1 & p3=$!; wait $p3; echo newcomer=$?; ";
  }
  script += "wait $p0; echo rank0=$?; wait $p1; echo rank1=$?; cat " + dir + "/out0";
  return "bash -c '" + script + "'";
}

class InPlaceRecovery : public ::testing::TestWithParam<Launch> {};

TEST_P(InPlaceRecovery, SurvivorsGoOnAndMatchOneProcess) {
  const Launch launch = GetParam();
  const bool newcomer = launch != Launch::kSurvivorsOnly;
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_command(launch_script(dir, launch), 120);
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  if (launch == Launch::kUnderDtrainRun || launch == Launch::kRankZeroUnderDtrainRun) {
    EXPECT_NE(result.output.find("restarting it alone as a newcomer"), std::string::npos);
  } else if (launch == Launch::kElasticNodeLostAndReplaced) {
    EXPECT_NE(result.output.find("node_lost=137"), std::string::npos);  // its agent was killed
    EXPECT_NE(result.output.find("agents=0,0"), std::string::npos);
    EXPECT_NE(result.output.find("goes on in place with 1 node(s)"), std::string::npos);
    EXPECT_NE(result.output.find("joins the running round in place as node rank 1 (ranks 2..3)"),
              std::string::npos);
    EXPECT_EQ(result.output.find("new round"), std::string::npos) << "a worker was restarted";
  } else if (launch == Launch::kUnderElasticDtrainRun) {
    EXPECT_NE(result.output.find("agents=0,0"), std::string::npos);
    EXPECT_NE(result.output.find("rank 2/3 (local rank "), std::string::npos);  // on node 1
    EXPECT_NE(result.output.find("restarting it alone as a newcomer"), std::string::npos);
  } else {
    EXPECT_NE(result.output.find("victim=137"), std::string::npos);  // killed by SIGKILL
    EXPECT_NE(result.output.find("rank0=0"), std::string::npos);
    EXPECT_NE(result.output.find("rank1=0"), std::string::npos);
    if (newcomer) EXPECT_NE(result.output.find("newcomer=0"), std::string::npos);
  }
  // The node case loses and admits two workers; every other case one.
  const int lost = launch == Launch::kElasticNodeLostAndReplaced ? 2 : 1;
  const int full = launch == Launch::kElasticNodeLostAndReplaced ? 4 : 3;
  EXPECT_EQ(json_int(result.output, "recoveries"), 1);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 1);
  EXPECT_EQ(json_int(result.output, "admitted"), newcomer ? lost : 0);
  EXPECT_EQ(json_int(result.output, "world_size"), newcomer ? full : full - lost);
  // Note [A number riding on the gradients]: admission agreed at no all-reduce of its own.
  EXPECT_GT(json_int(result.output, "admission_carried"), 0);
  EXPECT_EQ(json_int(result.output, "admission_checks"), 0);

  auto steps = read_steps(dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.begin()->second.world, full);
  EXPECT_EQ(steps.at(6).world, full - lost);  // the step after the kill, redone without them
  expect_sound_job(dir, steps, newcomer ? full : full - lost);
  expect_one_random_stream(dir);
  fs::remove_all(dir);
}

// Note [Leaving in place] (dtrain/recovery.h) and [Rounds in place]: a node taken back on SIGTERM
// costs the others neither a restart nor a checkpoint, only a re-formation; every sample is still
// used once and the parameters are one process's.
TEST(InPlaceLeave, ANodeTakenBackOnSigtermLeavesAndTheOthersGoOnWithoutARestart) {
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_command(launch_script(dir, Launch::kElasticNodeLeavesOnSigterm), 120);
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  EXPECT_NE(result.output.find("node_left=143"), std::string::npos);  // 128 + SIGTERM
  EXPECT_NE(result.output.find("survivor=0"), std::string::npos);
  EXPECT_NE(result.output.find("rank 2 left on SIGTERM"), std::string::npos);
  EXPECT_NE(result.output.find("rank 3 left on SIGTERM"), std::string::npos);
  EXPECT_NE(result.output.find("left the job (received SIGTERM); the running round goes on in "
                               "place with 1 node(s)"),
            std::string::npos);
  EXPECT_EQ(result.output.find("new round"), std::string::npos) << "a worker was restarted";
  EXPECT_EQ(json_int(result.output, "departed"), 2);
  EXPECT_EQ(json_int(result.output, "recoveries"), 0);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 0);
  EXPECT_EQ(json_int(result.output, "world_size"), 2);
  auto steps = read_steps(dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.begin()->second.world, 4);
  EXPECT_EQ(steps.rbegin()->second.world, 2);
  expect_sound_job(dir, steps, 2);
  expect_one_random_stream(dir);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Launches, InPlaceRecovery,
                         ::testing::Values(Launch::kSurvivorsOnly, Launch::kNewcomer,
                                           Launch::kUnderDtrainRun, Launch::kRankZeroUnderDtrainRun,
                                           Launch::kUnderElasticDtrainRun,
                                           Launch::kElasticNodeLostAndReplaced),
                         [](const auto& info) {
                           switch (info.param) {
                             case Launch::kSurvivorsOnly:
                               return std::string("SurvivorsOnly");
                             case Launch::kNewcomer:
                               return std::string("NewcomerTakesTheDeadRanksPlace");
                             case Launch::kUnderDtrainRun:
                               return std::string("UnderDtrainRunRecoveryInPlace");
                             case Launch::kUnderElasticDtrainRun:
                               return std::string("UnderAnElasticRendezvousOfTwoAgents");
                             case Launch::kElasticNodeLostAndReplaced:
                               return std::string("ElasticNodeLostAndAnotherAdmittedInPlace");
                             default:
                               return std::string("RankZeroKilledUnderDtrainRun");
                           }
                         });

TEST(InPlaceRecoveryAdmission, WhereNothingRidesOnTheGradientsAnAllReduceOfItsOwnAdmits) {
  // A comm hook owns the buckets, so the admission count cannot ride on them: the members agree
  // through an all-reduce of one number every admit_every (2) steps, and the newcomer is admitted
  // all the same.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_command(bin("dtrain") +
                                " run --nproc-per-node 3 --recovery in-place --max-restarts 1 -- " +
                                bin("recovery_worker") + " " + dir +
                                " --kill-rank 2 --kill-after 5 --slow-until-admitted "
                                "--plain-comm-hook",
                            120);
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  EXPECT_EQ(json_int(result.output, "admitted"), 1);
  EXPECT_EQ(json_int(result.output, "world_size"), 3);
  EXPECT_EQ(json_int(result.output, "admission_carried"), 0);
  EXPECT_GT(json_int(result.output, "admission_checks"), 0);
  auto steps = read_steps(dir);
  expect_sound_job(dir, steps, 3);
  expect_one_random_stream(dir);
  fs::remove_all(dir);
}

TEST(InPlaceRecoveryLaggard, AStepCommittedOnSomeMembersOnlyStandsAndTheOthersAreHealed) {
  // Note [In-place recovery]: rank 2's step 6 fails after its all-reduce finished everywhere, so
  // ranks 0 and 1 commit step 6 with rank 2's gradient in it and rank 2 does not. The step must
  // stand: after re-forming, rank 2 takes the model, the momentum and the sampler's position of
  // step 6 from rank 0, and nobody trains step 6 again. Were rank 2 not healed, it would train on
  // from step 5's model and the job would no longer equal one process.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_command(bin("dtrain") +
                                " run --nproc-per-node 3 --recovery in-place --max-restarts 0 -- " +
                                bin("recovery_worker") + " " + dir + " --fail-rank 2 --fail-step 6",
                            120);
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  EXPECT_NE(result.output.find("members stand at steps 5 and 6 (step 6 committed on some members "
                               "only); this member, at step 6, sends its state to the others"),
            std::string::npos);
  EXPECT_EQ(json_int(result.output, "recoveries"), 1);
  EXPECT_EQ(json_int(result.output, "world_size"), 3);
  auto steps = read_steps(dir);
  EXPECT_EQ(steps.at(6).world, 3);
  EXPECT_EQ(steps.at(6).indices.size(), 3u * recovery_model::kBatch);  // step 6 once, all shares
  EXPECT_EQ(steps.at(7).world, 3);
  expect_sound_job(dir, steps, 3);
  fs::remove_all(dir);
}

// Steps per epoch and in all at three ranks: every step takes kBatch samples per rank.
constexpr int64_t kStepsPerEpoch = kSamples / (3 * recovery_model::kBatch);
constexpr int64_t kLastStep = kEpochs * kStepsPerEpoch;
static_assert(kSamples % (3 * recovery_model::kBatch) == 0, "an epoch of whole steps at 3 ranks");

// Three workers under `dtrain run --recovery in-place --max-restarts 0` with `flags`; a hang ends
// at DTRAIN_TIMEOUT_S (60 s), and the test requires less than that.
testing::CommandResult run_three(const std::string& dir, const std::string& flags) {
  const auto begun = std::chrono::steady_clock::now();
  auto result = run_command("env DTRAIN_TIMEOUT_S=60 " + bin("dtrain") +
                                " run --nproc-per-node 3 --recovery in-place --max-restarts 0 -- " +
                                bin("recovery_worker") + " " + dir + " " + flags,
                            120);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begun;
  EXPECT_LT(took.count(), 50) << "something waited for the collective timeout (60 s)";
  return result;
}

TEST(InPlaceRecoveryLaggard, AtAnEpochsLastStepTheLaggardEndsThatEpochWithTheOthers) {
  // Note [Where the sampler stands] (src/recovery/resilient_data_parallel.cpp): rank 2's step 20,
  // epoch 0's last, fails after its all-reduce finished everywhere. Ranks 0 and 1 commit it, leave
  // their step loop, call set_epoch(1), and fail epoch 1's first step; rank 2, whose loop is still
  // in epoch 0, must take the position at epoch 0's end and leave its loop as they did. Given where
  // their epoch-1 step began (as before), it trained epoch 1 inside its epoch-0 iteration, then set
  // epoch 1 again while the others set epoch 2, and the job hung at the end.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_three(dir, "--fail-rank 2 --fail-step " + std::to_string(kStepsPerEpoch));
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  const std::string before = std::to_string(kStepsPerEpoch - 1),
                    at = std::to_string(kStepsPerEpoch);
  EXPECT_NE(result.output.find("members stand at steps " + before + " and " + at + " (step " + at +
                               " committed on some members only)"),
            std::string::npos);
  EXPECT_EQ(json_int(result.output, "recoveries"), 1);
  EXPECT_EQ(json_int(result.output, "steps"), kLastStep);
  EXPECT_EQ(json_int(result.output, "world_size"), 3);
  auto steps = read_steps(dir);
  ASSERT_EQ(steps.size(), static_cast<size_t>(kLastStep));
  EXPECT_EQ(steps.at(kStepsPerEpoch).indices.size(), 3u * recovery_model::kBatch);  // once
  EXPECT_EQ(steps.at(kStepsPerEpoch + 1).world, 3);
  expect_sound_job(dir, steps, 3);
  fs::remove_all(dir);
}

// Note [The end of training] (src/recovery/resilient_data_parallel.cpp): the end is agreed like a
// step, by ResilientDataParallel::finish(), with no barrier of the program's own after it.
TEST(InPlaceRecoveryEnd, ALastStepThatFailedOnOneMemberStandsAndTheJobEndsAtFullSize) {
  // Rank 2's last step fails after its all-reduce finished everywhere: ranks 0 and 1 commit it and
  // finish. Before, their barrier after finish() threw and both exited 1, and rank 2 redid the step
  // alone (world size 1). Now rank 2 is healed with the last step, which stands once, and all three
  // end together.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_three(dir, "--fail-rank 2 --fail-step " + std::to_string(kLastStep));
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.output.find("exited with code"), std::string::npos) << "a worker failed";
  EXPECT_NE(result.output.find("members stand at steps " + std::to_string(kLastStep - 1) + " and " +
                               std::to_string(kLastStep)),
            std::string::npos);
  EXPECT_EQ(json_int(result.output, "recoveries"), 1);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 0);  // the last step stands
  EXPECT_EQ(json_int(result.output, "steps"), kLastStep);
  EXPECT_EQ(json_int(result.output, "world_size"), 3);
  auto steps = read_steps(dir);
  ASSERT_EQ(steps.size(), static_cast<size_t>(kLastStep));
  EXPECT_EQ(steps.at(kLastStep).world, 3);
  EXPECT_EQ(steps.at(kLastStep).indices.size(), 3u * recovery_model::kBatch);  // once, all shares
  expect_sound_job(dir, steps, 3);
  fs::remove_all(dir);
}

TEST(InPlaceRecoveryEnd, AMemberThatDiesAfterTheLastStepIsNotWaitedFor) {
  // Rank 2 dies (SIGKILL) right after committing the last step, with no restart left. The two
  // survivors' end fails on it, they re-form without it and end at two ranks, exit 0, with the last
  // step standing. Before, their barrier after finish() threw and the job failed after training
  // was complete.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_three(dir, "--kill-rank 2 --kill-after " + std::to_string(kLastStep));
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  EXPECT_EQ(occurrences(result.output, "exited with code 1"), 0u) << "a survivor failed";
  EXPECT_EQ(json_int(result.output, "recoveries"), 1);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 0);
  EXPECT_EQ(json_int(result.output, "steps"), kLastStep);
  EXPECT_EQ(json_int(result.output, "world_size"), 2);
  auto steps = read_steps(dir);
  ASSERT_EQ(steps.size(), static_cast<size_t>(kLastStep));
  EXPECT_EQ(steps.at(kLastStep).world, 3);
  EXPECT_EQ(steps.at(kLastStep).indices.size(), 3u * recovery_model::kBatch);
  expect_sound_job(dir, steps, 2);
  fs::remove_all(dir);
}

TEST(InPlaceRecoveryEnd, AWorkerFailingAfterTheEndIsNotRestartedAndGivesTheExitCode) {
  // Rank 1 took part in the end (finish()) and then fails in its own code (exit 3), with a restart
  // left: nothing is left to join, so it is not restarted as a newcomer; the training stands and
  // the launcher exits with its code. Before, it was restarted, found the job finished and exited
  // 0, and the launcher reported success.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_command("env DTRAIN_TIMEOUT_S=60 " + bin("dtrain") +
                                " run --nproc-per-node 3 --recovery in-place --max-restarts 1 -- " +
                                bin("recovery_worker") + " " + dir + " --exit-after-finish 1 3",
                            120);
  SCOPED_TRACE(result.output);
  EXPECT_EQ(result.exit_code, 3);
  EXPECT_NE(result.output.find("exited with code 3 after training completed: not restarted"),
            std::string::npos);
  EXPECT_EQ(result.output.find("restarting it alone"), std::string::npos);
  EXPECT_EQ(json_int(result.output, "world_size"), 3);
  auto steps = read_steps(dir);
  expect_sound_job(dir, steps, 3);
  fs::remove_all(dir);
}

TEST(InPlaceRecoveryTwice, TwoFailuresInARowUnderDtrainRun) {
  // Four workers; rank 3 dies after step 5 and rank 1 after step 9, with no restarts allowed: the
  // job goes on at 3, then at 2 ranks, each failed step redone, and still equals one process.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  const auto begun = std::chrono::steady_clock::now();
  auto result = run_command("env DTRAIN_TIMEOUT_S=60 " + bin("dtrain") +
                                " run --nproc-per-node 4 --recovery in-place --max-restarts 0 -- " +
                                bin("recovery_worker") + " " + dir +
                                " --kill-rank 3 --kill-after 5 --kill-rank 1 --kill-after 9",
                            120);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begun;
  SCOPED_TRACE(result.output);
  EXPECT_LT(took.count(), 50) << "something waited for the collective timeout (60 s)";
  // --max-restarts 0: the launcher replaces no one; the survivors finish, and the job succeeds.
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(occurrences(result.output, "go on without it"), 2u);
  EXPECT_EQ(json_int(result.output, "recoveries"), 2);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 2);
  EXPECT_EQ(json_int(result.output, "world_size"), 2);
  auto steps = read_steps(dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.at(5).world, 4);
  EXPECT_EQ(steps.at(6).world, 3);
  EXPECT_EQ(steps.at(10).world, 2);
  expect_exactly_once(steps);
  expect_final_equals_replay(dir, steps);
  expect_no_worker_left(dir);
  fs::remove_all(dir);
}

TEST(InPlaceRecoveryTwice, ASecondFailureWhileTheGroupReformsUnderDtrainRun) {
  // Four workers; rank 3 dies after step 5; while the survivors form the next generation, one of
  // them (DTRAIN_TEST_FAULT=kill-member-mid-formation: the first to claim it) dies after the
  // generation agreed on its members and before its group connected. The other two must form the
  // generation after it, redo the step once at 2 ranks, finish, and equal one process; nothing may
  // wait for a collective's timeout.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  const auto begun = std::chrono::steady_clock::now();
  auto result = run_command(
      "env DTRAIN_TEST_FAULT=kill-member-mid-formation DTRAIN_TIMEOUT_S=60 " + bin("dtrain") +
          " run --nproc-per-node 4 --recovery in-place --max-restarts 0 -- " +
          bin("recovery_worker") + " " + dir + " --kill-rank 3 --kill-after 5",
      120);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begun;
  SCOPED_TRACE(result.output);
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_LT(took.count(), 50) << "something waited for the collective timeout (60 s)";
  EXPECT_EQ(occurrences(result.output, "go on without it"), 2u);
  EXPECT_EQ(json_int(result.output, "world_size"), 2);
  EXPECT_EQ(json_int(result.output, "recoveries"), 2);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 1);
  auto steps = read_steps(dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.at(5).world, 4);
  EXPECT_EQ(steps.at(6).world, 2);  // the failed step, redone once, at 2 ranks
  EXPECT_EQ(steps.rbegin()->second.world, 2);
  expect_sound_job(dir, steps, 2);
  fs::remove_all(dir);
}

TEST(InPlaceRecoveryAdmission, AMemberThatMissedAnAdmissionWaitsForTheNewcomer) {
  // Three workers under `dtrain run --recovery in-place`; rank 2 dies after step 5 and is
  // restarted as a newcomer. When the members admit it, job rank 1 misses the admission
  // (DTRAIN_TEST_FAULT=miss-admission) and re-forms as after a failure, as a member does whose
  // all-reduce failed where the others' finished. Its formation must wait for the newcomer the
  // others admitted instead of closing without it: the newcomer is admitted once, never restarted
  // again, and the job ends at three ranks, sound.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  auto result = run_command("env DTRAIN_TEST_FAULT=miss-admission " + bin("dtrain") +
                                " run --nproc-per-node 3 --recovery in-place --max-restarts 2 -- " +
                                bin("recovery_worker") + " " + dir +
                                " --kill-rank 2 --kill-after 5 --slow-until-admitted",
                            120);
  SCOPED_TRACE(result.output);
  ASSERT_EQ(result.exit_code, 0);
  EXPECT_NE(result.output.find("DTRAIN_TEST_FAULT=miss-admission: this member misses the admission "
                               "of 1 newcomer(s)"),
            std::string::npos);
  EXPECT_EQ(occurrences(result.output, "restarting it alone as a newcomer"), 1u);
  EXPECT_EQ(result.output.find("formed without this process"), std::string::npos);
  EXPECT_EQ(json_int(result.output, "admitted"), 1);
  EXPECT_EQ(json_int(result.output, "world_size"), 3);
  auto steps = read_steps(dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.rbegin()->second.world, 3);
  expect_sound_job(dir, steps, 3);
  fs::remove_all(dir);
}

// A failure during a newcomer's state transfer. Three workers under `dtrain run --recovery
// in-place --max-restarts 1`; rank 2 dies after step 5 and is restarted as a newcomer; while the
// survivors' rank 0 sends it the state, the sender dies (or the newcomer does: DTRAIN_TEST_FAULT,
// a fault the library injects for this test alone, halfway through the transfer). No restart is
// left for the second death. The job must go on at the size it can, two ranks (the survivor that
// is left and the newcomer, or the two survivors), with every sample used once and the same
// parameters as one process; nothing may hang.
enum class TransferFault { kSourceDies, kNewcomerDies };

class InPlaceRecoveryTransfer : public ::testing::TestWithParam<TransferFault> {};

TEST_P(InPlaceRecoveryTransfer, AFailureMidTransferLeavesTheJobGoingOnAtTwoRanks) {
  const bool source_dies = GetParam() == TransferFault::kSourceDies;
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  const auto begun = std::chrono::steady_clock::now();
  auto result = run_command(
      std::string("env DTRAIN_TEST_FAULT=") +
          (source_dies ? "kill-source-mid-transfer" : "kill-newcomer-mid-transfer") + " " +
          bin("dtrain") + " run --nproc-per-node 3 --recovery in-place --max-restarts 1 -- " +
          bin("recovery_worker") + " " + dir +
          " --kill-rank 2 --kill-after 5 --slow-until-admitted",
      120);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begun;
  SCOPED_TRACE(result.output);
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_LT(took.count(), 60) << "something waited for a timeout";
  const std::string restarted = "restarting it alone as a newcomer";
  const size_t first_restart = result.output.find(restarted);
  EXPECT_NE(first_restart, std::string::npos);
  EXPECT_EQ(result.output.find(restarted, first_restart + 1), std::string::npos)
      << "restarted twice";
  // The second death, named by the launcher: the sender (rank 0) or the newcomer (rank 2).
  EXPECT_NE(
      result.output.find(std::string("rank ") + (source_dies ? "0" : "2") + "/3 (local rank "),
      std::string::npos);
  EXPECT_NE(result.output.find("no restart left to replace it"), std::string::npos);
  EXPECT_EQ(json_int(result.output, "world_size"), 2);
  EXPECT_EQ(json_int(result.output, "admitted"), 1);
  EXPECT_EQ(json_int(result.output, "recoveries"), 2);
  EXPECT_EQ(json_int(result.output, "steps_redone"), 1);

  auto steps = read_steps(dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.begin()->second.world, 3);
  EXPECT_EQ(steps.rbegin()->second.world, 2);
  expect_exactly_once(steps);
  expect_no_step_missing(steps);
  expect_final_equals_replay(dir, steps);
  // The two that finished: the survivor and the newcomer, whose count came with the state, or the
  // two survivors.
  expect_counts_travelled(dir, 2);
  expect_no_worker_left(dir);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Faults, InPlaceRecoveryTransfer,
                         ::testing::Values(TransferFault::kSourceDies,
                                           TransferFault::kNewcomerDies),
                         [](const auto& info) {
                           return std::string(info.param == TransferFault::kSourceDies
                                                  ? "TheSenderDies"
                                                  : "TheNewcomerDies");
                         });

TEST(InPlaceRecoveryTransferAlone, WhenTheOnlySenderDiesTheNewcomerStopsSayingSo) {
  // Two workers: rank 1 dies after step 5 and is restarted as a newcomer; rank 0, the only member
  // that holds the state, dies halfway through sending it, with no restart left. The newcomer,
  // left alone with no state, must not go on training a fresh model under the job's name: it stops
  // with one line saying why, and the job ends in bounded time.
  const std::string dir = testing::temp_dir("recovery");
  fs::create_directories(dir);
  const auto begun = std::chrono::steady_clock::now();
  auto result = run_command("env DTRAIN_TEST_FAULT=kill-source-mid-transfer " + bin("dtrain") +
                                " run --nproc-per-node 2 --recovery in-place --max-restarts 1 -- " +
                                bin("recovery_worker") + " " + dir +
                                " --kill-rank 1 --kill-after 5 --slow-until-admitted",
                            120);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begun;
  SCOPED_TRACE(result.output);
  EXPECT_NE(result.exit_code, 0);
  EXPECT_LT(took.count(), 60) << "something waited for a timeout";
  EXPECT_NE(result.output.find("every member that held the job's state died before it was sent"),
            std::string::npos);
  EXPECT_EQ(result.output.find("\"world_size\""), std::string::npos) << "a worker finished";
  expect_no_worker_left(dir);
  fs::remove_all(dir);
}

TEST(RecoveryInput, BadOptionsAndVariablesAreOneUsageErrorLine) {
  auto net = recovery_model::make_net();
  auto optimizer = recovery_model::make_optimizer(net);
  DistributedSampler sampler(recovery_model::kSamples, 1, 0);
  auto expect_usage_error = [&](const RecoveryOptions& options, const std::string& needle) {
    try {
      ResilientDataParallel rdp(net, optimizer, sampler, options);
      FAIL() << "accepted: " << needle;
    } catch (const UsageError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  };
  RecoveryOptions options;
  options.admit_every = 0;
  expect_usage_error(options, "RecoveryOptions::admit_every is 0");
  options = {};
  options.min_size = 0;
  expect_usage_error(options, "RecoveryOptions::min_size is 0");
  options = {};
  options.settle = std::chrono::milliseconds(-1);
  expect_usage_error(options, "RecoveryOptions::settle is -1");
  options = {};
  options.state = {torch::zeros({2}), at::Tensor()};
  expect_usage_error(options, "RecoveryOptions::state[1] is an undefined tensor");

  // Read before any store is opened: no launcher environment is needed to see it refused.
  setenv("DTRAIN_RECOVERY_JOIN", "yes", 1);
  expect_usage_error({}, "DTRAIN_RECOVERY_JOIN is 'yes'");
  unsetenv("DTRAIN_RECOVERY_JOIN");

  auto result = run_command(
      "env DTRAIN_RECOVERY=sometimes " + bin("train_fashion_mnist") + " --epochs 1", 60);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("DTRAIN_RECOVERY is 'sometimes'; accepted: restart or in-place"),
            std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace dtrain
