// Failure paths of the communication layer: a rank that never joins a collective or the start-up
// rendezvous is named in the error, and bad launch environments are one-line UsageErrors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <tuple>

#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::run_ranks;
using testing::unique_store_name;

class TimeoutTransports : public ::testing::TestWithParam<bool> {};

TEST_P(TimeoutTransports, CollectiveNamesTheRankThatNeverJoined) {
  const int world = 3;
  const int absent = 2;
  std::string method = unique_store_name("timeout");
  std::vector<std::string> errors(world);
  std::atomic<int> finished{0};
  run_ranks(world, [&](int rank) {
    InitOptions options;
    options.init_method = method;
    options.rank = rank;
    options.world_size = world;
    options.shared_memory = GetParam();
    struct CountFinished {  // whatever happens to ranks 0 and 1, rank 2 must not wait forever
      std::atomic<int>& finished;
      int rank;
      ~CountFinished() {
        if (rank != absent) ++finished;
      }
    } count{finished, rank};
    // Start-up and the first two collectives run with the default timeout; only #3 is meant to time
    // out.
    auto group = init_process_group(options);
    at::Tensor t = torch::ones({10});
    group->all_reduce(t);    // #1: everyone
    group->broadcast(t, 0);  // #2: everyone
    if (rank == absent) {
      // Stay alive (and connected) until the others gave up, so this is "never joined", not "died".
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (finished.load() < world - 1 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return;
    }
    CollectiveOptions short_wait;
    short_wait.timeout = std::chrono::milliseconds(1500);
    try {
      group->all_reduce(t, ReduceOp::kSum, short_wait);  // #3: rank 2 never comes
      errors[rank] = "no error";
    } catch (const CommError& e) {
      errors[rank] =
          std::string(dynamic_cast<const TimeoutError*>(&e) ? "" : "not a TimeoutError: ") +
          e.what();
    }
    // The group is broken now: further calls fail at once instead of hanging.
    EXPECT_THROW(group->barrier(), CommError);
  });
  for (int rank = 0; rank < world; ++rank) {
    if (rank == absent) continue;
    const std::string& e = errors[rank];
    SCOPED_TRACE(e);
    EXPECT_EQ(e.find("rank " + std::to_string(rank) +
                     "/3: all_reduce #3 on group 'default' timed out after 1.5 s"),
              0u);
    const std::string seen = "ranks {2} never joined (rank 2 last seen at broadcast #2, ";
    const size_t at = e.find(seen);
    ASSERT_NE(at, std::string::npos);
    // Rank 2 has not moved on since broadcast #2: at least the 1.5 s the others waited for it.
    const double age = std::atof(e.c_str() + at + seen.size());
    EXPECT_GE(age, 1.4);
    EXPECT_LT(age, 60.0);
    EXPECT_EQ(e.find(" s ago)", at),
              at + seen.size() + std::to_string(static_cast<int>(age)).size() + 2);
    EXPECT_NE(e.find("DTRAIN_DEBUG=detail"), std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(SharedMemoryAndGloo, TimeoutTransports, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "SharedMemory" : "Gloo";
                         });

TEST(Timeouts, StartupNamesTheRanksThatNeverCame) {
  std::string method = unique_store_name("startup");
  std::string error;
  // Only ranks 0 and 2 of 4 start.
  run_ranks(2, [&](int thread) {
    InitOptions options;
    options.init_method = method;
    options.rank = thread * 2;
    options.world_size = 4;
    options.timeout = std::chrono::milliseconds(500);
    try {
      init_process_group(options);
    } catch (const TimeoutError& e) {
      if (thread == 0) error = e.what();
    }
  });
  EXPECT_NE(
      error.find("rank 0/4: creating group 'default' of 4 ranks timed out after 0.5 s; ranks {1,3} "
                 "never joined"),
      std::string::npos)
      << error;
}

TEST(Timeouts, RecvNamesThePeer) {
  std::string method = unique_store_name("p2p");
  std::string error;
  std::atomic<bool> done{false};
  run_ranks(2, [&](int rank) {
    InitOptions options;
    options.init_method = method;
    options.rank = rank;
    options.world_size = 2;
    auto group = init_process_group(options);  // default timeout for start-up on a loaded machine
    if (rank == 0) {
      struct SetDone {
        std::atomic<bool>& done;
        ~SetDone() { done = true; }
      } set_done{done};
      at::Tensor t = torch::empty({4});
      try {
        CollectiveOptions short_wait;
        short_wait.timeout = std::chrono::milliseconds(800);
        group->recv(t, 1, 3, short_wait);
      } catch (const TimeoutError& e) {
        error = e.what();
      }
    } else {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!done && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  });
  EXPECT_NE(
      error.find(
          "rank 0/2: recv with rank 1 on group 'default' timed out after 0.8 s; rank 1 did not "
          "post the matching send"),
      std::string::npos)
      << error;
}

// ---- the launch environment ----

LaunchInfo from(const std::map<std::string, std::string>& env) {
  return launch_info_from_env([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string usage_error(const std::map<std::string, std::string>& env) {
  try {
    from(env);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "no error";
}

TEST(LaunchEnv, TorchrunVariables) {
  LaunchInfo info = from({{"RANK", "5"},
                          {"WORLD_SIZE", "8"},
                          {"LOCAL_RANK", "1"},
                          {"LOCAL_WORLD_SIZE", "4"},
                          {"GROUP_RANK", "1"},
                          {"MASTER_ADDR", "10.0.0.1"},
                          {"MASTER_PORT", "29400"}});
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.master_addr, "10.0.0.1");
  EXPECT_EQ(info.master_port, 29400);
}

TEST(LaunchEnv, SlurmVariables) {
  LaunchInfo info = from({{"SLURM_PROCID", "3"},
                          {"SLURM_NTASKS", "4"},
                          {"SLURM_LOCALID", "1"},
                          {"SLURM_NNODES", "2"},
                          {"SLURM_NODEID", "1"},
                          {"SLURM_STEP_NODELIST", "gpu[07-08]"},
                          {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 15000 + 123456 % 20000);
}

TEST(LaunchEnv, OpenMpiVariables) {
  LaunchInfo info = from({{"OMPI_COMM_WORLD_RANK", "2"},
                          {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                          {"MASTER_ADDR", "head"},
                          {"MASTER_PORT", "29500"}});
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.master_addr, "head");
}

TEST(LaunchEnv, NoLauncherIsAWorldOfOne) {
  LaunchInfo info = from({});
  EXPECT_EQ(info.source, "none");
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.rank, 0);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EXPECT_NE(usage_error({{"RANK", "abc"}, {"WORLD_SIZE", "2"}})
                .find("RANK='abc': expected an integer in 0..1"),
            std::string::npos);
  EXPECT_NE(usage_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK='2'"), std::string::npos);
  EXPECT_NE(usage_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE='0'"),
            std::string::npos);
  EXPECT_NE(usage_error({{"RANK", "0"}}).find("WORLD_SIZE=''"), std::string::npos);
  EXPECT_NE(usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT='70000': expected a TCP port"),
            std::string::npos);
  EXPECT_NE(usage_error({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "x"}}).find("SLURM_NTASKS='x'"),
            std::string::npos);
}

TEST(LaunchEnv, BadDtrainVariablesAreUsageErrors) {
  InitOptions options;
  options.init_method = unique_store_name("env");
  options.rank = 0;
  options.world_size = 1;
  for (auto [name, value, expected] :
       {std::tuple<const char*, const char*, const char*>{"DTRAIN_SHM", "yes",
                                                          "DTRAIN_SHM='yes': expected 0"},
        {"DTRAIN_TIMEOUT_S", "soon", "DTRAIN_TIMEOUT_S='soon': expected a positive"},
        {"GLOO_SOCKET_IFNAME", "no-such-if0", "GLOO_SOCKET_IFNAME='no-such-if0'"}}) {
    setenv(name, value, 1);
    try {
      init_process_group(options);
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    unsetenv(name);
  }
}

TEST(LaunchEnv, MissingMasterAddressIsAUsageError) {
  InitOptions options;
  options.rank = 0;
  options.world_size = 2;
  options.init_method = "tcp://nohost";
  EXPECT_THROW(init_process_group(options), UsageError);
  options.init_method = "smoke-signals://";
  try {
    init_process_group(options);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("expected env://, tcp://HOST:PORT"), std::string::npos);
  }
}

}  // namespace
}  // namespace dtrain
