// dtrain's communication layer: process groups over c10d (Gloo for CPU tensors, NCCL for CUDA
// tensors in a CUDA build), created from torchrun's, Slurm's or Open MPI's environment, with
// collectives whose timeouts name the ranks that never arrived.
//
//   auto pg = dtrain::init_process_group();   // RANK, WORLD_SIZE, MASTER_ADDR, ... from the env
//   pg->all_reduce(grad);                      // blocks; a TimeoutError names the missing ranks
//   auto work = pg->all_reduce_async(bucket);  // overlaps with other work; work.wait() later
//
// This header stays light on purpose (no LibTorch include): tensors are passed by reference.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/errors.h"

namespace at {
class Tensor;
}

namespace dtrain {

// How long a blocking operation (a collective, the start-up rendezvous) waits before it gives up
// and reports who did not arrive. Override per group (InitOptions::timeout), per call
// (CollectiveOptions), or for a whole run with DTRAIN_TIMEOUT_S.
constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(10);

// Who this process is, as a launcher told it through the environment.
struct LaunchInfo {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int world_size = 1;        // number of processes in the job
  int local_rank = 0;        // rank among the processes on this node
  int local_world_size = 1;  // processes on this node
  int node_rank = 0;         // index of this node (torchrun's GROUP_RANK)
  std::string
      master_addr;      // host of the rank-0 store; empty when world_size == 1 and none was given
  int master_port = 0;  // port of the rank-0 store; 0 when unknown
  std::string source;   // which environment it came from: "torchrun", "slurm", "openmpi", "none"
  // How often this job was restarted before this attempt: the larger of TORCHELASTIC_RESTART_COUNT
  // (`dtrain run`, torchrun) and SLURM_RESTART_COUNT (a requeued Slurm job), whatever the launch
  // environment; 0 in a first attempt. A program resumes from its checkpoints when it is above 0.
  int64_t restarts = 0;
};

// Reads the launch environment. Precedence: torchrun's names (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, as set by `dtrain run`), then Slurm's
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...), then Open MPI's (OMPI_COMM_WORLD_RANK, ...).
// With none of them the process is a world of one. Throws UsageError naming the variable for a
// value that is not a number or out of range (RANK >= WORLD_SIZE, ...). `getenv` is replaceable for
// tests.
LaunchInfo launch_info_from_env(const std::function<const char*(const char*)>& getenv = nullptr);

enum class ReduceOp { kSum, kAvg, kProduct, kMin, kMax };

struct InitOptions {
  // Where ranks meet. "env://" (default): MASTER_ADDR:MASTER_PORT from the environment, rank 0
  // hosts a TCPStore there. "tcp://HOST:PORT": the same with an explicit address. "file:///PATH": a
  // FileStore on a shared file system. "memory://NAME": an in-process store shared by every group
  // opened with that NAME (ranks as threads of one process; tests and single-process strategies).
  std::string init_method = "env://";
  int rank = -1;                         // -1: from the environment
  int world_size = -1;                   // -1: from the environment
  std::chrono::milliseconds timeout{0};  // 0: DTRAIN_TIMEOUT_S if set, else kDefaultTimeout
  std::string group_name = "default";    // shown in error messages; prefixes the group's store keys
  // When every rank runs on one host, all-reduce and send/recv CPU tensors through shared memory
  // instead of TCP loopback (many times faster; see Note [Shared-memory all-reduce] and Note
  // [Shared-memory point to point]). DTRAIN_SHM=0 turns it off for a whole run.
  bool shared_memory = true;
};

// Counters of a group's collectives and point-to-point transfers since the group was created (what
// DTRAIN_PROFILE's per-step records are computed from; see dtrain/profile.h).
struct CommStats {
  uint64_t ops = 0;  // operations started on this rank
  uint64_t bytes =
      0;  // payload bytes of the tensors this rank passed in (an all-reduce of 7 MiB counts 7 MiB)
  double busy_s =
      0;  // summed duration of the finished operations: shared-memory all-reduces as timed on
          // the transport's thread, others from their start to the end of their wait
};

struct CollectiveOptions {
  std::chrono::milliseconds timeout{0};  // 0: the group's timeout
};

namespace detail {
struct GroupState;
struct WorkState;
struct GroupInternals;  // src/comm/group_state.h
}  // namespace detail

// A handle to a collective in flight.
class Work {
 public:
  Work() = default;
  // Blocks until the operation has finished on this rank, or its timeout passed. Throws
  // TimeoutError (naming the ranks that never arrived) or PeerLostError; afterwards the output
  // tensors hold the result.
  void wait();
  // Non-blocking: true once the operation has finished (successfully or not).
  bool is_completed() const;

 private:
  friend struct detail::GroupInternals;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::WorkState> state_;
};

// A group of ranks that run collectives together. Every member must issue the same collectives in
// the same order; each call's tensors must have the same shape and dtype on every rank. Calls are
// not thread-safe against each other on one group (as in c10d): issue them from one thread.
class ProcessGroup {
 public:
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;  // this process's rank within the group
  int size() const;  // number of ranks in the group
  const std::string& name() const;
  int global_rank() const;  // this process's rank in the job (as RANK)
  int global_size() const;  // processes in the job (as WORLD_SIZE)
  int global_rank_of(int group_rank) const;
  std::chrono::milliseconds timeout() const;
  // True when all-reduces of CPU float/double/int tensors and sends/recvs of CPU tensors go through
  // shared memory (every rank on one host, InitOptions::shared_memory); otherwise through Gloo.
  bool uses_shared_memory() const;
  // Counters of this group's operations so far (cheap: a few atomic loads).
  CommStats stats() const;

  // Blocking collectives: each returns when this rank's part is done or throws after the timeout.
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum, const CollectiveOptions& = {});
  void broadcast(at::Tensor& tensor, int root, const CollectiveOptions& = {});
  // outputs: size() tensors shaped like input; outputs[r] receives rank r's input.
  void all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                  const CollectiveOptions& = {});
  // inputs: size() tensors shaped like output; output receives the reduction of every rank's
  // inputs[rank()].
  void reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                      ReduceOp op = ReduceOp::kSum, const CollectiveOptions& = {});
  void barrier(const CollectiveOptions& = {});
  // Point to point: blocks until the peer has posted the matching recv/send with the same tag.
  void send(const at::Tensor& tensor, int dst, int tag = 0, const CollectiveOptions& = {});
  void recv(at::Tensor& tensor, int src, int tag = 0, const CollectiveOptions& = {});
  // Non-blocking point to point: start the transfer and return at once; Work::wait() blocks until
  // this side is done (the tensor may then be reused) or the timeout passed, naming the peer.
  // Messages match by (peer, tag), in order among those with the same peer and tag. A rank may
  // isend long before the peer posts its irecv and go on with other transfers meanwhile. CPU
  // tensors between ranks on one host go through shared memory (see uses_shared_memory()): the send
  // and the recv must then have the same number of elements and dtype, or the recv throws
  // UsageError naming both ranks and the tag.
  Work isend(const at::Tensor& tensor, int dst, int tag = 0, const CollectiveOptions& = {});
  Work irecv(at::Tensor& tensor, int src, int tag = 0, const CollectiveOptions& = {});

  // Asynchronous forms: start the operation and return at once. The tensors must stay alive and
  // untouched until Work::wait() returns.
  Work all_reduce_async(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum,
                        const CollectiveOptions& = {});
  Work broadcast_async(at::Tensor& tensor, int root, const CollectiveOptions& = {});
  // As all_gather / reduce_scatter (the outputs / inputs may be views into one flat buffer). Among
  // ranks on one host, CPU tensors go through shared memory, each rank moving only its share;
  // CUDA tensors through NCCL; elsewhere through Gloo, where a reduce-scatter is an all-to-all
  // (each rank sends and receives (N-1)/N of its inputs, as a ring would) and the reduction runs
  // on this rank's thread in wait(): Note [Reduce-scatter over Gloo] in src/comm/process_group.cpp.
  Work all_gather_async(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                        const CollectiveOptions& = {});
  Work reduce_scatter_async(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                            ReduceOp op = ReduceOp::kSum, const CollectiveOptions& = {});

  // A sub-group of the given ranks of this group (ranks as in this group, ascending, no repeats).
  // Members get the group, others nullptr. Every member must call it with the same ranks in the
  // same order of calls; `name` must be unique among this group's sub-groups (empty: numbered in
  // order of creation).
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, std::string name = "");

 private:
  friend struct detail::GroupInternals;
  explicit ProcessGroup(std::shared_ptr<detail::GroupState> state);
  std::shared_ptr<detail::GroupState> state_;  // shared with the Works in flight
};

// Creates the job's default group: meets every rank (throws TimeoutError naming the ranks that
// never came), then connects Gloo (and, in a CUDA build, NCCL on first use of a CUDA tensor).
// Blocks up to the timeout, all of it counted against one deadline; a rank whose master is not up
// yet keeps trying until then. Gloo talks on the interface that routes to MASTER_ADDR (as NCCL
// picks its socket), or on GLOO_SOCKET_IFNAME when set; DTRAIN_LOG=debug names it. Under a launcher
// (TORCHELASTIC_RUN_ID set) it also makes stdout line-buffered, so that the launcher relays each
// line as it is written and none is lost when the worker is killed. Every group's connection also
// ignores SIGPIPE, unless the program chose a disposition of its own, as Python does from its
// start: Gloo writes to a dead peer's socket with writev(), and SIGPIPE's default would end this
// process before the failure could be reported (or, in place, survived).
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

// A 3-D arrangement of a group's ranks for data × pipeline × tensor parallelism:
//   rank = (data_index * pipeline_size + pipeline_index) * tensor_size + tensor_index,
// so the ranks of one tensor-parallel group are neighbours (on one host when a launcher numbers
// ranks by host: tensor parallelism communicates in every layer, forward and backward, and wants
// the fastest links). Ranks that hold the same shard of the same stage form a data group (gradients
// are averaged there); ranks of one replica that hold the same tensor shard form a pipeline group
// (activations flow there); ranks of one stage of one replica form a tensor group (they split each
// layer, see dtrain/tensor_parallel.h). With tensor_size = 1 it is the 2-D data × pipeline mesh:
// rank = data_index * pipeline_size + pipeline_index, and the tensor group is this rank alone.
struct RankMesh {
  int data_size = 1;                             // number of model replicas
  int pipeline_size = 1;                         // stages per replica
  int data_index = 0;                            // which replica this rank belongs to
  int pipeline_index = 0;                        // which stage this rank holds
  std::shared_ptr<ProcessGroup> data_group;      // same stage and tensor shard, every replica
  std::shared_ptr<ProcessGroup> pipeline_group;  // same replica and tensor shard, every stage
  int tensor_size = 1;                           // ranks that split each layer of a stage
  int tensor_index = 0;                          // which shard of each layer this rank holds
  std::shared_ptr<ProcessGroup> tensor_group;    // same replica and stage, every shard
};

// Every rank of `group` must call it, with the same sizes; it creates every sub-group (each rank
// gets the three it belongs to) and blocks until their members have met (up to the group's
// timeout). Throws UsageError if the group is null, a size is below 1 or pipeline_size *
// tensor_size does not divide the group's size.
RankMesh make_rank_mesh(const std::shared_ptr<ProcessGroup>& group, int pipeline_size,
                        int tensor_size = 1);

}  // namespace dtrain
