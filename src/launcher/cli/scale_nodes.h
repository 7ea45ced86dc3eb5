// `dtrain scale` on several hosts outside Slurm (--nnodes N, scale_options.h): how the hosts run
// each worker count together. Node 0's `dtrain scale` hosts a store (a WorkerStore, the launcher's
// TCPStore server) at --master-addr:--master-port; every other node is a client of it, through the
// one-connection-per-call helpers of worker_store.h, so nothing but that port crosses between the
// hosts (no shared file system). Each node's `dtrain scale` draws a random token when it starts;
// its id, ID below, is "R:<token>", and node 0 keeps the first id it reads for each R: a process
// left over from an earlier run on the same port (or started twice) takes no part, as nothing it
// reads or writes carries the id node 0 kept. The keys, all under "scale/":
//
//   joined/R           node R arrived; its value is "<token>\n<plan>" (counts, steps, program),
//                      the plan compared with node 0's
//   refused/R          node 0 refused node R (its plan differs)
//   I/start/ID         node 0 starts the I-th count (from 0): the nodes it needs start their share
//   I/records/ID/S     the S-th batch (from 0) of whole record lines node R's ranks wrote
//   I/stop             node 0 has measured enough (or a rank failed): every node stops its workers
//   I/end/ID           node R's workers are gone: "<exit code>\n<how they ended>"
//   quit/ID            node R left early: why (node 0 fails the counts that need it)
//   end                node 0 measured every count, or ended early; the others leave
//   bye/ID             node R saw the end (node 0 waits for it before closing the store)
//
// Every wait polls every 100 ms and has a deadline; a failure is one line that names the node.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "launcher/cli/scale_options.h"
#include "launcher/elastic/signal_pipe.h"
#include "launcher/elastic/worker_store.h"

namespace dtrain::cli::scale {

// What every node must agree on: the counts, how long each runs, the program.
std::string plan_of(const ScaleOptions& options);

// How a node's share of one count ended, as it tells node 0.
struct NodeEnding {
  int exit_code = 0;   // 0: its workers ended well (stopped by us, or finished)
  std::string ending;  // "stopped after 20 measured steps", "rank 3 exited with code 3"
};

// Node 0's side.
class Coordinator {
 public:
  // Binds the store on every interface at --master-port. Throws UsageError when the port is taken.
  explicit Coordinator(const ScaleOptions& options);

  // Waits until every other node joined, at most `timeout`. Returns "" or the one line to print
  // (which nodes did not arrive); `signals` ends the wait. Throws UsageError when a node's plan
  // differs from node 0's (refusing it), or when a second process joins as the same node.
  std::string wait_for_nodes(std::chrono::milliseconds timeout, elastic::SignalPipe& signals);

  // Throw CommError when node 0's own store does not take the key.
  void start(int count);
  void stop(int count);
  // The record lines nodes 1..nodes-1 sent for `count` since the last call.
  std::string new_records(int count, int nodes);
  // The first of nodes 1..nodes-1 whose share of `count` failed, or that quit, as "node R: <how>".
  std::optional<NodeEnding> failed_node(int count, int nodes) const;
  // Waits until nodes 1..nodes-1 reported the end of their share of `count` (or quit), at most
  // `timeout`. Returns "" or one line naming the nodes that did not; a signal ends the wait and
  // sets *signo.
  std::string wait_for_ends(int count, int nodes, std::chrono::milliseconds timeout,
                            elastic::SignalPipe& signals, int* signo) const;
  // Tells every node that the measurement is over and waits up to `timeout` (or a signal) for
  // those that joined, and did not quit and were not refused, to see it. Returns "" or one line
  // naming the nodes that did not.
  std::string finish(std::chrono::milliseconds timeout, elastic::SignalPipe& signals);

 private:
  void set(const std::vector<std::string>& names);  // each to "": only their presence counts
  // Node R's id as node 0 kept it ("R" until it joined).
  std::string id_of(int node) const;

  const ScaleOptions& options_;
  std::string plan_;
  elastic::WorkerStore store_;
  std::map<int, std::string> ids_;                 // node -> the first id read
  std::map<std::pair<int, int>, int> next_batch_;  // (count, node) -> next batch to read
};

// The side of every other node.
class Member {
 public:
  explicit Member(const ScaleOptions& options);

  // Joins node 0's store, retrying while it is not up, at most `timeout`. Returns "" or one line.
  std::string join(std::chrono::milliseconds timeout, elastic::SignalPipe& signals);
  // Waits until node 0 starts `count` (true) or ends the measurement (false, *failure empty).
  // *failure is set (and false returned) when node 0 is gone, refused this node, the wait ran past
  // `timeout`, or a signal came.
  bool wait_for_start(int count, std::chrono::milliseconds timeout, elastic::SignalPipe& signals,
                      std::string* failure);
  // Sends `records` (whole lines; may be empty) and asks whether node 0 said stop. *failure is set
  // when node 0 cannot be reached (then stop: true), and kept as lost().
  bool send_and_check_stop(int count, const std::string& records, std::string* failure);
  // Why node 0 was lost during a count ("lost node 0 at HOST:PORT: ..."), or "".
  const std::string& lost() const { return lost_; }
  void report_end(int count, const NodeEnding& ending);
  // Tells node 0 that this node leaves early, and why (one try: node 0 may be gone).
  void quit(const std::string& why);
  // Waits (at most `timeout`) for node 0's end and says goodbye; "" or why not.
  std::string leave(std::chrono::milliseconds timeout, elastic::SignalPipe& signals);

 private:
  // One call to node 0's store: sets `entries`, then CHECKs `key` (worker_store.h).
  elastic::KeyCheck exchange(const std::vector<std::pair<std::string, std::string>>& entries,
                             const std::string& key, std::string* why);
  // Polls `key` every 100 ms until present; false with *failure set otherwise.
  bool poll_for(const std::string& key, const std::string& what, std::chrono::milliseconds timeout,
                elastic::SignalPipe& signals, std::string* failure, const std::string& or_key = "",
                bool* or_present = nullptr);

  const ScaleOptions& options_;
  std::string token_;              // random, drawn at construction
  std::string id_;                 // "R:<token>"
  std::string where_;              // "node 0 at HOST:PORT"
  std::map<int, int> next_batch_;  // count -> next batch to send
  std::string lost_;
};

}  // namespace dtrain::cli::scale
