// dtrain::ProcessGroup's collectives and point-to-point transfers, and the creation of groups. How
// a group connects is in connect.cpp; how an operation in flight is waited for and fails, in
// work.cpp.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/c10d_backends.h"  // first of c10d's headers: it sets the macros their backends need
#include "comm/connect.h"
#include "comm/group_state.h"
#include "comm/shm_p2p.h"
#include "comm/shm_transport.h"
#include "comm/thread_launch.h"
#include "common/log.h"
#include "dtrain/comm.h"

namespace dtrain {
namespace {

using detail::backend_for;
using detail::c10d_in_flight;
using detail::GroupInternals;
using detail::GroupState;
using detail::shm_collective_in_flight;
using detail::shm_message_in_flight;
using detail::start_work;
using detail::uses_nccl;
using detail::WorkState;

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // Gloo has no average: sum, then the Work's finish step divides
      return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

// The dtypes c10d's Gloo backend reduces and moves; anything else is the caller's mistake, reported
// as such before anything is sent (other failures at launch are communication failures).
void check_gloo_dtype(const GroupState& group, const char* op, const at::Tensor& tensor) {
  if (tensor.is_cuda()) return;
  switch (tensor.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return;
    case at::kBFloat16:
    case at::kBool:
      return;
    default:
      throw UsageError(group.who() + ": " + op + " on " + group.group_label() +
                       ": Gloo cannot carry " + std::string(c10::toString(tensor.scalar_type())) +
                       " tensors; convert to float32 (or another supported dtype) first.");
  }
}

void check_rank(const GroupState& group, int r, const char* what) {
  if (r < 0 || r >= group.size) {
    throw UsageError(group.who() + ": " + what + "=" + std::to_string(r) + " is not a rank of " +
                     group.group_label() + "; expected 0.." + std::to_string(group.size - 1));
  }
}

void check_average(const GroupState& group, const at::Tensor& tensor, ReduceOp op) {
  if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
    throw UsageError(group.who() + ": ReduceOp::kAvg needs a floating-point tensor, got " +
                     std::string(c10::toString(tensor.scalar_type())) +
                     "; use kSum and divide yourself.");
  }
}

// Note [Reduce-scatter over Gloo]
// Among ranks on one host a reduce-scatter of CPU tensors runs in shared memory (ShmTransport), and
// on CUDA tensors in NCCL; this is the path of every other case: groups that span hosts (every
// ZeRO-2/3 or sequence-parallel group of a multi-host job), DTRAIN_SHM=0, dtypes the shared-memory
// transport does not carry (bfloat16, float16, int8, uint8, bool) and DTRAIN_CUDA_BACKEND=gloo.
// With N ranks and pieces of C bytes, a reduce-scatter needs each rank to send and receive (N-1) C
// bytes. An all-to-all does that: rank j sends its piece r to rank r, keeps its own, and each rank
// then reduces the N pieces it holds. c10d's Gloo reduce_scatter (LibTorch 2.15 has one) does not:
// measured with two to four processes over loopback, each rank wrote 2 (N-1) C bytes to its
// sockets, exactly as much as an all-reduce of all N pieces (dtrain's previous way, for the same
// reason), while Gloo's all-to-all wrote (N-1) C. The pieces are reduced in rank order, as the
// shared-memory transport does, so both give the same bits.

// The inputs as one flat tensor without a copy, when they are adjacent contiguous views of one
// storage in rank order (ShardedDataParallel's pieces of a flat gradient buffer); undefined if not.
at::Tensor flat_view_of(const std::vector<at::Tensor>& inputs) {
  const at::Tensor& first = inputs.front();
  const int64_t numel = first.numel();
  const auto bytes = static_cast<int64_t>(first.nbytes());
  for (size_t r = 0; r < inputs.size(); ++r) {
    const at::Tensor& input = inputs[r];
    if (input.layout() != at::kStrided || !input.is_contiguous() ||
        !input.storage().is_alias_of(first.storage()) ||
        static_cast<const char*>(input.const_data_ptr()) !=
            static_cast<const char*>(first.const_data_ptr()) + static_cast<int64_t>(r) * bytes) {
      return {};
    }
  }
  return first.as_strided({numel * static_cast<int64_t>(inputs.size())}, {1},
                          first.storage_offset());
}

// Reduces the pieces of `received` (piece r, output.numel() elements, came from rank r) into
// `output`, in rank order. kAvg sums; the Work's finish step divides.
void reduce_pieces_in_rank_order(at::Tensor& output, const at::Tensor& received, ReduceOp op,
                                 int size) {
  const int64_t n = output.numel();
  // Reduce in place when the output is host memory laid out as the pieces are; else on the host,
  // then one copy.
  const bool in_place = output.device().is_cpu() && output.is_contiguous();
  at::Tensor result = in_place ? output.view({-1}) : at::empty({n}, received.options());
  result.copy_(received.narrow(0, 0, n));
  for (int r = 1; r < size; ++r) {
    const at::Tensor piece = received.narrow(0, r * n, n);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        result.add_(piece);
        break;
      case ReduceOp::kProduct:
        result.mul_(piece);
        break;
      case ReduceOp::kMin:
        at::minimum_out(result, result, piece);
        break;
      case ReduceOp::kMax:
        at::maximum_out(result, result, piece);
        break;
    }
  }
  if (!in_place) output.copy_(result.view(output.sizes()));
}

}  // namespace

// ---- ProcessGroup ----

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}
ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::size() const { return state_->size; }
const std::string& ProcessGroup::name() const { return state_->name; }
int ProcessGroup::global_rank() const { return state_->global_ranks[state_->rank]; }
int ProcessGroup::global_size() const { return state_->world_size; }
int ProcessGroup::global_rank_of(int group_rank) const {
  check_rank(*state_, group_rank, "group_rank");
  return state_->global_ranks[group_rank];
}
std::chrono::milliseconds ProcessGroup::timeout() const { return state_->timeout; }
bool ProcessGroup::uses_shared_memory() const { return state_->shm != nullptr; }

CommStats ProcessGroup::stats() const {
  const GroupState& group = *state_;
  CommStats stats;
  stats.ops = group.stat_ops.load(std::memory_order_relaxed);
  stats.bytes = group.stat_bytes.load(std::memory_order_relaxed);
  int64_t busy_ns = group.stat_busy_ns.load(std::memory_order_relaxed);
  if (group.shm) busy_ns += group.shm->busy_ns();
  stats.busy_s = static_cast<double>(busy_ns) * 1e-9;
  return stats;
}

Work ProcessGroup::all_reduce_async(at::Tensor& tensor, ReduceOp op,
                                    const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_average(group, tensor, op);
  auto work =
      start_work(state_, "all_reduce", true, -1, options, tensor.nbytes(), [&](WorkState& w) {
        if (group.shm && detail::ShmTransport::supports(tensor)) {
          w.in_flight =
              shm_collective_in_flight(group.shm->all_reduce_async(tensor, op, w.timeout));
          return;
        }
        check_gloo_dtype(group, "all_reduce", tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::AllreduceOptions opts;
        opts.reduceOp = to_c10d(op);
        opts.timeout = w.timeout;
        w.in_flight = c10d_in_flight(backend_for(group, tensor).allreduce(tensors, opts),
                                     uses_nccl(group, tensor));
      });
  if (op == ReduceOp::kAvg) {
    at::Tensor result = tensor;  // shares storage with the caller's tensor
    int size = group.size;
    work->finish = [result, size]() mutable { result.div_(size); };
  }
  return GroupInternals::work(std::move(work));
}

void ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op, const CollectiveOptions& options) {
  all_reduce_async(tensor, op, options).wait();
}

Work ProcessGroup::broadcast_async(at::Tensor& tensor, int root, const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_rank(group, root, "root");
  return GroupInternals::work(
      start_work(state_, "broadcast", true, -1, options, tensor.nbytes(), [&](WorkState& w) {
        check_gloo_dtype(group, "broadcast", tensor);
        std::vector<at::Tensor> tensors{tensor};
        c10d::BroadcastOptions opts;
        opts.rootRank = root;
        opts.timeout = w.timeout;
        w.in_flight = c10d_in_flight(backend_for(group, tensor).broadcast(tensors, opts),
                                     uses_nccl(group, tensor));
      }));
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root, const CollectiveOptions& options) {
  broadcast_async(tensor, root, options).wait();
}

Work ProcessGroup::all_gather_async(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                    const CollectiveOptions& options) {
  GroupState& group = *state_;
  if (static_cast<int>(outputs.size()) != group.size) {
    throw UsageError(group.who() + ": all_gather needs one output tensor per rank (" +
                     std::to_string(group.size) + "), got " + std::to_string(outputs.size()));
  }
  for (const auto& output : outputs) {
    if (output.numel() != input.numel() || output.scalar_type() != input.scalar_type()) {
      throw UsageError(
          group.who() + ": all_gather: every output must have the input's numel and dtype (" +
          std::to_string(input.numel()) + " of " + c10::toString(input.scalar_type()) + "), got " +
          std::to_string(output.numel()) + " of " + c10::toString(output.scalar_type()));
    }
  }
  return GroupInternals::work(
      start_work(state_, "all_gather", true, -1, options, input.nbytes(), [&](WorkState& w) {
        if (group.shm && detail::ShmTransport::supports(input)) {
          w.in_flight =
              shm_collective_in_flight(group.shm->all_gather_async(outputs, input, w.timeout));
          return;
        }
        check_gloo_dtype(group, "all_gather", input);
        std::vector<std::vector<at::Tensor>> out{outputs};
        std::vector<at::Tensor> in{input};
        c10d::AllgatherOptions opts;
        opts.timeout = w.timeout;
        w.in_flight = c10d_in_flight(backend_for(group, input).allgather(out, in, opts),
                                     uses_nccl(group, input));
      }));
}

void ProcessGroup::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              const CollectiveOptions& options) {
  all_gather_async(outputs, input, options).wait();
}

Work ProcessGroup::reduce_scatter_async(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                        ReduceOp op, const CollectiveOptions& options) {
  GroupState& group = *state_;
  if (static_cast<int>(inputs.size()) != group.size) {
    throw UsageError(group.who() + ": reduce_scatter needs one input tensor per rank (" +
                     std::to_string(group.size) + "), got " + std::to_string(inputs.size()));
  }
  for (const auto& input : inputs) {
    if (input.numel() != output.numel() || input.scalar_type() != output.scalar_type()) {
      throw UsageError(
          group.who() + ": reduce_scatter: every input must have the output's numel and dtype (" +
          std::to_string(output.numel()) + " of " + c10::toString(output.scalar_type()) +
          "), got " + std::to_string(input.numel()) + " of " + c10::toString(input.scalar_type()));
    }
  }
  check_average(group, output, op);
  std::function<void()> finish;
  auto work = start_work(
      state_, "reduce_scatter", true, -1, options, output.nbytes() * group.size, [&](WorkState& w) {
        if (group.shm && detail::ShmTransport::supports(output)) {
          w.in_flight = shm_collective_in_flight(
              group.shm->reduce_scatter_async(output, inputs, op, w.timeout));
          return;
        }
        if (output.is_cuda() && !group.cuda_through_gloo) {  // NCCL has a native reduce-scatter
          std::vector<at::Tensor> out{output};
          std::vector<std::vector<at::Tensor>> in{inputs};
          c10d::ReduceScatterOptions opts;
          opts.reduceOp = to_c10d(op);
          opts.timeout = w.timeout;
          w.in_flight = c10d_in_flight(backend_for(group, output).reduce_scatter(out, in, opts),
                                       uses_nccl(group, output));
          return;
        }
        // Note [Reduce-scatter over Gloo]: an all-to-all hands piece r of every rank to rank r,
        // which reduces the N pieces it got once the Work is waited for.
        at::Tensor send = flat_view_of(inputs);
        if (!send.defined()) {
          std::vector<at::Tensor> flat;
          flat.reserve(inputs.size());
          for (const auto& input : inputs) flat.push_back(input.reshape({-1}));
          send = at::cat(flat);
        }
        // Gloo moves host memory only (see isend): under DTRAIN_CUDA_BACKEND=gloo a CUDA tensor
        // goes through a host copy, and the reduction runs on the host.
        if (send.is_cuda()) send = send.to(at::kCPU);
        check_gloo_dtype(group, "reduce_scatter", send);
        at::Tensor received = at::empty({send.numel()}, send.options());
        std::vector<int64_t> equal_splits;  // empty: numel / size() elements to and from each rank
        c10d::AllToAllOptions opts;
        opts.timeout = w.timeout;
        // alltoall_base: the name every supported LibTorch has (2.15 calls it all_to_all_single and
        // forwards the old name to it).
        c10d::Backend& gloo = backend_for(group, send);
        w.in_flight =
            c10d_in_flight(gloo.alltoall_base(received, send, equal_splits, equal_splits, opts));
        finish = [target = output, received, op, size = group.size]() mutable {
          reduce_pieces_in_rank_order(target, received, op, size);
        };
      });
  int size = group.size;
  work->finish = [finish, target = output, average = op == ReduceOp::kAvg, size]() mutable {
    if (finish) finish();
    if (average) target.div_(size);
  };
  return GroupInternals::work(std::move(work));
}

void ProcessGroup::reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                  ReduceOp op, const CollectiveOptions& options) {
  reduce_scatter_async(output, inputs, op, options).wait();
}

void ProcessGroup::barrier(const CollectiveOptions& options) {
  GroupState& group = *state_;
  if (group.shm) {
    // Asynchronous shared-memory all-reduces issued before the barrier complete before it, as
    // Gloo's do.
    auto flushed = group.shm->flush();
    flushed.wait();
  }
  auto work = start_work(state_, "barrier", true, -1, options, 0, [&](WorkState& w) {
    c10d::BarrierOptions opts;
    opts.timeout = w.timeout;
    w.in_flight = c10d_in_flight(group.gloo->barrier(opts));
  });
  detail::wait_for(*work);
}

Work ProcessGroup::isend(const at::Tensor& tensor, int dst, int tag,
                         const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_rank(group, dst, "dst");
  return GroupInternals::work(
      start_work(state_, "send", false, dst, options, tensor.nbytes(), [&](WorkState& w) {
        w.tag = tag;
        check_gloo_dtype(group, "send", tensor);  // the same dtypes on one host as across hosts
        // c10d's Gloo sends host memory only (it would read a device pointer as one): a CUDA tensor
        // under DTRAIN_CUDA_BACKEND=gloo goes through a host copy.
        at::Tensor payload = tensor.is_cuda() && group.cuda_through_gloo
                                 ? tensor.to(at::kCPU).contiguous()
                                 : tensor.contiguous();
        if (group.shm_p2p && detail::ShmPointToPoint::supports(payload)) {
          w.in_flight =
              shm_message_in_flight(*group.shm_p2p, group.shm_p2p->send(payload, dst, tag));
          return;
        }
        std::vector<at::Tensor> tensors{payload};
        w.in_flight = c10d_in_flight(backend_for(group, payload).send(tensors, dst, tag),
                                     uses_nccl(group, payload));
      }));
}

Work ProcessGroup::irecv(at::Tensor& tensor, int src, int tag, const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_rank(group, src, "src");
  return GroupInternals::work(
      start_work(state_, "recv", false, src, options, tensor.nbytes(), [&](WorkState& w) {
        w.tag = tag;
        check_gloo_dtype(group, "recv", tensor);
        // A non-contiguous tensor, or a CUDA one under DTRAIN_CUDA_BACKEND=gloo (Gloo receives into
        // host memory only), lands in a contiguous host buffer first; the caller's tensor gets it
        // after a successful wait.
        at::Tensor landing = tensor.is_cuda() && group.cuda_through_gloo
                                 ? at::empty(tensor.sizes(), tensor.options().device(at::kCPU))
                                 : tensor.contiguous();
        if (!landing.is_same(tensor)) {
          w.finish = [target = tensor, landing]() mutable { target.copy_(landing); };
        }
        if (group.shm_p2p && detail::ShmPointToPoint::supports(landing)) {
          w.in_flight =
              shm_message_in_flight(*group.shm_p2p, group.shm_p2p->recv(landing, src, tag));
          return;
        }
        std::vector<at::Tensor> tensors{landing};
        w.in_flight = c10d_in_flight(backend_for(group, landing).recv(tensors, src, tag),
                                     uses_nccl(group, landing));
      }));
}

void ProcessGroup::send(const at::Tensor& tensor, int dst, int tag,
                        const CollectiveOptions& options) {
  isend(tensor, dst, tag, options).wait();
}

void ProcessGroup::recv(at::Tensor& tensor, int src, int tag, const CollectiveOptions& options) {
  irecv(tensor, src, tag, options).wait();
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks,
                                                      std::string name) {
  GroupState& parent = *state_;
  int index = parent.subgroups_created++;
  if (name.empty()) name = parent.name + "." + std::to_string(index);
  if (ranks.empty())
    throw UsageError(parent.who() + ": new_group('" + name + "') needs at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    check_rank(parent, ranks[i], "new_group rank");
    if (i > 0 && ranks[i] <= ranks[i - 1]) {
      throw UsageError(parent.who() + ": new_group('" + name +
                       "'): ranks must be ascending without repeats");
    }
  }
  auto self = std::find(ranks.begin(), ranks.end(), parent.rank);
  if (self == ranks.end()) return nullptr;

  auto group = std::make_unique<GroupState>();
  group->name = name;
  group->rank = static_cast<int>(self - ranks.begin());
  group->size = static_cast<int>(ranks.size());
  for (int r : ranks) group->global_ranks.push_back(parent.global_ranks[r]);
  group->world_size = parent.world_size;
  group->timeout = parent.timeout;
  group->master_addr = parent.master_addr;
  group->shared_memory_allowed = parent.shared_memory_allowed;
  group->root_store = parent.root_store;
  group->store = c10::make_intrusive<c10d::PrefixStore>("dtrain/" + name, parent.root_store);
  return GroupInternals::group(detail::connect_group(std::move(group)));
}

namespace {

// Under a launcher a worker's stdout is a pipe, which the C library buffers in 4 KiB blocks: the
// launcher would relay a worker's lines in bursts, and lose the last block when the worker is
// killed. Line buffering, as on a terminal, costs one write per line and keeps every line whole and
// timely.
void line_buffer_stdout_under_launcher() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("TORCHELASTIC_RUN_ID") == nullptr || isatty(STDOUT_FILENO)) return;
    std::fflush(stdout);
    std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  });
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& requested) {
  line_buffer_stdout_under_launcher();
  LaunchInfo launch = launch_info_from_env();
  InitOptions options = requested;
  if (const detail::ThreadLaunch* thread = detail::current_thread_launch();
      thread != nullptr && (options.init_method == "env://" || options.init_method.empty())) {
    options.init_method = "memory://" + thread->store_name;  // dtrain::spawn's thread mode
  }
  int world_size = options.world_size > 0 ? options.world_size : launch.world_size;
  int rank = options.rank >= 0 ? options.rank : launch.rank;
  if (rank >= world_size) {
    throw UsageError("rank " + std::to_string(rank) + " is not below world size " +
                     std::to_string(world_size) + "; expected 0 <= rank < world_size");
  }
  auto timeout = detail::resolve_timeout(options.timeout);
  log::set_rank(rank, world_size);

  auto group = std::make_unique<GroupState>();
  group->name = options.group_name;
  group->rank = rank;
  group->size = world_size;
  for (int r = 0; r < world_size; ++r) group->global_ranks.push_back(r);
  group->world_size = world_size;
  group->timeout = timeout;
  group->shared_memory_allowed = options.shared_memory && detail::shared_memory_enabled_by_env();
  group->master_addr = launch.master_addr;
  if (options.init_method.rfind("tcp://", 0) == 0) {
    group->master_addr = detail::tcp_host(options.init_method);
  }
  group->root_store = detail::open_store(options, launch, rank, world_size, timeout);
  group->root_store->setTimeout(timeout);
  group->store =
      c10::make_intrusive<c10d::PrefixStore>("dtrain/" + options.group_name, group->root_store);
  DTRAIN_LOG(kInfo, "joining " << group->group_label() << " of " << world_size << " ranks via "
                               << options.init_method << " (launch environment: " << launch.source
                               << ")");
  return GroupInternals::group(detail::connect_group(std::move(group)));
}

}  // namespace dtrain
