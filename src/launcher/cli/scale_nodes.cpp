// `dtrain scale` on several hosts: node 0's store and the other nodes' calls to it (see
// scale_nodes.h for the keys).
#include "launcher/cli/scale_nodes.h"

#include <poll.h>

#include <cstdio>
#include <functional>
#include <random>

#include "common/format.h"
#include "dtrain/errors.h"
#include "launcher/elastic/worker_group.h"

namespace dtrain::cli::scale {
namespace {

using Clock = std::chrono::steady_clock;
using elastic::KeyCheck;
using std::chrono::milliseconds;

// How often every wait looks again, and how long one call to the store may take.
constexpr milliseconds kPoll{100};
constexpr milliseconds kCallTimeout{2000};

std::string key(int count, const std::string& what) {
  return "scale/" + std::to_string(count) + "/" + what;
}

// Sleeps one poll period, or less when a signal arrives; the signal's number, or 0.
int pause_for_signal(elastic::SignalPipe& signals) {
  pollfd p{signals.fd(), POLLIN, 0};
  poll(&p, 1, static_cast<int>(kPoll.count()));
  return signals.take();
}

// Polls until no node in 1..nodes-1 is `pending`, at most `timeout`; a signal ends the wait and
// sets *signo. Returns the nodes still pending.
std::vector<std::string> wait_while_pending(int nodes, const std::function<bool(int)>& pending,
                                            milliseconds timeout, elastic::SignalPipe& signals,
                                            int* signo) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    std::vector<std::string> missing;
    for (int node = 1; node < nodes; ++node) {
      if (pending(node)) missing.push_back(std::to_string(node));
    }
    if (missing.empty() || Clock::now() >= deadline) return missing;
    if ((*signo = pause_for_signal(signals)) != 0) return missing;
  }
}

// 64 random bits in hex: a node's token.
std::string random_token() {
  std::random_device random;  // /dev/urandom on Linux
  char text[17];
  std::snprintf(text, sizeof text, "%08x%08x", random(), random());
  return text;
}

std::string refused_text(const std::string& where) {
  return where +
         " refused this node: its flags differ from node 0's (see node 0's message); give every "
         "host the same flags but --node-rank";
}

}  // namespace

std::string plan_of(const ScaleOptions& options) {
  std::string plan = "--nproc ";
  for (int count : options.nproc) plan += std::to_string(count) + ",";
  plan.back() = ' ';
  plan += "--nproc-per-node " + std::to_string(options.nproc_per_node);
  if (options.seconds) {
    plan += " --seconds " + detail::seconds_text(*options.seconds);
  } else {
    plan += " --steps " + std::to_string(options.steps);
  }
  plan += " --warmup-steps " + std::to_string(options.warmup_steps) + " --";
  for (const std::string& word : options.command) plan.append(" ").append(word);
  return plan;
}

// ---- node 0 -----------------------------------------------------------------------------------

Coordinator::Coordinator(const ScaleOptions& options)
    : options_(options), plan_(plan_of(options)), store_("", options.master_port) {}

std::string Coordinator::wait_for_nodes(milliseconds timeout, elastic::SignalPipe& signals) {
  int signo = 0;
  auto absent = [&](int node) {
    const std::string r = std::to_string(node);
    std::optional<std::string> joined = store_.value_of("scale/joined/" + r);
    if (!joined) return true;
    const std::size_t newline = joined->find('\n');
    const std::string id = r + ":" + joined->substr(0, newline), plan = joined->substr(newline + 1);
    if (plan != plan_) {
      set({"scale/refused/" + r});
      throw UsageError("dtrain scale: node " + r + " runs other flags: '" + plan +
                       "', node 0 runs '" + plan_ +
                       "'; give every host the same flags but --node-rank");
    }
    if (ids_.emplace(node, id).first->second != id) {
      throw UsageError("dtrain scale: two processes joined as node " + r +
                       " (one left over from an earlier run on port " +
                       std::to_string(options_.master_port) + "?); stop them and start one");
    }
    return false;
  };
  std::vector<std::string> missing =
      wait_while_pending(options_.nnodes, absent, timeout, signals, &signo);
  if (missing.empty()) return "";
  if (signo != 0) {
    return "received " + elastic::signal_name(signo) + " while waiting for node(s) " +
           detail::list_text(missing);
  }
  return "node(s) " + detail::list_text(missing) + " did not join within " +
         detail::seconds_text(timeout) + " (--time-limit) at port " +
         std::to_string(options_.master_port) + "; start `dtrain scale --nnodes " +
         std::to_string(options_.nnodes) + " --node-rank R --master-addr " + options_.master_addr +
         " ...` there";
}

// Node 0 sets its keys as a client of its own store, over loopback: WorkerStore serves its clients
// on a thread of its own, which alone may wake a waiting client, so it offers no set() beside them.
// The CHECK of the last key set says that the store took them all.
void Coordinator::set(const std::vector<std::string>& names) {
  std::vector<std::pair<std::string, std::string>> entries;
  for (const std::string& name : names) entries.emplace_back(name, "");
  std::string why = "the key is missing after it was set";
  if (elastic::set_and_check_in_worker_store("127.0.0.1", options_.master_port, entries,
                                             names.back(), kCallTimeout,
                                             &why) != KeyCheck::kPresent) {
    throw CommError("dtrain scale: node 0 cannot set '" + names.back() +
                    "' in its own store at 127.0.0.1:" + std::to_string(options_.master_port) +
                    ": " + why);
  }
}

std::string Coordinator::id_of(int node) const {
  auto kept = ids_.find(node);
  return kept == ids_.end() ? std::to_string(node) : kept->second;
}

void Coordinator::start(int count) {
  std::vector<std::string> names;
  for (int node = 1; node < options_.nnodes; ++node) {
    names.push_back(key(count, "start/" + id_of(node)));
  }
  set(names);
}

void Coordinator::stop(int count) { set({key(count, "stop")}); }

std::string Coordinator::new_records(int count, int nodes) {
  std::string lines;
  for (int node = 1; node < nodes; ++node) {
    int& next = next_batch_[{count, node}];
    while (std::optional<std::string> batch =
               store_.value_of(key(count, "records/" + id_of(node) + "/" + std::to_string(next)))) {
      lines += *batch;
      ++next;
    }
  }
  return lines;
}

std::optional<NodeEnding> Coordinator::failed_node(int count, int nodes) const {
  for (int node = 1; node < nodes; ++node) {
    if (std::optional<std::string> why = store_.value_of("scale/quit/" + id_of(node))) {
      return NodeEnding{1, "node " + std::to_string(node) + " quit: " + *why};
    }
    std::optional<std::string> end = store_.value_of(key(count, "end/" + id_of(node)));
    if (!end) continue;
    std::size_t newline = end->find('\n');
    NodeEnding ending{std::atoi(end->c_str()), end->substr(newline + 1)};
    if (ending.exit_code != 0) {
      ending.ending = "node " + std::to_string(node) + ": " + ending.ending;
      return ending;
    }
  }
  return std::nullopt;
}

std::string Coordinator::wait_for_ends(int count, int nodes, milliseconds timeout,
                                       elastic::SignalPipe& signals, int* signo) const {
  auto running = [&](int node) {
    return !store_.contains(key(count, "end/" + id_of(node))) &&
           !store_.contains("scale/quit/" + id_of(node));
  };
  std::vector<std::string> missing = wait_while_pending(nodes, running, timeout, signals, signo);
  if (missing.empty()) return "";
  if (*signo != 0) {
    return "received " + elastic::signal_name(*signo) + " while waiting for node(s) " +
           detail::list_text(missing) + " to report the end of their workers";
  }
  return "node(s) " + detail::list_text(missing) +
         " did not report the end of their workers within " + detail::seconds_text(timeout) +
         " (their records may be missing)";
}

std::string Coordinator::finish(milliseconds timeout, elastic::SignalPipe& signals) {
  set({"scale/end"});
  // The nodes node 0 kept (a refused one never is) say goodbye, unless they quit.
  auto staying = [&](int node) {
    return ids_.count(node) != 0 && !store_.contains("scale/bye/" + id_of(node)) &&
           !store_.contains("scale/quit/" + id_of(node));
  };
  int signo = 0;
  std::vector<std::string> missing =
      wait_while_pending(options_.nnodes, staying, timeout, signals, &signo);
  if (missing.empty()) return "";
  if (signo != 0) {
    return "received " + elastic::signal_name(signo) + " while waiting for node(s) " +
           detail::list_text(missing) + " to see the end";
  }
  return "node(s) " + detail::list_text(missing) + " did not see the end within " +
         detail::seconds_text(timeout);
}

// ---- every other node -------------------------------------------------------------------------

Member::Member(const ScaleOptions& options)
    : options_(options),
      token_(random_token()),
      id_(std::to_string(options.node_rank) + ":" + token_),
      where_("node 0 at " + options.master_addr + ":" + std::to_string(options.master_port)) {}

KeyCheck Member::exchange(const std::vector<std::pair<std::string, std::string>>& entries,
                          const std::string& check_key, std::string* why) {
  return elastic::set_and_check_in_worker_store(options_.master_addr, options_.master_port, entries,
                                                check_key, kCallTimeout, why);
}

bool Member::poll_for(const std::string& wanted, const std::string& what, milliseconds timeout,
                      elastic::SignalPipe& signals, std::string* failure, const std::string& or_key,
                      bool* or_present) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    std::string why;
    KeyCheck found = exchange({}, wanted, &why);
    if (found == KeyCheck::kPresent) return true;
    if (found == KeyCheck::kAbsent && !or_key.empty() &&
        exchange({}, or_key, &why) == KeyCheck::kPresent) {
      *or_present = true;
      return false;
    }
    if (found == KeyCheck::kNoStore) {
      *failure = where_ + " is gone (" + why + ") while waiting for it to " + what;
      return false;
    }
    if (Clock::now() >= deadline) {
      *failure = where_ + " did not " + what + " within " + detail::seconds_text(timeout) +
                 (why.empty() ? "" : " (" + why + ")");
      return false;
    }
    if (int signo = pause_for_signal(signals); signo != 0) {
      *failure = "received " + elastic::signal_name(signo) + " while waiting for node 0 to " + what;
      return false;
    }
  }
}

std::string Member::join(milliseconds timeout, elastic::SignalPipe& signals) {
  const std::string me = std::to_string(options_.node_rank);
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    std::string why;
    KeyCheck refused = exchange({{"scale/joined/" + me, token_ + "\n" + plan_of(options_)}},
                                "scale/refused/" + me, &why);
    if (refused == KeyCheck::kPresent) return refused_text(where_);
    if (refused == KeyCheck::kAbsent) return "";
    if (Clock::now() >= deadline) {
      return "cannot reach " + where_ + " within " + detail::seconds_text(timeout) +
             " (--time-limit): " + why +
             "; start `dtrain scale --node-rank 0 ...` there, with the same --master-port";
    }
    if (int signo = pause_for_signal(signals); signo != 0) {
      return "received " + elastic::signal_name(signo) + " while waiting for " + where_;
    }
  }
}

bool Member::wait_for_start(int count, milliseconds timeout, elastic::SignalPipe& signals,
                            std::string* failure) {
  bool ended = false;
  std::string what = "start " + std::to_string(options_.nproc.at(count)) + " workers";
  if (poll_for(key(count, "start/" + id_), what, timeout, signals, failure, "scale/end", &ended)) {
    return true;
  }
  if (ended) {
    const std::string me = std::to_string(options_.node_rank);
    *failure = exchange({}, "scale/refused/" + me, nullptr) == KeyCheck::kPresent
                   ? refused_text(where_)
                   : "";
  }
  return false;
}

bool Member::send_and_check_stop(int count, const std::string& records, std::string* failure) {
  std::vector<std::pair<std::string, std::string>> entries;
  int& next = next_batch_[count];
  if (!records.empty()) {
    entries.emplace_back(key(count, "records/" + id_ + "/" + std::to_string(next)), records);
  }
  std::string why;
  KeyCheck stop = exchange(entries, key(count, "stop"), &why);
  if (stop == KeyCheck::kNoStore || stop == KeyCheck::kNoAnswer) {
    *failure = lost_ = "lost " + where_ + ": " + why;
    return true;
  }
  if (!records.empty()) ++next;
  return stop == KeyCheck::kPresent;
}

void Member::report_end(int count, const NodeEnding& ending) {
  exchange({{key(count, "end/" + id_), std::to_string(ending.exit_code) + "\n" + ending.ending}},
           key(count, "stop"), nullptr);
}

void Member::quit(const std::string& why) {
  exchange({{"scale/quit/" + id_, why}}, "scale/end", nullptr);
}

std::string Member::leave(milliseconds timeout, elastic::SignalPipe& signals) {
  std::string failure;
  if (!poll_for("scale/end", "end the measurement", timeout, signals, &failure)) return failure;
  exchange({{"scale/bye/" + id_, ""}}, "scale/end", nullptr);
  return "";
}

}  // namespace dtrain::cli::scale
