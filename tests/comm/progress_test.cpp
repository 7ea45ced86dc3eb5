// The progress records that name the ranks missing from a failed collective (src/comm/progress.h),
// when the store that holds them is gone: rank 0 hosts it, and its death is the common case.
#include "comm/progress.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace dtrain::detail {
namespace {

// The sentence goes into every peer's one-line error: the store's failure in it must be c10d's
// message alone, without the C++ backtrace that c10::Error::what() carries.
TEST(Progress, AStoreThatDiedIsOneLineWithoutABacktrace) {
  c10d::TCPStoreOptions server_options;
  server_options.port = 0;  // a free one
  server_options.isServer = true;
  server_options.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", server_options);
  c10d::TCPStoreOptions client_options;
  client_options.port = server->getPort();
  client_options.timeout = std::chrono::seconds(2);
  auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", client_options);
  ProgressTracker progress(client, /*group_rank=*/1, /*group_size=*/2);
  const uint64_t seq = progress.begin("allreduce");
  server.reset();  // rank 0, and the store with it

  const std::string missing = progress.describe_missing(seq, {0, 1}, /*let_peers_post=*/false);
  EXPECT_EQ(missing.rfind("the store could not be read to find the missing ranks (", 0), 0u)
      << missing;
  EXPECT_NE(missing.find("rank 0 hosts it and may have died"), std::string::npos) << missing;
  EXPECT_EQ(missing.find('\n'), std::string::npos) << missing;
  EXPECT_EQ(missing.find("frame #"), std::string::npos) << missing;
}

}  // namespace
}  // namespace dtrain::detail
