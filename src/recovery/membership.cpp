// The store protocol of membership.h: registration, the close by compare-and-set, admission, and
// the members' heartbeats.
#include "recovery/membership.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <sstream>
#include <thread>

#include "comm/connect.h"
#include "common/format.h"
#include "common/log.h"
#include "common/process_identity.h"
#include "dtrain/errors.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

// A wait asks verdict() every 100 ms (InFlight::kAbandonSlice): one that asked within this is still
// waiting, late wake-ups of a busy machine included.
constexpr std::chrono::milliseconds kAskedRecently{1000};

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}
std::string text_of(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

// A heartbeat counter its process retired at the end of training (Heartbeats::retire).
bool retired_count(const std::vector<uint8_t>& count) { return text_of(count) == "done"; }

std::string members_text(const std::vector<MemberRecord>& members) {
  std::string text;
  for (const auto& m : members) text += m.text() + "\n";
  return text;
}

std::vector<MemberRecord> parse_members(const std::string& text) {
  std::vector<MemberRecord> members;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) members.push_back(MemberRecord::parse(line));
  }
  return members;
}

// Polls start fast (a survivor's peers arrive within milliseconds of one another) and back off to
// a few store round trips per second per process.
std::chrono::milliseconds poll_pause(int round) {
  return std::chrono::milliseconds(std::min(2 + round, 20));
}

}  // namespace

MemberRecord MemberRecord::of_this_process(int job_rank, bool newcomer) {
  MemberRecord record;
  record.job_rank = job_rank;
  record.host = own_hostname();
  record.pid = static_cast<int>(::getpid());
  record.pid_namespace = own_pid_namespace();
  record.newcomer = newcomer;
  return record;
}

// "<rank> <host> <pid> <pid namespace> <newcomer 0|1> <knock address|-> <knock port>
// <unreachable ids, comma-separated|->"
std::string MemberRecord::text() const {
  std::string cut;
  for (const auto& id : unreachable) cut += (cut.empty() ? "" : ",") + id;
  return std::to_string(job_rank) + " " + host + " " + std::to_string(pid) + " " +
         std::to_string(pid_namespace) + " " + (newcomer ? "1" : "0") + " " +
         (knock_address.empty() ? "-" : knock_address) + " " + std::to_string(knock_port) + " " +
         (cut.empty() ? "-" : cut);
}

MemberRecord MemberRecord::parse(const std::string& text) {
  MemberRecord record;
  std::istringstream in(text);
  int newcomer = 0;
  std::string cut;
  if (!(in >> record.job_rank >> record.host >> record.pid >> record.pid_namespace >> newcomer >>
        record.knock_address >> record.knock_port >> cut)) {
    throw InternalError("in-place recovery: unreadable member record in the store: '" + text + "'");
  }
  record.newcomer = newcomer != 0;
  if (record.knock_address == "-") record.knock_address.clear();
  std::istringstream ids(cut == "-" ? "" : cut);
  for (std::string id; std::getline(ids, id, ',');) record.unreachable.push_back(id);
  return record;
}

std::string MemberRecord::id() const {
  return host + "/" + std::to_string(pid) + "/" + std::to_string(pid_namespace);
}

bool MemberRecord::seen_dead() const {
  static const std::string here = own_hostname();
  static const uint64_t namespace_here = own_pid_namespace();
  return host == here && pid_namespace == namespace_here && pid > 0 && ::kill(pid, 0) != 0 &&
         errno == ESRCH;
}

std::string MemberRecord::label() const {
  return "rank " + std::to_string(job_rank) + " (pid " + std::to_string(pid) + " on " + host + ")";
}

Membership::Membership(c10::intrusive_ptr<c10d::Store> root_store, MemberRecord self,
                       std::chrono::milliseconds timeout)
    : store_(std::move(root_store)), self_(std::move(self)), timeout_(timeout) {}

bool Membership::exists(const std::string& name) { return store_->check({key(name)}); }
bool Membership::started(int64_t generation) {
  return exists("g" + std::to_string(generation) + "/arrivals");
}
std::vector<MemberRecord> Membership::departed(const std::vector<MemberRecord>& previous,
                                               const std::vector<MemberRecord>& members) {
  std::vector<MemberRecord> gone;
  for (const MemberRecord& m : previous) {
    if (std::any_of(members.begin(), members.end(),
                    [&](const MemberRecord& s) { return s.same_process(m); })) {
      continue;
    }
    const std::string notice = Heartbeats::exit_key(m);
    // get() on a key not there would wait for it: checked first.
    if (store_->check({notice}) && text_of(store_->get(notice)) == Heartbeats::kLeftOnSigterm) {
      gone.push_back(m);
    }
  }
  return gone;
}

std::string Membership::read(const std::string& name) { return text_of(store_->get(key(name))); }
void Membership::write(const std::string& name, const std::string& value) {
  store_->set(key(name), bytes_of(value));
}

std::vector<MemberRecord> Membership::form(int64_t generation,
                                           const std::vector<MemberRecord>& previous, int newcomers,
                                           std::optional<std::chrono::milliseconds> settle) {
  const std::string prefix = "g" + std::to_string(generation) + "/";
  const auto arrived_at = Clock::now();
  const auto deadline = arrived_at + timeout_;
  // The heartbeat counter exists before the record that makes this process a member: a watcher
  // reads the counters of every member at once (multiGet), which would wait for a missing one.
  store_->add(Heartbeats::key(self_), 1);
  // An exit notice under this process's name was an earlier process's, with the same pid.
  store_->deleteKey(Heartbeats::exit_key(self_));
  const int64_t number = store_->add(key(prefix + "arrivals"), 1);
  write(prefix + "arrival/" + std::to_string(number), self_.text());

  // A newcomer that is admitted knows nobody yet: it waits for the members to close. One that
  // re-forms after a failure during its transfer knows the last generation, as they do, and may
  // close this one (it may be the only one left: Note [In-place recovery]).
  const bool re_forming = !self_.newcomer || !previous.empty();
  std::vector<MemberRecord> arrivals;  // in order of arrival, as far as read
  std::string closed;
  for (int round = 0; closed.empty(); ++round) {
    if (exists(prefix + "closed")) {
      closed = read(prefix + "closed");
      break;
    }
    // Read the records of those that registered since the last round (skipping one whose record is
    // not written yet: it is read next round).
    const int64_t count = store_->add(key(prefix + "arrivals"), 0);
    while (static_cast<int64_t>(arrivals.size()) < count) {
      const std::string name = prefix + "arrival/" + std::to_string(arrivals.size() + 1);
      if (!exists(name)) break;
      arrivals.push_back(MemberRecord::parse(read(name)));
    }
    auto came = [&](const MemberRecord& m) {
      return std::any_of(arrivals.begin(), arrivals.end(),
                         [&](const MemberRecord& a) { return a.same_process(m); });
    };
    std::vector<const MemberRecord*> missing;
    for (const auto& m : previous) {
      if (!came(m)) missing.push_back(&m);
    }
    // Newcomers admitted into this generation by other members (admit()): a member that re-forms
    // after a failure may not have seen the admission (its all-reduce failed where theirs
    // finished), and must not close the generation without them. They wrote it before
    // registering, so it is there by the time all of them have come.
    if (re_forming && exists(prefix + "newcomers")) {
      newcomers = std::max(newcomers, std::stoi(read(prefix + "newcomers")));
    }
    const size_t expected = previous.size() + static_cast<size_t>(newcomers);
    const auto newcomers_came = static_cast<int>(std::count_if(
        arrivals.begin(), arrivals.end(), [](const MemberRecord& a) { return a.newcomer; }));
    const auto now = Clock::now();
    bool complete = arrivals.size() >= expected && missing.empty();
    if (settle && !complete) {
      const bool all_missing_dead =
          std::all_of(missing.begin(), missing.end(), [&](const MemberRecord* m) {
            return m->seen_dead() || (heartbeats_ && heartbeats_->lost(*m)) ||
                   store_->check({Heartbeats::exit_key(*m)});
          });
      complete = (all_missing_dead && newcomers_came >= newcomers) || now - arrived_at >= *settle;
    }
    if (complete && re_forming) {
      // Members in rank order: the survivors by their job rank, then the newcomers; none of a pair
      // that cannot reach each other (Note [A link cut between members]).
      std::vector<MemberRecord> members = arrivals;
      std::stable_sort(members.begin(), members.end(),
                       [](const MemberRecord& a, const MemberRecord& b) {
                         if (a.newcomer != b.newcomer) return !a.newcomer;
                         return a.job_rank < b.job_rank;
                       });
      const std::string mine =
          members_text(without_cut_pairs(std::move(members), launcher_hosts_store() ? -1 : 0));
      closed = text_of(store_->compareSet(key(prefix + "closed"), {}, bytes_of(mine)));
      if (closed == mine) write("latest", std::to_string(generation));
      break;
    }
    if (now >= deadline) {
      std::vector<std::string> absent;
      for (const auto* m : missing) absent.push_back(m->label());
      throw TimeoutError(self_.label() + ": in-place recovery: generation " +
                         std::to_string(generation) + " did not form within " +
                         seconds_text(timeout_) + "; " + std::to_string(arrivals.size()) + " of " +
                         std::to_string(expected) + " processes came" +
                         (absent.empty() ? std::string() : ", missing " + list_text(absent)) +
                         ". Likely cause: a rank died or stalled before it joined; see its log.");
    }
    std::this_thread::sleep_for(poll_pause(round));
  }

  std::vector<MemberRecord> members = parse_members(closed);
  const bool in = std::any_of(members.begin(), members.end(),
                              [&](const MemberRecord& m) { return m.same_process(self_); });
  if (!in) {
    // Left out of a pair that cannot reach each other (Note [A link cut between members])?
    std::vector<std::string> cut = self_.unreachable;
    for (const auto& a : arrivals) {
      if (std::find(a.unreachable.begin(), a.unreachable.end(), self_.id()) != a.unreachable.end())
        cut.push_back(a.id());
    }
    if (!cut.empty()) {
      std::vector<std::string> names;
      for (const auto& a : arrivals) {
        if (std::find(cut.begin(), cut.end(), a.id()) != cut.end()) names.push_back(a.label());
      }
      if (self_.unreachable.empty() && !names.empty()) {
        // This process reached every member it knocked at, and they could not reach it: the cut
        // is one-way, what comes into this host is dropped. Re-trying changes nothing until the
        // setting does, which is what the line must say.
        throw CommError(
            self_.label() + ": in-place recovery: generation " + std::to_string(generation) +
            " formed without this process: " + list_text(names) + " could not connect to it at " +
            self_.knock_address + ":" + std::to_string(self_.knock_port) +
            " though it reached them when it knocked: connections coming into this host are "
            "dropped (a firewall on it, or on the way, that lets out what it does not let in: "
            "let in TCP from the job's other hosts), unless the network between them failed "
            "since. It exits; under `dtrain run "
            "--recovery in-place` it is restarted as a newcomer and left out the same "
            "way until they can connect to it or its launcher's --max-restarts run "
            "out.");
      }
      throw CommError(self_.label() + ": in-place recovery: generation " +
                      std::to_string(generation) + " formed without this process: it and " +
                      (names.empty() ? std::string("another member") : list_text(names)) +
                      " cannot reach each other (the network between their hosts is cut: check "
                      "the link, the switch port and firewalls between them), and of such a pair "
                      "the one cut off from more members leaves, the higher rank of equals. It "
                      "exits; under `dtrain run --recovery in-place` it is restarted as a "
                      "newcomer, admitted once it reaches every member again.");
    }
    throw CommError(self_.label() + ": in-place recovery: generation " +
                    std::to_string(generation) + " formed without this process (" +
                    std::to_string(members.size()) +
                    " members): it came after the others had waited --settle for it. It exits; "
                    "under `dtrain run --recovery in-place` it is restarted and admitted as a "
                    "newcomer.");
  }
  return members;
}

std::string shared_address_problem(const std::vector<MemberRecord>& members) {
  for (size_t i = 0; i < members.size(); ++i) {
    for (size_t j = i + 1; j < members.size(); ++j) {
      const MemberRecord &a = members[i], &b = members[j];
      if (a.knock_address.empty() || a.knock_address != b.knock_address || a.host == b.host) {
        continue;
      }
      return a.label() + " and " + b.label() + " both give " + a.knock_address +
             " as the address the others reach them at (the interface GLOO_SOCKET_IFNAME names, "
             "or the one that routes to MASTER_ADDR), an address every host has (a container "
             "bridge, loopback) that reaches no other host. Set GLOO_SOCKET_IFNAME to the "
             "interface of the network between the hosts, or MASTER_ADDR to an address on it";
    }
  }
  return "";
}

std::vector<MemberRecord> without_cut_pairs(std::vector<MemberRecord> members, int store_holder) {
  auto cut = [&](const MemberRecord& a, const MemberRecord& b) {
    auto names = [](const MemberRecord& x, const MemberRecord& y) {
      return std::find(x.unreachable.begin(), x.unreachable.end(), y.id()) != x.unreachable.end();
    };
    return names(a, b) || names(b, a);
  };
  // Greedy, as pairs are few: each round leaves out the member in the most pairs still standing.
  for (;;) {
    std::vector<int> pairs(members.size(), 0);
    for (size_t i = 0; i < members.size(); ++i) {
      for (size_t j = i + 1; j < members.size(); ++j) {
        if (cut(members[i], members[j])) ++pairs[i], ++pairs[j];
      }
    }
    // The members are in rank order (newcomers last), so the last of the most is the one to go.
    size_t out = members.size();
    for (size_t i = 0; i < members.size(); ++i) {
      // The store's host stays: without it nobody goes on.
      const bool holds_store = !members[i].newcomer && members[i].job_rank == store_holder;
      if (pairs[i] > 0 && !holds_store && (out == members.size() || pairs[i] >= pairs[out])) {
        out = i;
      }
    }
    if (out == members.size()) return members;
    members.erase(members.begin() + static_cast<std::ptrdiff_t>(out));
  }
}

void Membership::joined() { self_.newcomer = false; }

Membership::Readiness Membership::wait_until_members_answer(
    const std::function<bool()>& stop_requested) {
  const auto deadline = Clock::now() + timeout_;
  std::string waiting_for;  // said in the log, once per member
  for (int round = 0;; ++round) {
    if (stop_requested()) return Readiness::kStopRequested;
    std::string closed;  // the members of the last generation that closed
    try {
      if (exists("finished")) return Readiness::kJobFinished;
      if (exists("latest")) {
        // "latest" may lag (it is written after the close): the newest is further on.
        int64_t generation = std::stoll(read("latest"));
        while (exists("g" + std::to_string(generation + 1) + "/closed")) ++generation;
        closed = read("g" + std::to_string(generation) + "/closed");
      }
    } catch (const c10::Error& e) {
      // As in wait_for_admission: the store is gone with the job, or with rank 0.
      DTRAIN_LOG(kWarn, "in-place recovery: the job's store went away while this newcomer waited ("
                            << e.what() << "): the job finished, or rank 0 died");
      return Readiness::kJobFinished;
    }
    std::vector<MemberRecord> targets;
    std::vector<MemberRecord> with_this_one = parse_members(closed);
    with_this_one.push_back(self_);
    if (const std::string problem = shared_address_problem(with_this_one); !problem.empty()) {
      throw UsageError(self_.label() +
                       ": in-place recovery: this newcomer cannot join: " + problem + ".");
    }
    for (auto& m : parse_members(closed)) {
      // Not the process this one replaces (the same job rank): it is dead, or cut off.
      if (m.job_rank != self_.job_rank && m.knock_port > 0) targets.push_back(std::move(m));
    }
    std::vector<std::vector<elastic::SocketAddress>> addresses;
    for (const auto& m : targets) {
      addresses.push_back(elastic::resolve_addresses(m.knock_address, m.knock_port));
    }
    // SIGTERM cuts the knock short too: the launcher's grace period may be shorter than a knock.
    const std::vector<elastic::Knock> answers =
        elastic::knock_each(addresses, Heartbeats::kKnockTimeout, stop_requested);
    if (stop_requested()) return Readiness::kStopRequested;
    // A refusal is a dead member, which the others re-form without: only silence waits.
    const MemberRecord* silent = nullptr;
    for (size_t i = 0; i < answers.size() && !silent; ++i) {
      if (answers[i] == elastic::Knock::kSilent) silent = &targets[i];
    }
    if (!silent) return Readiness::kReady;
    const std::string at = silent->knock_address + ":" + std::to_string(silent->knock_port);
    if (waiting_for != silent->id()) {
      waiting_for = silent->id();
      DTRAIN_LOG(kWarn, "in-place recovery: this newcomer cannot reach "
                            << silent->label() << " at " << at
                            << " (the network between the hosts is cut?); it asks to be admitted "
                               "once every member answers");
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(self_.label() + ": in-place recovery: " + silent->label() +
                         " answered no connection at " + at + " for " + seconds_text(timeout_) +
                         ", so this newcomer cannot join the group. Likely cause: the network "
                         "between the two hosts is cut; check the link and firewalls.");
    }
    // In slices, so that SIGTERM is answered within the launcher's grace period.
    for (auto until = Clock::now() + poll_pause(round) * 25; Clock::now() < until;) {
      if (stop_requested()) return Readiness::kStopRequested;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

int64_t Membership::request_admission() { return store_->add(key("newcomers"), 1); }

std::optional<int64_t> Membership::wait_for_admission(int64_t number) {
  const std::string name = "admit/" + std::to_string(number);
  const auto deadline = Clock::now() + timeout_;
  for (int round = 0;; ++round) {
    try {
      if (exists(name)) break;
      if (exists("finished")) return std::nullopt;
    } catch (const std::exception& e) {
      // Started without `dtrain run --recovery in-place`, rank 0 hosts the store (Note [In-place
      // recovery]): it is gone when the job finished, or when rank 0 died, which ends the job.
      // Either way there is nothing to join.
      DTRAIN_LOG(kWarn, "in-place recovery: the job's store went away while this newcomer waited ("
                            << e.what() << "): the job finished, or rank 0 died");
      return std::nullopt;
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(self_.label() + ": in-place recovery: not admitted within " +
                         seconds_text(timeout_) + " of asking (newcomer " + std::to_string(number) +
                         "). Likely cause: the job's members are stuck or gone, or do not recover "
                         "in place; see rank 0's log.");
    }
    std::this_thread::sleep_for(poll_pause(round) * 5);
  }
  return std::stoll(read(name));
}

void Membership::mark_done() {
  // Named by the process group, which under `dtrain run` is the worker the launcher started (a
  // wrapper script's too).
  write("done/" + process_key(getpgrp()), "1");
}

void Membership::mark_finished(bool completed) {
  if (completed) write("completed", "1");
  write("finished", "1");
}

void Membership::mark_failed(int64_t generation) {
  write("g" + std::to_string(generation) + "/failed", "1");
}

int64_t Membership::newcomers_requested() { return store_->add(key("newcomers"), 0); }

void Membership::admit(int64_t first, int64_t last, int64_t generation) {
  write("g" + std::to_string(generation) + "/newcomers", std::to_string(last - first + 1));
  for (int64_t k = first; k <= last; ++k) {
    write("admit/" + std::to_string(k), std::to_string(generation));
  }
}

Heartbeats::Heartbeats(c10::intrusive_ptr<c10d::Store> store, MemberRecord self,
                       std::chrono::milliseconds lost_after, std::string where)
    : store_(std::move(store)),
      self_(std::move(self)),
      self_key_(key(self_)),
      lost_after_(lost_after),
      where_(std::move(where)),
      reached_(Clock::now()) {}

std::string Heartbeats::key(const MemberRecord& member) {
  return "dtrain/recovery/beat/" + member.id();
}

// The launcher writes this key (in_place_recovery.cpp spells it there too, as its store holds it:
// with the "/" that c10d's client puts before every key).
std::string Heartbeats::exit_key(const MemberRecord& member) {
  return "dtrain/recovery/exited/" + member.id();
}

void Heartbeats::watch(int64_t generation, const std::vector<MemberRecord>& members) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  generation_ = generation;
  next_failed_ = false;
  std::vector<Watched> before = std::move(watched_);
  watched_.clear();
  for (const auto& m : members) {
    if (m.same_process(self_)) continue;
    // Numeric: resolving does not block.
    auto knock_at = m.knock_port > 0 ? elastic::resolve_addresses(m.knock_address, m.knock_port)
                                     : std::vector<elastic::SocketAddress>{};
    Watched w{m, key(m), {}, now, std::move(knock_at), elastic::Knock::kAccepted, {}, false};
    // A member watched before keeps its heartbeat's history: whether it still beats is known, not
    // assumed, when the new generation is knocked at before it connects.
    for (const auto& b : before) {
      if (b.record.same_process(m)) w.count = b.count, w.moved = b.moved;
    }
    watched_.push_back(std::move(w));
  }
}

void Heartbeats::round() {
  int64_t generation;
  std::vector<std::string> keys;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (retired_) return;
    generation = generation_;
    for (const auto& w : watched_) keys.push_back(w.key);
  }
  store_->add(self_key_, 1);
  std::vector<std::vector<uint8_t>> counts;
  if (!keys.empty()) counts = store_->multiGet(keys);
  const bool next_failed =
      generation >= 0 &&
      store_->check({"dtrain/recovery/g" + std::to_string(generation + 1) + "/failed"});
  const int64_t newcomers = store_->add("dtrain/recovery/newcomers", 0);
  const auto now = Clock::now();

  {
    std::lock_guard<std::mutex> lock(mutex_);
    reached_ = now;
    newcomers_seen_.store(newcomers);
    // watch() may have moved on while this round read: then its counts are the old members'.
    if (generation == generation_ && counts.size() == watched_.size()) {
      next_failed_ = next_failed;
      for (size_t i = 0; i < counts.size(); ++i) {
        if (counts[i] != watched_[i].count) {
          watched_[i].count = std::move(counts[i]);
          watched_[i].moved = now;
        }
      }
    }
  }
  knock_if_stalled(now);
}

void Heartbeats::take_answers(int64_t generation, Clock::time_point begun,
                              const std::vector<elastic::Knock>& answers) {
  // Answers about another generation's members are of no use.
  if (generation != generation_ || answers.size() != watched_.size()) return;
  for (size_t i = 0; i < answers.size(); ++i) {
    Watched& w = watched_[i];
    // One with no address to knock at (it could not listen) is not judged by knocks, nor one this
    // process could not even try (out of sockets).
    if (w.knock_at.empty() || answers[i] == elastic::Knock::kUnknown) continue;
    w.knocked = answers[i];
    w.knocked_at = begun;
    if (w.knocked == elastic::Knock::kAccepted) w.said = false;
    // Said here, on the member that found it: the line rank 0 prints names only what it saw.
    if (!w.said && unreachable_now(w)) {
      w.said = true;
      DTRAIN_LOG(kWarn, "in-place recovery: " << unreachable_text(w));
    }
  }
}

bool Heartbeats::unreachable_now(const Watched& w) const {
  // A member that finished training may have exited (it refuses: no failure), and one whose
  // heartbeats stopped too is lost, as the verdict says first.
  return w.knocked != elastic::Knock::kAccepted &&
         (waiting_since_ == Clock::time_point::max() || w.knocked_at >= waiting_since_) &&
         !retired_count(w.count) && reached_ - w.moved < lost_after_;
}

std::string Heartbeats::unreachable_text(const Watched& w) const {
  const std::string at = w.record.knock_address + ":" + std::to_string(w.record.knock_port);
  if (w.knocked == elastic::Knock::kRefused) {
    return w.record.label() + " refused a connection at " + at +
           ": nothing listens there any more (its process is gone), or a firewall rejects it";
  }
  return w.record.label() + " answered no connection at " + at + " within " +
         seconds_text(kKnockTimeout) +
         " though its heartbeats through the store go on: the network between this host and " +
         w.record.host + " is cut (check the link, the switch port and firewalls between them)";
}

void Heartbeats::knock_if_stalled(Clock::time_point now) {
  std::vector<std::vector<elastic::SocketAddress>> targets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (knocking_.valid()) {
      if (knocking_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return;
      take_answers(knocking_generation_, knocked_at_, knocking_.get());
    }
    // The training thread waits (it asked within the last few slices) for an operation issued
    // lost_after ago, and the last knock is lost_after old: knock again.
    const bool waiting =
        waiting_since_ != Clock::time_point::max() && now - asked_last_ < kAskedRecently;
    if (retired_ || !waiting || now - waiting_since_ < lost_after_ ||
        now - knocked_at_ < lost_after_) {
      return;
    }
    for (const auto& w : watched_) targets.push_back(w.knock_at);
    knocked_at_ = now;
    knocking_generation_ = generation_;
  }
  knocking_ = std::async(std::launch::async, [this, targets = std::move(targets)] {
    return elastic::knock_each(targets, kKnockTimeout, [this] { return knocks_given_up_.load(); });
  });
}

std::string Heartbeats::knock_now() {
  std::vector<std::vector<elastic::SocketAddress>> targets;
  int64_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation = generation_;
    for (const auto& w : watched_) targets.push_back(w.knock_at);
  }
  const auto begun = Clock::now();
  const std::vector<elastic::Knock> answers = elastic::knock_each(targets, kKnockTimeout);
  std::lock_guard<std::mutex> lock(mutex_);
  take_answers(generation, begun, answers);
  for (const auto& w : watched_) {
    if (generation == generation_ && unreachable_now(w)) return unreachable_text(w);
  }
  return "";
}

std::vector<std::string> Heartbeats::unreachable() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> ids;
  for (const auto& w : watched_) {
    if (unreachable_now(w)) ids.push_back(w.record.id());
  }
  return ids;
}

void Heartbeats::leave(const std::string& how) {
  try {
    store_->set(exit_key(self_), bytes_of(how));
  } catch (const std::exception& e) {
    // The others then wait `settle` for it: a retired counter is never counted lost.
    DTRAIN_LOG(kWarn, "in-place recovery: could not tell the others that this process leaves: "
                          << e.what());
  }
  retire();
}

void Heartbeats::retire() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    retired_ = true;
  }
  try {
    store_->set(self_key_, bytes_of("done"));
  } catch (const std::exception& e) {
    DTRAIN_LOG(kDebug, "in-place recovery: could not retire the heartbeat: " << e.what());
  }
}

std::string Heartbeats::lost_text(const Watched& w, Clock::time_point now) const {
  return w.record.label() + " sent no heartbeat through the store for " +
         seconds_text(now - w.moved) + " (its host is lost, or cut off from the store)";
}

std::string Heartbeats::verdict(int64_t generation, Clock::time_point waiting_since) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto now = Clock::now();
  // Note [A link cut between members]: the asks tell the watcher what the training thread waits
  // for, and since when.
  waiting_since_ = waiting_since;
  asked_last_ = now;
  if (retired_ || generation != generation_) return "";
  if (now - reached_ >= lost_after_) {
    return "the job's store at " + where_ + " has answered none of this process's heartbeats for " +
           seconds_text(now - reached_) + " (this host is cut off from it, or its host is lost)";
  }
  for (const auto& w : watched_) {
    if (!retired_count(w.count) && reached_ - w.moved >= lost_after_) return lost_text(w, reached_);
  }
  for (const auto& w : watched_) {
    if (unreachable_now(w)) return unreachable_text(w);
  }
  if (next_failed_) {
    return "a member abandoned generation " + std::to_string(generation) +
           " after a failure and re-forms as generation " + std::to_string(generation + 1) +
           ", so this collective cannot finish";
  }
  return "";
}

bool Heartbeats::lost(const MemberRecord& member) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Clock::now() - reached_ >= lost_after_) return false;  // cut off: judges nobody
  for (const auto& w : watched_) {
    if (w.record.same_process(member)) {
      return !retired_count(w.count) && reached_ - w.moved >= lost_after_;
    }
  }
  return false;
}

std::string Heartbeats::cut_off() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto now = Clock::now();
  if (retired_ || now - reached_ < lost_after_) return "";
  return "the job's store at " + where_ + " has answered none of this process's heartbeats for " +
         seconds_text(now - reached_) +
         ": this host is cut off from the job, or the store's host (node 0's launcher) is lost";
}

}  // namespace dtrain::detail
