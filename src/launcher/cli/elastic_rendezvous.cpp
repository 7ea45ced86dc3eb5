// The elastic rendezvous of the agent (see elastic_rendezvous.h). The rendezvous writes this node's
// heartbeats on a thread of its own, so they continue while the agent's loop blocks stopping
// workers.
#include "launcher/cli/elastic_rendezvous.h"

#include <poll.h>
#include <unistd.h>

#include <atomic>
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

// One call to the store: bounded more tightly than the wait at start, so that a store whose machine
// vanished (no reset, only silence) ends a join in seconds, not after join_timeout; mid-job, the
// patience bounds it more tightly still (Note [A store that stops answering]).
std::chrono::milliseconds store_call_timeout(const RunOptions& options) {
  return std::min(to_ms(options.rdzv_conf.join_timeout_s), kMaxCallTimeout);
}

// Where the rendezvous is, as the backend is given it and messages name it: HOST:PORT, or with etcd
// --rdzv-endpoint as given (every member of its cluster, to fail over between).
std::string rendezvous_endpoint(const RunOptions& options) {
  return options.rdzv_backend == "etcd"
             ? options.rdzv_endpoint
             : options.rdzv_host + ":" + std::to_string(options.rdzv_port);
}

// Whether `fd` becomes readable within `timeout_ms` (the signal pipe: a signal for the launcher).
bool readable_within(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, timeout_ms) > 0;
}

// The backend for the flags, after its first successful contact, or nullptr when a signal made
// `signal_fd` readable first (not read: the caller takes it). c10d: hosts the store when this
// process can bind the endpoint, then waits up to join_timeout for the store to answer (its host
// may start after this agent, and its host name may not resolve before it does: a scheduler
// registers a node's name once that node runs). Throws CommError (exit 1) when nothing answers in
// time, or the name never resolved (the flags may be right and the store's node only late or down:
// a scheduler retries a 1, not a 2), UsageError (exit 2) when the token is refused or the host can
// be no host's name at all, and elastic::NotAStoreError (exit 1) at once when another program
// answers at the endpoint. A signal ends the wait at once, a store call in flight included.
std::unique_ptr<elastic::RendezvousBackend> connect_backend(
    const RunOptions& options, const std::string& token, int signal_fd,
    std::unique_ptr<elastic::C10dStoreServer>* server) {
  const std::string endpoint = rendezvous_endpoint(options);
  std::chrono::milliseconds join_timeout = to_ms(options.rdzv_conf.join_timeout_s);
  std::chrono::milliseconds call_timeout = store_call_timeout(options);
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

  if (!elastic::plausible_host(options.rdzv_host)) {
    throw UsageError("dtrain run: --rdzv-endpoint " + endpoint + ": '" + options.rdzv_host +
                     "' is not a host name or address; expected HOST:PORT of the node hosting "
                     "the store");
  }
  std::unique_ptr<elastic::C10dBackend> backend;
  Clock::time_point start = Clock::now();
  Clock::time_point deadline = start + join_timeout;
  std::string last_error;
  bool unresolved = false;  // the last try found no address for the host name
  bool said_unresolved = false;
  for (;;) {
    try {
      if (!backend) {
        // Hosting is tried once, as soon as the name resolves: then this agent either has the
        // endpoint's address or does not.
        *server = elastic::C10dStoreServer::try_host(options.rdzv_host, options.rdzv_port, token,
                                                     [](const std::string& line) { say(line); });
        if (*server) {
          say("hosting the c10d rendezvous store at " + (*server)->address() +
              " (the job ends if this agent dies; --rdzv-backend etcd has no such single point "
              "of failure)");
        }
        if (token.empty()) {
          say("the rendezvous at " + endpoint +
              " is open: any process that can reach it can join this job; set DTRAIN_RDZV_TOKEN "
              "on every node to require a token");
        }
        backend = std::make_unique<elastic::C10dBackend>(options.rdzv_host, options.rdzv_port,
                                                         options.run_id, token, call_timeout);
        backend->set_interrupt_fd(signal_fd);
      }
      backend->get_state();
      backend->set_interrupt_fd(-1);  // from now on the heartbeats share it
      return backend;
    } catch (const elastic::InterruptedError&) {
      return nullptr;
    } catch (const elastic::NotAStoreError&) {
      // Another program holds the port (its message says so): waiting cannot help. It ends this
      // agent with exit code 1, the code of a rendezvous that failed (run_usage()), through
      // run_main's handler of every error that is not a UsageError; not 2 ("fix the flags"): the
      // flags may well be right and the port only taken for now, and a scheduler retries a 1.
      throw;
    } catch (const elastic::UnresolvedHostError& error) {
      last_error = strip_prefix(error.what());
      unresolved = true;
      if (!said_unresolved) {
        say(last_error + "; retrying for up to " +
            detail::seconds_text(options.rdzv_conf.join_timeout_s) +
            " (--rdzv-conf join_timeout): its node may not be registered yet");
        said_unresolved = true;
      }
    } catch (const TimeoutError& error) {
      last_error = strip_prefix(error.what());
      unresolved = false;
    } catch (const CommError& error) {
      last_error = strip_prefix(error.what());  // refused: its host may not have started yet
      unresolved = false;
    }
    if (Clock::now() >= deadline) {
      if (unresolved) {
        throw CommError("dtrain run: " + last_error + " after trying for " +
                        detail::seconds_text(Clock::now() - start) +
                        " (--rdzv-conf join_timeout); check the endpoint's name, or allow its "
                        "node longer to register it");
      }
      throw CommError("dtrain run: --rdzv-endpoint " + endpoint +
                      ": no rendezvous store answered within " +
                      detail::seconds_text(options.rdzv_conf.join_timeout_s) + " (" + last_error +
                      "); start the agent on the node that has this address, or fix the "
                      "endpoint");
    }
    if (readable_within(signal_fd, 200)) return nullptr;
  }
}

// Note [A store that stops answering]
// Mid-job, a store that stops answering is gone (the agent that hosts the c10d store, or the etcd
// cluster), cut off from this node, or only slow (an etcd leader election, a host starved on a
// loaded machine: silences of 3.6 s were seen in CI). A store call cannot tell them apart: nothing
// resets the connection, the call only waits. The others count this node dead once its heartbeats
// have not landed for the patience (keep_alive_interval x keep_alive_max_attempt, 3 s by default),
// so while the workers run every call to the store, the heartbeats' included, is bounded by what
// is left of the patience since the store's last answer, not by the 15 s a call may take while
// joining. Once the store has been silent for the whole patience, the agent knocks: a TCP
// connection to each address of the store's machine (each etcd member's) at once, resolved when
// the agent started (a resolver may be cut off too), 2 s at most (two SYNs: one lost is no cut).
//   - Accepted: the machine is up and the store's program still listens, however busy (the kernel
//     completes the handshake for it), so the store is slow, not gone. The bound is lifted: calls
//     wait as long as they may while joining, and the job ends only when one of those fails too.
//     The first answer brings the bound back.
//   - Refused (by an address, none accepting): the machine is up and nothing listens: the store is
//     gone. The
//     job ends for this node now, and the line says so.
//   - Silent (no route, no answer): the machine is down or this node is cut off from it; from here
//     the two look the same and the line names both. The job ends for this node now, about the
//     patience plus a monitor interval after the last answer (3.5 s on namespace hosts, up to the
//     knock's 2 s more where the packets vanish; it took 18 to 30 s) and about when the others
//     count it lost.
// The knock is the second signal a 3 s bound alone lacked: on a machine loaded enough to starve
// the store, the store's machine still answers a connection, so a slow store no longer ends a job.
// Where the round ends anyway (a worker's failure reported, this node leaving) the bound is lifted
// too. The agent's thread, which relays the workers' output between looks at the store, is held
// by a look at most the patience plus the knock while bounded; once the bound is lifted, a look
// may wait for the heartbeat thread's call and then make its own, up to 15 s each (the rendezvous
// holds one lock around a read and a write: about 45 s at worst). The output written meanwhile
// waits in the pipes and is relayed when the look returns, stop() included. (A look off the
// agent's thread would relay without that pause but needs a second thread beside the heartbeats'.)
constexpr std::chrono::milliseconds kKnockTimeout{2000};

class PatientBackend final : public elastic::RendezvousBackend {
 public:
  PatientBackend(std::unique_ptr<elastic::RendezvousBackend> backend,
                 std::chrono::milliseconds call_timeout, std::chrono::milliseconds patience)
      : backend_(std::move(backend)), call_timeout_(call_timeout), patience_(patience) {}

  std::string name() const override { return backend_->name(); }
  elastic::Knock knock(std::chrono::milliseconds timeout) override {
    return backend_->knock(timeout);  // touches nothing a call does: safe beside the heartbeats
  }
  std::optional<elastic::VersionedState> get_state() override {
    return answered([&] { return backend_->get_state(); });
  }
  SetResult set_state(const std::string& state, std::optional<uint64_t> expected) override {
    return answered([&] { return backend_->set_state(state, expected); });
  }

  // On while the workers run (Note [A store that stops answering]); off while joining a round or
  // waiting at the end, where a slow answer is legitimate. Turning it on counts as an answer: the
  // round was just agreed through the store.
  void bound_by_patience(bool on) {
    if (on) last_answer_ = Clock::now().time_since_epoch().count();
    bounded_ = on;
  }

  // How long the store has not answered any call (this node's heartbeats' included).
  Clock::duration silent_for() const {
    return Clock::now() - Clock::time_point(Clock::duration(last_answer_.load()));
  }

 private:
  template <typename Call>
  auto answered(Call call) -> decltype(call()) {
    std::chrono::milliseconds timeout = call_timeout_;
    if (bounded_) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(patience_ - silent_for());
      if (left.count() <= 0) {
        throw TimeoutError("dtrain run: not tried: the " + name() +
                           " rendezvous store has been silent for " +
                           detail::seconds_text(silent_for()));
      }
      timeout = std::min(timeout, left);
    }
    // Calls come one at a time (elastic::Rendezvous holds its lock around each).
    backend_->set_timeout(timeout);
    auto result = call();
    last_answer_ = Clock::now().time_since_epoch().count();
    return result;
  }

  std::unique_ptr<elastic::RendezvousBackend> backend_;
  const std::chrono::milliseconds call_timeout_;
  const std::chrono::milliseconds patience_;
  // Read by the agent's thread, written by whichever thread's call got the answer.
  std::atomic<bool> bounded_{false};
  std::atomic<Clock::rep> last_answer_{Clock::now().time_since_epoch().count()};
};

// The message for a rendezvous store that stopped answering mid-job: `what` happened (how long it
// has been silent, or the error of the call that failed), what the knock at its machine found, and
// what to do (Note [A store that stops answering]).
std::string store_lost(const RunOptions& options, const std::string& what, elastic::Knock knocked) {
  const bool c10d = options.rdzv_backend == "c10d";
  const std::string store = c10d ? "the c10d store's host (" + rendezvous_endpoint(options) + ")"
                                 : "etcd (tried " + rendezvous_endpoint(options) + ")";
  std::string message = "lost the rendezvous: " + what + "; ";
  if (c10d) message += "with --rdzv-backend c10d the store lives in the agent that hosted it: ";
  if (knocked == elastic::Knock::kRefused) {
    message += store + " refuses connections, so " +
               (c10d ? std::string("that agent is gone") : "etcd no longer runs there");
  } else if (knocked == elastic::Knock::kAccepted) {
    message += store + " takes connections but " +
               (c10d ? std::string("the store does not answer: that agent is stalled")
                     : "does not answer: it has no leader or is overloaded");
  } else if (knocked == elastic::Knock::kUnknown) {
    message += store + " could not be knocked at from here (this machine is out of sockets)";
  } else {
    message += store +
               " does not answer a connection either: either that machine is down or this node is "
               "cut off from it (from here the two look the same)";
  }
  message += ", and this node cannot continue without it";
  if (c10d) message += " (--rdzv-backend etcd has no such single point of failure)";
  if (knocked == elastic::Knock::kSilent) message += "; check that machine and this node's network";
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
                    std::unique_ptr<elastic::RendezvousBackend> connected)
      : options_(options), server_(std::move(server)) {
    elastic::NodeInfo self;
    self.host = host_name();
    self.id = node_id(self.host);
    // IPv4: what Gloo and TCPStore reach everywhere (MASTER_ADDR is given from it).
    self.addr = elastic::route_to(options.rdzv_host, AF_INET).address;
    if (self.addr.empty()) self.addr = self.host;
    if (!options.local_addr.empty()) self.addr = options.local_addr;  // torchrun's --local-addr
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
    auto backend = std::make_unique<PatientBackend>(std::move(connected),
                                                    store_call_timeout(options), store_patience_);
    backend_ = backend.get();
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
    backend_->bound_by_patience(false);
    knocked_.reset();  // a new round's silence is knocked at anew
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
      say(store_lost(options_, strip_prefix(error.what()), backend_->knock(kKnockTimeout)));
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
    backend_->bound_by_patience(true);
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
      store_trouble_ = false;
      if (knocked_) backend_->bound_by_patience(true);  // the store answered again
      knocked_.reset();
    } catch (const UsageError&) {
      throw;
    } catch (const TimeoutError& error) {
      return store_failed(strip_prefix(error.what()), /*timed_out=*/true);
    } catch (const std::exception& error) {
      return store_failed(strip_prefix(error.what()), /*timed_out=*/false);
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
    // The round ends either way: a slow answer is legitimate now, as while joining (Note [A store
    // that stops answering]).
    backend_->bound_by_patience(false);
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
      return {Verdict::Kind::kShutdown,
              store_lost(options_, strip_prefix(error.what()), backend_->knock(kKnockTimeout))};
    }
  }

  void finish(int signal_fd) override {
    say("round " + std::to_string(rendezvous_->current_round()) +
        ": every worker of this node succeeded");
    backend_->bound_by_patience(false);  // the others may take a while to finish
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
    // Still bounded: the workers get their SIGTERM after this returns, and must not wait for a
    // store that stopped answering.
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

  void leave(int signo, elastic::WorkersLeft workers) override {
    backend_->bound_by_patience(false);  // the workers are stopped: as in report_failure()
    if (server_) {
      try {
        rendezvous_->wait_until_others_left(std::chrono::seconds(5));
      } catch (const std::exception&) {
      }
    }
    try {
      rendezvous_->leave("received " + elastic::signal_name(signo), workers);
    } catch (const std::exception& error) {
      say("could not leave the rendezvous cleanly (" + strip_prefix(error.what()) +
          "); the others notice by heartbeat");
    }
  }

 private:
  // check()'s verdict when its look at the store failed with `error`. A store that misses a look or
  // two (an etcd leader election, a starved c10d host) is not a lost job: the workers keep running
  // while it stays silent for less than the patience, the time after which the others would count
  // this node dead anyway; then the knock decides (Note [A store that stops answering]).
  Verdict store_failed(const std::string& error, bool timed_out) {
    if (backend_->silent_for() < store_patience_) {
      if (!store_trouble_) {
        say("the rendezvous store did not answer (" + error +
            "); the workers keep running while it is retried for up to " +
            detail::seconds_text(store_patience_) + " since its last answer");
      }
      store_trouble_ = true;
      return {};
    }
    // The silence, said once: a timed-out call (one bounded by what was left of the patience, or
    // one not tried once nothing was left) tells no more than how long the store has been silent;
    // another error (a refusal, a closed connection, an etcd without a leader) says more.
    std::string silence = "the " + backend_->name() + " rendezvous store has not answered for " +
                          detail::seconds_text(backend_->silent_for());
    if (!timed_out) silence += " (the last call failed: " + error + ")";
    // Knocked before: the lifted bound's call failed too; knock again for the line.
    const bool first_knock = !knocked_;
    knocked_ = backend_->knock(kKnockTimeout);
    // The store's machine takes connections (the store is slow), or this machine could not knock
    // (out of sockets: no verdict): the store is given the longer calls, once.
    if (first_knock &&
        (knocked_ == elastic::Knock::kAccepted || knocked_ == elastic::Knock::kUnknown)) {
      backend_->bound_by_patience(false);
      say(silence +
          (knocked_ == elastic::Knock::kAccepted
               ? ", but its machine still takes connections, so the store is slow, not gone; "
               : ", and this machine could not knock at the store's (out of sockets); ") +
          "the workers keep running while it is given up to " +
          detail::seconds_text(store_call_timeout(options_)) + " per call");
      return {};
    }
    store_lost_ = true;
    return {Verdict::Kind::kShutdown, store_lost(options_, silence, *knocked_)};
  }

  RunOptions options_;
  // Declared before the rendezvous, whose keep-alive thread talks to it until destroyed.
  std::unique_ptr<elastic::C10dStoreServer> server_;
  PatientBackend* backend_ = nullptr;  // owned by rendezvous_
  std::unique_ptr<elastic::Rendezvous> rendezvous_;
  // How long the store may stay silent while workers run (see check()), and whether it is now.
  std::chrono::milliseconds store_patience_{};
  bool store_trouble_ = false;
  // What the knock at the store's machine found, once it had been silent for the patience; reset
  // by its next answer (Note [A store that stops answering]).
  std::optional<elastic::Knock> knocked_;
  // The store stopped answering: the job ended without a word to the others.
  bool store_lost_ = false;
};

}  // namespace

std::unique_ptr<AgentRendezvous> join_elastic_rendezvous(const RunOptions& options,
                                                         elastic::SignalPipe& signals,
                                                         int* exit_code) {
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
  std::unique_ptr<elastic::RendezvousBackend> backend =
      connect_backend(options, token, signals.fd(), &server);
  if (!backend) {
    const int signo = signals.take();
    say("received " + elastic::signal_name(signo) + " while joining the rendezvous; leaving");
    *exit_code = 128 + signo;
    return nullptr;
  }
  return std::make_unique<ElasticRendezvous>(options, std::move(server), std::move(backend));
}

}  // namespace dtrain::cli
