// The store protocol of membership.h: registration, the close by compare-and-set, admission.
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
  const int64_t number = store_->add(key(prefix + "arrivals"), 1);
  write(prefix + "arrival/" + std::to_string(number), self_.text());
  const size_t expected = previous.size() + static_cast<size_t>(newcomers);

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
    const auto newcomers_came = static_cast<int>(std::count_if(
        arrivals.begin(), arrivals.end(), [](const MemberRecord& a) { return a.newcomer; }));
    const auto now = Clock::now();
    bool complete = arrivals.size() >= expected && missing.empty();
    if (settle && !complete) {
      const bool all_missing_dead = std::all_of(
          missing.begin(), missing.end(), [](const MemberRecord* m) { return m->seen_dead(); });
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

int64_t Membership::newcomers_requested() { return store_->add(key("newcomers"), 0); }

void Membership::admit(int64_t first, int64_t last, int64_t generation) {
  for (int64_t k = first; k <= last; ++k) {
    write("admit/" + std::to_string(k), std::to_string(generation));
  }
}

}  // namespace dtrain::detail
