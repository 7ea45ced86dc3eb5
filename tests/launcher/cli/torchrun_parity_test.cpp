// `dtrain run` against torchrun 2.15: the same probe (a /bin/sh script that dumps its environment)
// runs under `python -m torch.distributed.run` (the python of support/system.h) and under `dtrain
// run` with the same flags, and every variable either launcher sets for its workers is compared,
// rank by rank and attempt by attempt. Variables both inherit from the test are not the launchers'
// doing and are left out. A variable torchrun sets must be set by dtrain too, and with the same
// value, except where the value is run-specific (ports, run ids, temporary paths: compared by
// shape) or the difference is intended (kIntendedDifferences, each with its reason, mirrored in
// `dtrain run --help` and doc/launcher.md). A variable only dtrain sets fails too, unless it is
// one of dtrain's own DTRAIN_*.
//
// Skips where no python imports torch. Each test starts torchrun once (a few seconds of Python
// start-up); every launch is bounded by kLaunchTimeout.
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "launcher/elastic/worker_group.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "test_support.h"

extern char** environ;

namespace {

using namespace dtrain::cli::testing_support;
using Env = std::map<std::string, std::string>;

// Python's start-up dominates (seconds on a loaded 2-core machine); the bound only turns a hang
// into a failure.
constexpr auto kLaunchTimeout = 120s;
constexpr int kWorkers = 2;

// Variables the person running the tests may have set (an outer launcher, a shell profile). They
// are removed from both launchers' environment, so that each one the workers see was set by a
// launcher.
constexpr const char* kLauncherVariables[] = {"RANK",
                                              "LOCAL_RANK",
                                              "WORLD_SIZE",
                                              "LOCAL_WORLD_SIZE",
                                              "GROUP_RANK",
                                              "GROUP_WORLD_SIZE",
                                              "ROLE_RANK",
                                              "ROLE_WORLD_SIZE",
                                              "ROLE_NAME",
                                              "MASTER_ADDR",
                                              "MASTER_PORT",
                                              "TORCHELASTIC_RESTART_COUNT",
                                              "TORCHELASTIC_MAX_RESTARTS",
                                              "TORCHELASTIC_RUN_ID",
                                              "TORCHELASTIC_USE_AGENT_STORE",
                                              "TORCHELASTIC_ERROR_FILE",
                                              "TORCHELASTIC_SIGNALS_TO_HANDLE",
                                              "TORCHELASTIC_ENABLE_FILE_TIMER",
                                              "TORCHELASTIC_TIMER_FILE",
                                              "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                              "OMP_NUM_THREADS",
                                              "DTRAIN_RDZV_TOKEN"};

// How a variable whose value is run-specific is compared; every other variable by value.
enum class Shape {
  kPort,       // MASTER_PORT: a port number, the same on every rank of a launch
  kRunId,      // equal values, or a uuid4 from each launcher where torchrun makes one up
  kErrorFile,  // .../attempt_<A>/<local rank>/error.json in a folder the worker can write
};
const std::map<std::string, Shape> kRunSpecific = {
    {"MASTER_PORT", Shape::kPort},
    {"TORCHELASTIC_RUN_ID", Shape::kRunId},
    {"TORCHELASTIC_ERROR_FILE", Shape::kErrorFile},
};

// Where dtrain run deliberately differs from torchrun 2.15 (also listed in `dtrain run --help` and
// doc/launcher.md's workers' environment).
struct IntendedDifference {
  enum class Kind {
    kDtrainValue,  // dtrain always sets `dtrain_value`, whatever torchrun says
    kSameHost,     // both name this machine (loopback), perhaps differently
    kNotSet,       // dtrain does not set it
  };
  Kind kind;
  const char* dtrain_value;
};
const std::map<std::string, IntendedDifference> kIntendedDifferences = {
    // torchrun names the store's host as its rendezvous saw it ("localhost" on one node); dtrain
    // gives the address the node is reached at (127.0.0.1 on one node). Same machine, same port.
    {"MASTER_ADDR", {IntendedDifference::Kind::kSameHost, nullptr}},
    // torchrun sets it when TORCHELASTIC_ENABLE_FILE_TIMER=1, for its FileTimerServer watchdog
    // (torch.distributed.elastic.timer); dtrain has no such watchdog. Not set in these tests.
    {"TORCHELASTIC_TIMER_FILE", {IntendedDifference::Kind::kNotSet, nullptr}},
};

bool is_uuid4(const std::string& text) {
  if (text.size() != 36 || text[14] != '4') return false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash != (text[i] == '-')) return false;
    if (!dash && std::strchr("0123456789abcdef", text[i]) == nullptr) return false;
  }
  return true;
}

bool is_port(const std::string& text) {
  if (text.empty() || text.size() > 5 ||
      text.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  int port = std::stoi(text);
  return port > 0 && port <= 65535;
}

// Whether every address `host` resolves to is a loopback one.
bool is_loopback_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool loopback = found != nullptr;
  for (addrinfo* at = found; at != nullptr; at = at->ai_next) {
    if (at->ai_family == AF_INET) {
      auto* address = reinterpret_cast<sockaddr_in*>(at->ai_addr);
      loopback &= (ntohl(address->sin_addr.s_addr) >> 24) == 127;
    } else if (at->ai_family == AF_INET6) {
      auto* address = reinterpret_cast<sockaddr_in6*>(at->ai_addr);
      loopback &= IN6_IS_ADDR_LOOPBACK(&address->sin6_addr) != 0;
    }
  }
  freeaddrinfo(found);
  return loopback;
}

// What one launcher gave one worker in one attempt: the variables it set (not inherited), and
// whether the folder of TORCHELASTIC_ERROR_FILE existed and was writable for the worker.
struct WorkerView {
  Env set;
  bool error_folder_writable = false;
};

class TorchrunParityTest : public testing::Test {
 protected:
  void SetUp() override {
    const std::string& python = dtrain::testing::python_with_torch();
    if (python.empty()) GTEST_SKIP() << dtrain::testing::kNoPythonWithTorch;
    // ChildProcess execs a path; the configured python may be a name on PATH.
    python_ = dtrain::elastic::find_executable(python);
    ASSERT_FALSE(python_.empty()) << python;
    for (const char* name : kLauncherVariables) unset_.emplace_back(name, std::nullopt);
    for (char** entry = environ; entry && *entry; ++entry) {
      std::string text = *entry;
      std::size_t equals = text.find('=');
      if (equals != std::string::npos) parent_[text.substr(0, equals)] = text.substr(equals + 1);
    }
    for (const char* name : kLauncherVariables) parent_.erase(name);
  }

  // Runs the probe under `launcher` (argv up to the program) and returns, per attempt, each local
  // rank's view. The probe fails every attempt before `failing_attempts`, so restarts are seen.
  std::vector<std::vector<WorkerView>> launch(const std::string& tag, const Args& launcher,
                                              int failing_attempts = 0) {
    // $1: folder, $2: tag, $3: attempts that fail. The folder test runs in the worker, as a
    // program's own write of the error file would. A failing attempt fails only once every rank
    // wrote its files (.done), since the first failure stops the other ranks; 30 s at most.
    const std::string probe =
        "a=$TORCHELASTIC_RESTART_COUNT; out=\"$1/$2.$LOCAL_RANK.$a\"; env > \"$out.env\"; "
        "folder=\"${TORCHELASTIC_ERROR_FILE%/*}\"; "
        "if [ -n \"$TORCHELASTIC_ERROR_FILE\" ] && [ -d \"$folder\" ] && [ -w \"$folder\" ]; then "
        ": > \"$out.writable\"; fi; "
        "[ \"$a\" -ge \"$3\" ] && exit 0; "
        ": > \"$out.done\"; i=0; "
        "while [ $(ls \"$1/$2\".*.\"$a\".done | wc -l) -lt \"$LOCAL_WORLD_SIZE\" ] && "
        "[ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done; exit 1";
    Args argv = launcher;
    for (const std::string& arg :
         {std::string("/bin/sh"), std::string("-c"), probe, std::string("sh"), dir_.path().string(),
          tag, std::to_string(failing_attempts)}) {
      argv.push_back(arg);
    }
    ChildProcess child(argv, dir_ / (tag + ".out"), dir_ / (tag + ".err"), unset_);
    bool exited = child.wait(kLaunchTimeout);
    std::string err = read_file(dir_ / (tag + ".err"));
    EXPECT_TRUE(exited) << tag << " did not exit within the time limit\n" << err;
    EXPECT_EQ(child.exit_code(), 0) << tag << " failed\n" << err;

    std::vector<std::vector<WorkerView>> attempts;
    for (int attempt = 0; attempt <= failing_attempts; ++attempt) {
      std::vector<WorkerView> ranks;
      for (int local_rank = 0; local_rank < kWorkers; ++local_rank) {
        std::string out =
            dir_ / (tag + "." + std::to_string(local_rank) + "." + std::to_string(attempt));
        EXPECT_TRUE(fs::exists(out + ".env"))
            << tag << ": local rank " << local_rank << " of attempt " << attempt << " did not run\n"
            << err;
        WorkerView view;
        for (const auto& [name, value] : parse_env(read_file(out + ".env"))) {
          auto inherited = parent_.find(name);
          if (inherited == parent_.end() || inherited->second != value) view.set[name] = value;
        }
        view.error_folder_writable = fs::exists(out + ".writable");
        ranks.push_back(std::move(view));
      }
      attempts.push_back(std::move(ranks));
    }
    return attempts;
  }

  Args torchrun(const Args& flags) const {
    Args argv = {python_, "-m", "torch.distributed.run"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--no-python");
    return argv;
  }

  Args dtrain(const Args& flags) const {
    Args argv = {DTRAIN_LAUNCHER, "run"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    return argv;
  }

  // Every variable of one attempt, one by one (see the file comment).
  void compare(const std::vector<WorkerView>& torchrun, const std::vector<WorkerView>& dtrain,
               int attempt) {
    for (int local_rank = 0; local_rank < kWorkers; ++local_rank) {
      SCOPED_TRACE("attempt " + std::to_string(attempt) + ", local rank " +
                   std::to_string(local_rank));
      const Env& theirs = torchrun[local_rank].set;
      const Env& ours = dtrain[local_rank].set;
      for (const auto& [name, value] : theirs) {
        auto intended = kIntendedDifferences.find(name);
        auto found = ours.find(name);
        if (intended != kIntendedDifferences.end() &&
            intended->second.kind == IntendedDifference::Kind::kNotSet) {
          EXPECT_EQ(found, ours.end()) << name << " is listed as not set by dtrain, but it is";
          continue;
        }
        if (found == ours.end()) {
          ADD_FAILURE() << "torchrun sets " << name << "=" << value
                        << " for its workers, dtrain run does not; set it in the launcher or list "
                           "it in kIntendedDifferences with the reason";
          continue;
        }
        const std::string& mine = found->second;
        if (intended != kIntendedDifferences.end()) {
          if (intended->second.kind == IntendedDifference::Kind::kDtrainValue) {
            EXPECT_EQ(mine, intended->second.dtrain_value)
                << name << " (torchrun: " << value << ")";
          } else {
            EXPECT_TRUE(mine == value || (is_loopback_host(mine) && is_loopback_host(value)))
                << name << ": dtrain " << mine << ", torchrun " << value
                << ": expected both to name this machine";
          }
          continue;
        }
        auto shape = kRunSpecific.find(name);
        if (shape == kRunSpecific.end()) {
          EXPECT_EQ(mine, value) << name << ": dtrain's value differs from torchrun's";
          continue;
        }
        switch (shape->second) {
          case Shape::kPort:
            EXPECT_TRUE(is_port(value) && is_port(mine))
                << name << ": dtrain " << mine << ", torchrun " << value;
            EXPECT_EQ(mine, dtrain[0].set.at(name)) << name << " differs between dtrain's ranks";
            break;
          case Shape::kRunId:
            if (is_uuid4(value)) {
              EXPECT_TRUE(is_uuid4(mine))
                  << name << ": torchrun made up a uuid4 (" << value << "), dtrain gave " << mine;
            } else {
              EXPECT_EQ(mine, value) << name;
            }
            EXPECT_EQ(mine, dtrain[0].set.at(name)) << name << " differs between dtrain's ranks";
            break;
          case Shape::kErrorFile: {
            std::string tail = "/attempt_" + std::to_string(attempt) + "/" +
                               std::to_string(local_rank) + "/error.json";
            for (const std::string* path : {&value, &mine}) {
              EXPECT_TRUE(path->starts_with("/") && path->ends_with(tail))
                  << name << "=" << *path << ": expected an absolute path ending in " << tail;
            }
            EXPECT_TRUE(torchrun[local_rank].error_folder_writable) << "torchrun's " << value;
            EXPECT_TRUE(dtrain[local_rank].error_folder_writable)
                << name << "=" << mine << ": its folder is missing or not writable for the worker";
            break;
          }
        }
      }
      for (const auto& [name, value] : ours) {
        if (theirs.count(name) != 0 || name.starts_with("DTRAIN_")) continue;
        EXPECT_TRUE(kIntendedDifferences.count(name) != 0)
            << "dtrain run sets " << name << "=" << value
            << ", torchrun does not; drop it or list it in kIntendedDifferences with the reason";
      }
    }
  }

  void compare_all(const std::vector<std::vector<WorkerView>>& torchrun,
                   const std::vector<std::vector<WorkerView>>& dtrain) {
    ASSERT_EQ(torchrun.size(), dtrain.size());
    for (std::size_t attempt = 0; attempt < torchrun.size(); ++attempt) {
      compare(torchrun[attempt], dtrain[attempt], static_cast<int>(attempt));
    }
  }

  TempDir dir_;
  std::string python_;
  EnvChanges unset_;
  Env parent_;
};

TEST_F(TorchrunParityTest, StandaloneSingleNode) {
  const Args flags = {"--standalone", "--nproc-per-node", std::to_string(kWorkers)};
  auto theirs = launch("torchrun", torchrun(flags));
  auto ours = launch("dtrain", dtrain(flags));
  compare_all(theirs, ours);
}

// A fixed master, a named run and a restart: attempt 0 fails, attempt 1 must look like torchrun's
// attempt 1 (TORCHELASTIC_RESTART_COUNT, a fresh error file).
TEST_F(TorchrunParityTest, StaticMasterAcrossARestart) {
  auto flags = [](int port) {
    return Args{"--nproc-per-node", std::to_string(kWorkers),
                "--master-addr",    "127.0.0.1",
                "--master-port",    std::to_string(port),
                "--rdzv-id",        "parity7",
                "--max-restarts",   "1"};
  };
  const int their_port = dtrain::testing::free_port();
  auto theirs = launch("torchrun", torchrun(flags(their_port)), /*failing_attempts=*/1);
  const int our_port = dtrain::testing::free_port();
  auto ours = launch("dtrain", dtrain(flags(our_port)), /*failing_attempts=*/1);
  compare_all(theirs, ours);
  // Run-specific in general, but here both launchers were told the port.
  for (const auto& [views, port] : {std::pair(&theirs, their_port), std::pair(&ours, our_port)}) {
    for (const auto& attempt : *views) {
      for (const WorkerView& worker : attempt) {
        EXPECT_EQ(worker.set.count("MASTER_PORT") ? worker.set.at("MASTER_PORT") : "",
                  std::to_string(port));
      }
    }
  }
}

// The elastic form, one node of at most two, over a c10d rendezvous on loopback.
TEST_F(TorchrunParityTest, ElasticRangeOverC10d) {
  auto flags = [](int port) {
    return Args{"--nnodes", "1:2", "--nproc-per-node", std::to_string(kWorkers), "--rdzv-backend",
                "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port),
                // The round starts 1 s after the first node instead of torchrun's 30 s.
                "--rdzv-conf", "last_call_timeout=1"};
  };
  auto theirs = launch("torchrun", torchrun(flags(dtrain::testing::free_port())));
  auto ours = launch("dtrain", dtrain(flags(dtrain::testing::free_port())));
  compare_all(theirs, ours);
}

}  // namespace
