// EtcdBackend against a real etcd (Debian's etcd-server, started per test on free loopback ports):
// the compare-and-set contract of RendezvousBackend, a race of two agents that only a working CAS
// survives, binary state, job isolation, the errors when etcd is paused, stopped or not etcd, and
// the failover between the members of a list of endpoints when one refuses or stays silent.
#include "launcher/elastic/etcd_backend.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include "dtrain/errors.h"
#include "launcher/elastic/etcd_server.h"  // tests/launcher/elastic/etcd_server.h
#ifdef DTRAIN_HAVE_BACKEND_CONTRACT
#include "launcher/cli/backend_contract.h"
#endif

namespace dtrain::elastic {
namespace {

using dtrain::testing::EtcdServer;
using namespace std::chrono_literals;

constexpr std::chrono::milliseconds kTimeout = 5s;  // generous: only the error tests wait for it

class EtcdBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdServer::available()) GTEST_SKIP() << EtcdServer::skip_reason();
    etcd_.start();
  }
  void TearDown() override { etcd_.stop(); }

  EtcdBackend backend(const std::string& run_id = "job",
                      std::chrono::milliseconds timeout = kTimeout) {
    return EtcdBackend(etcd_.endpoint(), run_id, timeout);
  }

  EtcdServer etcd_;
};

TEST_F(EtcdBackendTest, EmptyStoreHasNoState) {
  auto etcd = backend();
  EXPECT_EQ(etcd.name(), "etcd");
  EXPECT_EQ(etcd.key(), "/dtrain/rdzv/job/state");
  EXPECT_FALSE(etcd.get_state().has_value());
  EXPECT_NO_THROW(etcd.check_reachable());
}

#ifdef DTRAIN_HAVE_BACKEND_CONTRACT
TEST_F(EtcdBackendTest, PassesTheBackendContract) {
  auto etcd = backend();
  dtrain::cli::testing_support::expect_backend_contract(etcd);
}
#endif

TEST_F(EtcdBackendTest, FirstWriteWinsAndASecondFirstWriteLoses) {
  auto agent_a = backend();
  auto agent_b = backend();

  auto first = agent_a.set_state("from a", std::nullopt);
  EXPECT_TRUE(first.written);
  EXPECT_EQ(first.current.state, "from a");
  EXPECT_NE(first.current.version, 0u);

  auto stored = agent_b.get_state();
  ASSERT_TRUE(stored.has_value());
  EXPECT_EQ(stored->state, "from a");
  EXPECT_EQ(stored->version, first.current.version);

  // b also believes nothing is stored yet: it loses and is handed a's state to merge into.
  auto second = agent_b.set_state("from b", std::nullopt);
  EXPECT_FALSE(second.written);
  EXPECT_EQ(second.current.state, "from a");
  EXPECT_EQ(second.current.version, first.current.version);
  EXPECT_EQ(agent_a.get_state()->state, "from a");
}

TEST_F(EtcdBackendTest, CompareAndSetWinsWithTheCurrentVersionAndLosesWithAStaleOne) {
  auto etcd = backend();
  auto v1 = etcd.set_state("one", std::nullopt).current.version;

  auto won = etcd.set_state("two", v1);
  EXPECT_TRUE(won.written);
  EXPECT_EQ(won.current.state, "two");
  EXPECT_NE(won.current.version, v1);
  EXPECT_EQ(etcd.get_state()->version, won.current.version);

  auto lost = etcd.set_state("three", v1);  // v1 is stale now
  EXPECT_FALSE(lost.written);
  EXPECT_EQ(lost.current.state, "two");
  EXPECT_EQ(lost.current.version, won.current.version);
  EXPECT_EQ(etcd.get_state()->state, "two");

  // Writing the same bytes again is still a write: the version moves on.
  auto same = etcd.set_state("two", won.current.version);
  EXPECT_TRUE(same.written);
  EXPECT_NE(same.current.version, won.current.version);
}

// Two agents each add 1 to a counter kept in the state, kIncrements times, with the rendezvous'
// retry loop: merge into what a lost race returns and try again. Without an atomic compare-and-set
// both would read the same value and one increment would vanish.
TEST_F(EtcdBackendTest, TwoAgentsRacingIncrementsLoseNone) {
  constexpr int kIncrements = 40;
  constexpr int kMaxAttempts = 1000;
  std::atomic<int> lost_races{0};
  auto agent = [&](std::string* error) {
    try {
      auto etcd = backend();
      for (int i = 0; i < kIncrements; ++i) {
        auto seen = etcd.get_state();
        // Bounded: a backend whose compare never matches must fail this test, not hang it.
        for (int attempt = 0;; ++attempt) {
          if (attempt == kMaxAttempts) {
            throw std::runtime_error("no write won in " + std::to_string(kMaxAttempts) + " tries");
          }
          int counter = seen ? std::stoi(seen->state) : 0;
          std::optional<uint64_t> version;
          if (seen) version = seen->version;
          auto result = etcd.set_state(std::to_string(counter + 1), version);
          if (result.written) break;
          ++lost_races;
          seen = result.current;
        }
      }
    } catch (const std::exception& e) {
      *error = e.what();
    }
  };
  std::string error_a, error_b;
  std::thread a(agent, &error_a);
  std::thread b(agent, &error_b);
  a.join();
  b.join();
  ASSERT_EQ(error_a, "");
  ASSERT_EQ(error_b, "");
  auto final_state = backend().get_state();
  ASSERT_TRUE(final_state.has_value());
  EXPECT_EQ(final_state->state, std::to_string(2 * kIncrements));
  // Not a requirement, but a race that never happened proves nothing: say so if it did not.
  if (lost_races == 0) std::cout << "note: the two agents never collided in this run\n";
}

TEST_F(EtcdBackendTest, BinaryStateRoundTrips) {
  std::string bytes;
  for (int round = 0; round < 3; ++round) {
    for (int value = 0; value < 256; ++value) bytes += static_cast<char>(value);
  }
  auto etcd = backend();
  // Every length modulo 3 (base64 padding of 0, 1 and 2 characters), empty included.
  std::optional<uint64_t> version;
  for (size_t length : {size_t(0), size_t(1), size_t(2), size_t(3), size_t(256), bytes.size()}) {
    std::string state = bytes.substr(bytes.size() - length);
    auto result = etcd.set_state(state, version);
    ASSERT_TRUE(result.written) << length;
    version = result.current.version;
    auto stored = etcd.get_state();
    ASSERT_TRUE(stored.has_value()) << length;
    EXPECT_EQ(stored->state, state) << length;
    EXPECT_EQ(stored->version, *version) << length;
  }
  // What a lost race returns is decoded the same way.
  auto lost = etcd.set_state("x", std::nullopt);
  EXPECT_FALSE(lost.written);
  EXPECT_EQ(lost.current.state, bytes);
}

TEST_F(EtcdBackendTest, JobsWithDifferentIdsDoNotSeeEachOther) {
  auto job_a = backend("job-a");
  auto job_b = backend("job-b");
  auto job_a_prefixed = EtcdBackend(etcd_.endpoint(), "job-a", kTimeout, "/elsewhere/");
  ASSERT_TRUE(job_a.set_state("a", std::nullopt).written);
  EXPECT_FALSE(job_b.get_state().has_value());
  EXPECT_FALSE(job_a_prefixed.get_state().has_value());
  EXPECT_EQ(job_a_prefixed.key(), "/elsewhere/job-a/state");
  ASSERT_TRUE(job_b.set_state("b", std::nullopt).written);
  EXPECT_EQ(job_a.get_state()->state, "a");
  EXPECT_EQ(job_b.get_state()->state, "b");
}

// The agents rewrite the state at every heartbeat; etcd keeps every old copy until its history is
// compacted, which the backend does itself (Note [Compacting etcd's history]).
TEST_F(EtcdBackendTest, HistoryIsCompactedAndTheStateKept) {
  auto etcd = backend();
  etcd.set_compaction_interval(10);
  std::optional<uint64_t> version;
  for (int i = 0; i < 35; ++i) {
    auto result = etcd.set_state("state " + std::to_string(i), version);
    ASSERT_TRUE(result.written);
    version = result.current.version;
  }
  ASSERT_GE(*version, 30u);
  // Reading the key as it was at revision 2 needs history older than the last compaction.
  std::string old_read =
      etcd_.post("/v3/kv/range", R"({"key":"L2R0cmFpbi9yZHp2L2pvYi9zdGF0ZQ==","revision":"2"})");
  EXPECT_NE(old_read.find("required revision has been compacted"), std::string::npos) << old_read;
  auto now = etcd.get_state();
  ASSERT_TRUE(now.has_value());
  EXPECT_EQ(now->state, "state 34");
  EXPECT_EQ(now->version, *version);
}

// With a TTL, a state that agents keep writing lives on; once nobody writes it, it disappears
// (between ttl/2 and ttl later) and the run id is free again.
TEST_F(EtcdBackendTest, StateWithATtlLivesWhileWrittenAndExpiresAfterwards) {
  constexpr auto kTtl = 2s;  // etcd's minimum with its default election timeout
  auto etcd = backend();
  etcd.set_state_ttl(kTtl);
  std::optional<uint64_t> version;
  auto writing_until = std::chrono::steady_clock::now() + 3 * kTtl / 2;
  while (std::chrono::steady_clock::now() < writing_until) {
    auto result = etcd.set_state("alive", version);
    ASSERT_TRUE(result.written) << "the state expired although it was written every 0.2 s";
    version = result.current.version;
    std::this_thread::sleep_for(200ms);
  }
  auto last_write = std::chrono::steady_clock::now();
  std::optional<VersionedState> state = etcd.get_state();
  ASSERT_TRUE(state.has_value());
  while (state && std::chrono::steady_clock::now() - last_write < 5 * kTtl) {
    std::this_thread::sleep_for(100ms);
    state = etcd.get_state();
  }
  EXPECT_FALSE(state.has_value()) << "still stored " << 5 * kTtl.count()
                                  << " s after the last write";
  EXPECT_GE(std::chrono::steady_clock::now() - last_write, kTtl / 2);
  // The run id is free again, and a stale writer is told what happened.
  try {
    etcd.set_state("late", version);
    FAIL() << "a write expecting the expired state succeeded";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("TTL of 2 s expired"), std::string::npos)
        << error.what();
  }
  EXPECT_TRUE(backend().set_state("new job", std::nullopt).written);
}

TEST_F(EtcdBackendTest, EtcdsOwnErrorIsReportedWithItsMessage) {
  // etcd refuses requests over --max-request-bytes (1.5 MiB by default).
  auto etcd = backend();
  try {
    etcd.set_state(std::string(1600 * 1000, 'x'), std::nullopt);
    FAIL() << "a 1.6 MB state was accepted";
  } catch (const TimeoutError& error) {
    FAIL() << "a timeout instead of etcd's error: " << error.what();
  } catch (const CommError& error) {
    std::string message = error.what();
    EXPECT_NE(message.find("etcd at " + etcd_.endpoint()), std::string::npos) << message;
    EXPECT_NE(message.find("request is too large"), std::string::npos) << message;
  }
  EXPECT_FALSE(etcd.get_state().has_value());  // and the backend still works afterwards
}

// get_state() with a short timeout, tried a few times: etcd on a loaded two-core machine (or one
// just resumed from SIGSTOP) can miss one 300 ms deadline without anything being wrong.
std::optional<VersionedState> get_state_patiently(EtcdBackend& etcd) {
  for (int attempt = 1;; ++attempt) {
    try {
      return etcd.get_state();
    } catch (const TimeoutError&) {
      if (attempt == 20) throw;
    }
  }
}

// A paused etcd accepts connections (the kernel's backlog) and never answers: every call gives up
// at its timeout with a TimeoutError naming the endpoint.
TEST_F(EtcdBackendTest, PausedEtcdTimesOut) {
  constexpr auto kShortTimeout = 300ms;
  auto etcd = backend("job", kShortTimeout);
  // Connected once, so the first call below goes over a kept-alive connection, the others over new
  // ones: both must time out.
  ASSERT_FALSE(get_state_patiently(etcd).has_value());
  etcd_.pause();
  for (int call = 0; call < 3; ++call) {
    auto started = std::chrono::steady_clock::now();
    try {
      if (call == 0) etcd.get_state();
      if (call == 1) etcd.set_state("x", std::nullopt);
      if (call == 2) EtcdBackend(etcd_.endpoint(), "job", kShortTimeout).check_reachable();
      FAIL() << "call " << call << " returned from a paused etcd";
    } catch (const TimeoutError& error) {
      std::string message = error.what();
      EXPECT_NE(message.find("etcd at " + etcd_.endpoint()), std::string::npos) << message;
      EXPECT_NE(message.find("got no answer within the call's 0.3 s timeout;"), std::string::npos)
          << message;
    }
    // Bounded by the timeout (plus scheduling slack on a loaded machine), not by etcd.
    EXPECT_LT(std::chrono::steady_clock::now() - started, kShortTimeout + 5s) << call;
  }
  etcd_.resume();
  // The same backend recovers once etcd answers again. The timed-out write was already in etcd's
  // socket buffer, so etcd may still have applied it after the caller gave up (see
  // etcd_backend.h).
  auto after = get_state_patiently(etcd);
  if (after) {
    EXPECT_EQ(after->state, "x");
  }
}

TEST_F(EtcdBackendTest, StoppedEtcdIsAConnectionRefusedThatSaysWhatToDo) {
  std::string endpoint = etcd_.endpoint();
  auto etcd = backend();
  ASSERT_FALSE(etcd.get_state().has_value());
  etcd_.stop();
  auto started = std::chrono::steady_clock::now();
  for (int call = 0; call < 3; ++call) {
    try {
      if (call == 0) etcd.get_state();
      if (call == 1) etcd.set_state("x", std::nullopt);
      if (call == 2) EtcdBackend(endpoint, "job", kTimeout).check_reachable();
      FAIL() << "call " << call << " succeeded without etcd";
    } catch (const TimeoutError& error) {
      FAIL() << "a refused connection reported as a timeout: " << error.what();
    } catch (const CommError& error) {
      std::string message = error.what();
      EXPECT_NE(message.find("etcd at " + endpoint + " refused the connection"), std::string::npos)
          << message;
      EXPECT_NE(message.find("is etcd running there?"), std::string::npos) << message;
      EXPECT_NE(message.find("apt-get install etcd-server"), std::string::npos) << message;
    }
  }
  // A refusal is immediate: no call waited for its 5 s timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - started, kTimeout);
}

// Binds the TCP socket `fd` to a port of 127.0.0.1 the kernel picks, and returns that port.
int bind_to_a_free_loopback_port(int fd) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return ntohs(address.sin_port);
}

// A loopback port held by this process where nothing answers: `listening`, the kernel accepts
// connections into its backlog and nobody reads them (a silent member, as when its host is lost);
// otherwise the port is only bound, and a connection is refused (a stopped member).
class DeadMember {
 public:
  explicit DeadMember(bool listening) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    port_ = bind_to_a_free_loopback_port(fd_);
    if (listening) listen(fd_, 8);
  }
  ~DeadMember() { close(fd_); }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Note [Failing over between etcd members]: a member that refuses is passed over at once, and the
// member that answered is the one asked first from then on.
TEST_F(EtcdBackendTest, AListPassesOverARefusingMemberAndStaysWithTheOneThatAnswered) {
  DeadMember stopped(/*listening=*/false);
  EtcdBackend etcd(stopped.endpoint() + "," + etcd_.endpoint(), "job", kTimeout);
  EXPECT_EQ(etcd.endpoint(), stopped.endpoint() + "," + etcd_.endpoint());
  EXPECT_EQ(etcd.current_member(), stopped.endpoint());
  EXPECT_NO_THROW(etcd.check_reachable());
  EXPECT_EQ(etcd.current_member(), etcd_.endpoint());
  auto written = etcd.set_state("a", std::nullopt);
  EXPECT_TRUE(written.written);
  auto read = etcd.get_state();
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->state, "a");
  EXPECT_EQ(read->version, written.current.version);
}

// A silent member (no reset, no answer) costs its share of the call's timeout, and the call still
// succeeds on the next member, well within the timeout: without the failover it would time out.
TEST_F(EtcdBackendTest, ASilentMemberCostsItsShareOfTheTimeoutAndTheCallSucceedsOnTheNext) {
  DeadMember silent(/*listening=*/true);
  EtcdBackend etcd(silent.endpoint() + "," + etcd_.endpoint(), "job", 3s);
  auto started = std::chrono::steady_clock::now();
  EXPECT_FALSE(etcd.get_state().has_value());
  // At least the silent member's half of the 3 s (curl's timer may end it a little early).
  EXPECT_GT(std::chrono::steady_clock::now() - started, 1200ms);
  EXPECT_EQ(etcd.current_member(), etcd_.endpoint());
  EXPECT_TRUE(etcd.set_state("b", std::nullopt).written);
  EXPECT_EQ(etcd.current_member(), etcd_.endpoint());
}

// When no member answers within the timeout (round after round), the error names every member and
// what each did last; a refusal among them makes it a CommError, silence alone a TimeoutError.
TEST(EtcdBackendErrors, WhenNoMemberAnswersTheErrorNamesEach) {
  DeadMember stopped(/*listening=*/false);
  DeadMember silent(/*listening=*/true);
  const std::string list = stopped.endpoint() + "," + silent.endpoint();
  try {
    EtcdBackend(list, "job", 1s).get_state();
    FAIL() << "a state from no etcd";
  } catch (const TimeoutError& error) {
    FAIL() << "a refusal reported as a timeout: " << error.what();
  } catch (const CommError& error) {
    std::string message = error.what();
    EXPECT_NE(message.find("no member of the etcd cluster " + list +
                           " answered within the call's 1 s timeout: "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("etcd at " + stopped.endpoint() + " refused the connection"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("etcd at " + silent.endpoint() + ": read the rendezvous state"),
              std::string::npos)
        << message;
    // The silent member's wait is its share of the call's timeout, named as such.
    EXPECT_NE(message.find(" share of the call's timeout; "), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  DeadMember silent_too(/*listening=*/true);
  EXPECT_THROW(EtcdBackend(silent.endpoint() + "," + silent_too.endpoint(), "job", 600ms)
                   .set_state("x", std::nullopt),
               TimeoutError);
}

// A listening socket that answers every request with a fixed HTTP reply: a server that is not etcd.
class FakeHttpServer {
 public:
  explicit FakeHttpServer(std::string reply) : reply_(std::move(reply)) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    port_ = bind_to_a_free_loopback_port(fd_);
    listen(fd_, 8);
    thread_ = std::thread([this] {
      int client;
      while ((client = accept(fd_, nullptr, nullptr)) >= 0) {
        char request[4096];
        recv(client, request, sizeof(request), 0);  // one read is enough for these small requests
        send(client, reply_.data(), reply_.size(), MSG_NOSIGNAL);
        close(client);
      }
    });
  }
  ~FakeHttpServer() {
    shutdown(fd_, SHUT_RDWR);  // wakes accept() with an error
    thread_.join();
    close(fd_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  std::string reply_;
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(EtcdBackendErrors, AServerThatIsNotEtcdIsNamedAsSuch) {
  FakeHttpServer not_found(
      "HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nNot Found");
  EtcdBackend etcd(not_found.endpoint(), "job", kTimeout);
  try {
    etcd.get_state();
    FAIL() << "a 404 was taken for a state";
  } catch (const CommError& error) {
    std::string message = error.what();
    EXPECT_NE(message.find("etcd at " + not_found.endpoint()), std::string::npos) << message;
    EXPECT_NE(message.find("HTTP 404"), std::string::npos) << message;
    EXPECT_NE(message.find("etcd 3.4 or newer"), std::string::npos) << message;
  }

  FakeHttpServer other(
      "HTTP/1.1 200 OK\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{\"hello\":\"x\"}");
  try {
    EtcdBackend(other.endpoint(), "job", kTimeout).check_reachable();
    FAIL() << "a server that is not etcd passed the check";
  } catch (const CommError& error) {
    std::string message = error.what();
    EXPECT_NE(message.find(other.endpoint() + " answered GET /version but is not etcd"),
              std::string::npos)
        << message;
  }
}

TEST(EtcdBackendErrors, MalformedEndpointsAndRunIdsAreUsageErrors) {
  for (const char* endpoint :
       {"", ":2379", "host:", "host:port", "host:0", "host:65536", "host:123456", "::1:2379",
        "[::1", "[::1]x", "https://host:2379", "host/path:1"}) {
    try {
      EtcdBackend etcd(endpoint, "job", kTimeout);
      ADD_FAILURE() << "accepted '" << endpoint << "'";
    } catch (const UsageError& error) {
      EXPECT_NE(std::string(error.what()).find(std::string("'") + endpoint + "'"),
                std::string::npos)
          << error.what();
    }
  }
  for (const char* list : {"a:1,,b:2", "a:1,", ",a:1", "a:1,a:1", "a,a:2379", "a:1,b:port"}) {
    try {
      EtcdBackend etcd(list, "job", kTimeout);
      ADD_FAILURE() << "accepted '" << list << "'";
    } catch (const UsageError& error) {
      const std::string message = error.what();
      const bool names_it = message.find(std::string("'") + list + "'") != std::string::npos ||
                            message.find("'b:port'") != std::string::npos;
      EXPECT_TRUE(names_it) << message;
    }
  }
  EXPECT_EQ(EtcdBackend("10.0.0.1,http://10.0.0.2:2380", "job", kTimeout).endpoint(),
            "10.0.0.1:2379,10.0.0.2:2380");
  EXPECT_THROW(EtcdBackend("127.0.0.1:2379", "", kTimeout), UsageError);
  EXPECT_THROW(EtcdBackend("127.0.0.1:2379", "job", 0ms), UsageError);

  EXPECT_EQ(EtcdBackend("10.0.0.1", "job", kTimeout).endpoint(), "10.0.0.1:2379");
  EXPECT_EQ(EtcdBackend("http://etcd.example:4001/", "job", kTimeout).endpoint(),
            "etcd.example:4001");
  EXPECT_EQ(EtcdBackend("[::1]:2380", "job", kTimeout).endpoint(), "[::1]:2380");
  EXPECT_EQ(EtcdBackend("[::1]", "job", kTimeout).endpoint(), "[::1]:2379");
}

}  // namespace
}  // namespace dtrain::elastic
