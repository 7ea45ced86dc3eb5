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

#include "common/format.h"
#include "common/log.h"
#include "common/process_identity.h"
#include "dtrain/errors.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

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

std::string MemberRecord::text() const {
  return std::to_string(job_rank) + " " + host + " " + std::to_string(pid) + " " +
         std::to_string(pid_namespace) + " " + (newcomer ? "1" : "0");
}

MemberRecord MemberRecord::parse(const std::string& text) {
  MemberRecord record;
  std::istringstream in(text);
  int newcomer = 0;
  if (!(in >> record.job_rank >> record.host >> record.pid >> record.pid_namespace >> newcomer)) {
    throw InternalError("in-place recovery: unreadable member record in the store: '" + text + "'");
  }
  record.newcomer = newcomer != 0;
  return record;
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
    if (!self_.newcomer && exists(prefix + "newcomers")) {
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
    if (complete && !self_.newcomer) {
      // Members in rank order: the survivors by their job rank, then the newcomers.
      std::vector<MemberRecord> members = arrivals;
      std::stable_sort(members.begin(), members.end(),
                       [](const MemberRecord& a, const MemberRecord& b) {
                         if (a.newcomer != b.newcomer) return !a.newcomer;
                         return a.job_rank < b.job_rank;
                       });
      closed =
          text_of(store_->compareSet(key(prefix + "closed"), {}, bytes_of(members_text(members))));
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
    throw CommError(self_.label() + ": in-place recovery: generation " +
                    std::to_string(generation) + " formed without this process (" +
                    std::to_string(members.size()) +
                    " members): it came after the others had waited --settle for it. It exits; "
                    "under `dtrain run --recovery in-place` it is restarted and admitted as a "
                    "newcomer.");
  }
  return members;
}

void Membership::joined() { self_.newcomer = false; }

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

void Membership::mark_finished() { write("finished", "1"); }

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
  return "dtrain/recovery/beat/" + member.host + "/" + std::to_string(member.pid) + "/" +
         std::to_string(member.pid_namespace);
}

// The launcher writes this key (in_place_recovery.cpp spells it there too, as its store holds it:
// with the "/" that c10d's client puts before every key).
std::string Heartbeats::exit_key(const MemberRecord& member) {
  return "dtrain/recovery/exited/" + member.host + "/" + std::to_string(member.pid) + "/" +
         std::to_string(member.pid_namespace);
}

void Heartbeats::watch(int64_t generation, const std::vector<MemberRecord>& members) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  generation_ = generation;
  next_failed_ = false;
  watched_.clear();
  for (const auto& m : members) {
    if (m.same_process(self_)) continue;
    watched_.push_back(Watched{m, key(m), {}, now});
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

  std::lock_guard<std::mutex> lock(mutex_);
  reached_ = now;
  newcomers_seen_.store(newcomers);
  // watch() may have moved on while this round read: then its counts are the old members'.
  if (generation != generation_ || counts.size() != watched_.size()) return;
  next_failed_ = next_failed;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] != watched_[i].count) {
      watched_[i].count = std::move(counts[i]);
      watched_[i].moved = now;
    }
  }
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

std::string Heartbeats::verdict(int64_t generation) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (retired_ || generation != generation_) return "";
  const auto now = Clock::now();
  if (now - reached_ >= lost_after_) {
    return "the job's store at " + where_ + " has answered none of this process's heartbeats for " +
           seconds_text(now - reached_) + " (this host is cut off from it, or its host is lost)";
  }
  for (const auto& w : watched_) {
    if (!retired_count(w.count) && reached_ - w.moved >= lost_after_) return lost_text(w, reached_);
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
