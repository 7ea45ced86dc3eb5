// The elastic rendezvous over a RendezvousBackend (see rendezvous.h and Note [Rounds] there). One
// state machine, kept in one file (about 750 lines) so that it reads top to bottom against
// the note.
#include "launcher/elastic/rendezvous.h"

#include <poll.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/format.h"
#include "dtrain/errors.h"

namespace dtrain::elastic {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

bool contains(const std::vector<std::string>& list, const std::string& id) {
  return std::find(list.begin(), list.end(), id) != list.end();
}

bool erase(std::vector<std::string>& list, const std::string& id) {
  auto found = std::find(list.begin(), list.end(), id);
  if (found == list.end()) return false;
  list.erase(found);
  return true;
}

// true when interrupt_fd became readable within timeout_ms.
bool wait_for(int interrupt_fd, int timeout_ms) {
  if (interrupt_fd < 0) {
    poll(nullptr, 0, timeout_ms);
    return false;
  }
  pollfd fd{interrupt_fd, POLLIN, 0};
  return poll(&fd, 1, timeout_ms) > 0;
}

}  // namespace

std::string NodeInfo::describe() const { return "host " + host + " (node " + id + ")"; }

std::string RendezvousState::to_json() const {
  json nodes_json = json::object();
  for (const auto& [id, node] : nodes) {
    nodes_json[id] = {{"host", node.host},
                      {"addr", node.addr},
                      {"port", node.port},
                      {"nproc", node.nproc},
                      {"hosts_rendezvous", node.hosts_rendezvous}};
  }
  json slots_json = json::object();
  for (const auto& [id, slot] : slots) slots_json[id] = {slot.node_rank, slot.first_rank};
  json out = {{"round", round},
              {"complete", complete},
              {"participants", participants},
              {"expected", expected},
              {"waiting", waiting},
              {"finished", finished},
              {"leaving", leaving},
              {"nodes", nodes_json},
              {"keep_alive", keep_alive},
              {"slots", slots_json},
              {"in_place", in_place},
              {"joined_running", joined_running},
              {"changes_in_place", changes_in_place},
              {"last_call_deadline_ms", last_call_deadline_ms},
              {"failures", failures},
              {"last_failure_ms", last_failure_ms},
              {"reason", reason},
              {"ended_by_loss", ended_by_loss},
              {"shutdown", shutdown}};
  return out.dump();
}

RendezvousState RendezvousState::from_json(const std::string& text) {
  try {
    json in = json::parse(text);
    RendezvousState state;
    state.round = in.at("round").get<int>();
    state.complete = in.at("complete").get<bool>();
    state.participants = in.at("participants").get<std::vector<std::string>>();
    state.expected = in.at("expected").get<std::vector<std::string>>();
    state.waiting = in.at("waiting").get<std::vector<std::string>>();
    state.finished = in.at("finished").get<std::vector<std::string>>();
    state.leaving = in.at("leaving").get<std::vector<std::string>>();
    for (const auto& [id, node] : in.at("nodes").items()) {
      NodeInfo info;
      info.id = id;
      info.host = node.at("host").get<std::string>();
      info.addr = node.at("addr").get<std::string>();
      info.port = node.at("port").get<int>();
      info.nproc = node.at("nproc").get<int>();
      // The fields from "hosts_rendezvous" on came with in-place rounds: a state an older dtrain
      // left under the same run id (Note [Reusing a run id]) reads with their defaults.
      info.hosts_rendezvous = node.value("hosts_rendezvous", false);
      state.nodes[id] = info;
    }
    state.keep_alive = in.at("keep_alive").get<std::map<std::string, uint64_t>>();
    const json slots = in.value("slots", json::object());
    for (const auto& [id, slot] : slots.items()) {
      state.slots[id] = Slot{slot.at(0).get<int>(), slot.at(1).get<int>()};
    }
    state.in_place = in.value("in_place", false);
    state.joined_running = in.value("joined_running", std::vector<std::string>{});
    state.changes_in_place = in.value("changes_in_place", std::vector<std::string>{});
    state.last_call_deadline_ms = in.at("last_call_deadline_ms").get<int64_t>();
    state.failures = in.at("failures").get<int>();
    state.last_failure_ms = in.at("last_failure_ms").get<int64_t>();
    state.reason = in.at("reason").get<std::string>();
    state.ended_by_loss = in.value("ended_by_loss", false);
    state.shutdown = in.at("shutdown").get<std::string>();
    return state;
  } catch (const json::exception& error) {
    throw InternalError(std::string("dtrain run: the rendezvous state is not readable (") +
                        error.what() +
                        "); another program may use the same --rdzv-id, or agents of different "
                        "dtrain versions share it");
  }
}

Rendezvous::Rendezvous(std::unique_ptr<RendezvousBackend> backend, RendezvousSettings settings,
                       NodeInfo self)
    : backend_(std::move(backend)), settings_(std::move(settings)), self_(std::move(self)) {}

Rendezvous::~Rendezvous() {
  stopping_ = true;
  if (keep_alive_thread_.joinable()) keep_alive_thread_.join();
}

void Rendezvous::start_keep_alive() {
  if (keep_alive_thread_.joinable()) return;
  // The first heartbeat is due one interval after this call, not after the thread got going.
  Clock::time_point first = now() + settings_.keep_alive_interval;
  keep_alive_thread_ = std::thread([this, first] { keep_alive_loop(first); });
}

void Rendezvous::keep_alive_loop(Clock::time_point next) {
  while (!stopping_) {
    if (now() < next) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    // After a heartbeat that took long (a store that stalled), the next is an interval away, not
    // a burst of the ones missed.
    next = std::max(next + settings_.keep_alive_interval, now());
    try {
      keep_alive();
    } catch (const std::exception&) {
      // The main thread's next call to the backend meets the same problem and reports it.
    }
  }
}

void Rendezvous::keep_alive() {
  std::lock_guard<std::mutex> lock(mutex_);
  update([&](RendezvousState& state) {
    auto found = state.keep_alive.find(self_.id);
    if (found == state.keep_alive.end()) return false;  // not (or no longer) in the job
    found->second = ++heartbeat_;
    return true;
  });
}

int64_t Rendezvous::wall_ms() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             settings_.clock.wall().time_since_epoch())
      .count();
}

RendezvousState Rendezvous::read() {
  Clock::time_point start = now();
  try {
    cached_ = backend_->get_state();
  } catch (...) {
    store_was_blind_ = true;
    throw;
  }
  forgive_blind_time(now() - start);
  RendezvousState state = cached_ ? RendezvousState::from_json(cached_->state) : RendezvousState{};
  observe(state);
  return state;
}

// While the store could not be reached or answered slowly (a stalled etcd, a starved c10d host),
// nobody's heartbeat could land either: counters that did not move then are no evidence of death.
// So after a failed or slow store call every counter counts as just seen, and the dead-node clock
// starts over. (Plain gaps between this agent's reads are no such case: the others' heartbeats
// landed meanwhile, and the next read sees them.)
void Rendezvous::forgive_blind_time(Clock::duration call_took) {
  // A call that took half a heartbeat timeout stalled long enough to matter.
  if (!store_was_blind_ &&
      call_took * 2 <= settings_.keep_alive_interval * settings_.keep_alive_max_attempt) {
    return;
  }
  Clock::time_point time = now();
  for (auto& [id, seen] : seen_) seen.changed = time;
  store_was_blind_ = false;
}

template <typename Change>
RendezvousState Rendezvous::update(Change change) {
  RendezvousState state = read();
  // Each lost race means another agent's write succeeded, so this terminates while agents make
  // progress; the bound only turns a livelock bug into an error.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    if (!change(state)) return state;
    std::optional<uint64_t> expected;
    if (cached_) expected = cached_->version;
    RendezvousBackend::SetResult result;
    try {
      result = backend_->set_state(state.to_json(), expected);
    } catch (...) {
      store_was_blind_ = true;
      throw;
    }
    cached_ = result.current;
    if (result.written) return state;
    state = RendezvousState::from_json(cached_->state);
    observe(state);
  }
  throw InternalError("dtrain run: the rendezvous state kept changing under 1000 updates");
}

void Rendezvous::observe(const RendezvousState& state) {
  Clock::time_point time = now();
  for (const auto& [id, counter] : state.keep_alive) {
    auto found = seen_.find(id);
    if (found == seen_.end() || found->second.counter != counter) seen_[id] = Seen{counter, time};
  }
  // A node that left the state and comes back starts with a fresh clock, not a stale one.
  for (auto it = seen_.begin(); it != seen_.end();) {
    it = state.keep_alive.count(it->first) ? std::next(it) : seen_.erase(it);
  }
}

bool Rendezvous::is_dead(const std::string& id) const {
  if (id == self_.id) return false;
  auto found = seen_.find(id);
  if (found == seen_.end()) return false;
  return now() - found->second.changed >
         settings_.keep_alive_interval * settings_.keep_alive_max_attempt;
}

std::string Rendezvous::describe_node(const RendezvousState& state, const std::string& id) const {
  auto found = state.nodes.find(id);
  return found != state.nodes.end() ? found->second.describe() : "node " + id;
}

bool Rendezvous::sweep(RendezvousState& state) {
  std::vector<std::string> candidates = state.participants;
  candidates.insert(candidates.end(), state.waiting.begin(), state.waiting.end());
  for (const auto& [id, counter] : state.keep_alive) candidates.push_back(id);
  std::vector<std::string> lost;
  for (const std::string& id : candidates) {
    if (!contains(state.finished, id) && !contains(lost, id) && is_dead(id)) lost.push_back(id);
  }
  if (lost.empty()) return false;

  bool running_participant_lost = false;  // one whose loss ends the running round
  bool lost_in_place = false;             // Note [Rounds in place]
  bool member_lost = false;               // of the running round, or expected back in the open one
  std::string names;
  for (const std::string& id : lost) {
    if (state.complete && contains(state.participants, id)) {
      auto slot = state.slots.find(id);
      if (state.in_place && slot != state.slots.end() && slot->second.node_rank != 0) {
        lost_in_place = true;
      } else {
        running_participant_lost = true;
      }
    }
    if (contains(state.participants, id) || contains(state.expected, id)) member_lost = true;
    names += (names.empty() ? "" : ", ") + describe_node(state, id);
    erase(state.participants, id);
    erase(state.waiting, id);
    erase(state.expected, id);
    erase(state.leaving, id);
    erase(state.joined_running, id);
    state.slots.erase(id);
    state.keep_alive.erase(id);
    state.nodes.erase(id);
    seen_.erase(id);
  }
  std::chrono::milliseconds heartbeat_timeout =
      settings_.keep_alive_interval * settings_.keep_alive_max_attempt;
  std::string what = names + " lost: no heartbeat for " + detail::seconds_text(heartbeat_timeout);
  // Note [Failures caused by a lost node]: a failure counted shortly before was this loss's doing.
  if (member_lost && state.last_failure_ms != 0 && state.failures > 0 &&
      wall_ms() - state.last_failure_ms <= 2 * heartbeat_timeout.count()) {
    state.failures -= 1;
    state.last_failure_ms = 0;
    what += " (the worker failure just before it spends no restart)";
  }
  if (running_participant_lost && state.shutdown.empty()) {
    if (!state.finished.empty()) {
      // As in report_failure: a node whose workers succeeded is gone for good, so a restart would
      // run the job again without it.
      state.shutdown = what + "; not restarting: " + describe_node(state, state.finished.front()) +
                       " had already finished";
    } else {
      open_round(state, what, what);
    }
    state.ended_by_loss = true;
  } else if (lost_in_place && state.shutdown.empty()) {
    if (!go_on_in_place(state, what)) state.ended_by_loss = true;
  }
  return true;
}

// Note [Rounds in place]: the running round goes on without participants already removed from
// `state` (lost, or left), nodes waiting to join filling the gap in the same change (where MIN ==
// MAX they must, or the job would end for want of a node that is there). False when fewer than MIN
// are left: the job ends.
bool Rendezvous::go_on_in_place(RendezvousState& state, const std::string& what) {
  const int left = static_cast<int>(state.participants.size());
  const std::size_t first_change = state.changes_in_place.size();
  state.changes_in_place.push_back(what + "; the running round goes on in place with " +
                                   std::to_string(left) +
                                   " node(s), whose workers carry on without the ones gone");
  admit_in_place(state);
  const int now = static_cast<int>(state.participants.size());
  if (now >= settings_.min_nodes) return true;
  state.changes_in_place.resize(first_change);
  state.shutdown = what + "; " + std::to_string(now) + " node(s) left, fewer than the minimum of " +
                   std::to_string(settings_.min_nodes) + " (--nnodes " +
                   std::to_string(settings_.min_nodes) + ":" + std::to_string(settings_.max_nodes) +
                   ")";
  return false;
}

void Rendezvous::open_round(RendezvousState& state, const std::string& reason,
                            const std::string& lost) {
  std::vector<std::string> back;
  for (const std::string& id : state.participants) {
    if (!contains(state.leaving, id)) back.push_back(id);
  }
  for (const std::string& id : state.waiting) {
    if (!contains(back, id)) back.push_back(id);
  }
  if (static_cast<int>(back.size()) < settings_.min_nodes) {
    state.shutdown = (lost.empty() ? reason : lost) + "; " + std::to_string(back.size()) +
                     " node(s) left, fewer than the minimum of " +
                     std::to_string(settings_.min_nodes) + " (--nnodes " +
                     std::to_string(settings_.min_nodes) + ":" +
                     std::to_string(settings_.max_nodes) + ")";
    return;
  }
  state.round += 1;
  state.complete = false;
  state.expected = back;
  state.participants.clear();
  state.finished.clear();
  state.last_call_deadline_ms = 0;
  state.reason = reason;
  state.ended_by_loss = false;
  state.slots.clear();
  state.in_place = false;
  state.joined_running.clear();
  state.changes_in_place.clear();
}

bool Rendezvous::try_close(RendezvousState& state) {
  int joined = static_cast<int>(state.participants.size());
  if (joined < settings_.min_nodes) {
    bool had_deadline = state.last_call_deadline_ms != 0;
    state.last_call_deadline_ms = 0;
    return had_deadline;
  }
  bool all_back = !state.expected.empty() &&
                  std::all_of(state.expected.begin(), state.expected.end(),
                              [&](const auto& id) { return contains(state.participants, id); });
  bool window_over = state.last_call_deadline_ms != 0 && wall_ms() >= state.last_call_deadline_ms;
  if (joined >= settings_.max_nodes || all_back || window_over) {
    // Survivors keep their relative order (rank 0 stays rank 0 when it survives), newcomers follow,
    // the c10d store's host first among them (NodeInfo::hosts_rendezvous).
    auto position = [&](const std::string& id) {
      auto found = std::find(state.expected.begin(), state.expected.end(), id);
      const auto at = 2 * (found - state.expected.begin());
      return state.nodes.at(id).hosts_rendezvous ? at : at + 1;
    };
    std::stable_sort(state.participants.begin(), state.participants.end(),
                     [&](const auto& a, const auto& b) { return position(a) < position(b); });
    state.complete = true;
    state.expected.clear();
    state.last_call_deadline_ms = 0;
    state.ended_by_loss = false;
    state.slots.clear();
    int first_rank = 0;
    for (std::size_t rank = 0; rank < state.participants.size(); ++rank) {
      const std::string& id = state.participants[rank];
      state.slots[id] = Slot{static_cast<int>(rank), first_rank};
      first_rank += state.nodes.at(id).nproc;
      erase(state.waiting, id);
    }
    return true;
  }
  if (state.last_call_deadline_ms == 0) {
    state.last_call_deadline_ms = wall_ms() + settings_.last_call_timeout.count();
    return true;
  }
  return false;
}

// The sizes are those of the rank spaces (Note [Rounds in place]): where a lost node's slot is
// still free, WORLD_SIZE counts its ranks though no worker holds them.
RoundAssignment Rendezvous::assignment(const RendezvousState& state) const {
  RoundAssignment out;
  out.round = state.round;
  out.group_world_size = 0;
  out.world_size = 0;
  int next_rank = 0;  // a round closed by an older dtrain has no slots: ranks in participant order
  for (std::size_t index = 0; index < state.participants.size(); ++index) {
    const std::string& id = state.participants[index];
    const NodeInfo& node = state.nodes.at(id);
    auto found = state.slots.find(id);
    const Slot slot =
        found != state.slots.end() ? found->second : Slot{static_cast<int>(index), next_rank};
    next_rank += node.nproc;
    if (id == self_.id) {
      out.group_rank = slot.node_rank;
      out.base_rank = slot.first_rank;
    }
    out.group_world_size = std::max(out.group_world_size, slot.node_rank + 1);
    out.world_size = std::max(out.world_size, slot.first_rank + node.nproc);
    out.nodes.push_back(node);
  }
  out.master_addr = out.nodes.front().addr;
  out.master_port = out.nodes.front().port;
  out.join_running = contains(state.joined_running, self_.id);
  return out;
}

bool Rendezvous::admit_in_place(RendezvousState& state) {
  if (!state.in_place || !state.complete || !state.finished.empty() || !state.shutdown.empty()) {
    return false;
  }
  bool admitted = false;
  while (!state.waiting.empty() &&
         static_cast<int>(state.participants.size()) < settings_.max_nodes) {
    const std::string id = state.waiting.front();
    erase(state.waiting, id);
    const int nproc = state.nodes.at(id).nproc;
    Slot slot;
    auto node_rank_taken = [&](int rank) {
      return std::any_of(state.slots.begin(), state.slots.end(),
                         [&](const auto& entry) { return entry.second.node_rank == rank; });
    };
    while (node_rank_taken(slot.node_rank)) ++slot.node_rank;
    // The lowest block of nproc global ranks that no participant holds: a lost node's ranks are
    // given again, so that the job keeps its size.
    for (bool moved = true; moved;) {
      moved = false;
      for (const auto& [other, taken] : state.slots) {
        const int end = taken.first_rank + state.nodes.at(other).nproc;
        if (slot.first_rank < end && taken.first_rank < slot.first_rank + nproc) {
          slot.first_rank = end;
          moved = true;
        }
      }
    }
    state.slots[id] = slot;
    state.participants.push_back(id);
    std::stable_sort(state.participants.begin(), state.participants.end(),
                     [&](const auto& a, const auto& b) {
                       return state.slots.at(a).node_rank < state.slots.at(b).node_rank;
                     });
    state.joined_running.push_back(id);
    state.changes_in_place.push_back(
        describe_node(state, id) + " joins the running round in place as node rank " +
        std::to_string(slot.node_rank) + " (ranks " + std::to_string(slot.first_rank) + ".." +
        std::to_string(slot.first_rank + nproc - 1) +
        "): its workers start as newcomers that the others admit");
    admitted = true;
  }
  return admitted;
}

// Note [Reusing a run id]: an etcd key outlives the job that wrote it (a c10d store dies with its
// host agent), so an agent started later under the same --rdzv-id finds the state of a job that is
// over: every participant finished, or it was shut down. Waiting in it would hang until the
// rendezvous timeout (every round is complete and full of finished nodes), and failing would make a
// run id single-use with etcd but reusable with c10d. So such a state starts over as a new job,
// once no other agent still holds it (their keep-alive entries are gone: finished and leaving
// agents remove theirs, the sweep removes the silent ones), so that a slow agent of the old job is
// never pulled into the new one. Only a newcomer does this: an agent of the old job (in its nodes)
// is told how that job ended.
bool Rendezvous::ended_and_abandoned(const RendezvousState& state) const {
  if (state.nodes.count(self_.id) > 0)
    return false;  // this agent took part: it learns how it ended
  bool all_finished = state.complete && !state.participants.empty() &&
                      std::all_of(state.participants.begin(), state.participants.end(),
                                  [&](const auto& id) { return contains(state.finished, id); });
  if (state.shutdown.empty() && !all_finished) return false;
  return std::all_of(state.keep_alive.begin(), state.keep_alive.end(),
                     [&](const auto& entry) { return entry.first == self_.id; });
}

std::optional<RoundAssignment> Rendezvous::next_round(int port, int interrupt_fd) {
  self_.port = port;
  Clock::time_point deadline = now() + settings_.timeout;
  for (;;) {
    RendezvousState state;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state = update([&](RendezvousState& s) {
        bool changed = false;
        if (ended_and_abandoned(s)) {
          // Note [Reusing a run id]
          s = RendezvousState{};
          s.reason = "a new job under rendezvous id '" + settings_.job_id +
                     "' (the previous job with this id had ended)";
          changed = true;
        }
        if (!s.shutdown.empty()) {
          // A newcomer to a job that was shut down waits for its agents to go (then starts over);
          // a node of that job learns below why it ended.
          return s.nodes.count(self_.id) == 0 ? sweep(s) || changed : changed;
        }
        changed |= sweep(s);
        if (!s.shutdown.empty()) return true;
        bool joined = contains(s.participants, self_.id);
        if (s.complete && joined && s.round <= round_ && !contains(s.joined_running, self_.id)) {
          // This node still counts as a participant of the round it ran: it never left it (it
          // should not happen, but a new round is the safe way back).
          open_round(s, self_.describe() + " rejoins", "");
          return true;
        }
        auto node = s.nodes.find(self_.id);
        if (node == s.nodes.end() || node->second.port != self_.port ||
            node->second.addr != self_.addr) {
          s.nodes[self_.id] = self_;
          changed = true;
        }
        if (s.keep_alive.count(self_.id) == 0) {
          s.keep_alive[self_.id] = ++heartbeat_;  // a value no observer holds from before
          changed = true;
        }
        if (!s.complete && !joined &&
            static_cast<int>(s.participants.size()) < settings_.max_nodes) {
          s.participants.push_back(self_.id);
          erase(s.waiting, self_.id);
          changed = true;
        } else if (!joined && !contains(s.waiting, self_.id)) {
          s.waiting.push_back(self_.id);
          changed = true;
        }
        if (!s.complete) {
          changed |= try_close(s);
        } else if (s.in_place && contains(s.waiting, self_.id)) {
          // Note [Rounds in place]: no need to wait for a running agent's next look.
          changed |= admit_in_place(s);
        }
        return changed;
      });
    }
    if (!state.shutdown.empty() && state.nodes.count(self_.id) > 0) {
      throw PeerLostError("dtrain run: " + state.shutdown);
    }
    if (state.complete && contains(state.participants, self_.id) &&
        (state.round > round_ || contains(state.joined_running, self_.id))) {
      round_ = state.round;
      changes_seen_ = state.changes_in_place.size();
      return assignment(state);
    }
    if (now() >= deadline) {
      std::string present;
      for (const std::string& id : state.participants) {
        present += (present.empty() ? "" : ", ") + describe_node(state, id);
      }
      std::string range =
          std::to_string(settings_.min_nodes) + ":" + std::to_string(settings_.max_nodes);
      if (state.complete) {
        throw TimeoutError("dtrain run: rendezvous '" + settings_.job_id + "': no room for " +
                           self_.describe() + " within " + detail::seconds_text(settings_.timeout) +
                           ": the job runs with " + std::to_string(state.participants.size()) +
                           " node(s) (" + present + "), its maximum (--nnodes " + range + ")");
      }
      throw TimeoutError(
          "dtrain run: rendezvous '" + settings_.job_id + "' round " + std::to_string(state.round) +
          " did not complete within " + detail::seconds_text(settings_.timeout) + ": " +
          std::to_string(state.participants.size()) + " node(s) joined (" +
          (present.empty() ? "none" : present) + "), at least " +
          std::to_string(settings_.min_nodes) + " needed (--nnodes " + range +
          "); start the missing nodes with the same --rdzv-endpoint and --rdzv-id, or lower MIN");
    }
    if (wait_for(interrupt_fd, 50)) return std::nullopt;
  }
}

Verdict Rendezvous::check() {
  RendezvousState state;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state = update([&](RendezvousState& s) {
      if (!s.shutdown.empty()) return false;
      bool changed = sweep(s);
      if (s.in_place && s.round == round_) {
        changed |= admit_in_place(s);
      } else if (s.shutdown.empty() && s.round == round_ && s.complete && !s.waiting.empty() &&
                 static_cast<int>(s.participants.size()) < settings_.max_nodes &&
                 s.finished.empty()) {
        std::string names;
        for (const std::string& id : s.waiting) {
          names += (names.empty() ? "" : ", ") + describe_node(s, id);
        }
        open_round(s, names + " waiting to join: the job grows", "");
        changed = true;
      }
      return changed;
    });
  }
  if (!state.shutdown.empty()) {
    return {Verdict::Kind::kShutdown, state.shutdown, state.ended_by_loss};
  }
  if (state.round != round_) {
    // Only the round right after this node's tells why this node's workers must stop.
    const bool lost = state.ended_by_loss && state.round == round_ + 1;
    return {Verdict::Kind::kNewRound, state.reason, lost};
  }
  if (!contains(state.participants, self_.id)) {
    return {Verdict::Kind::kNewRound,
            self_.describe() + " was dropped from the round (its heartbeat was missed)"};
  }
  if (state.changes_in_place.size() > changes_seen_) {
    std::string changes;
    for (std::size_t i = changes_seen_; i < state.changes_in_place.size(); ++i) {
      changes += (changes.empty() ? "" : "; then ") + state.changes_in_place[i];
    }
    changes_seen_ = state.changes_in_place.size();
    return {Verdict::Kind::kKeepRunning, changes};
  }
  return {};
}

void Rendezvous::mark_in_place() {
  std::lock_guard<std::mutex> lock(mutex_);
  update([&](RendezvousState& s) {
    if (s.in_place || !s.complete || s.round != round_ || !s.shutdown.empty()) return false;
    s.in_place = true;
    return true;
  });
}

Verdict Rendezvous::report_failure(const std::string& what) {
  // Note [Failures caused by a lost node]: with no restarts left, give a dying peer's heartbeat
  // the time to expire before ending the job for what may be its doing.
  std::chrono::milliseconds heartbeat_timeout =
      settings_.keep_alive_interval * settings_.keep_alive_max_attempt;
  Clock::time_point wait_until = now() + heartbeat_timeout + settings_.keep_alive_interval;
  for (;;) {
    RendezvousState state;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state = update([&](RendezvousState& s) { return sweep(s); });
    }
    if (!state.shutdown.empty() || state.round != round_ || !state.complete ||
        state.failures < settings_.max_restarts || !state.leaving.empty() ||
        !state.finished.empty() || now() >= wait_until) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  std::lock_guard<std::mutex> lock(mutex_);
  RendezvousState state = update([&](RendezvousState& s) {
    if (!s.shutdown.empty() || s.round != round_ || !s.complete) return false;
    if (!s.finished.empty()) {
      s.shutdown = what + "; not restarting: " + describe_node(s, s.finished.front()) +
                   " had already finished";
      return true;
    }
    if (!s.leaving.empty()) {
      // A peer leaving (preempted) takes its workers down, and ours fail with them: no restart is
      // spent on that.
      open_round(s, what + " while " + describe_node(s, s.leaving.front()) + " leaves", "");
      return true;
    }
    s.failures += 1;
    s.last_failure_ms = wall_ms();
    if (s.failures > settings_.max_restarts) {
      s.shutdown = what + "; no restarts left (--max-restarts " +
                   std::to_string(settings_.max_restarts) + ")";
      return true;
    }
    open_round(s,
               what + " (restart " + std::to_string(s.failures) + " of " +
                   std::to_string(settings_.max_restarts) + ")",
               "");
    return true;
  });
  if (!state.shutdown.empty()) return {Verdict::Kind::kShutdown, state.shutdown};
  return {Verdict::Kind::kNewRound, state.reason};
}

void Rendezvous::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  update([&](RendezvousState& s) {
    if (contains(s.finished, self_.id)) return false;
    if (s.round != round_) {
      // Another node's failure opened a new round while this node's workers were succeeding: the
      // others would rerun the job without this node's finished share, so the job ends instead
      // (the rule of report_failure).
      bool changed = erase(s.expected, self_.id) | (s.keep_alive.erase(self_.id) > 0);
      if (!s.shutdown.empty()) return changed;
      s.shutdown = s.reason + "; not restarting: " + self_.describe() + " had already finished";
      return true;
    }
    s.finished.push_back(self_.id);
    s.keep_alive.erase(self_.id);
    return true;
  });
}

void Rendezvous::wait_for_others(std::chrono::milliseconds timeout, int interrupt_fd) {
  Clock::time_point deadline = now() + timeout;
  while (now() < deadline) {
    RendezvousState state;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state = update([&](RendezvousState& s) { return sweep(s); });
    }
    if (!state.shutdown.empty() || state.round != round_) return;
    bool all_done = std::all_of(state.participants.begin(), state.participants.end(),
                                [&](const auto& id) { return contains(state.finished, id); });
    if (all_done) return;
    if (wait_for(interrupt_fd, 100)) return;
  }
}

void Rendezvous::end_job(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  update([&](RendezvousState& s) {
    if (!s.shutdown.empty()) return false;
    s.shutdown = why;
    return true;
  });
}

void Rendezvous::wait_until_others_left(std::chrono::milliseconds timeout) {
  Clock::time_point deadline = now() + timeout;
  while (now() < deadline) {
    RendezvousState state;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state = update([&](RendezvousState& s) { return sweep(s); });
    }
    bool alone = std::all_of(state.keep_alive.begin(), state.keep_alive.end(),
                             [&](const auto& entry) { return entry.first == self_.id; });
    if (alone) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void Rendezvous::announce_leaving() {
  std::lock_guard<std::mutex> lock(mutex_);
  update([&](RendezvousState& s) {
    if (contains(s.leaving, self_.id) || !contains(s.participants, self_.id)) return false;
    s.leaving.push_back(self_.id);
    return true;
  });
}

void Rendezvous::leave(const std::string& why, WorkersLeft workers) {
  std::lock_guard<std::mutex> lock(mutex_);
  update([&](RendezvousState& s) {
    bool changed = erase(s.leaving, self_.id);
    bool was_participant = contains(s.participants, self_.id);
    // Note [Rounds in place]: its workers left at a step boundary and the others went on without
    // them (Note [Leaving in place], dtrain/recovery.h), unless it is node 0, the workers' store's.
    // The round recovers in place where node 0's agent marked it so, or where it has not looked
    // yet but the leaving agent found the workers' group formed in their store. (Below MIN the job
    // ends either way.)
    auto slot = s.slots.find(self_.id);
    const bool leaves_in_place = (workers == WorkersLeft::kInPlaceConfirmed ||
                                  (workers == WorkersLeft::kInPlace && s.in_place)) &&
                                 slot != s.slots.end() && slot->second.node_rank != 0;
    changed |= erase(s.participants, self_.id);
    changed |= erase(s.waiting, self_.id);
    changed |= erase(s.expected, self_.id);
    changed |= erase(s.joined_running, self_.id);
    changed |= s.slots.erase(self_.id) > 0;
    changed |= s.keep_alive.erase(self_.id) > 0;
    if (s.complete && was_participant && s.round == round_ && s.shutdown.empty() &&
        s.finished.empty()) {
      std::string what = self_.describe() + " left the job (" + why + ")";
      if (leaves_in_place) {
        s.in_place = true;
        go_on_in_place(s, what);
      } else {
        open_round(s, what, what);
      }
    }
    s.nodes.erase(self_.id);
    return changed;
  });
}

}  // namespace dtrain::elastic
