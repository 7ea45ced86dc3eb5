// ResilientDataParallel's machinery (Note [In-place recovery], dtrain/recovery.h): joining the job,
// re-forming the group after a failure or for a newcomer, moving the state from the most advanced
// member to the others, and watching the store off the training thread: the members' heartbeats
// (Note [Heartbeats], membership.h) and newcomers.
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/connect.h"
#include "comm/group_state.h"
#include "common/format.h"
#include "common/log.h"
#include "dtrain/recovery.h"
#include "dtrain/stop.h"
#include "recovery/membership.h"

namespace dtrain {
namespace detail {

using Clock = std::chrono::steady_clock;

// Final: no member of a new generation holds the job's state (transfer_state); re-forming again
// cannot help.
class StateLost : public CommError {
 public:
  using CommError::CommError;
};

class RecoveryCore {
 public:
  RecoveryCore(ResilientDataParallelBase& owner, std::shared_ptr<torch::nn::Module> module,
               torch::optim::Optimizer& optimizer, DistributedSampler sampler,
               RecoveryOptions options)
      : owner_(owner),
        module_(std::move(module)),
        optimizer_(optimizer),
        sampler_(std::move(sampler)),
        options_(std::move(options)) {
    auto check = [](bool ok, const std::string& field, int64_t value, const char* accepted) {
      if (!ok) {
        throw UsageError("ResilientDataParallel: RecoveryOptions::" + field + " is " +
                         std::to_string(value) + "; accepted: " + accepted + ".");
      }
    };
    check(options_.admit_every >= 1, "admit_every", options_.admit_every, ">= 1 (steps)");
    check(options_.settle.count() >= 0, "settle", options_.settle.count(), ">= 0 (milliseconds)");
    check(options_.max_recoveries >= 0, "max_recoveries", options_.max_recoveries, ">= 0");
    check(options_.min_size >= 1, "min_size", options_.min_size, ">= 1 (ranks)");
    check(options_.lost_after.count() >= 300, "lost_after", options_.lost_after.count(),
          ">= 300 (milliseconds; heartbeats go every 100 ms)");
    for (size_t i = 0; i < options_.state.size(); ++i) {
      if (!options_.state[i].defined()) {
        throw UsageError("ResilientDataParallel: RecoveryOptions::state[" + std::to_string(i) +
                         "] is an undefined tensor; accepted: defined tensors of fixed shape.");
      }
    }
  }

  ~RecoveryCore() {
    stop_watching();
    for (auto& t : releases_) t.join();
  }

  void start();
  bool step(const std::function<bool()>& body);
  void stop_watching();
  void finish();
  bool generation_current() { return !membership_->started(generation_ + 1); }
  bool departed() const { return departed_; }
  bool admitted_as_newcomer() const { return admitted_as_newcomer_; }
  StopAgreement agree_to_stop();

  bool job_finished_ = false;
  std::shared_ptr<ProcessGroup> group_;
  RecoveryStats stats_;
  ReadinessCost readiness_cost() const {
    ReadinessCost cost = readiness_;
    cost.heartbeat_cpu_s = static_cast<double>(heartbeat_cpu_ns_->load()) * 1e-9;
    return cost;
  }

 private:
  enum class Reason { kFailure, kAdmission, kDeparture };
  void reform(Reason reason, int newcomers, const std::string& cause);
  void admit_newcomers();
  void connect(int64_t generation);
  void transfer_state();
  // `failed`: the generation is left after a failure (its NCCL communicator is aborted).
  void release_group(bool failed);
  void depart();
  void start_watching();
  void watch(int64_t generation);
  void knock_before_connecting();
  std::string who() const { return rank_text(launch_.rank, launch_.world_size); }

  ResilientDataParallelBase& owner_;
  std::shared_ptr<torch::nn::Module> module_;
  torch::optim::Optimizer& optimizer_;
  DistributedSampler sampler_;
  RecoveryOptions options_;
  LaunchInfo launch_;
  std::chrono::milliseconds timeout_{0};
  c10::intrusive_ptr<c10d::Store> root_store_;
  std::unique_ptr<Membership> membership_;
  MemberRecord self_;  // this process, as the store knows it
  std::vector<MemberRecord> members_;
  int64_t generation_ = 0;
  bool newcomer_ = false;              // holds no state until the first transfer
  bool departed_ = false;              // left on SIGTERM (agree_to_stop): no longer a member
  bool admitted_as_newcomer_ = false;  // joined a running job and received its state
  bool finished_ = false;              // finish() was called: training is over
  bool stopping_all_ = false;          // agree_to_stop() said kStopAll: the job stops, not ends
  int64_t newcomers_admitted_ = 0;     // newcomer numbers 1..this are admitted (or gone)
  // The step count at the members' last agreement on the newcomers (admit_newcomers), or at the
  // formation of this generation: the same on every member.
  int64_t agreed_at_step_ = 0;
  // Note [A number riding on the gradients] (comm/group_state.h): this generation's, and its
  // `carried` count when admit_newcomers() last read it.
  std::shared_ptr<RidingNumber> riding_;
  int64_t riding_read_ = 0;
  // Note [Where the sampler stands] (step()): where it stood when this step began (what a failed
  // step puts back, and what a newcomer takes), and right after the last committed step (what a
  // laggard takes).
  SamplerState step_start_;
  SamplerState after_commit_;
  ReadinessCost readiness_;  // the admission checks' part; the heartbeats' is below
  // The heartbeat thread's CPU time so far, which it writes after every round.
  std::shared_ptr<std::atomic<int64_t>> heartbeat_cpu_ns_ =
      std::make_shared<std::atomic<int64_t>>(0);
  std::vector<std::thread> releases_;
  // DTRAIN_TEST_FAULT (tests only, see transfer_state): "" or where this process kills itself.
  std::string test_fault_;

  // The watcher thread: a heartbeat round every kWatchEvery (the members' liveness and the
  // newcomers, Note [Heartbeats]); the training thread reads what it saw. What it uses is shared
  // with it, so that one stuck in a store call on a cut link can be left behind, not waited for.
  static constexpr std::chrono::milliseconds kWatchEvery{100};
  struct WatchControl {
    std::mutex mutex;
    std::condition_variable wake;
    bool stop = false;
  };
  std::shared_ptr<Heartbeats> heartbeats_;
  // Where the others knock (Note [A link cut between members]); drained by the watcher.
  std::shared_ptr<elastic::KnockTarget> knock_target_;
  std::shared_ptr<WatchControl> watch_control_;
  std::future<void> watcher_exited_;
  std::thread watcher_;
};

void RecoveryCore::start() {
  launch_ = launch_info_from_env();
  log::set_rank(launch_.rank, launch_.world_size);
  timeout_ = resolve_timeout(options_.timeout);
  const std::string join =
      std::getenv("DTRAIN_RECOVERY_JOIN") ? std::getenv("DTRAIN_RECOVERY_JOIN") : "";
  if (join != "" && join != "0" && join != "1") {
    throw UsageError(who() + ": DTRAIN_RECOVERY_JOIN is '" + join +
                     "'; accepted: 1 (this process replaces a dead worker and joins the running "
                     "job), 0 or unset. `dtrain run --recovery in-place` sets it; unset it.");
  }
  newcomer_ = join == "1";
  if (const char* fault = std::getenv("DTRAIN_TEST_FAULT")) test_fault_ = fault;
  if (!test_fault_.empty() && test_fault_ != "kill-source-mid-transfer" &&
      test_fault_ != "kill-newcomer-mid-transfer" && test_fault_ != "kill-member-mid-formation" &&
      test_fault_ != "miss-admission") {
    // A mistyped fault would inject nothing, and its test would pass for the wrong reason.
    throw UsageError(who() + ": DTRAIN_TEST_FAULT is '" + test_fault_ +
                     "'; accepted (tests only): kill-source-mid-transfer, "
                     "kill-newcomer-mid-transfer, kill-member-mid-formation, miss-admission, or "
                     "unset");
  }
  if (newcomer_ && launch_.rank == 0 && !launcher_hosts_store()) {
    throw CommError(who() +
                    ": in-place recovery: rank 0 hosts the job's store, so it cannot "
                    "rejoin as a newcomer; the whole job must restart (dtrain run does "
                    "so).");
  }
  InitOptions init;
  root_store_ = open_store(init, launch_, launch_.rank, launch_.world_size, timeout_);
  root_store_->setTimeout(timeout_);
  self_ = MemberRecord::of_this_process(launch_.rank, newcomer_);
  // Note [A link cut between members] (membership.h): the others knock here, at the address their
  // collectives reach this process at.
  try {
    const std::string address = gloo_address(launch_.master_addr);
    if (address.empty()) {
      throw InternalError(
          "no IPv4 address found for Gloo (GLOO_SOCKET_IFNAME, or the route to "
          "MASTER_ADDR " +
          launch_.master_addr + ") to listen for the others' knocks at");
    }
    knock_target_ = std::make_shared<elastic::KnockTarget>(address);
    self_.knock_address = address;
    self_.knock_port = knock_target_->port();
  } catch (const std::exception& e) {
    DTRAIN_LOG(kWarn, "in-place recovery: " << e.what()
                                            << "; a link cut between this host and another "
                                               "member's is seen only at the collective timeout");
  }
  membership_ = std::make_unique<Membership>(root_store_, self_, timeout_);
  // The heartbeats go through a connection of their own (Note [Heartbeats]).
  c10::intrusive_ptr<c10d::Store> beat_store = root_store_;
  try {
    beat_store = root_store_->clone();
  } catch (const std::exception& e) {
    DTRAIN_LOG(kDebug, "in-place recovery: heartbeats share the store's connection: " << e.what());
  }
  if (beat_store.get() != root_store_.get()) {
    beat_store->setTimeout(std::max(options_.lost_after, std::chrono::milliseconds(1000)));
  }
  heartbeats_ =
      std::make_shared<Heartbeats>(beat_store, self_, options_.lost_after,
                                   launch_.master_addr + ":" + std::to_string(launch_.master_port));
  membership_->use_heartbeats(heartbeats_);
  start_watching();

  if (newcomer_) {
    std::optional<int64_t> admitted;
    switch (membership_->wait_until_members_answer(stop_requested)) {
      case Membership::Readiness::kStopRequested:
        // Nobody counts on it yet: it leaves as a member that voted to (Note [Leaving in place]).
        DTRAIN_LOG(kWarn,
                   "in-place recovery: asked to stop (SIGTERM) before it asked to be "
                   "admitted: this newcomer leaves the job");
        departed_ = true;
        stop_watching();
        return;
      case Membership::Readiness::kJobFinished:
        break;
      case Membership::Readiness::kReady: {
        // Asked, it is counted on: SIGTERM from here on is answered at its first step boundary,
        // where it votes with the members (agree_to_stop).
        const int64_t number = membership_->request_admission();
        DTRAIN_LOG(kInfo, "in-place recovery: newcomer " << number << " waits to be admitted");
        admitted = membership_->wait_for_admission(number);
      }
    }
    if (!admitted) {
      job_finished_ = true;
      DTRAIN_LOG(kWarn,
                 "in-place recovery: the job finished before this newcomer was admitted; "
                 "nothing to do");
      return;
    }
    generation_ = *admitted;
    members_ = membership_->form(generation_, {}, 0, options_.settle);
    watch(generation_);
    try {
      knock_before_connecting();
      connect(generation_);
      transfer_state();
      owner_.wrap(group_);
    } catch (const StateLost&) {
      throw;
    } catch (const CommError& e) {
      // Note [In-place recovery]: a member failed during the transfer (the one sending the state,
      // say). This process applied nothing yet, so it is still a newcomer: it re-forms with the
      // others, as they do, and receives the state again from a member that holds it.
      reform(Reason::kFailure, 0, e.what());
    }
    // Only now does it hold the state: until here it registered as a newcomer, which a generation
    // leaves out before a member of a pair that cannot reach each other (without_cut_pairs).
    newcomer_ = false;
    admitted_as_newcomer_ = true;
    membership_->joined();
    agreed_at_step_ = stats_.steps;  // as the members who admitted it
  } else {
    members_ = membership_->form(0, {}, launch_.world_size, std::nullopt);
    // Every rank sees the same members, so every rank stops alike: nobody is left waiting.
    if (const std::string problem = shared_address_problem(members_); !problem.empty()) {
      throw UsageError(who() + ": in-place recovery: " + problem + ".");
    }
    watch(0);
    step_start_ = after_commit_ = sampler_.state();
    try {
      // Note [A link cut between members]: a pair cut before the job started (a firewall between
      // two hosts) is found here too, and the first generation re-forms as any other would.
      knock_before_connecting();
      connect(0);
      sampler_.reshard(group_->size(), group_->rank());
      owner_.wrap(group_);
    } catch (const TimeoutError& e) {
      // Where neither the heartbeats nor the knocks know of anyone gone, the group could not
      // connect at all (a firewall that lets knocks through but not Gloo's ports, say), and every
      // later generation would wait for its timeout the same way.
      const bool someone_gone =
          !heartbeats_->unreachable().empty() ||
          std::any_of(members_.begin(), members_.end(),
                      [&](const MemberRecord& m) { return heartbeats_->lost(m); });
      if (!someone_gone) throw;
      reform(Reason::kFailure, 0, e.what());
    } catch (const CommError& e) {
      reform(Reason::kFailure, 0, e.what());
    }
  }
  step_start_ = sampler_.state();
  // (A newcomer keeps the sender's after_commit_, which the transfer gave it.)
  if (!admitted_as_newcomer_) after_commit_ = step_start_;
}

void RecoveryCore::watch(int64_t generation) { heartbeats_->watch(generation, members_); }

// Note [A link cut between members]: Gloo's connection of a new generation waits for every pair
// up to the timeout and asks nothing meanwhile, so a pair that cannot reach each other is found
// first, by a knock (milliseconds when every member answers). This member then does not come to
// the meeting, whose waits do ask, and the others stop on the failed mark it leaves.
void RecoveryCore::knock_before_connecting() {
  if (const std::string cut = heartbeats_->knock_now(); !cut.empty()) {
    throw CommError(who() + ": in-place recovery: generation " + std::to_string(generation_) +
                    " cannot connect: " + cut);
  }
}

void RecoveryCore::connect(int64_t generation) {
  auto state = std::make_unique<GroupState>();
  state->name = "gen" + std::to_string(generation);
  state->size = static_cast<int>(members_.size());
  for (size_t i = 0; i < members_.size(); ++i) {
    state->global_ranks.push_back(members_[i].job_rank);
    if (members_[i].same_process(self_)) {
      state->rank = static_cast<int>(i);
    }
  }
  state->world_size = launch_.world_size;
  state->timeout = timeout_;
  state->shared_memory_allowed = shared_memory_enabled_by_env();
  state->master_addr = launch_.master_addr;
  state->root_store = root_store_;
  // Note [In-place recovery]: every generation meets under its own prefix, so nothing of a broken
  // one is read again.
  state->store = c10::make_intrusive<c10d::PrefixStore>("dtrain/" + state->name, root_store_);
  // A wait on a member whose host is lost, or on a cut link, ends when the heartbeats say so.
  state->abandon_check = [heartbeats = heartbeats_, generation](Clock::time_point since) {
    return heartbeats->verdict(generation, since);
  };
  // A failure re-forms the group at once: no pause for a fuller message (GroupState).
  state->wait_for_peer_posts = false;
  // The admission check's number rides on the DDP's gradient all-reduce (step()).
  riding_ = std::make_shared<RidingNumber>();
  riding_read_ = 0;
  state->riding_number = riding_;
  group_ = GroupInternals::group(connect_group(std::move(state)));
}

// Hands the old generation's group to a thread of its own: Gloo's destructor joins its threads,
// which a stuck operation may hold, and the survivors must not wait for that.
void RecoveryCore::release_group(bool failed) {
  // Gradients may be views into the old buckets (gradient_as_bucket_view): drop them, the next
  // backward makes new ones.
  for (auto& p : module_->parameters()) p.mutable_grad() = at::Tensor();
  owner_.unwrap();
  // NCCL, unlike Gloo, can abort: after a failure the old generation's communicator is aborted
  // here, on this thread, so that none of its kernels still waits on the device for a peer that is
  // gone when the next generation's kernels queue behind it (on an H100, 0.5 s with the all-reduce
  // of a dead peer in flight: tests/cuda/cuda_recovery_test.cpp).
  if (failed && group_) GroupInternals::state(*group_)->abort_nccl();
  if (group_) releases_.emplace_back([old = std::move(group_)]() mutable { old.reset(); });
  group_.reset();
}

void RecoveryCore::reform(Reason reason, int newcomers, const std::string& cause) {
  std::string why = cause;
  for (;;) {
    if (stats_.generation >= options_.max_recoveries) {
      throw CommError(who() + ": in-place recovery: giving up after " +
                      std::to_string(stats_.generation) +
                      " re-formations (RecoveryOptions::max_recoveries); the last failure: " + why);
    }
    // Note [Heartbeats]: the side of a partition without the store stops; it must not go on as a
    // second job.
    if (const std::string cut = heartbeats_->cut_off(); !cut.empty()) {
      throw CommError(who() + ": in-place recovery: " + cut +
                      ". This process stops rather than go on as a second job; under `dtrain run "
                      "--recovery in-place` its launcher restarts it as a newcomer, admitted once "
                      "the store answers again. The failure: " +
                      why);
    }
    // A process left out while it did not answer (stopped, stalled, cut off) that comes back
    // after the others finished training: there is nothing left to re-form. Its launcher reads the
    // same mark and does not restart it (src/launcher/cli/in_place_recovery.cpp).
    bool job_over = false;
    try {
      // (finish() re-forms too, as a member of the end: it looks for the mark itself.)
      job_over = !finished_ && membership_->finished();
    } catch (const std::exception&) {
      // The store did not answer: forming the next generation says what is wrong.
    }
    if (job_over) {
      bool completed = true;
      try {
        completed = membership_->completed();
      } catch (const std::exception&) {
      }
      throw CommError(who() +
                      ": in-place recovery: the job ended without this process: it was left "
                      "out of the group while it did not answer (stopped, stalled or cut off), "
                      "and the others " +
                      (completed ? "completed training; it exits and is not restarted"
                                 : "stopped together on SIGTERM; it exits") +
                      ". The failure: " + why);
    }
    const int old_size = static_cast<int>(members_.size());
    // Where the time goes, for the log line: release, membership, connection, state, DDP.
    std::vector<Clock::time_point> marks{Clock::now()};
    release_group(reason == Reason::kFailure);
    marks.push_back(Clock::now());
    ++generation_;
    ++stats_.generation;
    if (reason == Reason::kFailure) ++stats_.recoveries;
    // A generation that cannot form (a timeout), one formed without this process or too small for
    // the job: final. A failure after it formed: the next generation is tried.
    if (reason == Reason::kFailure) membership_->mark_failed(generation_);
    // Note [A link cut between members]: a pair that cannot reach each other must not both be in.
    membership_->report_unreachable(heartbeats_->unreachable());
    std::vector<MemberRecord> previous =
        membership_->form(generation_, members_, newcomers, options_.settle);
    std::swap(previous, members_);
    // The members gone by their own leave, whichever re-formation finds them gone: a departure's,
    // or a failure's when the leaver's vote finished and a survivor's did not.
    stats_.departed += static_cast<int64_t>(membership_->departed(previous, members_).size());
    watch(generation_);
    // Fault injection for tests/recovery/recovery_test.cpp (see transfer_state): after a failure,
    // one survivor (the first to claim it) dies once the next generation agreed on its members and
    // before it connects, so that the others meet a second failure while the group forms.
    if (test_fault_ == "kill-member-mid-formation" && reason == Reason::kFailure &&
        root_store_->add("dtrain/recovery/test-fault", 1) == 1) {
      std::raise(SIGKILL);
    }
    marks.push_back(Clock::now());
    if (static_cast<int>(members_.size()) < options_.min_size) {
      throw CommError(who() + ": in-place recovery: " + std::to_string(members_.size()) +
                      " ranks left, fewer than RecoveryOptions::min_size (" +
                      std::to_string(options_.min_size) + "); the job stops.");
    }
    try {
      knock_before_connecting();
      connect(generation_);
      marks.push_back(Clock::now());
      transfer_state();
      marks.push_back(Clock::now());
      owner_.wrap(group_);
      marks.push_back(Clock::now());
      agreed_at_step_ = stats_.steps;  // equal on every member once the state is
    } catch (const StateLost&) {
      throw;
    } catch (const CommError& e) {
      why = e.what();
      reason = Reason::kFailure;
      newcomers = 0;
      continue;
    }
    if (group_->rank() == 0) {
      auto part = [&](size_t i) { return seconds_text(marks[i] - marks[i - 1]); };
      DTRAIN_LOG(
          kWarn,
          "in-place recovery: generation "
              << generation_ << " of " << group_->size() << " ranks (was " << old_size
              << ") ready in " << seconds_text(marks.back() - marks.front())
              << " (old group released " << part(1) << ", membership " << part(2) << ", connected "
              << part(3) << ", state " << part(4) << ", DDP " << part(5) << ") after "
              << (reason == Reason::kFailure ? "a failure: " + why
                  : reason == Reason::kDeparture
                      ? why
                      : std::string("admitting ") + std::to_string(newcomers) + " newcomer(s)"));
    }
    return;
  }
}

// After a formation: the survivors at the most steps send everything a step depends on (the
// module, the optimizer, the sampler's position, the counters and RecoveryOptions::state) to the
// others (the laggard that did not step, and newcomers), unless all are already equal.
void RecoveryCore::transfer_state() {
  const int64_t mine = newcomer_ ? -1 : stats_.steps;
  // The admission counts go by the largest too: a member that missed an admission (its all-reduce
  // failed where the others' finished) may be the one that sends the state below, and its counts
  // must not take the others' back (the newcomer would be admitted twice).
  auto counts =
      torch::tensor({mine, -mine, int64_t{newcomer_ ? 1 : 0}, newcomers_admitted_, stats_.admitted},
                    torch::kInt64);
  group_->all_reduce(counts, ReduceOp::kMax);
  const int64_t most = counts[0].item<int64_t>(), least = -counts[1].item<int64_t>();
  const bool newcomers = counts[2].item<int64_t>() > 0;
  newcomers_admitted_ = counts[3].item<int64_t>();  // the largest of the members'
  stats_.admitted = counts[4].item<int64_t>();
  if (most < 0) {
    // Only newcomers are left (every member that held the state died during their transfer):
    // going on would train a fresh model under the job's name.
    throw StateLost(who() + ": in-place recovery: generation " + std::to_string(generation_) +
                    " has only newcomers (" + std::to_string(group_->size()) +
                    "): every member that held the job's state died before it was sent, so the "
                    "job cannot go on in place; restart it from its last checkpoint.");
  }
  if (most == least && !newcomers) {
    // The common case: every survivor committed the same steps and holds the same state; each
    // stands where its own step began (Note [Where the sampler stands]).
    sampler_.load_state(step_start_);
    sampler_.reshard(group_->size(), group_->rank());
    return;
  }
  auto source_tensor = torch::tensor(
      {mine == most ? int64_t{group_->rank()} : int64_t{group_->size()}}, torch::kInt64);
  group_->all_reduce(source_tensor, ReduceOp::kMin);
  const int source = static_cast<int>(source_tensor.item<int64_t>());
  const bool sending = group_->rank() == source;
  if (sending && least >= 0 && least < most) {
    // Note [In-place recovery]: the last step finished its all-reduce on some members and failed
    // on others; it stands, and the members that did not step take this one's state.
    DTRAIN_LOG(kWarn, "in-place recovery: generation "
                          << generation_ << ": members stand at steps " << least << " and " << most
                          << " (step " << most
                          << " committed on some members only); this member, at step " << most
                          << ", sends its state to the others");
  }

  // Received into copies, applied only once all arrived: a transfer cut short by another failure
  // must not leave a half-updated replica (the next formation then sends again).
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  for (auto& p : module_->parameters())
    tensors.push_back(sending ? p.detach() : p.detach().clone());
  for (auto& b : module_->buffers()) tensors.push_back(sending ? b.detach() : b.detach().clone());
  for (auto& t : options_.state) tensors.push_back(sending ? t.detach() : t.detach().clone());
  // The default CPU generator (dropout, random augmentation): a newcomer continues the source's
  // stream instead of its own fresh one. (Fixed size for a given LibTorch.)
  at::Tensor random_state;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    random_state = generator.get_state();
  }
  tensors.push_back(random_state);
  for (auto& t : tensors) group_->broadcast(t, source);
  // Fault injection for tests/recovery/recovery_test.cpp, the only user: the member sending the
  // state to a newcomer, or the newcomer, dies (SIGKILL) halfway through the transfer, once per job
  // (the first process to claim it in the store). Not for programs: it kills the process.
  if ((test_fault_ == "kill-source-mid-transfer" && sending && newcomers) ||
      (test_fault_ == "kill-newcomer-mid-transfer" && newcomer_)) {
    if (root_store_->add("dtrain/recovery/test-fault", 1) == 1) std::raise(SIGKILL);
  }

  std::string optimizer_bytes;
  if (sending) {
    torch::serialize::OutputArchive archive;
    optimizer_.save(archive);
    std::ostringstream out;
    archive.save_to(out);
    optimizer_bytes = out.str();
  }
  // (The admission counts came with the first all-reduce, above.)
  auto counters = torch::tensor(
      {stats_.steps, step_start_.epoch, step_start_.samples_consumed, after_commit_.epoch,
       after_commit_.samples_consumed, stats_.recoveries, stats_.steps_redone, stats_.departed,
       static_cast<int64_t>(optimizer_bytes.size())},
      torch::kInt64);
  group_->broadcast(counters, source);
  auto bytes = torch::empty({counters[8].item<int64_t>()}, torch::kUInt8);
  if (sending) std::memcpy(bytes.data_ptr(), optimizer_bytes.data(), optimizer_bytes.size());
  group_->broadcast(bytes, source);

  if (!sending) {
    size_t i = 0;
    for (auto& p : module_->parameters()) p.detach().copy_(tensors[i++]);
    for (auto& b : module_->buffers()) b.detach().copy_(tensors[i++]);
    for (auto& t : options_.state) t.detach().copy_(tensors[i++]);
    if (newcomer_) {
      // A laggard keeps its own stream: it was already drawing from it.
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(tensors[i]);
    }
    std::istringstream in(std::string(static_cast<const char*>(bytes.data_ptr()),
                                      static_cast<size_t>(bytes.numel())));
    torch::serialize::InputArchive archive;
    // Onto this process's device: the sender's momentum buffers name its GPU (cuda:1 there may
    // be this process's cuda:0, or absent).
    std::optional<c10::Device> device;
    if (!module_->parameters().empty()) device = module_->parameters().front().device();
    archive.load_from(in, device);
    optimizer_.load(archive);
    auto c = counters.accessor<int64_t, 1>();
    // Note [Where the sampler stands] (step()): a newcomer begins where the sender's step began;
    // a laggard goes on from right after the step it missed, and replays what the sender did since
    // (an epoch's end, set_epoch); a member at the sender's step keeps its own.
    const SamplerState sender_start{c[1], c[2]}, sender_after_commit{c[3], c[4]};
    if (newcomer_) {
      step_start_ = sender_start;
      after_commit_ = sender_after_commit;
    } else if (mine < most) {
      step_start_ = after_commit_ = sender_after_commit;
    }
    stats_.steps = c[0];
    stats_.recoveries = c[5];
    stats_.steps_redone = c[6];
    stats_.departed = c[7];
  }
  stats_.generation = generation_;
  sampler_.load_state(step_start_);
  sampler_.reshard(group_->size(), group_->rank());
}

// Note [Where the sampler stands]
// A member keeps two positions of the sampler: where its current step began (step_start_: a failed
// step puts the sampler back there, and a newcomer begins there) and where it stood right after its
// last committed step (after_commit_). They differ when the program moved the sampler between two
// steps: at an epoch's end, where step() returned false and the loop called set_epoch. A laggard
// (its step failed where the others' finished: it is one step behind) takes the sender's
// after_commit_, not its step_start_: its step() then runs the body from there, as the sender's
// did, and returns false at an epoch's end as the sender's did, so its own loop reaches set_epoch,
// and finish(), as the sender's loop did. Given the sender's step_start_ instead (its next epoch),
// the laggard would train that epoch inside the one its loop is still in, and a loop that counts
// epochs itself would then call set_epoch once more than the others (a repeated epoch, a skipped
// one, and a hang at the end).
bool RecoveryCore::step(const std::function<bool()>& body) {
  if (job_finished_ || departed_ || finished_) return false;
  step_start_ = sampler_.state();
  admit_newcomers();
  // Rank 0's count of the newcomers that asked rides on this step's gradients; the next step's
  // admit_newcomers() reads the same sum on every member.
  riding_->contribution.store(
      group_->rank() == 0 ? static_cast<double>(heartbeats_->newcomers_seen()) : 0.0);
  for (;;) {
    try {
      const bool stepped = body();
      if (stepped) {
        ++stats_.steps;
        after_commit_ = sampler_.state();
      }
      return stepped;
    } catch (const CommError& e) {
      // Note [In-place recovery]: back to where the step began, then re-form; the transfer settles
      // who is ahead.
      sampler_.load_state(step_start_);
      ++stats_.steps_redone;
      reform(Reason::kFailure, 0, e.what());
    }
  }
}

// Note [Leaving in place] (dtrain/recovery.h). Each member's vote is 1, or the group's size where
// its leaving would take the job's store away (so the sum reaches the size: everyone stops). After
// a departure the members vote again in the new generation, so that its first collective is this
// vote on every member: also on one whose vote failed where the others' finished, which re-forms
// for the failure in step() and runs the body, and this vote, again.
StopAgreement RecoveryCore::agree_to_stop() {
  if (departed_) return StopAgreement::kLeave;  // left already (a newcomer that never joined)
  for (;;) {
    const bool mine = stop_requested();  // read once: SIGTERM may land during the all-reduce
    const int size = group_->size();
    const bool holds_store = launcher_hosts_store() ? launch_.node_rank == 0 : launch_.rank == 0;
    auto votes = torch::tensor({int64_t{mine ? (holds_store ? size : 1) : 0}}, torch::kInt64);
    group_->all_reduce(votes, ReduceOp::kSum);
    const int64_t leaving = votes.item<int64_t>();
    if (leaving == 0) return StopAgreement::kGoOn;
    if (size - leaving < options_.min_size) {
      stopping_all_ = true;  // finish() then marks the job stopped, not completed
      return StopAgreement::kStopAll;
    }
    if (mine) {
      depart();
      return StopAgreement::kLeave;
    }
    // Nothing of this step has changed yet; the formation re-deals the sampler from where it
    // began, and counts who left (reform): not the vote, as a leaver whose vote failed comes back.
    reform(Reason::kDeparture, 0,
           std::to_string(leaving) + " member(s) leaving on SIGTERM at step " +
               std::to_string(stats_.steps));
  }
}

// This member leaves the job (agree_to_stop): it tells the others that it is gone, so that their
// next generation closes without waiting for it, and stops watching.
void RecoveryCore::depart() {
  departed_ = true;
  stop_watching();
  heartbeats_->leave(Heartbeats::kLeftOnSigterm);
  release_group(/*failed=*/false);
}

// Admission happens where every member has the same count of newcomers to admit, at the same
// step. The count comes, in order of preference:
// - riding on the last step's gradient all-reduce (Note [A number riding on the gradients]): rank
//   0's count, no collective of its own; every member sees `carried` move in the same backward;
// - alone in the group, from the watcher directly: there is nobody to agree with;
// - otherwise, once admit_every steps have passed without either (their gradients could not carry
//   it: a comm hook, half-precision or CUDA gradients; or the body ran no synchronised backward),
//   from an all-reduce of its own.
// Each branch is taken on every member alike: `carried` moves in the same backwards everywhere, and
// agreed_at_step_ is the same everywhere.
void RecoveryCore::admit_newcomers() {
  int64_t requested = -1;
  if (const int64_t carried = riding_->carried.load(); carried != riding_read_) {
    riding_read_ = carried;
    agreed_at_step_ = stats_.steps;
    requested = std::llround(riding_->sum.load());
    ++readiness_.admission_carried;
  } else if (group_->size() == 1) {
    requested = heartbeats_->newcomers_seen();
  } else if (stats_.steps >= agreed_at_step_ + options_.admit_every) {
    agreed_at_step_ = stats_.steps;
    const auto check_start = std::chrono::steady_clock::now();
    auto seen = torch::tensor({heartbeats_->newcomers_seen()}, torch::kInt64);
    try {
      group_->all_reduce(seen, ReduceOp::kMax);
    } catch (const CommError& e) {
      reform(Reason::kFailure, 0, e.what());
      return;
    }
    requested = seen.item<int64_t>();
    ++readiness_.admission_checks;
    readiness_.admission_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - check_start).count();
  }
  if (requested <= newcomers_admitted_) return;
  // Fault injection for tests/recovery/recovery_test.cpp: job rank 1 misses the first admission
  // and re-forms as after a failure, as a member does whose all-reduce failed where the others'
  // finished (Note [A number riding on the gradients]): the others' admission must still stand.
  if (test_fault_ == "miss-admission" && launch_.rank == 1 && !newcomer_ &&
      root_store_->add("dtrain/recovery/test-fault", 1) == 1) {
    DTRAIN_LOG(kWarn,
               "in-place recovery: DTRAIN_TEST_FAULT=miss-admission: this member misses the "
               "admission of "
                   << requested - newcomers_admitted_ << " newcomer(s) and re-forms");
    reform(Reason::kFailure, 0, "DTRAIN_TEST_FAULT=miss-admission: this member missed it");
    return;
  }
  const int64_t first = newcomers_admitted_ + 1;
  const int count = static_cast<int>(requested - newcomers_admitted_);
  // Every member writes the admission (the same keys and values everywhere): a step whose
  // all-reduce finished on some members and failed on others admits on the first and re-forms for
  // the failure on the second, and the newcomer must not wait on one that never writes it.
  membership_->admit(first, requested, generation_ + 1);
  newcomers_admitted_ = requested;
  stats_.admitted += count;
  // What escapes reform() is final (it retries what it can): this process was left out, or too few
  // are left. Re-forming again would only let it go on alone, as a second job.
  reform(Reason::kAdmission, count, "");
}

void RecoveryCore::start_watching() {
  watch_control_ = std::make_shared<WatchControl>();
  auto exited = std::make_shared<std::promise<void>>();
  watcher_exited_ = exited->get_future();
  auto cpu_ns = heartbeat_cpu_ns_;
  auto knocks = knock_target_;
  watcher_ =
      std::thread([control = watch_control_, heartbeats = heartbeats_, knocks, exited, cpu_ns] {
        std::unique_lock<std::mutex> lock(control->mutex);
        bool failing = false;
        while (!control->stop) {
          lock.unlock();
          if (knocks) knocks->drain();  // whether the store answers or not
          try {
            heartbeats->round();
            failing = false;
          } catch (const std::exception& e) {
            // The store did not answer (it is gone, or out of reach): the verdict counts for how
            // long (Note [Heartbeats]); the rounds go on, so that a link that comes back is seen.
            if (!failing) DTRAIN_LOG(kDebug, "in-place recovery: a heartbeat failed: " << e.what());
            failing = true;
          }
          timespec used{};
          if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &used) == 0) {
            cpu_ns->store(static_cast<int64_t>(used.tv_sec) * 1000000000 + used.tv_nsec);
          }
          lock.lock();
          control->wake.wait_for(lock, kWatchEvery, [&] { return control->stop; });
        }
        exited->set_value();
      });
}

// Note [The end of training]
// Training ends on every member at once only in effect: the last step's all-reduce can finish on
// some members and fail on another, and a member can die after the last step. So the end is agreed
// like a step: a barrier that, when it fails, re-forms the group among the live members, heals a
// laggard (whose step() returns false, the sampler being at the end, so its loop reaches finish()
// too: Note [Where the sampler stands]) and is tried again; a member that died is not waited for.
// Only once the members agreed do they stop watching (the heartbeats tell a lost member during the
// barrier), retire their counters, and does rank 0 tell waiting newcomers that the job is over.
// Where this job's rank 0 hosts the store (not under `dtrain run`), a last barrier keeps it until
// the others are done with the store; training is over by then, so a failure there is only logged.
// Gloo's barrier is a dissemination barrier: a member dying partway through it can complete it on
// some members and fail it on others, and those that completed it have left. So every member that
// completes it marks the job finished at once, and a member whose barrier failed looks for that
// mark before it re-forms. A member in finish() has committed every step; if the others cannot be
// agreed with (they left, the store is gone, fewer than min_size remain), it says so and ends
// rather than throw away a finished training.
void RecoveryCore::finish() {
  if (departed_ || finished_) return;  // a member that left has nothing to tell
  finished_ = true;
  if (job_finished_ || !group_) {  // a newcomer that came after the end: joined nothing
    stop_watching();
    if (heartbeats_) heartbeats_->retire();
    return;
  }
  // Taking part in the end, said before anything can fail or take long (a re-formation below):
  // once training completed, a launcher kills a worker still running without it.
  try {
    membership_->mark_done();
  } catch (const std::exception& e) {
    DTRAIN_LOG(kWarn, "in-place recovery: could not mark this process done: " << e.what());
  }
  step_start_ = sampler_.state();
  auto marked_finished = [this] {
    try {
      return membership_->finished();
    } catch (const std::exception&) {
      return false;  // the store did not answer: re-forming will say what is wrong
    }
  };
  bool agreed = false;
  bool ended_by_another = false;
  for (;;) {
    try {
      group_->barrier();
      agreed = true;
      break;
    } catch (const CommError& e) {
      if (marked_finished()) {  // another member completed the barrier and left
        ended_by_another = true;
        break;
      }
      try {
        reform(Reason::kFailure, 0, e.what());
      } catch (const std::exception& failure) {
        if (marked_finished()) {  // the others ended it meanwhile
          ended_by_another = true;
          break;
        }
        DTRAIN_LOG(kWarn, who() << ": in-place recovery: training is over here (every step "
                                   "committed), but the end could not be agreed with the others: "
                                << failure.what());
        break;
      }
    }
  }
  if (agreed || ended_by_another) {
    try {
      membership_->mark_finished(/*completed=*/!stopping_all_);
    } catch (const std::exception& e) {
      DTRAIN_LOG(kWarn, "in-place recovery: could not mark the job finished: " << e.what());
    }
  }
  stop_watching();
  heartbeats_->retire();
  if (agreed && !launcher_hosts_store() && group_->size() > 1) {
    try {
      group_->barrier();
    } catch (const CommError& e) {
      DTRAIN_LOG(kWarn,
                 "in-place recovery: training is over and agreed; the last barrier before "
                 "exiting failed: "
                     << e.what());
    }
  }
}

void RecoveryCore::stop_watching() {
  if (!watch_control_) return;
  {
    std::lock_guard<std::mutex> lock(watch_control_->mutex);
    watch_control_->stop = true;
  }
  watch_control_->wake.notify_all();
  if (!watcher_.joinable()) return;
  // A round stuck in a store call on a cut link would hold this process up to the store's timeout:
  // it is left behind instead, holding only what it shares.
  if (watcher_exited_.wait_for(std::chrono::seconds(1)) == std::future_status::ready) {
    watcher_.join();
  } else {
    DTRAIN_LOG(kDebug, "in-place recovery: the heartbeat thread is stuck in a store call; left");
    watcher_.detach();
  }
}

}  // namespace detail

ResilientDataParallelBase::ResilientDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                     torch::optim::Optimizer& optimizer,
                                                     DistributedSampler sampler,
                                                     RecoveryOptions options)
    : core_(std::make_unique<detail::RecoveryCore>(*this, std::move(module), optimizer,
                                                   std::move(sampler), std::move(options))) {}

ResilientDataParallelBase::~ResilientDataParallelBase() = default;

void ResilientDataParallelBase::start() { core_->start(); }

bool ResilientDataParallelBase::step(const std::function<bool()>& body) {
  return core_->step(body);
}

const std::shared_ptr<ProcessGroup>& ResilientDataParallelBase::group() const {
  return core_->group_;
}

RecoveryStats ResilientDataParallelBase::stats() const { return core_->stats_; }

ReadinessCost ResilientDataParallelBase::readiness_cost() const { return core_->readiness_cost(); }

void ResilientDataParallelBase::finish() { core_->finish(); }

bool ResilientDataParallelBase::generation_current() const { return core_->generation_current(); }

StopAgreement ResilientDataParallelBase::agree_to_stop() { return core_->agree_to_stop(); }

bool ResilientDataParallelBase::job_finished() const { return core_->job_finished_; }

bool ResilientDataParallelBase::left() const { return core_->departed(); }

bool ResilientDataParallelBase::admitted_as_newcomer() const {
  return core_->admitted_as_newcomer();
}

}  // namespace dtrain
