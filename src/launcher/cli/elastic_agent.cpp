// The elastic agent of `dtrain run` (see elastic_agent.h). One thread runs the loop below; the
// rendezvous writes this node's heartbeats on a thread of its own, so they continue while the loop
// blocks stopping workers. The loop wakes on three things, through one epoll descriptor that
// WorkerGroup::wait() polls: a worker's exit, a signal (self-pipe), and the monitor timer.
#include "launcher/cli/elastic_agent.h"

#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <random>

#include "common/format.h"
#include "dtrain/errors.h"
#include "launcher/elastic/c10d_backend.h"
#include "launcher/elastic/ports.h"
#include "launcher/elastic/rendezvous.h"
#include "launcher/elastic/signal_pipe.h"
#include "launcher/elastic/worker_group.h"
// DTRAIN_HAVE_ETCD_BACKEND: set by src/launcher/cli/CMakeLists.txt when the etcd backend is there.
#ifdef DTRAIN_HAVE_ETCD_BACKEND
#include "launcher/elastic/etcd_backend.h"
#endif

namespace dtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;
using elastic::Verdict;

// The longest one call to the rendezvous store may take (a loaded etcd answers in milliseconds).
constexpr std::chrono::milliseconds kMaxCallTimeout{15000};
using elastic::WaitResult;

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
}

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string strip_prefix(const std::string& message) {
  const std::string prefix = "dtrain run: ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

// One descriptor that is readable when a signal is pending or the monitor timer fired.
class Waker {
 public:
  Waker(int signal_fd, std::chrono::milliseconds period) {
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    timer_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
    if (epoll_ < 0 || timer_ < 0)
      throw InternalError("dtrain run: cannot create the monitor timer");
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

std::string host_name() {
  char name[256] = "";
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string node_id(const std::string& host) {
  std::random_device random;
  char suffix[9];
  snprintf(suffix, sizeof(suffix), "%08x", static_cast<unsigned>(random()));
  return host + "_" + std::to_string(getpid()) + "_" + suffix;
}

// The backend for the flags, after its first successful contact. c10d: hosts the store when this
// process can bind the endpoint, then waits up to join_timeout for the store to answer (its host
// may start after this agent). Throws CommError (exit 1) when nothing answers in time (the flags
// may be right and the store's node only late or down: a scheduler retries a 1, not a 2),
// UsageError (exit 2) when the token is refused, and elastic::NotAStoreError (exit 1) at once when
// another program answers at the endpoint.
std::unique_ptr<elastic::RendezvousBackend> connect_backend(
    const RunOptions& options, const std::string& token,
    std::unique_ptr<elastic::C10dStoreServer>* server) {
  std::string endpoint = options.rdzv_host + ":" + std::to_string(options.rdzv_port);
  std::chrono::milliseconds join_timeout = to_ms(options.rdzv_conf.join_timeout_s);
  // One call to the store: bounded more tightly than the wait at start, so that a store whose
  // machine vanished (no reset, only silence) ends the job in seconds, not after join_timeout.
  std::chrono::milliseconds call_timeout = std::min(join_timeout, kMaxCallTimeout);
  if (options.rdzv_backend == "etcd") {
#ifdef DTRAIN_HAVE_ETCD_BACKEND
    endpoint = options.rdzv_endpoint;  // every member of the etcd cluster, to fail over between
    if (!token.empty()) {
      say("note: the rendezvous token guards the c10d store only; secure etcd with its own "
          "authentication and TLS");
    }
    auto backend = std::make_unique<elastic::EtcdBackend>(endpoint, options.run_id, call_timeout);
    try {
      backend->check_reachable();
    } catch (const CommError& error) {
      throw CommError("dtrain run: --rdzv-endpoint " + endpoint + ": " +
                      strip_prefix(error.what()));
    }
    return backend;
#else
    throw UsageError(
        "dtrain run: --rdzv-backend etcd: this dtrain was built without the etcd "
        "backend; use c10d");
#endif
  }

  *server = elastic::C10dStoreServer::try_host(options.rdzv_host, options.rdzv_port, token,
                                               [](const std::string& line) { say(line); });
  if (*server) {
    say("hosting the c10d rendezvous store at " + (*server)->address() +
        " (the job ends if this agent dies; --rdzv-backend etcd has no such single point of "
        "failure)");
  }
  if (token.empty()) {
    say("the rendezvous at " + endpoint +
        " is open: any process that can reach it can join this job; set DTRAIN_RDZV_TOKEN on "
        "every node to require a token");
  }
  auto backend = std::make_unique<elastic::C10dBackend>(options.rdzv_host, options.rdzv_port,
                                                        options.run_id, token, call_timeout);
  Clock::time_point deadline = Clock::now() + join_timeout;
  std::string last_error;
  for (;;) {
    try {
      backend->get_state();
      return backend;
    } catch (const elastic::NotAStoreError&) {
      // Another program holds the port (its message says so): waiting cannot help. It ends this
      // agent with exit code 1, the code of a rendezvous that failed (run_usage()), through
      // run_main's handler of every error that is not a UsageError; not 2 ("fix the flags"): the
      // flags may well be right and the port only taken for now, and a scheduler retries a 1.
      throw;
    } catch (const TimeoutError& error) {
      last_error = strip_prefix(error.what());
    } catch (const CommError& error) {
      last_error = strip_prefix(error.what());  // refused: its host may not have started yet
    }
    if (Clock::now() >= deadline) {
      throw CommError("dtrain run: --rdzv-endpoint " + endpoint +
                      ": no rendezvous store answered within " +
                      detail::seconds_text(options.rdzv_conf.join_timeout_s) + " (" + last_error +
                      "); start the agent on the node that has this address, or fix the "
                      "endpoint");
    }
    usleep(200 * 1000);
  }
}

// The message for a rendezvous store that stopped answering mid-job.
std::string store_lost(const RunOptions& options, const std::exception& error) {
  std::string message = "lost the rendezvous: " + strip_prefix(error.what());
  if (options.rdzv_backend == "c10d") {
    message +=
        "; with --rdzv-backend c10d the store lives in the agent that hosted it, and that agent "
        "is gone, so the job cannot continue (--rdzv-backend etcd has no such single point of "
        "failure)";
  }
  return message;
}

std::string describe_failure(const elastic::NodeInfo& self, const elastic::WorkerExit& root) {
  return "worker rank " + std::to_string(root.global_rank) + " on " + self.describe() + " " +
         root.describe();
}

}  // namespace

int run_elastic(const RunOptions& options, const LaunchPlan& plan) {
  // Installed before the first worker exists, so no signal slips between fork and the handler.
  elastic::SignalPipe signals(elastic::kLauncherSignals);

  // The token: --rdzv-token, or DTRAIN_RDZV_TOKEN which stays out of process listings. Removed from
  // this process's environment so that the workers never see it.
  std::string token = options.rdzv_token;
  if (const char* variable = std::getenv("DTRAIN_RDZV_TOKEN"); token.empty() && variable) {
    token = variable;
  }
  unsetenv("DTRAIN_RDZV_TOKEN");
  if (!options.rdzv_token.empty()) {
    say("warning: --rdzv-token is visible in process listings; prefer the variable "
        "DTRAIN_RDZV_TOKEN");
  }

  std::unique_ptr<elastic::C10dStoreServer> server;
  std::unique_ptr<elastic::RendezvousBackend> backend = connect_backend(options, token, &server);

  elastic::NodeInfo self;
  self.host = host_name();
  self.id = node_id(self.host);
  self.addr = elastic::local_address_towards(options.rdzv_host, options.rdzv_port);
  if (self.addr.empty()) self.addr = self.host;
  self.nproc = options.nproc_per_node;

  elastic::RendezvousSettings settings;
  settings.job_id = options.run_id;
  settings.min_nodes = options.min_nodes;
  settings.max_nodes = options.nnodes;
  settings.timeout = to_ms(options.rdzv_conf.timeout_s);
  settings.last_call_timeout = to_ms(options.rdzv_conf.last_call_timeout_s);
  settings.keep_alive_interval = to_ms(options.rdzv_conf.keep_alive_interval_s);
  settings.keep_alive_max_attempt = options.rdzv_conf.keep_alive_max_attempt;
  settings.max_restarts = options.max_restarts;
  elastic::Rendezvous rendezvous(std::move(backend), settings, self);
  rendezvous.start_keep_alive();

  elastic::WorkerGroup group(worker_group_options(options, plan));
  Waker waker(signals.fd(), to_ms(options.monitor_interval_s));
  say(self.describe() + " joins rendezvous '" + options.run_id + "' at " + options.rdzv_host + ":" +
      std::to_string(options.rdzv_port) + " (" + options.rdzv_backend + ", --nnodes " +
      std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes) + ")");

  // SIGTERM/SIGINT/SIGHUP/SIGQUIT while workers run: passed on to them (SIGTERM, SIGKILL after the
  // grace period, the trainer checkpoints meanwhile), then this node leaves so the others shrink at
  // once.
  auto leave_on_signal = [&](int signo) {
    say("received " + elastic::signal_name(signo) + "; passing SIGTERM to " +
        std::to_string(group.running()) + " worker(s) (SIGKILL after " +
        detail::seconds_text(options.grace_period_s) + ") and leaving the rendezvous");
    try {
      if (server) {
        // The store leaves with this process: tell the others now, while it still answers, rather
        // than let them find it gone.
        rendezvous.end_job(self.describe() + ", which hosts the c10d rendezvous store, received " +
                           elastic::signal_name(signo) +
                           "; with --rdzv-backend c10d the job cannot continue without it "
                           "(--rdzv-backend etcd has no such single point of failure)");
      } else {
        rendezvous.announce_leaving();
      }
    } catch (const std::exception&) {
    }
    group.stop(signals.fd());
    if (server) {
      try {
        rendezvous.wait_until_others_left(std::chrono::seconds(5));
      } catch (const std::exception&) {
      }
    }
    try {
      rendezvous.leave("received " + elastic::signal_name(signo));
    } catch (const std::exception& error) {
      say("could not leave the rendezvous cleanly (" + strip_prefix(error.what()) +
          "); the others notice by heartbeat");
    }
    return 128 + signo;
  };

  // Once the job has ended: out of the state, so that the c10d store's host need not wait for us;
  // the host itself first waits (briefly) for the others to read why it ended.
  auto leave_quietly = [&] {
    try {
      if (server) rendezvous.wait_until_others_left(std::chrono::seconds(5));
      rendezvous.leave("the job ended");
    } catch (const std::exception&) {
    }
  };

  // How long the store may stay silent while workers run (see the check below).
  const std::chrono::milliseconds store_patience =
      settings.keep_alive_interval * settings.keep_alive_max_attempt;
  Clock::time_point store_trouble_since{};

  for (;;) {
    Clock::time_point rendezvous_start = Clock::now();
    std::optional<elastic::RoundAssignment> round;
    try {
      round = rendezvous.next_round(elastic::pick_free_port(), signals.fd());
    } catch (const PeerLostError& error) {  // the job was shut down
      say(strip_prefix(error.what()));
      leave_quietly();
      return 1;
    } catch (const TimeoutError& error) {
      say(strip_prefix(error.what()));
      return 1;
    } catch (const UsageError&) {
      throw;
    } catch (const CommError& error) {
      say(store_lost(options, error));
      return 1;
    }
    if (!round) {
      int signo = signals.take();
      say("received " + elastic::signal_name(signo) + " while in the rendezvous; leaving");
      try {
        rendezvous.leave("received " + elastic::signal_name(signo));
      } catch (const std::exception&) {
      }
      return 128 + signo;
    }

    elastic::WorkerGroupRound worker_round;
    worker_round.group_rank = round->group_rank;
    worker_round.group_world_size = round->group_world_size;
    worker_round.base_rank = round->base_rank;
    worker_round.world_size = round->world_size;
    worker_round.master_addr = round->master_addr;
    worker_round.master_port = round->master_port;
    worker_round.restart_count = round->round;
    say("round " + std::to_string(round->round) + ": node rank " +
        std::to_string(round->group_rank) + " of " + std::to_string(round->group_world_size) +
        ", WORLD_SIZE " + std::to_string(round->world_size) + ", master " + round->master_addr +
        ":" + std::to_string(round->master_port) + " (rendezvous took " +
        detail::seconds_text(since(rendezvous_start)) + ")");
    group.start(worker_round);

    for (bool round_running = true; round_running;) {
      WaitResult result = group.wait(waker.fd());
      if (result.state == WaitResult::State::kSucceeded) {
        group.stop();
        say("round " + std::to_string(round->round) + ": every worker of this node succeeded");
        try {
          rendezvous.finish();
          if (server) {
            // The others' rendezvous runs through this process: stay while they are alive and
            // running (their heartbeats say so; a lost one stops counting).
            rendezvous.wait_for_others(std::chrono::hours(24 * 365), signals.fd());
          }
        } catch (const std::exception& error) {
          say("this node's workers succeeded; the rendezvous did not answer at the end (" +
              strip_prefix(error.what()) + ")");
        }
        return 0;
      }

      // WorkerGroup::wait() reports kInterrupted when the monitor timer fired in the same wake-up
      // as a worker's exit, with that exit in result.failures (and reaped: the next wait() would
      // not see it again, and would call the round a success). Only a signal outranks it.
      if (result.state == WaitResult::State::kInterrupted && !result.failures.empty()) {
        if (int signo = signals.take(); signo != 0) return leave_on_signal(signo);
        waker.drain_timer();
        result.state = WaitResult::State::kFailed;
      }
      if (result.state == WaitResult::State::kInterrupted) {
        if (int signo = signals.take(); signo != 0) return leave_on_signal(signo);
        waker.drain_timer();
        Verdict verdict;
        try {
          verdict = rendezvous.check();
          store_trouble_since = {};
        } catch (const UsageError&) {
          throw;
        } catch (const std::exception& error) {
          // A store that misses a look or two (an etcd leader election, a starved c10d host) is
          // not a lost job: the workers keep running while it stays silent for less than a
          // heartbeat timeout, the time after which the others would count this node dead anyway.
          if (store_trouble_since == Clock::time_point{}) {
            store_trouble_since = Clock::now();
            say("the rendezvous store did not answer (" + strip_prefix(error.what()) +
                "); the workers keep running while it is retried for up to " +
                detail::seconds_text(store_patience));
          }
          if (Clock::now() - store_trouble_since < store_patience) continue;
          say(store_lost(options, error) + "; stopping " + std::to_string(group.running()) +
              " worker(s)");
          group.stop(signals.fd());
          return 1;
        }
        if (verdict.kind == Verdict::Kind::kKeepRunning) continue;
        Clock::time_point stop_start = Clock::now();
        int running = group.running();
        group.stop(signals.fd());
        if (verdict.kind == Verdict::Kind::kShutdown) {
          say("the job ends: " + verdict.message + "; stopped " + std::to_string(running) +
              " worker(s) of this node");
          leave_quietly();
          return 1;
        }
        say("new round: " + verdict.message + "; stopped " + std::to_string(running) +
            " worker(s) of this node in " + detail::seconds_text(since(stop_start)));
        round_running = false;
        continue;
      }

      // A local worker failed.
      const elastic::WorkerExit& root = result.failures.front();
      Clock::time_point stop_start = Clock::now();
      group.stop(signals.fd());
      double stop_seconds = since(stop_start);
      print_failure_summary(result, worker_round);
      if (int signo = signals.take(); signo != 0) return leave_on_signal(signo);
      if (root.usage_error()) {
        std::string why = describe_failure(self, root) +
                          ": a usage error (a bad flag, variable or file), which a restart cannot "
                          "fix; not restarting";
        try {
          rendezvous.end_job(why);
        } catch (const std::exception&) {
        }
        leave_quietly();
        say("the job ends: " + why + "; exiting with code 2");
        return root.launcher_exit_code();
      }
      Verdict verdict;
      try {
        verdict = rendezvous.report_failure(describe_failure(self, root));
      } catch (const UsageError&) {
        throw;
      } catch (const std::exception& error) {
        say(store_lost(options, error));
        return root.launcher_exit_code();
      }
      if (verdict.kind == Verdict::Kind::kShutdown) {
        leave_quietly();
        say("the job ends: " + verdict.message + "; exiting with code " +
            std::to_string(root.launcher_exit_code()));
        return root.launcher_exit_code();
      }
      say("new round: " + verdict.message + "; stopped this node's workers in " +
          detail::seconds_text(stop_seconds));
      round_running = false;
    }
  }
}

}  // namespace dtrain::cli
