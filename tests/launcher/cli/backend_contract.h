// The contract of a RendezvousBackend (launcher/elastic/rendezvous_backend.h), as gtest
// expectations that any backend must pass on a fresh job id: nothing stored at first; a write that
// expects nothing succeeds once; a write with a stale version loses and returns the winner;
// versions change on every write. Used for the in-memory test backend and the c10d store here
// (rendezvous_test.cpp) and for the etcd backend (tests/launcher/elastic/etcd_backend_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include "launcher/elastic/rendezvous_backend.h"

namespace dtrain::cli::testing_support {

inline void expect_backend_contract(elastic::RendezvousBackend& backend) {
  using Result = elastic::RendezvousBackend::SetResult;
  EXPECT_FALSE(backend.get_state().has_value()) << backend.name() << ": a fresh job has a state";

  Result first = backend.set_state("one", std::nullopt);
  EXPECT_TRUE(first.written);
  EXPECT_EQ(first.current.state, "one");
  EXPECT_NE(first.current.version, 0u);

  // Someone else created it first: a second "only if nothing is stored" loses.
  Result again = backend.set_state("other", std::nullopt);
  EXPECT_FALSE(again.written);
  EXPECT_EQ(again.current.state, "one");
  EXPECT_EQ(again.current.version, first.current.version);

  Result second = backend.set_state(std::string("two\0bytes", 9), first.current.version);
  EXPECT_TRUE(second.written);
  EXPECT_EQ(second.current.state, std::string("two\0bytes", 9));
  EXPECT_NE(second.current.version, first.current.version);

  // A stale version loses and sees the winner.
  Result stale = backend.set_state("three", first.current.version);
  EXPECT_FALSE(stale.written);
  EXPECT_EQ(stale.current.state, std::string("two\0bytes", 9));
  EXPECT_EQ(stale.current.version, second.current.version);

  std::optional<elastic::VersionedState> now = backend.get_state();
  ASSERT_TRUE(now.has_value());
  EXPECT_EQ(now->state, std::string("two\0bytes", 9));
  EXPECT_EQ(now->version, second.current.version);

  // A state of the size a large job's rendezvous reaches.
  std::string big(200000, 'x');
  Result large = backend.set_state(big, now->version);
  EXPECT_TRUE(large.written);
  EXPECT_EQ(backend.get_state()->state, big);
}

}  // namespace dtrain::cli::testing_support
