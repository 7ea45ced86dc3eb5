// Rendezvous: how the agents of an elastic job agree on rounds - which nodes take part, their node
// ranks, the round number, and where rank 0's store will be - through one versioned state blob in a
// RendezvousBackend (c10d store or etcd), in the manner of PyTorch's dynamic_rendezvous.
//
// The state (JSON) holds the current round: open (nodes are joining) or complete (its participants
// run their workers), its participants in rank order, a waiting list of nodes that arrived while it
// ran, a keep-alive counter per node, the restart count and, once the job is over, why. Every
// change is a compare-and-set of the whole state: on a lost race the change is recomputed on the
// state that won, so agents never overwrite each other.
//
// Note [Rounds]
//   - A round closes when MAX nodes have joined, when every node expected back from the previous
//     round (its survivors and the waiting list) has rejoined, or when MIN have joined and the
//     last-call window after the MIN-th join has passed. Ranks: survivors keep their order,
//     newcomers follow; the node that hosts the c10d store comes first among newcomers.
//   - Any agent opens the next round (round + 1, empty participants, `expected` = who should come
//     back) when: one of its workers failed; it noticed a dead participant; a node waits and the
//     job is below MAX (growth); it leaves (SIGTERM). (A round whose workers recover in place
//     takes the second and third in place instead: Note [Rounds in place].) The other agents
//     notice the new round number at their monitor interval, stop their workers and rejoin.
//   - Liveness without trusting clocks across machines: each node increments its counter every
//     keep_alive_interval; each observer notes, on its own clock, when a counter last changed. A
//     counter unchanged for keep_alive_interval * keep_alive_max_attempt means that node is dead;
//     the first observer to see it removes it (and opens a new round if it was a participant of a
//     running one, or ends the job if fewer than MIN nodes remain).
//   - In place (Note [Rounds in place]): a round whose workers recover in place is changed without
//     a new round when a node other than node 0 is lost, or a waiting node is admitted.
//   - Note [Stopping after a loss]: when a round ends because a participant was lost, its workers
//     cannot stop at a step they agree on with the lost ones (a trainer's SIGTERM stop,
//     dtrain/stop.h): they wait in a collective with them instead. The agents then stop their
//     workers with a short grace (Verdict::participant_lost), not --grace-period, which they would
//     only wait out.
//   - Only the last-call deadline uses wall-clock time from another machine (as PyTorch does); skew
//     only lengthens or shortens that window.
//   - The time is read through RendezvousSettings::clock (Note [The rendezvous clock]).
//
// Note [Rounds in place]
//   Under `--recovery in-place` the workers of a round re-form their own group when some of them
//   die, and admit newcomers who take their state from a live peer (dtrain/recovery.h). Restarting
//   every worker for a change of nodes would throw that away, so once node 0's agent has seen the
//   round's workers form such a group (mark_in_place()), the round itself changes instead:
//   - A lost participant other than node 0 is removed from the running round; its workers are gone
//     with it and the survivors' group carries on without them. Node 0 hosts the workers' store,
//     and without it nobody can go on: its loss still opens a new round.
//   - A participant other than node 0 that leaves on SIGTERM is removed the same way when its
//     workers left at a step boundary and the others went on (Note [Leaving in place],
//     dtrain/recovery.h); where they stopped with the others at a checkpoint instead, a new round
//     opens, as without in place. Its agent asks the workers' store whether their group formed
//     in place: node 0's agent marks the round at its next look only, and a node taken back
//     before that look must not restart everyone.
//   - A waiting node, while the job is below MAX, is admitted into the running round: it takes the
//     lowest free node rank and the lowest free block of global ranks (a lost node's, when its
//     nproc fits), and its workers start as newcomers (RoundAssignment::join_running) that the
//     others admit at their next step boundary.
//   A waiting node fills a lost one's place in the same change, so a job at MAX (or at MIN == MAX)
//     goes on at its size; a loss that leaves fewer than MIN, with nobody waiting, ends the job.
//   Each participant keeps its slot (node rank, first global rank) for the whole round, so that the
//     ranks of running workers never move. Every other change (a worker failure the agents cannot
//     repair alone, node 0 leaving or lost) opens a new round, as without in place.
//   Limit: a node cut off from the rendezvous store but not from the other nodes is removed as lost
//     while its workers may still run, until its agent finds out (its store patience, then the
//     grace period); a node admitted meanwhile gets the same RANKs. The workers' group tells
//     processes apart by host and pid, not by rank, but files a program names by rank alone (a
//     shared --log-dir) could then be written by two processes for that while.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "launcher/elastic/rendezvous_backend.h"

namespace dtrain::elastic {

// How a node's workers ended when it left on a signal (Rendezvous::leave, Note [Rounds in place]).
enum class WorkersLeft {
  kStopped,  // not every one left at a step boundary: stopped at a checkpoint (143), killed, none
  kInPlace,  // every one left at a step boundary (dtrain::kLeftExitCode), the others going on
  kInPlaceConfirmed,  // the same, and the workers' store says their group recovers in place
};

// Note [The rendezvous clock]: the two clocks the rendezvous reads. `steady` times this agent's own
// deadlines (next_round's timeout, report_failure's wait, the waits before exiting, the keep-alive
// period) and the age of the heartbeats it observes; `wall` stamps what goes into the shared state
// for the other machines (the last-call deadline, the time of the last counted failure). The
// defaults are the system's clocks. Tests give a fake clock that they advance by hand, so that a
// deadline passes exactly when the test says. Only readings go through it: the pauses between two
// polls of the state (20 to 100 ms) stay real, so a loop waiting for a deadline of a fake clock
// notices it at its first poll after the test moved the time past it.
struct RendezvousClock {
  std::function<std::chrono::steady_clock::time_point()> steady = [] {
    return std::chrono::steady_clock::now();
  };
  std::function<std::chrono::system_clock::time_point()> wall = [] {
    return std::chrono::system_clock::now();
  };
};

struct RendezvousSettings {
  std::string job_id = "none";
  int min_nodes = 1;
  int max_nodes = 1;
  // Longest wait for one round to complete (MIN nodes to arrive, or room for a waiting node).
  std::chrono::milliseconds timeout{900000};
  // After MIN nodes have joined, how long the round stays open for more.
  std::chrono::milliseconds last_call_timeout{30000};
  // Heartbeat period, and how many missed ones make a node dead.
  std::chrono::milliseconds keep_alive_interval{1000};
  int keep_alive_max_attempt = 3;
  // --max-restarts: worker failures the job survives (membership changes do not count).
  int max_restarts = 0;
  // Where the time comes from (Note [The rendezvous clock]); tests replace it.
  RendezvousClock clock;
};

// One node as the others see it.
struct NodeInfo {
  std::string id;    // unique per agent process: "<host>_<pid>_<random>"
  std::string host;  // host name, for messages
  std::string addr;  // address the other nodes reach this node at (MASTER_ADDR when it is rank 0)
  int port = 0;      // free port picked at join time (MASTER_PORT when it is rank 0)
  int nproc = 1;     // local workers
  // Its agent hosts the rendezvous's c10d store: it takes node rank 0 in the first round, so that
  // under --recovery in-place the job has one node it cannot lose (that store and the workers'
  // are on the same node) instead of two.
  bool hosts_rendezvous = false;

  std::string describe() const;  // "node <id> (host <host>)"
};

// What a completed round means for this node.
struct RoundAssignment {
  int round = 0;             // TORCHELASTIC_RESTART_COUNT: 0 for the job's first round
  int group_rank = 0;        // this node's rank
  int group_world_size = 1;  // nodes in the round
  int base_rank = 0;         // global rank of local rank 0
  int world_size = 1;        // workers in the round
  std::string master_addr;   // rank 0's node
  int master_port = 0;
  std::vector<NodeInfo> nodes;  // in rank order
  // Admitted into a round that was already running (Note [Rounds in place]): the workers start as
  // newcomers and join the others' group.
  bool join_running = false;
};

// What the agent should do, from check().
struct Verdict {
  enum class Kind {
    kKeepRunning,  // nothing changed
    kNewRound,     // a new round started: stop the workers and call next_round()
    kShutdown,     // the job is over (message says why); stop the workers and exit non-zero
  };
  Kind kind = Kind::kKeepRunning;
  // Why; with kKeepRunning empty, or what changed in the running round (Note [Rounds in place]).
  std::string message;
  // kNewRound or kShutdown because a participant of the running round was lost (Note [Stopping
  // after a loss]).
  bool participant_lost = false;
};

// Where a participant's workers sit in a complete round: set when the round closes, or when the
// node is admitted into it in place, and kept until the next round.
struct Slot {
  int node_rank = 0;   // GROUP_RANK
  int first_rank = 0;  // RANK of its local rank 0
};

// The rendezvous state (public for tests and for the etcd helper's tests).
struct RendezvousState {
  int round = 0;
  bool complete = false;
  std::vector<std::string> participants;  // rank order once complete, join order before
  std::vector<std::string> expected;      // open round: who should come back (closes early)
  std::vector<std::string> waiting;       // arrived while the round ran
  std::vector<std::string> finished;      // participants whose workers all succeeded
  std::vector<std::string> leaving;       // participants stopping their workers to leave (SIGTERM)
  std::map<std::string, NodeInfo> nodes;  // every participant and waiting node
  std::map<std::string, uint64_t> keep_alive;
  std::map<std::string, Slot> slots;  // complete round: every participant's
  // Note [Rounds in place]: the running round's workers recover in place; who was admitted into it
  // while it ran; what changed in it in place, in order (each agent says what it has not yet).
  bool in_place = false;
  std::vector<std::string> joined_running;
  std::vector<std::string> changes_in_place;
  int64_t last_call_deadline_ms = 0;  // wall clock (ms since the epoch); 0: not started
  int failures = 0;                   // worker failures so far (against --max-restarts)
  int64_t last_failure_ms = 0;        // wall clock of the last counted failure (for refunds)
  std::string reason;                 // why the current round started
  // The last round ended (this round opened, or the job was shut down) because a participant was
  // lost: Note [Stopping after a loss]. Cleared when a round closes.
  bool ended_by_loss = false;
  std::string shutdown;  // non-empty: the job is over, and why

  std::string to_json() const;
  static RendezvousState from_json(const std::string& text);  // throws InternalError
};

class Rendezvous {
 public:
  Rendezvous(std::unique_ptr<RendezvousBackend> backend, RendezvousSettings settings,
             NodeInfo self);
  // Stops the keep-alive thread.
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // Starts the thread that writes this node's heartbeat every keep_alive_interval (on
  // settings.clock). It ignores backend errors: the main thread's next call meets the same error
  // and reports it.
  void start_keep_alive();
  // Writes this node's heartbeat once, what the keep-alive thread does every interval (tests call
  // it by hand instead). Does nothing for a node not in the job; throws what the backend throws.
  void keep_alive();

  // Joins the next round (or the waiting list) and blocks until a round that includes this node is
  // complete. `port` is this node's fresh MASTER_PORT candidate. Returns nullopt when
  // `interrupt_fd` became readable (not read). Throws dtrain::TimeoutError after settings.timeout
  // naming the nodes present and how many were needed; dtrain::PeerLostError when the job was shut
  // down (message: why); dtrain::CommError / UsageError from the backend.
  std::optional<RoundAssignment> next_round(int port, int interrupt_fd);

  // Looks at the state once (the agent calls this every monitor interval while workers run):
  // removes dead nodes, admits waiting ones (growth), and says whether the round changed.
  Verdict check();

  // A local worker failed: opens the next round and returns kNewRound, or, when no restarts are
  // left, ends the job and returns kShutdown. `what` describes the failure for the other nodes.
  // Note [Failures caused by a lost node]: when a node dies, the workers of the others fail at once
  // (their collectives' connections close), seconds before its heartbeat expires. Such a failure is
  // not the workers' fault and spends no restart: a failure counted within one heartbeat timeout
  // before a participant is found dead is refunded; and with no restarts left, this call first
  // waits up to one heartbeat timeout for such a loss (blocking, the workers already stopped)
  // before it ends the job.
  Verdict report_failure(const std::string& what);

  // This node's workers all succeeded: recorded so that the others neither restart for it nor take
  // its departure as a loss.
  void finish();

  // Blocks while other participants of the round are still running (alive and not finished), or
  // until `timeout` or `interrupt_fd`. The agent hosting the c10d store calls it before exiting.
  void wait_for_others(std::chrono::milliseconds timeout, int interrupt_fd);

  // Says that this node is about to leave (SIGTERM): worker failures elsewhere until it has left
  // are its doing and do not count against --max-restarts.
  void announce_leaving();

  // Node 0's agent saw this round's workers form an in-place group: from now on a node lost or
  // joining changes the round in place (Note [Rounds in place]). Idempotent.
  void mark_in_place();

  // Leaves the job (SIGTERM): removed from the state; if the others were running, a new round
  // starts so they shrink at once instead of waiting for this node's heartbeat to expire. Where
  // every worker of this node left while the others went on (WorkersLeft, Note [Leaving in place]
  // in dtrain/recovery.h), the round recovers in place (marked so, or confirmed by the workers'
  // store), and this is not node 0, the running round goes on without it instead (Note [Rounds in
  // place]), marked in place if node 0's agent had not done so yet. Below MIN the job ends either
  // way.
  void leave(const std::string& why, WorkersLeft workers = WorkersLeft::kStopped);

  // Ends the job for every node (the c10d store's host is leaving, and the store with it): their
  // next check() returns kShutdown with `why`.
  void end_job(const std::string& why);
  // Blocks until no other node is left in the state (they leave() when they see the end), at most
  // `timeout`: the c10d store's host waits so that the others read why the job ended.
  void wait_until_others_left(std::chrono::milliseconds timeout);

  const NodeInfo& self() const { return self_; }
  int current_round() const { return round_; }

 private:
  // Reads the state, applies `change` (which returns false when it changed nothing), writes it back
  // with compare-and-set, retrying on a lost race. Returns the state now stored.
  template <typename Change>
  RendezvousState update(Change change);
  RendezvousState read();
  // Notes when each keep-alive counter changed (on this machine's clock).
  void observe(const RendezvousState& state);
  void forgive_blind_time(std::chrono::steady_clock::duration call_took);
  bool is_dead(const std::string& id) const;
  // The state is that of a job that is over and no other agent still holds (Note [Reusing a run
  // id]).
  bool ended_and_abandoned(const RendezvousState& state) const;
  // Removes dead nodes from `state`; true when it changed.
  bool sweep(RendezvousState& state);
  // Starts round + 1 of `state`, expecting `expected` back; ends the job instead when fewer than
  // MIN nodes remain (`lost` names who was lost, for that message).
  void open_round(RendezvousState& state, const std::string& reason, const std::string& lost);
  bool try_close(RendezvousState& state);
  // Note [Rounds in place]: admits waiting nodes into the running round while it is below MAX;
  // true when it admitted any.
  bool admit_in_place(RendezvousState& state);
  // Note [Rounds in place]: the running round goes on without the participants just removed
  // (`what` says who and why), waiting nodes filling the gap; false, with the job ended, when fewer
  // than MIN are left.
  bool go_on_in_place(RendezvousState& state, const std::string& what);
  RoundAssignment assignment(const RendezvousState& state) const;
  std::string describe_node(const RendezvousState& state, const std::string& id) const;
  void keep_alive_loop(std::chrono::steady_clock::time_point first);
  // settings_.clock's readings.
  std::chrono::steady_clock::time_point now() const { return settings_.clock.steady(); }
  int64_t wall_ms() const;  // ms since the epoch

  std::unique_ptr<RendezvousBackend> backend_;
  RendezvousSettings settings_;
  NodeInfo self_;
  int round_ = -1;                // the round this node's workers run in; -1 before the first
  std::size_t changes_seen_ = 0;  // of round_'s changes in place, those check() has reported

  std::mutex mutex_;  // the backend and everything below
  std::optional<VersionedState> cached_;
  struct Seen {
    uint64_t counter = 0;
    std::chrono::steady_clock::time_point changed;
  };
  std::map<std::string, Seen> seen_;
  bool store_was_blind_ = false;  // a store call failed since the last successful read
  uint64_t heartbeat_ = 1;

  std::atomic<bool> stopping_{false};
  std::thread keep_alive_thread_;
};

}  // namespace dtrain::elastic
