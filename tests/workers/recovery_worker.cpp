// A worker of the in-place recovery tests (tests/recovery/recovery_test.cpp): DDP on a small MLP
// and synthetic data through dtrain::ResilientDataParallel. Every process appends each committed
// step to <out>/steps-<pid>.txt ("<step> <world> <index> <index> ..."), so the test can replay
// the same global batches in one process and check that every sample was used exactly once. It
// also counts the steps it committed in a tensor of its own that travels with the model
// (RecoveryOptions::state) and writes it beside the job's count to <out>/counted-<pid>.txt at the
// end: a newcomer's must come out as the job's.
//   recovery_worker OUT [--kill-rank R --kill-after S]... [--kill-launcher-too]
//                   [--slow-until-admitted [--newcomers N]] [--step-ms MS] [--settle-ms MS]
//                   [--lost-after-ms MS] [--fail-rank R --fail-step S] [--plain-comm-hook]
//                   [--term-launcher-rank R --term-after S] [--leave-on-sigterm]
// The process of job rank R kills itself (SIGKILL) right after committing step S, unless it is a
// newcomer; the pair may be given several times (failures in a row). --kill-launcher-too: it kills
// its parent first, the `dtrain run` agent, whose other workers die with it (PR_SET_PDEATHSIG): the
// whole node is lost, as when its host is. It first waits (up to 10 s) until every rank has
// recorded step S, so that the replay holds the step its node-mates committed just before they
// died. --slow-until-admitted: 100 ms per step until a newcomer has been admitted (so one has time
// to start), bounded by the epochs; --newcomers N: until N have been (default 1).
// --step-ms: MS ms more per step, so that a fault from outside
// (tests/recovery/host_faults_test.cpp) lands mid-training. --settle-ms, --lost-after-ms:
// RecoveryOptions::settle and lost_after, so that a test can tell a wait for them from none.
// --fail-rank R --fail-step S: the process of job rank R throws a CommError in step S after its
// backward (whose all-reduce finished on every rank) and before its optimizer step, as when an
// all-reduce fails on one rank after finishing on the others: the step commits on the others only,
// and this process must be healed from them. It records the step's indices first: the others'
// step used its gradient. --plain-comm-hook: DDP all-reduces through a comm hook of its own (exact,
// as the plain path), on which no number rides: admission then agrees by an all-reduce of its own.
// --term-launcher-rank R --term-after S: every process asks rdp.agree_to_stop() at the start of
// each step (a SIGTERM stop handler installed), and the process of job rank R sends SIGTERM to its
// parent, the `dtrain run` agent, right after committing step S: its node is taken back, and its
// workers leave in place (Note [Leaving in place], dtrain/recovery.h) and exit with code 75
// (dtrain::kLeftExitCode). --leave-on-sigterm: the same votes and stop handler, with no process
// signalling its launcher (a test signals one from outside); a newcomer asked to stop before it
// asked to be admitted exits 75 at once.
// Every process also appends "<step> <draw>" to <out>/random-<pid>.txt, a draw from the default
// generator after each committed step: a newcomer's must continue the others' stream.
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/recovery.h"
#include "dtrain/stop.h"
#include "recovery_model.h"

namespace {

using namespace recovery_model;

// Whether `world` lines for `step` are in OUT's steps files, one per rank.
bool everyone_recorded(const std::string& out, int64_t step, int world) {
  int lines = 0;
  for (const auto& entry : std::filesystem::directory_iterator(out)) {
    if (entry.path().filename().string().rfind("steps-", 0) != 0) continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      if (line.rfind(std::to_string(step) + " ", 0) == 0) ++lines;
    }
  }
  return lines >= world;
}

// A comm hook that does what DDP's own path does (the buckets arrive divided by the world size;
// their sum over the ranks is the average), so that results stay exact.
class PlainAllReduce : public dtrain::CommHook {
 public:
  void start(dtrain::ProcessGroup& group, dtrain::GradBucket& bucket) override {
    if (works_.size() <= static_cast<size_t>(bucket.index)) works_.resize(bucket.index + 1);
    works_[bucket.index] = group.all_reduce_async(*bucket.buffer);
  }
  void finish(dtrain::ProcessGroup&, dtrain::GradBucket& bucket) override {
    works_[bucket.index].wait();
  }

 private:
  std::vector<dtrain::Work> works_;
};

int run(int argc, char** argv) {
  if (argc < 2)
    throw dtrain::UsageError("usage: recovery_worker OUT [--kill-rank R --kill-after S]");
  const std::string out = argv[1];
  std::vector<std::pair<int, int64_t>> kills;  // (job rank, after step)
  bool slow = false;
  bool kill_launcher = false;
  int64_t newcomers = 1;
  int step_ms = 0;
  int fail_rank = -1;
  int64_t fail_step = -1;
  int term_rank = -1;
  int64_t term_after = -1;
  bool leave_on_sigterm = false;
  int exit_rank = -1;  // --exit-after-finish R CODE: rank R exits with CODE after finish()
  int exit_code_after_finish = 0;
  dtrain::RecoveryOptions options;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--kill-rank" && i + 1 < argc) kills.emplace_back(std::atoi(argv[++i]), -1);
    if (arg == "--kill-after" && i + 1 < argc && !kills.empty()) {
      kills.back().second = std::atoll(argv[++i]);
    }
    if (arg == "--slow-until-admitted") slow = true;
    if (arg == "--kill-launcher-too") kill_launcher = true;
    if (arg == "--newcomers" && i + 1 < argc) newcomers = std::atoll(argv[++i]);
    if (arg == "--step-ms" && i + 1 < argc) step_ms = std::atoi(argv[++i]);
    if (arg == "--settle-ms" && i + 1 < argc) {
      options.settle = std::chrono::milliseconds(std::atoll(argv[++i]));
    }
    if (arg == "--lost-after-ms" && i + 1 < argc) {
      options.lost_after = std::chrono::milliseconds(std::atoll(argv[++i]));
    }
    if (arg == "--fail-rank" && i + 1 < argc) fail_rank = std::atoi(argv[++i]);
    if (arg == "--fail-step" && i + 1 < argc) fail_step = std::atoll(argv[++i]);
    if (arg == "--plain-comm-hook") options.ddp.comm_hook = std::make_shared<PlainAllReduce>();
    if (arg == "--term-launcher-rank" && i + 1 < argc) term_rank = std::atoi(argv[++i]);
    if (arg == "--term-after" && i + 1 < argc) term_after = std::atoll(argv[++i]);
    if (arg == "--leave-on-sigterm") leave_on_sigterm = true;
    if (arg == "--exit-after-finish" && i + 2 < argc) {
      exit_rank = std::atoi(argv[++i]);
      exit_code_after_finish = std::atoi(argv[++i]);
    }
  }
  const bool vote = term_rank >= 0 || leave_on_sigterm;
  if (vote) dtrain::install_stop_handler();
  const int job_rank = std::atoi(std::getenv("RANK"));
  const char* join = std::getenv("DTRAIN_RECOVERY_JOIN");
  const bool newcomer = join != nullptr && std::string(join) == "1";
  torch::set_num_threads(1);

  const auto [x, y] = make_data();
  auto net = make_net();
  auto optimizer = make_optimizer(net);
  dtrain::DistributedSampler sampler(kSamples, 1, 0);
  options.admit_every = 2;
  auto counted = torch::zeros({1}, torch::kInt64);
  options.state = {counted};
  dtrain::ResilientDataParallel rdp(net, optimizer, sampler, options);
  if (rdp.job_finished()) return 0;
  if (rdp.left()) {
    std::cout << "rank " << job_rank << " left before it was admitted" << std::endl;
    return dtrain::kLeftExitCode;
  }
  // What a program reads to know whether to load its checkpoint (tools/trainer/train.cpp): exactly
  // the processes started as newcomers, also where the first generation re-formed before its
  // first step (HostFaults.ALinkCutBeforeTheJobStartsLeavesOneOutUntilTheLinkReturns).
  if (rdp.admitted_as_newcomer() != newcomer) {
    std::cerr << "rank " << job_rank << ": admitted_as_newcomer() is " << rdp.admitted_as_newcomer()
              << " for a process started with DTRAIN_RECOVERY_JOIN " << (newcomer ? "1" : "unset")
              << " (generation " << rdp.stats().generation << ")" << std::endl;
    return 3;
  }

  std::ofstream steps(out + "/steps-" + std::to_string(::getpid()) + ".txt");
  std::ofstream draws(out + "/random-" + std::to_string(::getpid()) + ".txt");
  bool failed_once = false;
  dtrain::StopAgreement stop = dtrain::StopAgreement::kGoOn;
  for (int64_t epoch = sampler.epoch(); epoch < kEpochs && stop == dtrain::StopAgreement::kGoOn;
       ++epoch) {
    sampler.set_epoch(epoch);
    std::vector<size_t> used;
    while (rdp.step([&](auto& ddp) {
      if (vote && (stop = rdp.agree_to_stop()) != dtrain::StopAgreement::kGoOn) {
        return false;
      }
      auto batch = sampler.next(kBatch);
      if (!batch) return false;
      used = *batch;
      auto rows = torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()));
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp(x.index_select(0, rows)), y.index_select(0, rows))
          .backward();
      const int64_t step = rdp.stats().steps + 1;
      if (job_rank == fail_rank && step == fail_step && !failed_once && !newcomer) {
        failed_once = true;
        steps << step << " " << rdp.group()->size();
        for (size_t i : used) steps << " " << i;
        steps << std::endl;
        throw dtrain::CommError("recovery_worker: --fail-rank " + std::to_string(fail_rank) +
                                ": this rank's all-reduce of step " + std::to_string(step) +
                                " fails after finishing on the others");
      }
      optimizer.step();
      return true;
    })) {
      counted.add_(1);
      const auto stats = rdp.stats();
      draws << stats.steps << " " << torch::rand({1}).item<double>() << std::endl;
      steps << stats.steps << " " << rdp.group()->size();
      for (size_t i : used) steps << " " << i;
      steps << std::endl;  // flushed: the line must survive a SIGKILL right after
      for (const auto& [rank, after] : kills) {
        if (job_rank == rank && stats.steps == after && !newcomer) {
          if (kill_launcher) {
            for (int i = 0; i < 200 && !everyone_recorded(out, after, rdp.group()->size()); ++i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
            }
            // Every worker of the node dies together, by PR_SET_PDEATHSIG, once the launcher is
            // gone: none of them may register for the survivors' next generation first.
            const pid_t launcher = ::getppid();
            ::kill(launcher, SIGKILL);
            for (int i = 0; i < 500 && ::getppid() == launcher; ++i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            }
          }
          std::raise(SIGKILL);
        }
      }
      if (job_rank == term_rank && stats.steps == term_after && !newcomer) {
        ::kill(::getppid(), SIGTERM);
      }
      if (slow && stats.admitted < newcomers) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    }
  }
  if (stop != dtrain::StopAgreement::kGoOn) {
    std::cout << "rank " << job_rank
              << (stop == dtrain::StopAgreement::kLeave ? " left on SIGTERM"
                                                        : " stopped on SIGTERM")
              << " after step " << rdp.stats().steps << std::endl;
    return stop == dtrain::StopAgreement::kLeave ? dtrain::kLeftExitCode : dtrain::kStopExitCode;
  }
  rdp.finish();  // the end, agreed like a step (Note [The end of training]): no barrier after it
  auto group = rdp.group();
  const auto stats = rdp.stats();
  std::ofstream(out + "/counted-" + std::to_string(::getpid()) + ".txt")
      << counted.item<int64_t>() << " " << stats.steps << std::endl;
  if (job_rank == exit_rank) return exit_code_after_finish;  // its own code failing after the end
  if (group->rank() == 0) {
    std::vector<torch::Tensor> params;
    for (auto& p : net->parameters()) params.push_back(p.detach().clone());
    torch::save(params, out + "/final.pt");
    std::cout << "{\"world_size\": " << group->size() << ", \"steps\": " << stats.steps
              << ", \"recoveries\": " << stats.recoveries << ", \"admitted\": " << stats.admitted
              << ", \"steps_redone\": " << stats.steps_redone
              << ", \"departed\": " << stats.departed << ", \"generation\": " << stats.generation
              << ", \"admission_carried\": " << rdp.readiness_cost().admission_carried
              << ", \"admission_checks\": " << rdp.readiness_cost().admission_checks << "}"
              << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return dtrain::run_main([&] { return run(argc, argv); });
}
