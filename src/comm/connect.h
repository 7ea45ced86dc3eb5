// How a group comes to be: the store where its ranks meet, the start-up meeting, and the backends
// that carry its tensors (Gloo on the network interface that routes to MASTER_ADDR, NCCL on first
// use of a CUDA tensor, shared memory among ranks on one host).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/group_state.h"

namespace dtrain::detail {

// The group timeout: `requested` if positive, else DTRAIN_TIMEOUT_S, else kDefaultTimeout.
std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested);
// DTRAIN_SHM (default on).
bool shared_memory_enabled_by_env();
// DTRAIN_SHM_BUCKETS (default on).
bool shared_buckets_enabled_by_env();

// The store the ranks of a new job meet in, as options.init_method says. A rank that cannot reach
// the store keeps trying until the timeout (its master may still be booting) and then names the
// address, the time it tried and the last error; rank 0 failing to host it is a UsageError at once.
c10::intrusive_ptr<c10d::Store> open_store(const InitOptions& options, const LaunchInfo& launch,
                                           int rank, int world_size,
                                           std::chrono::milliseconds timeout);
// TORCHELASTIC_USE_AGENT_STORE=True, read exactly as PyTorch reads it: the launcher hosts the
// store at MASTER_ADDR:MASTER_PORT (so it outlives any worker) and every rank is its client.
bool launcher_hosts_store();
// The host of a "tcp://HOST:PORT" init method.
std::string tcp_host(const std::string& init_method);

// Meets every member of the new group (a TimeoutError names those that never came), then connects
// its backends. Every wait of the whole connection counts against one deadline: the group's
// timeout.
std::shared_ptr<GroupState> connect_group(std::unique_ptr<GroupState> group);

// The address this process's Gloo transport listens on, as the group picks it: GLOO_SOCKET_IFNAME's
// first IPv4 address, 127.0.0.1 for a job on one machine, else the address that routes to
// `master_addr`. Empty when none is found (Gloo then uses this host's name).
std::string gloo_address(const std::string& master_addr);

// Which backend carries this tensor: Gloo for CPU, NCCL for CUDA in a CUDA build (or Gloo with
// DTRAIN_CUDA_BACKEND=gloo). NCCL is created on the first CUDA tensor.
c10d::Backend& backend_for(GroupState& group, const at::Tensor& tensor);
// Whether backend_for() gives NCCL for this tensor (its waits poll: see c10d_in_flight()).
bool uses_nccl(const GroupState& group, const at::Tensor& tensor);

}  // namespace dtrain::detail
