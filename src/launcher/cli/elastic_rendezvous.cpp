// The elastic rendezvous of the agent (see elastic_rendezvous.h). The rendezvous writes this node's
// heartbeats on a thread of its own, so they continue while the agent's loop blocks stopping
// workers.
#include "launcher/cli/elastic_rendezvous.h"

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

// Where the rendezvous is, as the backend is given it and messages name it: HOST:PORT, or with etcd
// --rdzv-endpoint as given (every member of its cluster, to fail over between).
std::string rendezvous_endpoint(const RunOptions& options) {
  return options.rdzv_backend == "etcd"
             ? options.rdzv_endpoint
             : options.rdzv_host + ":" + std::to_string(options.rdzv_port);
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
  const std::string endpoint = rendezvous_endpoint(options);
  std::chrono::milliseconds join_timeout = to_ms(options.rdzv_conf.join_timeout_s);
  // One call to the store: bounded more tightly than the wait at start, so that a store whose
  // machine vanished (no reset, only silence) ends the job in seconds, not after join_timeout.
  std::chrono::milliseconds call_timeout = std::min(join_timeout, kMaxCallTimeout);
  if (options.rdzv_backend == "etcd") {
#ifdef DTRAIN_HAVE_ETCD_BACKEND
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
        "; with --rdzv-backend c10d the store lives in the agent that hosted it: either that "
        "agent is gone or this node is cut off from it (from here the two look the same), and "
        "this node cannot continue without it (--rdzv-backend etcd has no such single point of "
        "failure)";
  }
  return message;
}

std::string describe_failure(const elastic::NodeInfo& self, const elastic::WorkerExit& root) {
  return "worker rank " + std::to_string(root.global_rank) + " on " + self.describe() + " " +
         root.describe();
}

// A verdict of elastic::Rendezvous as the line the agent says.
Verdict as_line(Verdict verdict) {
  if (verdict.kind == Verdict::Kind::kNewRound) {
    verdict.message = "new round: " + verdict.message;
  } else if (verdict.kind == Verdict::Kind::kShutdown) {
    verdict.message = "the job ends: " + verdict.message;
  } else if (!verdict.message.empty()) {
    verdict.message = "in place: " + verdict.message;
  }
  return verdict;
}

class ElasticRendezvous final : public AgentRendezvous {
 public:
  ElasticRendezvous(const RunOptions& options, std::unique_ptr<elastic::C10dStoreServer> server,
                    std::unique_ptr<elastic::RendezvousBackend> backend)
      : options_(options), server_(std::move(server)) {
    elastic::NodeInfo self;
    self.host = host_name();
    self.id = node_id(self.host);
    self.addr = elastic::local_address_towards(options.rdzv_host, options.rdzv_port);
    if (self.addr.empty()) self.addr = self.host;
    self.nproc = options.nproc_per_node;
    self.hosts_rendezvous = server_ != nullptr;

    elastic::RendezvousSettings settings;
    settings.job_id = options.run_id;
    settings.min_nodes = options.min_nodes;
    settings.max_nodes = options.nnodes;
    settings.timeout = to_ms(options.rdzv_conf.timeout_s);
    settings.last_call_timeout = to_ms(options.rdzv_conf.last_call_timeout_s);
    settings.keep_alive_interval = to_ms(options.rdzv_conf.keep_alive_interval_s);
    settings.keep_alive_max_attempt = options.rdzv_conf.keep_alive_max_attempt;
    settings.max_restarts = options.max_restarts;
    store_patience_ = settings.keep_alive_interval * settings.keep_alive_max_attempt;
    rendezvous_ = std::make_unique<elastic::Rendezvous>(std::move(backend), settings, self);
    rendezvous_->start_keep_alive();
    say(self.describe() + " joins rendezvous '" + options.run_id + "' at " +
        rendezvous_endpoint(options) + " (" + options.rdzv_backend + ", --nnodes " +
        std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes) + ")");
  }

  std::optional<elastic::WorkerGroupRound> next_round(elastic::SignalPipe& signals,
                                                      int* exit_code) override {
    Clock::time_point start = Clock::now();
    std::optional<elastic::RoundAssignment> round;
    *exit_code = 1;
    try {
      round = rendezvous_->next_round(elastic::pick_free_port(), signals.fd());
    } catch (const PeerLostError& error) {  // the job was shut down
      say(strip_prefix(error.what()));
      leave_ended_job();
      return std::nullopt;
    } catch (const TimeoutError& error) {
      say(strip_prefix(error.what()));
      return std::nullopt;
    } catch (const UsageError&) {
      throw;
    } catch (const CommError& error) {
      say(store_lost(options_, error));
      return std::nullopt;
    }
    if (!round) {
      int signo = signals.take();
      say("received " + elastic::signal_name(signo) + " while in the rendezvous; leaving");
      try {
        rendezvous_->leave("received " + elastic::signal_name(signo));
      } catch (const std::exception&) {
      }
      *exit_code = 128 + signo;
      return std::nullopt;
    }
    say("round " + std::to_string(round->round) + ": node rank " +
        std::to_string(round->group_rank) + " of " + std::to_string(round->group_world_size) +
        ", WORLD_SIZE " + std::to_string(round->world_size) + ", master " + round->master_addr +
        ":" + std::to_string(round->master_port) + " (rendezvous took " +
        detail::seconds_text(since(start)) + ")");
    elastic::WorkerGroupRound workers;
    workers.group_rank = round->group_rank;
    workers.group_world_size = round->group_world_size;
    workers.base_rank = round->base_rank;
    workers.world_size = round->world_size;
    workers.master_addr = round->master_addr;
    workers.master_port = round->master_port;
    workers.restart_count = round->round;
    workers.join_running = round->join_running;
    if (round->join_running) {
      say("admitted into the running round " + std::to_string(round->round) +
          " in place: this node's workers join as newcomers and take their state from a live "
          "peer");
    }
    return workers;
  }

  std::chrono::milliseconds monitor_interval() const override {
    return to_ms(options_.monitor_interval_s);
  }

  Verdict check() override {
    Verdict verdict;
    try {
      verdict = rendezvous_->check();
      store_trouble_since_ = {};
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception& error) {
      // A store that misses a look or two (an etcd leader election, a starved c10d host) is not a
      // lost job: the workers keep running while it stays silent for less than a heartbeat
      // timeout, the time after which the others would count this node dead anyway.
      if (store_trouble_since_ == Clock::time_point{}) {
        store_trouble_since_ = Clock::now();
        say("the rendezvous store did not answer (" + strip_prefix(error.what()) +
            "); the workers keep running while it is retried for up to " +
            detail::seconds_text(store_patience_));
      }
      if (Clock::now() - store_trouble_since_ < store_patience_) return {};
      store_lost_ = true;
      return {Verdict::Kind::kShutdown, store_lost(options_, error)};
    }
    return as_line(verdict);
  }

  bool workers_recover_in_place() override {
    try {
      rendezvous_->mark_in_place();
      return true;
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception&) {
      // check() meets the same trouble and says so. Until a later try succeeds, a change of
      // nodes restarts the workers, as it would without in place.
      return false;
    }
  }

  Verdict report_failure(const elastic::WorkerExit& root) override {
    if (root.usage_error()) {
      std::string why = describe_failure(rendezvous_->self(), root) +
                        ": a usage error (a bad flag, variable or file), which a restart cannot "
                        "fix; not restarting";
      try {
        rendezvous_->end_job(why);
      } catch (const std::exception&) {
      }
      return as_line({Verdict::Kind::kShutdown, why});
    }
    try {
      return as_line(rendezvous_->report_failure(describe_failure(rendezvous_->self(), root)));
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception& error) {
      store_lost_ = true;
      return {Verdict::Kind::kShutdown, store_lost(options_, error)};
    }
  }

  void finish(int signal_fd) override {
    say("round " + std::to_string(rendezvous_->current_round()) +
        ": every worker of this node succeeded");
    try {
      rendezvous_->finish();
      if (server_) {
        // The others' rendezvous runs through this process: stay while they are alive and running
        // (their heartbeats say so; a lost one stops counting).
        rendezvous_->wait_for_others(std::chrono::hours(24 * 365), signal_fd);
      }
    } catch (const std::exception& error) {
      say("this node's workers succeeded; the rendezvous did not answer at the end (" +
          strip_prefix(error.what()) + ")");
    }
  }

  // Out of the state, so that the c10d store's host need not wait for this node; the host itself
  // first waits (briefly) for the others to read why the job ended.
  void leave_ended_job() override {
    if (store_lost_) return;  // nobody to tell
    try {
      if (server_) rendezvous_->wait_until_others_left(std::chrono::seconds(5));
      rendezvous_->leave("the job ended");
    } catch (const std::exception&) {
    }
  }

  // SIGTERM/SIGINT/SIGHUP/SIGQUIT: the workers get SIGTERM (the trainer checkpoints meanwhile),
  // then this node leaves so the others shrink at once.
  void leaving(int signo) override {
    try {
      if (server_) {
        // The store leaves with this process: tell the others now, while it still answers, rather
        // than let them find it gone.
        rendezvous_->end_job(rendezvous_->self().describe() +
                             ", which hosts the c10d rendezvous store, received " +
                             elastic::signal_name(signo) +
                             "; with --rdzv-backend c10d the job cannot continue without it "
                             "(--rdzv-backend etcd has no such single point of failure)");
      } else {
        rendezvous_->announce_leaving();
      }
    } catch (const std::exception&) {
    }
  }

  void leave(int signo) override {
    if (server_) {
      try {
        rendezvous_->wait_until_others_left(std::chrono::seconds(5));
      } catch (const std::exception&) {
      }
    }
    try {
      rendezvous_->leave("received " + elastic::signal_name(signo));
    } catch (const std::exception& error) {
      say("could not leave the rendezvous cleanly (" + strip_prefix(error.what()) +
          "); the others notice by heartbeat");
    }
  }

 private:
  RunOptions options_;
  // Declared before the rendezvous, whose keep-alive thread talks to it until destroyed.
  std::unique_ptr<elastic::C10dStoreServer> server_;
  std::unique_ptr<elastic::Rendezvous> rendezvous_;
  // How long the store may stay silent while workers run (see check()), and since when it has.
  std::chrono::milliseconds store_patience_{};
  Clock::time_point store_trouble_since_{};
  // The store stopped answering: the job ended without a word to the others.
  bool store_lost_ = false;
};

}  // namespace

std::unique_ptr<AgentRendezvous> join_elastic_rendezvous(const RunOptions& options) {
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
  return std::make_unique<ElasticRendezvous>(options, std::move(server), std::move(backend));
}

}  // namespace dtrain::cli
