// The elastic rendezvous of `dtrain run --rdzv-backend c10d|etcd`, as the agent's loop (agent.h)
// drives it: each round is agreed with the other nodes' agents through elastic::Rendezvous
// (launcher/elastic/rendezvous.h, Note [Rounds]), which restarts, shrinks, grows or ends the job;
// this side connects to its store (hosting the c10d store when this node has its address), says
// what each round and verdict means for this node, and rides out a store that misses a look or two.
#pragma once

#include <memory>

#include "launcher/cli/agent.h"
#include "launcher/cli/run_options.h"

namespace dtrain::cli {

// Connects to the rendezvous store of --rdzv-endpoint (waiting up to the join timeout for it to
// answer, and for its host name to resolve) and starts this node's heartbeats. Returns nullptr when
// a signal came first (taken from `signals`, said, *exit_code 128 + signal). Throws
// dtrain::UsageError for bad flags found late (a store that refuses this node's token, no etcd
// backend built in), dtrain::CommError (exit 1) when no store answers in time, its name never
// resolved, or another program holds the endpoint.
std::unique_ptr<AgentRendezvous> join_elastic_rendezvous(const RunOptions& options,
                                                         elastic::SignalPipe& signals,
                                                         int* exit_code);

}  // namespace dtrain::cli
