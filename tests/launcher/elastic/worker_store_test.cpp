// The launcher's workers' store (src/launcher/elastic/worker_store.h) against the client it is
// for: LibTorch's own c10d::TCPStore, then two dtrain process groups that meet through it and
// all-reduce over Gloo, as workers do under TORCHELASTIC_USE_AGENT_STORE=True. A bare socket sends
// what no TCPStore client would (a disconnect mid-wait, oversized or foreign requests).
#include "launcher/elastic/worker_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "dtrain/comm.h"
#include "dtrain/errors.h"
#include "gtest/gtest.h"
#include "support/system.h"
#include "support/thread_ranks.h"

namespace dtrain::elastic {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }
std::string text(const std::vector<uint8_t>& data) { return {data.begin(), data.end()}; }

// A client as a worker makes one: PyTorch's TCPStore, never the server. Every call of it is bounded
// by `timeout`.
c10::intrusive_ptr<c10d::TCPStore> client(int port, std::chrono::milliseconds timeout = 10s) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
}

// The server's debug lines, collected from its thread.
struct Log {
  std::mutex mutex;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex);
      lines.push_back(line);
    };
  }
  std::string all() {
    std::lock_guard<std::mutex> lock(mutex);
    std::string joined;
    for (const auto& line : lines) joined += line + "\n";
    return joined;
  }
};

// A bare TCP connection to the store, for requests no TCPStore client sends.
class RawClient {
 public:
  explicit RawClient(int port) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ < 0 || connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      throw std::runtime_error("cannot connect to the store");
    }
  }
  ~RawClient() { close_now(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  void send_all(const std::string& data) {
    ASSERT_EQ(send(fd_, data.data(), data.size(), MSG_NOSIGNAL), ssize_t(data.size()));
  }
  // The next byte within `timeout`: its value, -1 when the server closed the connection, nullopt
  // when nothing came.
  std::optional<int> next_byte(std::chrono::milliseconds timeout) {
    pollfd in{fd_, POLLIN, 0};
    if (poll(&in, 1, static_cast<int>(timeout.count())) <= 0) return std::nullopt;
    unsigned char byte = 0;
    ssize_t n = recv(fd_, &byte, 1, 0);
    return n == 1 ? std::optional<int>(byte) : std::optional<int>(-1);
  }
  void close_now() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

template <typename T>
std::string raw(T value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}
std::string field(const std::string& data) { return raw<uint64_t>(data.size()) + data; }
const std::string kValidate = std::string(1, '\0') + raw<uint32_t>(0x3C85F7CE);
// WAIT on keys as a raw client names them (TCPStore clients put "/" before every key).
std::string wait_request(const std::vector<std::string>& keys) {
  std::string request(1, char(6));
  request += raw<uint64_t>(keys.size());
  for (const auto& key : keys) request += field(key);
  return request;
}

// Sets environment variables for one scope, then restores them.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace(name, old ? std::optional<std::string>(old) : std::nullopt);
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old) {
        setenv(name.c_str(), old->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST(WorkerStore, PortZeroPicksAFreePortAndATakenPortIsAUsageError) {
  WorkerStore server("127.0.0.1", 0);
  EXPECT_GT(server.port(), 0);
  try {
    WorkerStore second("127.0.0.1", server.port());
    FAIL() << "a second store bound the same port";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the port is taken"), std::string::npos) << e.what();
  }
  EXPECT_THROW(WorkerStore("no-such-host.invalid", 0), UsageError);
  // "" is every interface: IPv4 clients reach it too.
  WorkerStore everywhere("", 0);
  auto store = client(everywhere.port());
  store->set("k", bytes("v"));
  EXPECT_EQ(text(store->get("k")), "v");
}

TEST(WorkerStore, SetGetAddCheck) {
  WorkerStore server("127.0.0.1", 0);
  auto store = client(server.port());
  store->set("greeting", bytes("hello"));
  EXPECT_EQ(text(store->get("greeting")), "hello");
  store->set("greeting", bytes(""));
  EXPECT_EQ(text(store->get("greeting")), "");  // an empty value is a value

  EXPECT_EQ(store->add("counter", 5), 5);  // a missing counter starts from 0
  EXPECT_EQ(store->add("counter", 0), 5);  // how clients read a counter
  EXPECT_EQ(store->add("counter", -7), -2);
  EXPECT_EQ(text(store->get("counter")), "-2");  // kept as decimal text

  EXPECT_TRUE(store->check({"greeting"}));
  EXPECT_TRUE(store->check({"greeting", "counter"}));
  EXPECT_FALSE(store->check({"missing"}));
  EXPECT_FALSE(store->check({"greeting", "missing"}));
}

TEST(WorkerStore, CompareSetFollowsPyTorchsServers) {
  WorkerStore server("127.0.0.1", 0);
  auto store = client(server.port());
  // A missing key with an empty `expected` is created.
  EXPECT_EQ(text(store->compareSet("k", bytes(""), bytes("first"))), "first");
  EXPECT_EQ(text(store->get("k")), "first");
  // A mismatch leaves the value and returns it.
  EXPECT_EQ(text(store->compareSet("k", bytes("wrong"), bytes("second"))), "first");
  EXPECT_EQ(text(store->get("k")), "first");
  // A match replaces it.
  EXPECT_EQ(text(store->compareSet("k", bytes("first"), bytes("second"))), "second");
  EXPECT_EQ(text(store->get("k")), "second");
  // A missing key with another `expected`: the reply is `expected`, the key stays missing.
  EXPECT_EQ(text(store->compareSet("absent", bytes("x"), bytes("y"))), "x");
  EXPECT_FALSE(store->check({"absent"}));
}

TEST(WorkerStore, DeleteNumKeysAppendMultiListAndQueues) {
  WorkerStore server("127.0.0.1", 0);
  auto store = client(server.port());
  EXPECT_EQ(store->getNumKeys(), 0);
  store->set("a", bytes("1"));
  store->set("b", bytes("2"));
  EXPECT_EQ(store->getNumKeys(), 2);
  EXPECT_TRUE(store->deleteKey("a"));
  EXPECT_FALSE(store->deleteKey("a"));
  EXPECT_EQ(store->getNumKeys(), 1);

  store->append("log", bytes("ab"));  // append creates
  store->append("log", bytes("cd"));
  EXPECT_EQ(text(store->get("log")), "abcd");

  store->multiSet({"x", "y", "z"}, {bytes("X"), bytes(""), bytes("ZZ")});
  auto values = store->multiGet({"z", "x", "y"});
  ASSERT_EQ(values.size(), 3u);
  EXPECT_EQ(text(values[0]), "ZZ");
  EXPECT_EQ(text(values[1]), "X");
  EXPECT_EQ(text(values[2]), "");

  auto keys = store->listKeys();
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{"b", "log", "x", "y", "z"}));

  EXPECT_EQ(store->queueLen("q"), 0);
  store->queuePush("q", bytes("one"));
  store->queuePush("q", bytes("two"));
  EXPECT_EQ(store->queueLen("q"), 2);
  EXPECT_TRUE(store->check({"q"}));  // a non-empty queue counts as an existing key
  EXPECT_EQ(text(store->queuePop("q", /*block=*/false)), "one");
  EXPECT_EQ(text(store->queuePop("q", /*block=*/true)), "two");
  EXPECT_THROW(store->queuePop("q", /*block=*/false), c10::DistQueueEmptyError);
  EXPECT_EQ(store->getNumKeys(), 5);  // queues are not keys
}

TEST(WorkerStore, GetBlocksUntilAnotherClientSetsTheKey) {
  WorkerStore server("127.0.0.1", 0);
  auto reader = client(server.port());
  auto writer = client(server.port());
  std::string got;
  std::atomic<bool> done{false};
  std::exception_ptr failure;
  std::thread waiting([&] {
    try {
      got = text(reader->get("late"));  // bounded by the client's 10 s timeout
    } catch (...) {
      failure = std::current_exception();
    }
    done = true;
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(done) << "get() returned before the key existed";
  writer->set("late", bytes("here"));
  waiting.join();
  if (failure) std::rethrow_exception(failure);
  EXPECT_EQ(got, "here");

  // A waiter on several keys is answered only when the last of them is set.
  std::atomic<bool> both{false};
  std::thread multi([&] {
    try {
      reader->wait({"k1", "k2"}, 10s);
      both = true;
    } catch (...) {
      failure = std::current_exception();
    }
  });
  std::this_thread::sleep_for(200ms);
  writer->set("k1", bytes("1"));
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(both) << "wait() returned with one of its two keys missing";
  writer->add("k2", 1);
  multi.join();
  if (failure) std::rethrow_exception(failure);
  EXPECT_TRUE(both);
}

TEST(WorkerStore, AWaitThatTimesOutThrowsAndTheStoreServesOn) {
  WorkerStore server("127.0.0.1", 0);
  auto store = client(server.port());
  auto other = client(server.port());
  const auto begun = Clock::now();
  EXPECT_THROW(store->wait({"never"}, 300ms), c10::DistStoreError);
  EXPECT_LT(Clock::now() - begun, 5s);
  // The same connection, after its CANCEL_WAIT, and another one still work; setting the key the
  // cancelled wait named sends that connection nothing it does not expect.
  other->set("never", bytes("now"));
  store->set("after", bytes("yes"));
  EXPECT_EQ(text(store->get("after")), "yes");
  EXPECT_EQ(text(other->get("after")), "yes");
  EXPECT_EQ(text(store->get("never")), "now");
}

TEST(WorkerStore, AClientThatDisconnectsWhileWaitingIsForgotten) {
  Log log;
  WorkerStore server("127.0.0.1", 0, log.sink());
  auto store = client(server.port());
  {
    RawClient gone(server.port());
    gone.send_all(kValidate + wait_request({"/k"}));
    EXPECT_EQ(gone.next_byte(200ms), std::nullopt);  // parked
  }
  std::this_thread::sleep_for(100ms);  // the server sees the close
  // The next connection most likely gets the same descriptor on the server: it must not inherit
  // the wait of the one that left.
  RawClient next(server.port());
  next.send_all(kValidate + wait_request({"/k2"}));
  EXPECT_EQ(next.next_byte(200ms), std::nullopt);  // parked before "k" is set
  store->set("k", bytes("v"));
  EXPECT_EQ(next.next_byte(300ms), std::nullopt) << "answered for a key it did not wait for";
  store->set("k2", bytes("v"));
  EXPECT_EQ(next.next_byte(5s), 0);  // STOP_WAITING
  EXPECT_EQ(text(store->get("k")), "v");
  EXPECT_EQ(log.all(), "");  // leaving is not an error
}

TEST(WorkerStore, TwoThreadsOfTwoClientsAddExactly) {
  WorkerStore server("127.0.0.1", 0);
  constexpr int kAdds = 1000;
  dtrain::testing::run_ranks(2, [&](int) {
    auto first = client(server.port());
    auto second = client(server.port());
    for (int i = 0; i < kAdds; ++i) {
      first->add("total", 1);
      second->add("total", 1);
    }
  });
  EXPECT_EQ(client(server.port())->add("total", 0), 4 * kAdds);
}

TEST(WorkerStore, BarrierReleasesEveryoneAtTheWorldSize) {
  // TCPStore::barrier is newer than LibTorch 2.11 (the server answers it for the clients that have
  // it): a generic lambda, so that a client without it compiles and the test says why it skips.
  auto barrier = [](auto& store) {
    if constexpr (requires { store.barrier("gate", 3, 10s); }) {
      store.barrier("gate", 3, 10s);
      return true;
    } else {
      return false;
    }
  };
  WorkerStore server("127.0.0.1", 0);
  std::atomic<int> through{0};
  std::atomic<bool> has_barrier{true};
  dtrain::testing::run_ranks(3, [&](int) {
    auto store = client(server.port());
    if (!barrier(*store)) {
      has_barrier = false;
      return;
    }
    ++through;
  });
  if (!has_barrier) GTEST_SKIP() << "this LibTorch's TCPStore has no barrier()";
  EXPECT_EQ(through, 3);
}

TEST(WorkerStore, DropsForeignAndOversizedRequestsAndServesOthers) {
  Log log;
  WorkerStore server("127.0.0.1", 0, log.sink());
  auto store = client(server.port());
  {
    RawClient http(server.port());
    http.send_all("GET / HTTP/1.1\r\n\r\n");
    EXPECT_EQ(http.next_byte(5s), -1);  // closed, not answered
  }
  {
    RawClient huge(server.port());
    // SET with a key of 1 TiB: refused at its length, before a byte of it is awaited.
    huge.send_all(kValidate + std::string(1, char(1)) + raw<uint64_t>(1ull << 40));
    EXPECT_EQ(huge.next_byte(5s), -1);
  }
  {
    RawClient value(server.port());
    value.send_all(kValidate + std::string(1, char(1)) + field("/k") +
                   raw<uint64_t>(64ull << 20));  // a 64 MiB value: over the 8 MiB limit
    EXPECT_EQ(value.next_byte(5s), -1);
  }
  {
    RawClient unknown(server.port());
    unknown.send_all(kValidate + std::string(1, char(99)));
    EXPECT_EQ(unknown.next_byte(5s), -1);
  }
  store->set("still", bytes("serving"));
  EXPECT_EQ(text(store->get("still")), "serving");
  const std::string lines = log.all();
  EXPECT_NE(lines.find("not VALIDATE"), std::string::npos) << lines;
  EXPECT_NE(lines.find("a key of 1099511627776 bytes"), std::string::npos) << lines;
  EXPECT_NE(lines.find("a value of 67108864 bytes"), std::string::npos) << lines;
  EXPECT_NE(lines.find("unknown command 99"), std::string::npos) << lines;
}

TEST(WorkerStore, StopsPromptlyWhileAClientWaits) {
  auto server = std::make_unique<WorkerStore>("127.0.0.1", 0);
  auto store = client(server->port());
  std::atomic<bool> threw{false};
  std::thread waiting([&] {
    try {
      store->wait({"never"}, 10s);
    } catch (const std::exception&) {
      threw = true;
    }
  });
  std::this_thread::sleep_for(200ms);
  const auto begun = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - begun, 2s);
  waiting.join();
  EXPECT_TRUE(threw);
  EXPECT_LT(Clock::now() - begun, 5s) << "the waiter did not see its connection close";
}

// What issue 21 needs: the store outlives the workers, so no rank hosts it. Under
// TORCHELASTIC_USE_AGENT_STORE=True every rank, rank 0 included, is a client of the launcher's.
TEST(WorkerStore, TwoRanksMeetThroughItAndAllReduceOverGloo) {
  WorkerStore server("127.0.0.1", 0);
  const std::string port = std::to_string(server.port());
  ScopedEnv env({{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                 {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", port}});
  // LibTorch's TCPStore forgives a server that cannot bind under the switch (and logs an error):
  // rank 0 must not try at all, or it would host a rival store wherever the bind succeeds.
  ::testing::internal::CaptureStderr();
  std::exception_ptr failure;
  try {
    dtrain::testing::run_ranks(2, [&](int rank) {
      InitOptions options;
      options.init_method = "tcp://127.0.0.1:" + port;
      options.rank = rank;
      options.world_size = 2;
      options.timeout = 30s;
      options.shared_memory = false;  // through Gloo, whose ranks find each other in the store
      auto group = init_process_group(options);
      auto tensor = torch::full({7}, static_cast<float>(rank + 1));
      group->all_reduce(tensor);
      EXPECT_TRUE(torch::equal(tensor, torch::full({7}, 3.0f))) << tensor;
    });
  } catch (...) {
    failure = std::current_exception();
  }
  const std::string errors = ::testing::internal::GetCapturedStderr();
  if (failure) std::rethrow_exception(failure);
  EXPECT_EQ(errors.find("failed to bind"), std::string::npos) << "rank 0 tried to host:\n"
                                                              << errors;
  EXPECT_GT(client(server.port())->getNumKeys(), 0);  // they met here
}

// PyTorch's own env:// init, as torchrun's workers run it: two processes, TCPStore clients both.
TEST(WorkerStore, PyTorchProcessesMeetThroughItUnderTheAgentStoreSwitch) {
  const std::string& python = dtrain::testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << dtrain::testing::kNoPythonWithTorch;
  WorkerStore server("127.0.0.1", 0);
  const std::string script =
      "import datetime, torch, torch.distributed as dist\n"
      "dist.init_process_group(\"gloo\", timeout=datetime.timedelta(seconds=60))\n"
      "t = torch.ones(3) * (dist.get_rank() + 1)\n"
      "dist.all_reduce(t)\n"
      "assert t.tolist() == [3.0, 3.0, 3.0], t\n"
      "dist.barrier()\n"
      "dist.destroy_process_group()\n"
      "print(\"rank\", dist.get_rank() if dist.is_initialized() else \"-\", \"ok\")\n";
  const std::string run_rank = "timeout -k 5 90 '" + python + "' -c '" + script + "' 2>&1";
  const std::string command =
      "export MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(server.port()) +
      " WORLD_SIZE=2 TORCHELASTIC_USE_AGENT_STORE=True; "
      "(RANK=0 LOCAL_RANK=0 " +
      run_rank +
      ") & first=$!; "
      "(RANK=1 LOCAL_RANK=1 " +
      run_rank +
      ") & second=$!; "
      "wait $first; a=$?; wait $second; b=$?; echo \"exit $a $b\"";
  std::string output;
  FILE* pipe = popen(command.c_str(), "r");  // /bin/sh
  ASSERT_NE(pipe, nullptr);
  char chunk[4096];
  std::size_t n = 0;
  while ((n = fread(chunk, 1, sizeof(chunk), pipe)) > 0) output.append(chunk, n);
  pclose(pipe);
  EXPECT_NE(output.find("exit 0 0"), std::string::npos) << output;
  EXPECT_GT(client(server.port())->getNumKeys(), 0);  // they met here, not in a store of rank 0
}

// Without the switch rank 0 hosts the store as before, and finds the launcher's port taken.
TEST(WorkerStore, WithoutTheSwitchRankZeroStillHosts) {
  WorkerStore server("127.0.0.1", 0);
  const std::string port = std::to_string(server.port());
  ScopedEnv env({{"TORCHELASTIC_USE_AGENT_STORE", "False"},
                 {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", port}});
  InitOptions options;
  options.init_method = "tcp://127.0.0.1:" + port;
  options.rank = 0;
  options.world_size = 2;
  options.timeout = 10s;
  try {
    init_process_group(options);
    FAIL() << "rank 0 hosted a store on a taken port";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot host the store"), std::string::npos) << e.what();
  }
}

// The launcher's own client (in_place_recovery.cpp: a worker's exit notice, and whether the
// workers formed an in-place group) against this store and against LibTorch's own TCPStore server,
// so that it speaks the protocol and not merely this server's reading of it. Keys as the server
// holds them: c10d's client puts "/" before each.
TEST(WorkerStore, TheLaunchersClientSetsAndChecksKeysInAnyTCPStore) {
  std::optional<WorkerStore> ours;
  ours.emplace("127.0.0.1", 0);
  c10d::TCPStoreOptions options;
  options.port = 0;
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = 10s;
  auto theirs = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  for (const int port : {ours->port(), static_cast<int>(theirs->getPort())}) {
    SCOPED_TRACE("the store on port " + std::to_string(port));
    auto worker = client(port);
    EXPECT_EQ(check_in_worker_store("127.0.0.1", port, "/formed", 2s), KeyCheck::kAbsent);
    worker->set("formed", bytes("1"));
    EXPECT_EQ(check_in_worker_store("127.0.0.1", port, "/formed", 2s), KeyCheck::kPresent);
    // Exit notices and the question in one exchange: the answer comes after the SETs were served.
    EXPECT_EQ(set_and_check_in_worker_store(
                  "127.0.0.1", port, {{"/exited/8", "exited with code 1"}, {"/exited/9", "x"}},
                  "/formed", 2s),
              KeyCheck::kPresent);
    EXPECT_EQ(text(worker->get("exited/8")), "exited with code 1");
    EXPECT_EQ(text(worker->get("exited/9")), "x");
  }
  // Nothing listening there any more: refused, said at once, and nothing thrown.
  const int closed = ours->port();
  ours.reset();
  std::string why;
  const auto start = Clock::now();
  EXPECT_EQ(check_in_worker_store("127.0.0.1", closed, "/formed", 1s, &why), KeyCheck::kNoStore);
  EXPECT_NE(why, "");
  EXPECT_LT(Clock::now() - start, 1s) << why;
}

}  // namespace
}  // namespace dtrain::elastic
