// Point to point between ranks on one host: isend/irecv through shared memory (Note [Shared-memory
// point to point]) against the contract in comm.h, and the Gloo path that DTRAIN_SHM=0 keeps. A
// tiny ring (256 bytes) makes small tensors reach the paths that large ones take: messages that
// stream through a full ring, and messages copied out of it before their recv is posted.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <regex>

#include "comm/shm_p2p.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::run_group;
using testing::run_ranks;
using testing::unique_store_name;

constexpr int64_t kTinyRing = 256;

// Groups created while this lives get a ring of `bytes`.
struct RingSize {
  explicit RingSize(int64_t bytes) { detail::set_shm_p2p_ring_bytes(bytes); }
  ~RingSize() { detail::set_shm_p2p_ring_bytes(0); }
};

// A tensor whose every element depends on (seed, index), in any dtype.
at::Tensor pattern(int64_t numel, at::ScalarType dtype, int seed) {
  at::Tensor values = torch::arange(numel, torch::kInt64).mul_(7).add_(seed * 13).remainder_(101);
  return values.to(dtype);
}

// Same dtype, shape and values (compared as double, which holds every value pattern() makes).
bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         torch::equal(a.to(at::kDouble), b.to(at::kDouble));
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kChar,
                                             at::kByte,  at::kInt,    at::kLong};

TEST(PointToPoint, OddSizesAndDtypesThroughSharedMemory) {
  RingSize ring(kTinyRing);
  // 0 bytes, 1 element, sizes around the ring's, and many rings' worth.
  const std::vector<int64_t> sizes = {0, 1, 3, 31, 32, 33, 200, 1000, 10007};
  const uint64_t before = detail::shm_p2p_messages_received();
  run_group(2, [&](int rank, ProcessGroup& group) {
    ASSERT_TRUE(group.uses_shared_memory());
    const int peer = 1 - rank;
    int tag = 0;
    for (at::ScalarType dtype : kDtypes) {
      for (int64_t numel : sizes) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " x " + std::to_string(numel));
        // Both directions at once: each rank sends before it receives.
        Work sent = group.isend(pattern(numel, dtype, rank), peer, tag);
        at::Tensor received = torch::full({numel}, -1, torch::TensorOptions().dtype(dtype));
        group.recv(received, peer, tag);
        sent.wait();
        EXPECT_TRUE(same(received, pattern(numel, dtype, peer)));
        ++tag;
      }
    }
  });
  // Every recv of both ranks was delivered through shared memory, none through Gloo.
  EXPECT_EQ(detail::shm_p2p_messages_received() - before, 2 * kDtypes.size() * sizes.size());
}

TEST(PointToPoint, NonContiguousTensors) {
  RingSize ring(kTinyRing);
  run_group(2, [&](int rank, ProcessGroup& group) {
    at::Tensor matrix = pattern(60, at::kFloat, 5).reshape({6, 10});
    if (rank == 0) {
      group.send(matrix.t(), 1, 1);  // a transposed view: sent in its logical order
    } else {
      at::Tensor target = torch::zeros({6, 10});
      at::Tensor view = target.t();  // lands through a contiguous buffer, then into the view
      group.recv(view, 0, 1);
      EXPECT_TRUE(torch::equal(view, matrix.t()));
    }
  });
}

TEST(PointToPoint, TagsMatchOutOfOrderAndInOrderWithinATag) {
  RingSize ring(kTinyRing);
  run_group(2, [&](int rank, ProcessGroup& group) {
    if (rank == 0) {
      std::vector<Work> sends;
      sends.push_back(group.isend(pattern(100, at::kFloat, 1), 1, /*tag=*/1));
      sends.push_back(group.isend(pattern(5, at::kFloat, 2), 1, /*tag=*/2));
      sends.push_back(group.isend(pattern(300, at::kFloat, 3), 1, /*tag=*/3));
      sends.push_back(
          group.isend(pattern(7, at::kFloat, 4), 1, /*tag=*/2));  // second message of tag 2
      for (auto& w : sends) w.wait();
    } else {
      // Tag 3 first: tags 1 and 2 in front of it are set aside, not lost and not blocking.
      at::Tensor three = torch::empty({300}), two_a = torch::empty({5}), two_b = torch::empty({7}),
                 one = torch::empty({100});
      group.recv(three, 0, 3);
      Work second_of_two =
          group.irecv(two_a, 0, 2);  // posted first: gets the first message of tag 2
      group.recv(one, 0, 1);
      group.recv(two_b, 0, 2);
      second_of_two.wait();
      EXPECT_TRUE(torch::equal(three, pattern(300, at::kFloat, 3)));
      EXPECT_TRUE(torch::equal(two_a, pattern(5, at::kFloat, 2)));
      EXPECT_TRUE(torch::equal(two_b, pattern(7, at::kFloat, 4)));
      EXPECT_TRUE(torch::equal(one, pattern(100, at::kFloat, 1)));
    }
  });
}

TEST(PointToPoint, SendCompletesWhileTheReceiverWaitsElsewhere) {
  RingSize ring(kTinyRing);
  // Rank 0's message is 40x the ring. If a send waited for its recv, rank 0 would block in wait()
  // while rank 1 waits for tag 2, which rank 0 sends only afterwards; the 20 s timeout would end
  // the test.
  run_group(
      2,
      [&](int rank, ProcessGroup& group) {
        at::Tensor big = pattern(2560, at::kFloat, 9);
        if (rank == 0) {
          group.isend(big, 1, /*tag=*/1).wait();
          group.send(torch::ones({3}), 1, /*tag=*/2);
          // And while rank 1 runs a collective, not a recv: its progress thread takes the message.
          group.isend(big, 1, /*tag=*/3).wait();
          at::Tensor sum = torch::ones({4});
          group.all_reduce(sum);
        } else {
          at::Tensor small = torch::empty({3});
          group.recv(small, 0, 2);
          at::Tensor sum = torch::ones({4});
          group.all_reduce(sum);
          at::Tensor first = torch::empty({2560}), second = torch::empty({2560});
          group.recv(first, 0, 1);
          group.recv(second, 0, 3);
          EXPECT_TRUE(torch::equal(first, big));
          EXPECT_TRUE(torch::equal(second, big));
        }
      },
      std::chrono::seconds(20));
}

TEST(PointToPoint, ManyMessagesInFlightEveryDirection) {
  RingSize ring(kTinyRing);
  const int world = 3, per_peer = 40;
  run_group(world, [&](int rank, ProcessGroup& group) {
    std::vector<Work> works;
    std::vector<at::Tensor> received;
    std::vector<at::Tensor> expected;
    for (int i = 0; i < per_peer; ++i) {
      for (int peer = 0; peer < world; ++peer) {
        if (peer == rank) continue;
        // Sizes vary with i; tags repeat (i % 4), so order within a tag matters too.
        works.push_back(
            group.isend(pattern(1 + 37 * i, at::kFloat, 100 * rank + peer + i), peer, i % 4));
        received.push_back(torch::empty({1 + 37 * i}));
        works.push_back(group.irecv(received.back(), peer, i % 4));
        expected.push_back(pattern(1 + 37 * i, at::kFloat, 100 * peer + rank + i));
      }
    }
    for (auto& w : works) w.wait();
    for (size_t k = 0; k < received.size(); ++k)
      EXPECT_TRUE(torch::equal(received[k], expected[k])) << k;
  });
}

std::string recv_error(at::Tensor sent, at::Tensor into, int tag) {
  std::string error;
  run_group(
      2,
      [&](int rank, ProcessGroup& group) {
        if (rank == 0) {
          group.send(sent, 1, tag);  // completes: the receiver consumes the message it rejects
        } else {
          try {
            group.recv(into, 0, tag);
            error = "no error";
          } catch (const UsageError& e) {
            error = e.what();
          }
          // The group is broken now: later calls fail at once.
          EXPECT_THROW(group.recv(into, 0, tag), CommError);
        }
      },
      std::chrono::seconds(20));
  return error;
}

TEST(PointToPoint, SizeOrDtypeMismatchIsAUsageErrorNamingBothRanksAndTheTag) {
  std::string error = recv_error(torch::ones({10}), torch::empty({12}), 4);
  EXPECT_EQ(
      error.find(
          "rank 1/2: recv with rank 0 on group 'default' (tag 4): the message holds 10 elements "
          "of Float (40 bytes) but this recv expects 12 elements of Float (48 bytes)"),
      0u)
      << error;
  error = recv_error(torch::ones({10}), torch::empty({10}, torch::kFloat64), 6);
  EXPECT_NE(
      error.find(
          "(tag 6): the message holds 10 elements of Float (40 bytes) but this recv expects 10 "
          "elements of Double (80 bytes)"),
      std::string::npos)
      << error;
}

TEST(PointToPoint, PeerThatDestroysItsGroupIsReportedWithoutTheTimeout) {
  std::string error;
  run_group(
      2,
      [&](int rank, ProcessGroup& group) {
        if (rank == 1) return;  // leaves: its group is destroyed, no message sent
        at::Tensor t = torch::empty({4});
        try {
          group.recv(t, 1, 8);
          error = "no error";
        } catch (const PeerLostError& e) {
          error = e.what();
        } catch (const CommError& e) {
          error =
              std::string("not a PeerLostError: ") + e.what();  // a timeout would come after 60 s
        }
      },
      std::chrono::seconds(60));
  EXPECT_TRUE(std::regex_search(
      error,
      std::regex(
          "^rank 0/2: recv with rank 1 on group 'default' failed after [0-9.]+ s \\(group "
          "rank 1 destroyed its group\\); rank 1 did not post the matching send \\(tag 8\\)")))
      << error;
}

TEST(PointToPoint, RecvTimeoutNamesThePeerAndTag) {
  for (bool shared_memory : {true, false}) {
    std::string error;
    std::atomic<bool> done{false};
    run_group(
        2,
        [&](int rank, ProcessGroup& group) {
          if (rank == 1) {  // alive, but never sends
            while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
            return;
          }
          at::Tensor t = torch::empty({4});
          CollectiveOptions short_wait;
          short_wait.timeout = std::chrono::milliseconds(300);
          try {
            group.recv(t, 1, 11, short_wait);
          } catch (const TimeoutError& e) {
            error = e.what();
          }
          done = true;
        },
        std::chrono::seconds(60), shared_memory);
    EXPECT_EQ(error.find(
                  "rank 0/2: recv with rank 1 on group 'default' timed out after 0.3 s; rank 1 did "
                  "not post the matching send (tag 11)"),
              0u)
        << (shared_memory ? "shared memory: " : "Gloo: ") << error;
  }
}

TEST(PointToPoint, WithoutSharedMemoryGoesThroughGloo) {
  // Both switches: InitOptions::shared_memory = false, and DTRAIN_SHM=0 in the environment.
  for (bool by_environment : {false, true}) {
    SCOPED_TRACE(by_environment ? "DTRAIN_SHM=0" : "InitOptions::shared_memory = false");
    struct Environment {  // restored whatever happens
      explicit Environment(bool set) {
        if (set) setenv("DTRAIN_SHM", "0", 1);
      }
      ~Environment() { unsetenv("DTRAIN_SHM"); }
    } environment(by_environment);
    const uint64_t before = detail::shm_p2p_messages_received();
    run_group(
        2,
        [&](int rank, ProcessGroup& group) {
          EXPECT_FALSE(group.uses_shared_memory());
          const int peer = 1 - rank;
          Work sent = group.isend(pattern(1000, at::kInt, rank), peer, 3);
          at::Tensor received = torch::empty({1000}, torch::kInt);
          group.recv(received, peer, 3);
          sent.wait();
          EXPECT_TRUE(torch::equal(received, pattern(1000, at::kInt, peer)));
        },
        std::chrono::seconds(60), /*shared_memory=*/by_environment);
    EXPECT_EQ(detail::shm_p2p_messages_received(), before);  // none went through shared memory
  }
}

}  // namespace
}  // namespace dtrain
