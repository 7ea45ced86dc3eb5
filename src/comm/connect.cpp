// How a group comes to be: store, meeting, backends. See connect.h.
#include "comm/connect.h"

#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/c10d_backends.h"  // first of c10d's headers: it sets the macros their backends need
#ifdef DTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>  // getDeviceProperties
#include <c10/util/env.h>
#endif
#include "comm/device_check.h"
#include "comm/shm_p2p.h"
#include "comm/shm_transport.h"
#include "comm/store_bytes.h"
#include "common/log.h"
#include "common/process_identity.h"
#include "launcher/elastic/ports.h"  // route_to, interface_addresses

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

// An on/off environment switch: unset, empty or 1 is on, 0 is off, anything else a UsageError
// naming it.
bool env_switch(const char* name, const char* off_means, const char* on_means) {
  const char* value = std::getenv(name);
  if (!value || std::string(value) == "1" || std::string(value).empty()) return true;
  if (std::string(value) == "0") return false;
  throw UsageError(std::string("environment variable ") + name + "='" + value + "': expected 0 (" +
                   off_means + ") or 1 (" + on_means + ")");
}

// DTRAIN_CUDA_BACKEND: nccl (default) or gloo, which lets several ranks share one GPU (NCCL refuses
// that), as PyTorch allows with init_process_group("gloo") and CUDA tensors.
bool cuda_through_gloo_by_env() {
  const char* value = std::getenv("DTRAIN_CUDA_BACKEND");
  if (!value || !*value || std::string(value) == "nccl") return false;
  if (std::string(value) == "gloo") return true;
  throw UsageError(std::string("environment variable DTRAIN_CUDA_BACKEND='") + value +
                   "': expected nccl (one GPU per process) or gloo (ranks may share a GPU)");
}

// memory://NAME stores: shared by name among the threads of this process, freed with their last
// group.
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

}  // namespace

bool launcher_hosts_store() {
  const char* flag = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return flag != nullptr && std::string(flag) == "True";
}

namespace {

// Whether the launcher hosts the store at `endpoint` (TORCHELASTIC_USE_AGENT_STORE=True), so that
// it outlives any worker and every rank, rank 0 included, is its client. Read as PyTorch's
// rendezvous.py reads it: exactly "True", and only for the agent's own MASTER_ADDR:MASTER_PORT.
bool agent_hosts_store(const Endpoint& endpoint) {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  return launcher_hosts_store() && addr && endpoint.host == addr && port &&
         std::to_string(endpoint.port) == port;
}

// Connects to (or, on rank 0 unless the launcher hosts it, hosts) the TCPStore. A client retries
// until the deadline: a worker may start before its master's machine is up, and c10d gives up early
// on some errors ("No route to host").
c10::intrusive_ptr<c10d::Store> tcp_store(const Endpoint& endpoint, int rank, int world_size,
                                          std::chrono::milliseconds timeout) {
  const std::string who = rank_text(rank, world_size);
  const std::string where = endpoint.host + ":" + std::to_string(endpoint.port);
  const bool agent_store = agent_hosts_store(endpoint);
  const bool host = rank == 0 && !agent_store;
  const auto begun = Clock::now();
  const auto deadline = begun + timeout;
  int attempts = 0;
  std::string last_error;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    c10d::TCPStoreOptions tcp;
    tcp.port = static_cast<uint16_t>(endpoint.port);
    tcp.isServer = host;
    tcp.numWorkers = world_size;
    tcp.waitWorkers =
        false;  // dtrain's own meeting (connect_group) names the ranks that never came
    tcp.timeout = std::max(left, std::chrono::milliseconds(1000));
    ++attempts;
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(endpoint.host, tcp);
      store->setTimeout(timeout);
      return store;
    } catch (const std::exception& e) {
      if (host) {
        throw UsageError(who + ": cannot host the store on " + where +
                         " (MASTER_ADDR:MASTER_PORT): " + e.what() +
                         ". Pick a free port (`dtrain run` picks one when --master-port is 0).");
      }
      last_error = e.what();
      if (auto newline = last_error.find('\n'); newline != std::string::npos)
        last_error.resize(newline);
    }
    if (Clock::now() + std::chrono::seconds(1) >= deadline) break;
    if (attempts == 1) {
      DTRAIN_LOG(kWarn, "cannot reach the store at " << where << " yet (" << last_error
                                                     << "); retrying for up to "
                                                     << seconds_text(deadline - Clock::now()));
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  throw TimeoutError(who + ": cannot reach the store at " + where +
                     " (MASTER_ADDR:MASTER_PORT): " + std::to_string(attempts) + " attempts over " +
                     seconds_text(Clock::now() - begun) + " (timeout " + seconds_text(timeout) +
                     "), the last one: " + last_error +
                     (agent_store ? ". Likely cause: the launcher that hosts it "
                                    "(TORCHELASTIC_USE_AGENT_STORE=True) is gone, or the address "
                                    "is wrong."
                                  : ". Likely cause: rank 0 has not started or died, or the "
                                    "address is wrong."));
}

// Which machine this is: the hostname alone can repeat across containers, the boot id does not.
std::string host_identity() {
  std::string identity = own_hostname();
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {0};
    if (std::fgets(boot, sizeof boot, f)) identity += std::string("/") + boot;
    std::fclose(f);
  }
  return identity;
}

// Every member announces itself, then waits for the others until `deadline`; the missing are named.
void meet(GroupState& group, Clock::time_point deadline) {
  // The shared-memory switch travels with the host: ranks that disagree on it all fall back to
  // Gloo.
  group.store->set("host/" + std::to_string(group.rank),
                   bytes_of(host_identity() + (group.shared_memory_allowed ? "|shm" : "|no-shm")));
  group.store->set("join/" + std::to_string(group.rank), bytes_of(std::to_string(::getpid())));
  std::vector<std::string> keys;
  for (int r = 0; r < group.size; ++r) keys.push_back("join/" + std::to_string(r));
  const auto began = Clock::now();
  while (!group.store->check(keys)) {
    // In-place recovery: a member that died after its generation agreed on it never comes, and its
    // heartbeats say so in seconds (GroupState::abandon_check); the deadline is the collective
    // timeout.
    if (group.abandon_check) {
      if (std::string why = group.abandon_check(began); !why.empty()) {
        throw PeerLostError(group.who() + ": creating " + group.group_label() + " of " +
                            std::to_string(group.size) + " ranks abandoned: " + why);
      }
    }
    if (Clock::now() > deadline) {
      std::vector<int> missing;
      for (int r = 0; r < group.size; ++r) {
        if (!group.store->check({keys[r]})) missing.push_back(group.global_ranks[r]);
      }
      std::ostringstream list;
      for (size_t i = 0; i < missing.size(); ++i) list << (i ? "," : "") << missing[i];
      throw TimeoutError(
          group.who() + ": creating " + group.group_label() + " of " + std::to_string(group.size) +
          " ranks timed out after " + seconds_text(group.timeout) + "; ranks {" + list.str() +
          "} never joined. Likely cause: they failed before init_process_group, or were "
          "started with a different WORLD_SIZE, MASTER_ADDR or MASTER_PORT.");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// A peer that dies mid-collective resets its connections, and Gloo writes to its sockets with
// writev(), which raises SIGPIPE: by default the end of this process, before the transport can
// report the failure (a survivor of in-place recovery died of it in a CI run, a peer on another
// host having been killed). Python, where Gloo usually runs, ignores SIGPIPE from its start; a
// program that chose a disposition of its own keeps it.
void ignore_sigpipe_unless_handled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) &&
        current.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
  });
}

// A job on one machine talks over loopback.
bool loopback_master(const std::string& master) {
  return master.empty() || master == "localhost" || master.rfind("127.", 0) == 0 || master == "::1";
}

}  // namespace

std::string gloo_address(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    // The interface's first IPv4 address, as Gloo's device for an interface takes it.
    for (const auto& [interface, address, family] : elastic::interface_addresses()) {
      if (interface == ifname && family == AF_INET) return address;
    }
    return "";
  }
  if (loopback_master(master_addr)) return "127.0.0.1";
  return elastic::route_to(master_addr).address;
}

namespace {

// Gloo's socket: GLOO_SOCKET_IFNAME when set; else the address that routes to MASTER_ADDR (as NCCL
// picks its socket interface), so that a machine whose hostname resolves to loopback, or not at
// all, still talks to its peers on the network that reaches the master.
std::shared_ptr<::gloo::transport::Device> gloo_device(const GroupState& group) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    try {
      return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    } catch (const std::exception& e) {  // Gloo's own enforce error, not a c10::Error
      throw UsageError(group.who() + ": environment variable GLOO_SOCKET_IFNAME='" + ifname +
                       "': not a usable network interface here (" + e.what() +
                       "); name one `ip link` lists, or unset it");
    }
  }
  const std::string& master = group.master_addr;
  if (loopback_master(master)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  elastic::LocalRoute route = elastic::route_to(master);
  if (route.address.empty()) {
    DTRAIN_LOG(kWarn, "no route to MASTER_ADDR '"
                          << master
                          << "' found for Gloo; using this host's name. Set "
                             "GLOO_SOCKET_IFNAME to choose the interface.");
    return c10d::ProcessGroupGloo::createDefaultDevice();
  }
  DTRAIN_LOG(kDebug, group.group_label() << ": Gloo uses " << route.address << " ("
                                         << (route.interface.empty() ? "?" : route.interface)
                                         << "), the route to MASTER_ADDR " << master);
  return c10d::ProcessGroupGloo::createDeviceForHostname(route.address);
}

bool all_on_one_host(GroupState& group) {
  auto mine = group.store->get("host/" + std::to_string(group.rank));
  for (int r = 0; r < group.size; ++r) {
    if (group.store->get("host/" + std::to_string(r)) != mine) return false;
  }
  return true;
}

#ifdef DTRAIN_WITH_CUDA
// Before NCCL starts, every rank of the group announces the GPU it drives; two ranks on one GPU
// become one clear line on every rank (see comm/device_check.h) instead of NCCL's "Duplicate GPU
// detected" at the first collective. The GPU is named as NCCL names it, by its PCI address (two
// processes given one GPU each through CUDA_VISIBLE_DEVICES both train on cuda:0), and the host by
// NCCL_HOSTID where it is set, which NCCL takes for the host's identity.
void check_one_process_per_gpu(GroupState& group, int device) {
  const cudaDeviceProp* properties = at::cuda::getDeviceProperties(device);
  char pci[32];
  std::snprintf(pci, sizeof pci, "%04x:%02x:%02x", properties->pciDomainID, properties->pciBusID,
                properties->pciDeviceID);
  const char* nccl_host = std::getenv("NCCL_HOSTID");
  group.store->set("cuda_device/" + std::to_string(group.rank),
                   bytes_of(std::to_string(device) + "|" + pci + "|" +
                            (nccl_host && *nccl_host ? nccl_host : "")));
  std::vector<RankDevice> ranks;
  for (int r = 0; r < group.size; ++r) {
    const std::string key = "cuda_device/" + std::to_string(r);
    try {
      group.store->wait({key}, group.timeout);
    } catch (const std::exception&) {
      throw TimeoutError(
          group.who() + ": rank " + std::to_string(group.global_ranks[r]) + " of " +
          group.group_label() + " did not reach its first CUDA collective within " +
          seconds_text(group.timeout) +
          ". Likely cause: it took a different code path, is stuck or died; see its log.");
    }
    auto host = group.store->get("host/" + std::to_string(r));
    auto announced = group.store->get(key);
    std::string host_text(host.begin(), host.end());
    // "index|pci|nccl_hostid"
    std::istringstream fields(std::string(announced.begin(), announced.end()));
    std::string index, gpu, nccl_host_id;
    std::getline(fields, index, '|');
    std::getline(fields, gpu, '|');
    std::getline(fields, nccl_host_id);
    RankDevice rank{group.global_ranks[r], host_text.substr(0, host_text.rfind('|')),
                    std::stoi(index), gpu};
    if (!nccl_host_id.empty()) rank.host = "NCCL_HOSTID=" + nccl_host_id;
    ranks.push_back(rank);
  }
  const std::string shared = describe_shared_device(ranks);
  if (!shared.empty())
    throw UsageError(group.who() + ": " + group.group_label() + ": " + shared + ".");
}
#endif

}  // namespace

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

bool shared_memory_enabled_by_env() {
  return env_switch("DTRAIN_SHM", "all-reduce and send/recv through Gloo",
                    "shared memory among ranks on one host");
}

bool shared_buckets_enabled_by_env() {
  return env_switch("DTRAIN_SHM_BUCKETS",
                    "DDP's gradient buckets in private memory, copied through the transport",
                    "in shared memory when every rank is on one host");
}

std::string tcp_host(const std::string& init_method) {
  return parse_tcp(init_method.substr(6), "init_method").host;
}

c10::intrusive_ptr<c10d::Store> open_store(const InitOptions& options, const LaunchInfo& launch,
                                           int rank, int world_size,
                                           std::chrono::milliseconds timeout) {
  const std::string& method = options.init_method;
  const std::string who = rank_text(rank, world_size);
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
      throw UsageError(
          who +
          ": environment variable MASTER_ADDR is not set; expected the host of rank 0. "
          "Launch with `dtrain run` (it sets it) or export MASTER_ADDR.");
    }
    if (launch.master_port == 0) {
      throw UsageError(who +
                       ": environment variable MASTER_PORT is not set; expected a TCP port in "
                       "1..65535. Launch with `dtrain run` (it sets it) or export MASTER_PORT.");
    }
    endpoint = {launch.master_addr, launch.master_port};
  } else {
    throw UsageError("init_method='" + method +
                     "': expected env://, tcp://HOST:PORT, file:///PATH or memory://NAME");
  }
  return tcp_store(endpoint, rank, world_size, timeout);
}

std::shared_ptr<GroupState> connect_group(std::unique_ptr<GroupState> group) {
  ignore_sigpipe_unless_handled();
  const auto begun = Clock::now();
  const auto deadline = begun + group->timeout;
  group->cuda_through_gloo = cuda_through_gloo_by_env();
  meet(*group, deadline);
  auto options = c10d::ProcessGroupGloo::Options::create(group->timeout);
  options->devices.push_back(gloo_device(*group));
  // Two threads let two buckets' all-reduces proceed at once (DDP overlaps them with backward).
  options->threads = 2;
  auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo", group->store);
  // Gloo's own waits for its peers' addresses take the store's timeout: make them end at the
  // deadline.
  const auto store_timeout = group->root_store->getTimeout();
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  group->root_store->setTimeout(std::max(left, std::chrono::milliseconds(1000)));
  try {
    group->gloo =
        c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, group->rank, group->size, options);
    group->root_store->setTimeout(store_timeout);
    group->progress = std::make_unique<ProgressTracker>(group->store, group->rank, group->size);
    if (group->size > 1 && group->shared_memory_allowed && all_on_one_host(*group)) {
      auto shm_store = c10::make_intrusive<c10d::PrefixStore>("shm", group->store);
      group->shm = ShmTransport::create(*shm_store, group->rank, group->size, group->timeout);
      if (group->shm) {
        group->shm_p2p =
            ShmPointToPoint::create(*shm_store, group->rank, group->size, group->timeout);
      }
    }
  } catch (const UsageError&) {
    group->root_store->setTimeout(store_timeout);
    throw;
  } catch (const std::exception& e) {
    group->root_store->setTimeout(store_timeout);
    // Every rank had joined (meet() above), so a failure here is a peer that died or stalled while
    // the connections were made. Which one it was is told by the clock, not by the backend's
    // wording.
    const auto elapsed = Clock::now() - begun;
    std::string what = e.what();
    if (auto newline = what.find('\n'); newline != std::string::npos) what.resize(newline);
    const bool timed_out = Clock::now() >= deadline;
    std::string message =
        group->who() + ": connecting " + group->group_label() + " of " +
        std::to_string(group->size) + " ranks " +
        (timed_out ? "timed out after " + seconds_text(group->timeout)
                   : "failed after " + seconds_text(elapsed)) +
        ", when every rank had joined: " + what +
        ". Likely cause: a rank died or stalled during start-up, or cannot reach this "
        "one's address; see its log (DTRAIN_LOG=debug shows the address Gloo uses).";
    if (timed_out) throw TimeoutError(message);
    throw PeerLostError(message);
  }
  return std::shared_ptr<GroupState>(std::move(group));
}

bool uses_nccl(const GroupState& group, const at::Tensor& tensor) {
  return tensor.is_cuda() && !group.cuda_through_gloo;
}

c10d::Backend& backend_for(GroupState& group, const at::Tensor& tensor) {
  if (uses_nccl(group, tensor)) {
#ifdef DTRAIN_WITH_CUDA
    std::call_once(group.nccl_once, [&] {
      check_one_process_per_gpu(group, tensor.get_device());
      // A group whose waits ask abandon_check (in-place recovery) must outlive a failed
      // collective: c10d's watchdog, by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), takes the
      // whole process down when NCCL reports an error, such as a peer's closed connection. 2
      // aborts the communicator and leaves the error to the waiting thread, which re-forms the
      // group. Read by ProcessGroupNCCL's constructor, for the process: a value the user set
      // (under either name c10d reads) is kept.
      if (group.abandon_check && !c10::utils::has_env("TORCH_NCCL_ASYNC_ERROR_HANDLING") &&
          !c10::utils::has_env("NCCL_ASYNC_ERROR_HANDLING")) {
        c10::utils::set_env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2");
      }
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = group.timeout;
      auto nccl_store = c10::make_intrusive<c10d::PrefixStore>("nccl", group.store);
      group.nccl =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(nccl_store, group.rank, group.size, options);
    });
    return *group.nccl;
#else
    throw UsageError(group.who() +
                     ": a CUDA tensor was passed to a collective, but this dtrain was built "
                     "against a LibTorch without CUDA. Rebuild with a CUDA LibTorch.");
#endif
  }
  return *group.gloo;
}

}  // namespace dtrain::detail
