// dtrain::ProcessGroup over c10d: store set-up, the start-up rendezvous, Gloo (and NCCL in a CUDA build)
// backends, collectives with timeouts, and errors that name the ranks that never arrived.
#include "comm/c10d_backends.h"  // first: it sets the macros c10d's backend headers need

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <future>
#include <cstdlib>
#include <map>
#include <thread>
#include <mutex>
#include <sstream>

#include "comm/device_check.h"
#include "comm/progress.h"
#include "comm/shm_p2p.h"
#include "comm/shared_buckets.h"
#include "comm/shm_segment.h"
#include "comm/shm_transport.h"
#include "comm/store_bytes.h"
#include "comm/thread_launch.h"
#include "common/log.h"
#include "dtrain/comm.h"

namespace dtrain {
namespace detail {

// Everything a group needs; ProcessGroup is its public face.
struct GroupState {
  std::string name;
  int rank = 0;
  int size = 1;
  std::vector<int> global_ranks;  // group rank -> job rank, for messages
  int world_size = 1;             // the job's size, for the "rank R/N" prefix
  std::string master_addr;        // picks Gloo's network interface (loopback for a one-machine job)
  std::chrono::milliseconds timeout{kDefaultTimeout};
  c10::intrusive_ptr<c10d::Store> root_store;  // unprefixed; sub-groups prefix it again
  c10::intrusive_ptr<c10d::Store> store;       // this group's keys
  c10::intrusive_ptr<c10d::Backend> gloo;
#ifdef DTRAIN_WITH_CUDA
  std::once_flag nccl_once;
  c10::intrusive_ptr<c10d::Backend> nccl;
#endif
  std::unique_ptr<ProgressTracker> progress;
  bool shared_memory_allowed = true;    // InitOptions::shared_memory and DTRAIN_SHM
  bool cuda_through_gloo = false;       // DTRAIN_CUDA_BACKEND=gloo: CUDA tensors take Gloo, not NCCL
  std::unique_ptr<ShmTransport> shm;    // all members on one host: all-reduce through shared memory
  std::unique_ptr<ShmPointToPoint> shm_p2p;  // ...and isend/irecv of CPU tensors
  int subgroups_created = 0;
  int shared_buckets_created = 0;       // names each DDP's segment alike on every rank
  // CommStats: updated from the caller's thread (starts) and whichever thread waits (busy time).
  std::atomic<uint64_t> stat_ops{0};
  std::atomic<uint64_t> stat_bytes{0};
  std::atomic<int64_t> stat_busy_ns{0};  // operations not on the shared-memory transport's thread
  // The first failure; later calls fail fast with it instead of hanging on a broken transport.
  std::mutex failure_mutex;
  std::string failure;

  ~GroupState() {
    progress.reset();
    if (!failure.empty()) {
      // After a timeout a Gloo worker thread may still be blocked inside the transport, and the backend's
      // destructor would join it, stalling exit for another full timeout. The process is going down with an
      // error anyway: leave the backend to the OS.
      (void)gloo.release();
#ifdef DTRAIN_WITH_CUDA
      (void)nccl.release();
#endif
    }
  }

  std::string who() const {
    return "rank " + std::to_string(global_ranks[rank]) + "/" + std::to_string(world_size);
  }
  std::string group_label() const { return "group '" + name + "'"; }
};

struct WorkState {
  std::shared_ptr<GroupState> group;  // kept alive: a Work may outlive its ProcessGroup
  std::chrono::steady_clock::time_point started;  // for CommStats::busy_s of non-shared-memory operations
  c10::intrusive_ptr<c10d::Work> work;   // a Gloo/NCCL operation, or
  std::shared_future<void> shm_done;     // a shared-memory all-reduce, or
  std::shared_ptr<ShmMessage> shm_message;  // a shared-memory send or recv
  const char* op = "";
  uint64_t seq = 0;       // collective sequence number; 0 for point to point
  int late_rank = -1;     // group rank the transport saw missing, when it knows
  int peer = -1;          // point to point: the other group rank
  int tag = 0;            // point to point: the message's tag
  std::chrono::milliseconds timeout{0};
  std::function<void()> finish;  // runs after a successful wait (e.g. divide for an average)
  bool done = false;
};

}  // namespace detail

namespace {

using detail::GroupState;
using detail::ShmFailure;
using detail::WorkState;
using detail::bytes_of;
using detail::describe_shared_device;
using detail::RankDevice;
using Clock = std::chrono::steady_clock;

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) {
  if (requested.count() > 0) return requested;
  if (const char* text = std::getenv("DTRAIN_TIMEOUT_S")) {
    char* end = nullptr;
    double seconds = std::strtod(text, &end);
    if (*text == '\0' || *end != '\0' || !(seconds > 0)) {
      throw UsageError(std::string("environment variable DTRAIN_TIMEOUT_S='") + text +
                       "': expected a positive number of seconds");
    }
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return kDefaultTimeout;
}

std::string seconds_text(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << ms.count() / 1000.0 << " s";
  return out.str();
}


// memory://NAME stores: shared by name among the threads of this process, freed with their last group.
c10::intrusive_ptr<c10d::Store> memory_store(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, c10::weak_intrusive_ptr<c10d::HashStore>> stores;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = stores.find(name);
  if (found != stores.end()) {
    if (auto existing = found->second.lock()) return existing;
    stores.erase(found);
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  stores.emplace(name, c10::weak_intrusive_ptr<c10d::HashStore>(store));
  return store;
}

struct Endpoint {
  std::string host;
  int port = 0;
};

Endpoint parse_tcp(const std::string& where, const std::string& what) {
  auto colon = where.rfind(':');
  Endpoint endpoint;
  if (colon != std::string::npos) {
    endpoint.host = where.substr(0, colon);
    endpoint.port = std::atoi(where.substr(colon + 1).c_str());
  }
  if (endpoint.host.empty() || endpoint.port <= 0 || endpoint.port > 65535) {
    throw UsageError(what + "='" + where + "': expected HOST:PORT with a port in 1..65535");
  }
  return endpoint;
}

c10::intrusive_ptr<c10d::Store> open_store(const InitOptions& options, const LaunchInfo& launch, int rank,
                                           int world_size, std::chrono::milliseconds timeout) {
  const std::string& method = options.init_method;
  const std::string who = "rank " + std::to_string(rank) + "/" + std::to_string(world_size);
  if (method.rfind("memory://", 0) == 0) return memory_store(method.substr(9));
  if (method.rfind("file://", 0) == 0) {
    return c10::make_intrusive<c10d::FileStore>(method.substr(7), world_size);
  }
  Endpoint endpoint;
  if (method.rfind("tcp://", 0) == 0) {
    endpoint = parse_tcp(method.substr(6), "init_method");
  } else if (method == "env://" || method.empty()) {
    if (world_size == 1 && launch.master_addr.empty()) {
      return c10::make_intrusive<c10d::HashStore>();  // a world of one needs no network
    }
    if (launch.master_addr.empty()) {
      throw UsageError(who + ": environment variable MASTER_ADDR is not set; expected the host of rank 0. "
                             "Launch with `dtrain run` (it sets it) or export MASTER_ADDR.");
    }
    if (launch.master_port == 0) {
      throw UsageError(who + ": environment variable MASTER_PORT is not set; expected a TCP port in "
                             "1..65535. Launch with `dtrain run` (it sets it) or export MASTER_PORT.");
    }
    endpoint = {launch.master_addr, launch.master_port};
  } else {
    throw UsageError("init_method='" + method +
                     "': expected env://, tcp://HOST:PORT, file:///PATH or memory://NAME");
  }

  c10d::TCPStoreOptions tcp;
  tcp.port = static_cast<uint16_t>(endpoint.port);
  tcp.isServer = rank == 0;
  tcp.numWorkers = world_size;
  tcp.waitWorkers = false;  // dtrain's own rendezvous below names the ranks that never came
  tcp.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(endpoint.host, tcp);
  } catch (const std::exception& e) {
    std::string where = endpoint.host + ":" + std::to_string(endpoint.port);
    if (rank == 0) {
      throw UsageError(who + ": cannot host the store on " + where + " (MASTER_ADDR:MASTER_PORT): " +
                       e.what() + ". Pick a free port (`dtrain run` picks one when --master-port is 0).");
    }
    throw TimeoutError(who + ": cannot reach the store at " + where + " (MASTER_ADDR:MASTER_PORT) within " +
                       seconds_text(timeout) + ": " + e.what() +
                       ". Likely cause: rank 0 has not started or died, or the address is wrong.");
  }
}

// Every member announces itself, then waits for the others; on timeout the missing ones are named.
// Which machine this is: the hostname alone can repeat across containers, the boot id does not.
std::string host_identity() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  std::string identity = name;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {0};
    if (std::fgets(boot, sizeof boot, f)) identity += std::string("/") + boot;
    std::fclose(f);
  }
  return identity;
}

void meet(GroupState& group) {
  // The shared-memory switch travels with the host: ranks that disagree on it all fall back to Gloo.
  group.store->set("host/" + std::to_string(group.rank),
                   bytes_of(host_identity() + (group.shared_memory_allowed ? "|shm" : "|no-shm")));
  group.store->set("join/" + std::to_string(group.rank), bytes_of(std::to_string(::getpid())));
  std::vector<std::string> keys;
  for (int r = 0; r < group.size; ++r) keys.push_back("join/" + std::to_string(r));
  auto deadline = Clock::now() + group.timeout;
  while (!group.store->check(keys)) {
    if (Clock::now() > deadline) {
      std::vector<int> missing;
      for (int r = 0; r < group.size; ++r) {
        if (!group.store->check({keys[r]})) missing.push_back(group.global_ranks[r]);
      }
      std::ostringstream list;
      for (size_t i = 0; i < missing.size(); ++i) list << (i ? "," : "") << missing[i];
      throw TimeoutError(group.who() + ": creating " + group.group_label() + " of " +
                         std::to_string(group.size) + " ranks timed out after " + seconds_text(group.timeout) +
                         "; ranks {" + list.str() +
                         "} never joined. Likely cause: they failed before init_process_group, or were "
                         "started with a different WORLD_SIZE, MASTER_ADDR or MASTER_PORT.");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    try {
      return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    } catch (const std::exception& e) {  // Gloo's own enforce error, not a c10::Error
      throw UsageError(std::string("environment variable GLOO_SOCKET_IFNAME='") + ifname +
                       "': not a usable network interface here (" + e.what() +
                       "); name one `ip link` lists, or unset it");
    }
  }
  // A job on one machine talks over loopback; this also spares machines whose hostname does not resolve.
  if (master_addr.empty() || master_addr == "localhost" || master_addr.rfind("127.", 0) == 0) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

bool all_on_one_host(GroupState& group) {
  auto mine = group.store->get("host/" + std::to_string(group.rank));
  for (int r = 0; r < group.size; ++r) {
    if (group.store->get("host/" + std::to_string(r)) != mine) return false;
  }
  return true;
}

// An on/off environment switch: unset, empty or 1 is on, 0 is off, anything else a UsageError naming it.
bool env_switch(const char* name, const char* off_means, const char* on_means) {
  const char* value = std::getenv(name);
  if (!value || std::string(value) == "1" || std::string(value).empty()) return true;
  if (std::string(value) == "0") return false;
  throw UsageError(std::string("environment variable ") + name + "='" + value + "': expected 0 (" + off_means +
                   ") or 1 (" + on_means + ")");
}

bool shared_memory_enabled_by_env() {
  return env_switch("DTRAIN_SHM", "all-reduce and send/recv through Gloo", "shared memory among ranks on one host");
}

// DTRAIN_CUDA_BACKEND: nccl (default) or gloo, which lets several ranks share one GPU (NCCL refuses that),
// as PyTorch allows with init_process_group("gloo") and CUDA tensors.
bool cuda_through_gloo_by_env() {
  const char* value = std::getenv("DTRAIN_CUDA_BACKEND");
  if (!value || !*value || std::string(value) == "nccl") return false;
  if (std::string(value) == "gloo") return true;
  throw UsageError(std::string("environment variable DTRAIN_CUDA_BACKEND='") + value +
                   "': expected nccl (one GPU per process) or gloo (ranks may share a GPU)");
}

bool looks_like_timeout(const std::string& what) {
  return what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
}

std::unique_ptr<GroupState> connect_group(std::unique_ptr<GroupState> group) {
  group->cuda_through_gloo = cuda_through_gloo_by_env();
  meet(*group);
  auto options = c10d::ProcessGroupGloo::Options::create(group->timeout);
  options->devices.push_back(gloo_device(group->master_addr));
  // Two threads let two buckets' all-reduces proceed at once (DDP overlaps them with backward).
  options->threads = 2;
  auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo", group->store);
  try {
    group->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, group->rank, group->size, options);
    group->progress = std::make_unique<detail::ProgressTracker>(group->store, group->rank, group->size);
    if (group->size > 1 && group->shared_memory_allowed && all_on_one_host(*group)) {
      auto shm_store = c10::make_intrusive<c10d::PrefixStore>("shm", group->store);
      group->shm = detail::ShmTransport::create(*shm_store, group->rank, group->size, group->timeout);
      if (group->shm) {
        group->shm_p2p =
            detail::ShmPointToPoint::create(*shm_store, group->rank, group->size, group->timeout);
      }
    }
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    // Every rank had joined (meet() above), so a failure here is a peer that died or stalled while the
    // connections were made.
    std::string what = e.what();
    std::string message = group->who() + ": connecting " + group->group_label() + " of " +
                          std::to_string(group->size) + " ranks failed after every rank had joined: " + what +
                          ". Likely cause: a rank died or stalled during start-up; see its log.";
    if (looks_like_timeout(what)) throw TimeoutError(message);
    throw PeerLostError(message);
  }
  return group;
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // Gloo has no average: sum, then the Work's finish step divides
      return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

#ifdef DTRAIN_WITH_CUDA
// Before NCCL starts, every rank of the group announces the GPU it drives; two ranks on one GPU become one
// clear line on every rank (see comm/device_check.h) instead of NCCL's "Duplicate GPU detected" at the first
// collective.
void check_one_process_per_gpu(GroupState& group, int device) {
  group.store->set("cuda_device/" + std::to_string(group.rank), bytes_of(std::to_string(device)));
  std::vector<RankDevice> ranks;
  for (int r = 0; r < group.size; ++r) {
    const std::string key = "cuda_device/" + std::to_string(r);
    try {
      group.store->wait({key}, group.timeout);
    } catch (const std::exception&) {
      throw TimeoutError(group.who() + ": rank " + std::to_string(group.global_ranks[r]) + " of " +
                         group.group_label() + " did not reach its first CUDA collective within " +
                         seconds_text(group.timeout) +
                         ". Likely cause: it took a different code path, is stuck or died; see its log.");
    }
    auto host = group.store->get("host/" + std::to_string(r));
    auto index = group.store->get(key);
    std::string host_text(host.begin(), host.end());
    ranks.push_back({group.global_ranks[r], host_text.substr(0, host_text.rfind('|')),
                     std::stoi(std::string(index.begin(), index.end()))});
  }
  const std::string shared = describe_shared_device(ranks);
  if (!shared.empty()) throw UsageError(group.who() + ": " + group.group_label() + ": " + shared + ".");
}
#endif

// Which backend carries this tensor: Gloo for CPU, NCCL for CUDA in a CUDA build (or Gloo with
// DTRAIN_CUDA_BACKEND=gloo).
c10d::Backend& backend_for(GroupState& group, const at::Tensor& tensor) {
  if (tensor.is_cuda() && !group.cuda_through_gloo) {
#ifdef DTRAIN_WITH_CUDA
    std::call_once(group.nccl_once, [&] {
      check_one_process_per_gpu(group, tensor.get_device());
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = group.timeout;
      auto nccl_store = c10::make_intrusive<c10d::PrefixStore>("nccl", group.store);
      group.nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(nccl_store, group.rank, group.size, options);
    });
    return *group.nccl;
#else
    throw UsageError(group.who() + ": a CUDA tensor was passed to a collective, but this dtrain was built "
                                   "against a LibTorch without CUDA. Rebuild with a CUDA LibTorch.");
#endif
  }
  return *group.gloo;
}

void check_usable(GroupState& group) {
  std::lock_guard<std::mutex> lock(group.failure_mutex);
  if (!group.failure.empty()) {
    throw CommError(group.who() + ": " + group.group_label() +
                    " cannot be used after an earlier failure: " + group.failure);
  }
}


// Turns a failed or late wait into dtrain's error, naming who did not arrive, and marks the group broken.
[[noreturn]] void fail(WorkState& work, const std::string& cause, bool timed_out) {
  GroupState& group = *work.group;
  std::ostringstream message;
  message << group.who() << ": " << work.op;
  std::string missing;
  if (work.seq > 0) {
    message << " #" << work.seq << " on " << group.group_label();
    missing = group.progress->describe_missing(work.seq, group.global_ranks);
    if (work.late_rank >= 0 && missing.rfind("every rank reached it", 0) == 0) {
      // Queued asynchronous operations: every rank issued it, but rank `late_rank` never got to run it.
      missing = "rank " + std::to_string(group.global_ranks[work.late_rank]) +
                " issued it but never arrived in the shared-memory exchange";
    }
  } else {
    message << " with rank " << group.global_ranks[work.peer] << " on " << group.group_label();
  }
  if (timed_out) {
    message << " timed out after " << seconds_text(work.timeout);
  } else {
    message << " failed (" << cause << ")";
  }
  if (work.seq > 0) {
    message << "; " << missing << ".";
  } else {
    message << "; rank " << group.global_ranks[work.peer] << " did not post the matching "
            << (std::string(work.op) == "send" ? "recv" : "send") << " (tag " << work.tag << ").";
  }
  message << " Likely cause: a rank took a different code path, is stuck or died";
  if (!timed_out) message << " (a peer's connection closed)";
  message << ". Set DTRAIN_DEBUG=detail to log every collective.";
  {
    std::lock_guard<std::mutex> lock(group.failure_mutex);
    if (group.failure.empty()) group.failure = message.str();
  }
  if (timed_out) throw TimeoutError(message.str());
  throw PeerLostError(message.str());
}

// The dtypes c10d's Gloo backend reduces and moves; anything else is the caller's mistake, reported as such
// before anything is sent (other failures at launch are communication failures).
void check_gloo_dtype(const GroupState& group, const char* op, const at::Tensor& tensor) {
  if (tensor.is_cuda()) return;
  switch (tensor.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kChar: case at::kByte: case at::kInt:
    case at::kLong:
      return;
    case at::kBFloat16: case at::kBool:
      return;
    default:
      throw UsageError(group.who() + ": " + op + " on " + group.group_label() + ": Gloo cannot carry " +
                       std::string(c10::toString(tensor.scalar_type())) +
                       " tensors; convert to float32 (or another supported dtype) first.");
  }
}

std::shared_ptr<WorkState> start(const std::shared_ptr<GroupState>& group_ptr, const char* op, bool collective,
                                 int peer, const CollectiveOptions& options, uint64_t bytes,
                                 const std::function<void(WorkState&)>& launch) {
  GroupState& group = *group_ptr;
  check_usable(group);
  auto work = std::make_shared<WorkState>();
  work->started = Clock::now();
  group.stat_ops.fetch_add(1, std::memory_order_relaxed);
  group.stat_bytes.fetch_add(bytes, std::memory_order_relaxed);
  work->group = group_ptr;
  work->op = op;
  work->peer = peer;
  work->timeout = options.timeout.count() > 0 ? options.timeout : group.timeout;
  if (collective) work->seq = group.progress->begin(op);
  if (log::detail()) {
    DTRAIN_LOG(kDebug, op << (collective ? " #" + std::to_string(work->seq) : "") << " on "
                          << group.group_label());
  }
  try {
    launch(*work);
  } catch (const UsageError&) {
    throw;
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    fail(*work, what, looks_like_timeout(what));
  }
  return work;
}

void wait_for(WorkState& work) {
  if (work.done) return;
  try {
    if (work.shm_done.valid()) {
      // The transport's thread enforces the timeout itself; this bound only guards against a stuck thread.
      if (work.shm_done.wait_for(2 * work.timeout + std::chrono::seconds(10)) != std::future_status::ready) {
        throw ShmFailure("timed out", ShmFailure::Kind::kTimeout);
      }
      work.shm_done.get();
    } else if (work.shm_message) {
      work.group->shm_p2p->wait(*work.shm_message, work.timeout);
    } else {
      work.work->wait(work.timeout);
    }
  } catch (const ShmFailure& e) {
    work.late_rank = e.late_rank;
    if (e.kind == ShmFailure::Kind::kMismatch && work.seq == 0) {
      GroupState& group = *work.group;
      std::string message = group.who() + ": " + work.op + " with rank " +
                            std::to_string(group.global_ranks[work.peer]) + " on " + group.group_label() +
                            " (tag " + std::to_string(work.tag) + "): " + e.what();
      {
        std::lock_guard<std::mutex> lock(group.failure_mutex);
        if (group.failure.empty()) group.failure = message;
      }
      throw UsageError(message + ". The send and the recv of one (peer, tag) must have the same number of "
                                 "elements and dtype.");
    }
    if (e.kind == ShmFailure::Kind::kMismatch || e.kind == ShmFailure::Kind::kDestroyed) {
      std::string message = work.group->who() + ": " + work.op + " #" + std::to_string(work.seq) + " on " +
                            work.group->group_label() + ": " + e.what();
      {
        std::lock_guard<std::mutex> lock(work.group->failure_mutex);
        if (work.group->failure.empty()) work.group->failure = message;
      }
      throw UsageError(message + (e.kind == ShmFailure::Kind::kMismatch
                                      ? ". Every rank must pass the same shape, dtype and op."
                                      : ". Wait for asynchronous work before destroying its group."));
    }
    fail(work, e.what(), e.kind == ShmFailure::Kind::kTimeout);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    fail(work, what, looks_like_timeout(what));
  } catch (const std::exception& e) {
    fail(work, e.what(), looks_like_timeout(e.what()));
  }
  work.done = true;
  if (!work.shm_done.valid()) {  // the shared-memory transport times its own operations
    work.group->stat_busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - work.started).count(),
                                       std::memory_order_relaxed);
  }
  if (work.finish) work.finish();
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
                     std::string(c10::toString(tensor.scalar_type())) + "; use kSum and divide yourself.");
  }
}

}  // namespace

// ---- Work ----

void Work::wait() {
  if (!state_) throw UsageError("Work::wait() on an empty Work (default-constructed or moved from)");
  wait_for(*state_);
}

bool Work::is_completed() const {
  if (!state_ || state_->done) return true;
  if (state_->shm_done.valid()) {
    return state_->shm_done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  if (state_->shm_message) return state_->shm_message->done.load(std::memory_order_acquire);
  return state_->work->isCompleted();
}

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

namespace detail {

// DTRAIN_SHM_BUCKETS: 1 (default) keeps DDP's gradient buckets in shared memory when the group has it.
bool shared_buckets_enabled_by_env() {
  return env_switch("DTRAIN_SHM_BUCKETS", "DDP's gradient buckets in private memory, copied through the transport",
                    "in shared memory when every rank is on one host");
}

std::unique_ptr<SharedBuckets> SharedBuckets::create(ProcessGroup& group, int64_t bytes_per_rank) {
  GroupState& state = *group.state_;
  if (!state.shm || bytes_per_rank <= 0) return nullptr;
  check_usable(state);
  const bool wanted = shared_buckets_enabled_by_env();
  const int64_t stride = (bytes_per_rank + 4095) / 4096 * 4096;  // each rank's region on its own pages
  const std::string key = "shared-buckets/" + std::to_string(state.shared_buckets_created++);
  SegmentOptions options;
  options.bytes = static_cast<size_t>(stride) * state.size;
  options.wanted = wanted;
  std::string problem;
  auto segment = map_group_segment(*state.store, key, state.rank, state.size, state.timeout, options, problem);
  if (!segment) {
    if (!problem.empty()) {
      DTRAIN_LOG(kWarn, "shared memory unavailable for DDP's gradient buckets ("
                            << problem << ", " << stride * state.size
                            << " bytes); each all-reduce copies them through the transport instead");
    }
    return nullptr;
  }
  return std::unique_ptr<SharedBuckets>(new SharedBuckets(group, std::move(segment), stride));
}

SharedBuckets::SharedBuckets(ProcessGroup& group, std::shared_ptr<ShmSegment> segment, int64_t bytes_per_rank)
    : group_(group), segment_(std::move(segment)), bytes_per_rank_(bytes_per_rank) {}

SharedBuckets::~SharedBuckets() = default;

at::Tensor SharedBuckets::tensor(int64_t offset, int64_t numel, at::ScalarType type) const {
  char* data = segment_->base() + bytes_per_rank_ * group_.state_->rank + offset;
  std::shared_ptr<ShmSegment> keep = segment_;
  return at::from_blob(data, {numel}, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(type));
}

Work SharedBuckets::all_reduce_async(int64_t offset, int64_t numel, at::ScalarType type, double scale) {
  const std::shared_ptr<GroupState>& state = group_.state_;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(type));
  return Work(start(state, "all_reduce", true, -1, {}, static_cast<uint64_t>(bytes), [&](WorkState& w) {
    std::vector<char*> regions;
    for (int r = 0; r < state->size; ++r) regions.push_back(segment_->base() + bytes_per_rank_ * r + offset);
    w.shm_done = state->shm->all_reduce_regions_async(std::move(regions), numel, type, scale, w.timeout);
  }));
}

}  // namespace detail

Work ProcessGroup::all_reduce_async(at::Tensor& tensor, ReduceOp op, const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_average(group, tensor, op);
  auto work = start(state_, "all_reduce", true, -1, options, tensor.nbytes(), [&](WorkState& w) {
    if (group.shm && detail::ShmTransport::supports(tensor)) {
      w.shm_done = group.shm->all_reduce_async(tensor, op, w.timeout);
      return;
    }
    check_gloo_dtype(group, "all_reduce", tensor);
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    opts.timeout = w.timeout;
    w.work = backend_for(group, tensor).allreduce(tensors, opts);
  });
  if (op == ReduceOp::kAvg) {
    at::Tensor result = tensor;  // shares storage with the caller's tensor
    int size = group.size;
    work->finish = [result, size]() mutable { result.div_(size); };
  }
  return Work(work);
}

void ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op, const CollectiveOptions& options) {
  all_reduce_async(tensor, op, options).wait();
}

Work ProcessGroup::broadcast_async(at::Tensor& tensor, int root, const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_rank(group, root, "root");
  return Work(start(state_, "broadcast", true, -1, options, tensor.nbytes(), [&](WorkState& w) {
    check_gloo_dtype(group, "broadcast", tensor);
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = w.timeout;
    w.work = backend_for(group, tensor).broadcast(tensors, opts);
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
      throw UsageError(group.who() + ": all_gather: every output must have the input's numel and dtype (" +
                       std::to_string(input.numel()) + " of " + c10::toString(input.scalar_type()) + "), got " +
                       std::to_string(output.numel()) + " of " + c10::toString(output.scalar_type()));
    }
  }
  return Work(start(state_, "all_gather", true, -1, options, input.nbytes(), [&](WorkState& w) {
    if (group.shm && detail::ShmTransport::supports(input)) {
      w.shm_done = group.shm->all_gather_async(outputs, input, w.timeout);
      return;
    }
    check_gloo_dtype(group, "all_gather", input);
    std::vector<std::vector<at::Tensor>> out{outputs};
    std::vector<at::Tensor> in{input};
    c10d::AllgatherOptions opts;
    opts.timeout = w.timeout;
    w.work = backend_for(group, input).allgather(out, in, opts);
  }));
}

void ProcessGroup::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              const CollectiveOptions& options) {
  all_gather_async(outputs, input, options).wait();
}

Work ProcessGroup::reduce_scatter_async(at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op,
                                        const CollectiveOptions& options) {
  GroupState& group = *state_;
  if (static_cast<int>(inputs.size()) != group.size) {
    throw UsageError(group.who() + ": reduce_scatter needs one input tensor per rank (" +
                     std::to_string(group.size) + "), got " + std::to_string(inputs.size()));
  }
  for (const auto& input : inputs) {
    if (input.numel() != output.numel() || input.scalar_type() != output.scalar_type()) {
      throw UsageError(group.who() + ": reduce_scatter: every input must have the output's numel and dtype (" +
                       std::to_string(output.numel()) + " of " + c10::toString(output.scalar_type()) +
                       "), got " + std::to_string(input.numel()) + " of " + c10::toString(input.scalar_type()));
    }
  }
  check_average(group, output, op);
  std::function<void()> finish;
  auto work = start(state_, "reduce_scatter", true, -1, options, output.nbytes() * group.size, [&](WorkState& w) {
    if (group.shm && detail::ShmTransport::supports(output)) {
      w.shm_done = group.shm->reduce_scatter_async(output, inputs, op, w.timeout);
      return;
    }
    if (output.is_cuda()) {  // NCCL has a native reduce-scatter
      std::vector<at::Tensor> out{output};
      std::vector<std::vector<at::Tensor>> in{inputs};
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = to_c10d(op);
      opts.timeout = w.timeout;
      w.work = backend_for(group, output).reduce_scatter(out, in, opts);
      return;
    }
    // Gloo has no reduce-scatter in c10d 1.13: all-reduce every rank's inputs stacked, keep this rank's
    // slice once it is done.
    at::Tensor stacked = at::stack(inputs);
    check_gloo_dtype(group, "reduce_scatter", stacked);
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    opts.timeout = w.timeout;
    std::vector<at::Tensor> tensors{stacked};
    w.work = backend_for(group, output).allreduce(tensors, opts);
    finish = [target = output, stacked, rank = group.rank]() mutable { target.copy_(stacked[rank].view_as(target)); };
  });
  int size = group.size;
  work->finish = [finish, target = output, average = op == ReduceOp::kAvg, size]() mutable {
    if (finish) finish();
    if (average) target.div_(size);
  };
  return Work(work);
}

void ProcessGroup::reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op,
                                  const CollectiveOptions& options) {
  reduce_scatter_async(output, inputs, op, options).wait();
}

void ProcessGroup::barrier(const CollectiveOptions& options) {
  GroupState& group = *state_;
  if (group.shm) {
    // Asynchronous shared-memory all-reduces issued before the barrier complete before it, as Gloo's do.
    auto flushed = group.shm->flush();
    flushed.wait();
  }
  auto work = start(state_, "barrier", true, -1, options, 0, [&](WorkState& w) {
    c10d::BarrierOptions opts;
    opts.timeout = w.timeout;
    w.work = group.gloo->barrier(opts);
  });
  wait_for(*work);
}

Work ProcessGroup::isend(const at::Tensor& tensor, int dst, int tag, const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_rank(group, dst, "dst");
  return Work(start(state_, "send", false, dst, options, tensor.nbytes(), [&](WorkState& w) {
    w.tag = tag;
    check_gloo_dtype(group, "send", tensor);  // the same dtypes on one host as across hosts
    if (group.shm_p2p && detail::ShmPointToPoint::supports(tensor)) {
      w.shm_message = group.shm_p2p->send(tensor.contiguous(), dst, tag);
      return;
    }
    std::vector<at::Tensor> tensors{tensor};
    w.work = backend_for(group, tensor).send(tensors, dst, tag);
  }));
}

Work ProcessGroup::irecv(at::Tensor& tensor, int src, int tag, const CollectiveOptions& options) {
  GroupState& group = *state_;
  check_rank(group, src, "src");
  return Work(start(state_, "recv", false, src, options, tensor.nbytes(), [&](WorkState& w) {
    w.tag = tag;
    check_gloo_dtype(group, "recv", tensor);
    if (group.shm_p2p && detail::ShmPointToPoint::supports(tensor)) {
      if (tensor.is_contiguous()) {
        w.shm_message = group.shm_p2p->recv(tensor, src, tag);
      } else {
        // Land in a contiguous buffer; the caller's tensor gets it after a successful wait.
        at::Tensor landing = tensor.contiguous();
        w.shm_message = group.shm_p2p->recv(landing, src, tag);
        w.finish = [target = tensor, landing]() mutable { target.copy_(landing); };
      }
      return;
    }
    std::vector<at::Tensor> tensors{tensor};
    w.work = backend_for(group, tensor).recv(tensors, src, tag);
  }));
}

void ProcessGroup::send(const at::Tensor& tensor, int dst, int tag, const CollectiveOptions& options) {
  isend(tensor, dst, tag, options).wait();
}

void ProcessGroup::recv(at::Tensor& tensor, int src, int tag, const CollectiveOptions& options) {
  irecv(tensor, src, tag, options).wait();
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks, std::string name) {
  GroupState& parent = *state_;
  int index = parent.subgroups_created++;
  if (name.empty()) name = parent.name + "." + std::to_string(index);
  if (ranks.empty()) throw UsageError(parent.who() + ": new_group('" + name + "') needs at least one rank");
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
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(connect_group(std::move(group))));
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& requested) {
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
  auto timeout = resolve_timeout(options.timeout);
  log::set_rank(rank, world_size);

  auto group = std::make_unique<GroupState>();
  group->name = options.group_name;
  group->rank = rank;
  group->size = world_size;
  for (int r = 0; r < world_size; ++r) group->global_ranks.push_back(r);
  group->world_size = world_size;
  group->timeout = timeout;
  group->shared_memory_allowed = options.shared_memory && shared_memory_enabled_by_env();
  group->master_addr = launch.master_addr;
  if (options.init_method.rfind("tcp://", 0) == 0) {
    group->master_addr = parse_tcp(options.init_method.substr(6), "init_method").host;
  }
  group->root_store = open_store(options, launch, rank, world_size, timeout);
  group->root_store->setTimeout(timeout);
  group->store = c10::make_intrusive<c10d::PrefixStore>("dtrain/" + options.group_name, group->root_store);
  DTRAIN_LOG(kInfo, "joining " << group->group_label() << " of " << world_size << " ranks via "
                               << options.init_method << " (launch environment: " << launch.source << ")");
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(connect_group(std::move(group))));
}

}  // namespace dtrain
