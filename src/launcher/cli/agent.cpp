// The agent's loop (see agent.h). One thread runs it; it wakes on three things, through one epoll
// descriptor that WorkerGroup::wait() polls: a worker's exit, a signal (self-pipe), and the monitor
// timer (only where the rendezvous has something to look at).
#include "launcher/cli/agent.h"

#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "common/format.h"
#include "dtrain/errors.h"
#include "dtrain/exit_codes.h"
#include "launcher/cli/elastic_rendezvous.h"
#include "launcher/cli/in_place_recovery.h"
#include "launcher/cli/static_rendezvous.h"

namespace dtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;
using elastic::Verdict;
using elastic::WaitResult;

// Note [Stopping after a loss] (launcher/elastic/rendezvous.h): the grace the workers get when a
// round ends because a participant was lost. A moment for a program to flush its output; a stop
// they agree on cannot happen without the lost peer, and waiting --grace-period for it gains
// nothing.
constexpr std::chrono::milliseconds kGraceAfterALoss{500};

// One descriptor that is readable when a signal is pending or the monitor timer fired. A zero
// period leaves the timer disarmed: only signals wake it.
class Waker {
 public:
  Waker(int signal_fd, std::chrono::milliseconds period) {
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    timer_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
    if (epoll_ < 0 || timer_ < 0) {
      if (epoll_ >= 0) close(epoll_);
      if (timer_ >= 0) close(timer_);
      throw InternalError("dtrain run: cannot create the monitor timer");
    }
    itimerspec spec{};
    spec.it_interval.tv_sec = period.count() / 1000;
    spec.it_interval.tv_nsec = (period.count() % 1000) * 1000000;
    spec.it_value = spec.it_interval;
    timerfd_settime(timer_, 0, &spec, nullptr);
    for (int fd : {signal_fd, timer_}) {
      epoll_event event{};
      event.events = EPOLLIN;
      event.data.fd = fd;
      epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &event);
    }
  }
  ~Waker() {
    close(timer_);
    close(epoll_);
  }
  Waker(const Waker&) = delete;
  Waker& operator=(const Waker&) = delete;
  int fd() const { return epoll_; }
  void drain_timer() {
    uint64_t expirations = 0;
    ssize_t ignored = read(timer_, &expirations, sizeof(expirations));
    (void)ignored;
  }

 private:
  int epoll_ = -1;
  int timer_ = -1;
};

}  // namespace

int run_agent(const RunOptions& options, const LaunchPlan& plan) {
  // Installed before the first worker exists, so no signal slips between fork and the handler.
  elastic::SignalPipe signals(elastic::kLauncherSignals);
  std::unique_ptr<AgentRendezvous> rendezvous;
  // --recovery in-place; without it a failure stops the whole group and asks for a new round.
  std::optional<InPlaceRecovery> in_place;
  // Under an elastic rendezvous, which counts its rounds against --max-restarts job-wide, a worker
  // restarted alone spends from this node's own budget instead.
  RestartBudget node_restarts(options.max_restarts);
  if (is_elastic(options)) {
    int exit_code = 1;
    rendezvous = join_elastic_rendezvous(options, signals, &exit_code);
    if (!rendezvous) return exit_code;  // a signal came while joining
    if (recovers_in_place(options)) {
      in_place.emplace(/*auto_port=*/false, node_restarts, /*one_node_job=*/options.nnodes == 1);
    }
  } else {
    auto fixed =
        std::make_unique<StaticRendezvous>(options, plan.auto_port, plan.master_unresolved);
    if (recovers_in_place(options)) {
      in_place.emplace(plan.auto_port, fixed->restarts(), /*one_node_job=*/options.nnodes == 1);
    }
    rendezvous = std::move(fixed);
  }
  elastic::WorkerGroup group(worker_group_options(options, plan));
  // In place, node 0 also looks for workers left behind by the end of the job
  // (InPlaceRecovery::end_stragglers): at the rendezvous's looks, or every kLookInterval where the
  // rendezvous has none (the static one).
  const bool rendezvous_looks = rendezvous->monitor_interval().count() > 0;
  Waker waker(signals.fd(), rendezvous_looks ? rendezvous->monitor_interval()
                            : in_place       ? InPlaceRecovery::kLookInterval
                                             : std::chrono::milliseconds(0));

  // SIGTERM/SIGINT/SIGHUP/SIGQUIT: passed on to the workers (SIGTERM, SIGKILL after the grace
  // period; a trainer checkpoints meanwhile, or leaves a job that recovers in place), and this node
  // leaves the job. `ended`: workers already reaped in the wake-up that brought the signal (a
  // scheduler signals them too); `round`: the running one.
  auto end_on_signal = [&](int signo, std::vector<elastic::WorkerExit> ended,
                           const elastic::WorkerGroupRound& round) {
    const int running = group.running();
    say("received " + elastic::signal_name(signo) + "; " +
        (running > 0
             ? "passing SIGTERM to " + std::to_string(running) + " worker(s) (SIGKILL after " +
                   detail::seconds_text(options.grace_period_s) + ")"
             : std::string("not restarting")));
    rendezvous->leaving(signo);
    for (elastic::WorkerExit& exit : group.stop(signals.fd())) ended.push_back(std::move(exit));
    // Note [Leaving in place] (dtrain/recovery.h): every worker of this node left while the others
    // went on, so the others need no new round; workers that stopped with their peers at a
    // checkpoint (143), or were killed, do. The workers' store confirms that their group recovers
    // in place (Note [Rounds in place]): node 0's agent may not have looked yet. (Another program
    // may exit with 75, EX_TEMPFAIL, for reasons of its own: unconfirmed, that counts only where
    // node 0's agent marked the round.)
    elastic::WorkersLeft workers = elastic::WorkersLeft::kStopped;
    if (in_place && !ended.empty() && std::all_of(ended.begin(), ended.end(), [](const auto& exit) {
          return exit.signal == 0 && exit.exit_code == kLeftExitCode;
        })) {
      workers = in_place->group_formed_in(round) ? elastic::WorkersLeft::kInPlaceConfirmed
                                                 : elastic::WorkersLeft::kInPlace;
    }
    rendezvous->leave(signo, workers);
    return 128 + signo;
  };

  for (;;) {
    int exit_code = 1;
    std::optional<elastic::WorkerGroupRound> round = rendezvous->next_round(signals, &exit_code);
    if (!round) return exit_code;
    if (in_place) in_place->prepare(*round);
    group.start(*round);
    // Node 0 tells the rendezvous once the workers recover in place (Note [Rounds in place]).
    bool told_in_place = false;

    for (bool round_running = true; round_running;) {
      WaitResult result = group.wait(waker.fd());
      if (in_place) in_place->announce_exits(*round, result);
      if (result.state == WaitResult::State::kInterrupted) {
        if (int signo = signals.take(); signo != 0) {
          return end_on_signal(signo, result.failures, *round);
        }
        waker.drain_timer();
        // wait() reports kInterrupted when the monitor timer fired in the same wake-up as a
        // worker's exit, with that exit in result.failures (and reaped: the next wait() would not
        // see it again, and would call the round a success).
        if (!result.failures.empty()) result.state = WaitResult::State::kFailed;
      }
      if (result.state == WaitResult::State::kSucceeded) {
        group.stop();  // ends whatever the workers left running in their process groups
        rendezvous->finish(signals.fd());
        return in_place ? in_place->exit_code_after_completion() : 0;
      }

      if (result.state == WaitResult::State::kInterrupted) {  // the monitor timer
        if (in_place) in_place->end_stragglers(group, *round);
        if (!rendezvous_looks) continue;
        if (in_place && !told_in_place && in_place->group_formed()) {
          told_in_place = rendezvous->workers_recover_in_place();
          if (told_in_place) {
            say("the workers recover in place: from now on a node lost, joining or leaving on "
                "SIGTERM changes the running round without restarting them");
          }
        }
        Verdict verdict = rendezvous->check();
        if (verdict.kind == Verdict::Kind::kKeepRunning) {
          if (!verdict.message.empty()) say(verdict.message);
          continue;
        }
        Clock::time_point stop_start = Clock::now();
        const int running = group.running();
        std::optional<std::chrono::milliseconds> grace;
        if (verdict.participant_lost) {
          grace = std::min(
              kGraceAfterALoss,
              std::chrono::milliseconds(static_cast<long long>(options.grace_period_s * 1000.0)));
        }
        // A signal while they stop: they keep their grace; it ends this node's part below.
        int signo = 0;
        group.stop(signals, &signo, grace);
        const bool killed = group.last_stop_killed();
        const std::string stopped =
            "; stopped " + std::to_string(running) + " worker(s) of this node in " +
            detail::seconds_text(Clock::now() - stop_start) +
            (grace && killed ? " (SIGKILL after " + detail::seconds_text(*grace) +
                                   ": they cannot stop together with a lost peer)"
                             : "");
        say(verdict.message + stopped);
        if (signo != 0) return end_on_signal(signo, {}, *round);
        if (verdict.kind == Verdict::Kind::kShutdown) {
          rendezvous->leave_ended_job();
          return 1;
        }
        round_running = false;
        continue;
      }

      // A local worker failed.
      if (in_place && in_place->restart_alone(group, *round, result, signals.fd())) continue;
      // A signal came with it (a scheduler signals the workers too): the others get their SIGTERM
      // and grace from end_on_signal, not the immediate SIGKILL that stop() gives for a signal
      // still pending (a second Ctrl-C).
      if (int signo = signals.take(); signo != 0) {
        return end_on_signal(signo, result.failures, *round);
      }
      const elastic::WorkerExit& root = result.failures.front();
      if (group.running() > 0) {
        say("rank " + std::to_string(root.global_rank) + " failed; stopping the other " +
            std::to_string(group.running()) + " worker(s) of this node");
      }
      std::vector<elastic::WorkerExit> ended = result.failures;
      // The others got SIGTERM for the failure before any signal came: a first signal meanwhile
      // leaves them their grace (a trainer may be saving a checkpoint on that SIGTERM), only a
      // second cuts it short, as for a stop that a signal began.
      int signo = 0;
      for (elastic::WorkerExit& exit : group.stop(signals, &signo)) {
        ended.push_back(std::move(exit));
      }
      print_failure_summary(result, *round);
      if (signo == 0) signo = signals.take();
      if (signo != 0) return end_on_signal(signo, std::move(ended), *round);
      Verdict verdict = rendezvous->report_failure(root);
      if (verdict.kind == Verdict::Kind::kShutdown) {
        say(verdict.message + "; exiting with code " + std::to_string(root.launcher_exit_code()));
        rendezvous->leave_ended_job();
        return root.launcher_exit_code();
      }
      say(verdict.message);
      round_running = false;
    }
  }
}

}  // namespace dtrain::cli
