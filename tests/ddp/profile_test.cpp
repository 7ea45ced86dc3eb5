// DTRAIN_PROFILE's per-step records for DDP: every field present and sane, and the breakdown adds
// up (forward + backward + exposed communication + optimizer + other is the step) on a run whose
// communication has a known artificial delay that backward cannot hide.
#include "dtrain/profile.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "dtrain/ddp.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::run_group;

constexpr auto kDelay = std::chrono::milliseconds(40);

// The plain all-reduce, then a fixed wait at the end of backward: communication that nothing hides.
class SlowHook : public CommHook {
 public:
  void start(ProcessGroup& group, GradBucket& bucket) override {
    if (static_cast<size_t>(bucket.index) >= works_.size()) works_.resize(bucket.index + 1);
    works_[bucket.index] = group.all_reduce_async(*bucket.buffer);
  }
  void finish(ProcessGroup& group, GradBucket& bucket) override {
    works_[bucket.index].wait();
    if (bucket.index == 0) std::this_thread::sleep_for(kDelay);
  }

 private:
  std::vector<Work> works_;
};

// Sets DTRAIN_PROFILE for the scope of a test and puts back whatever was there before.
struct ProfileTo {
  explicit ProfileTo(std::string file) : path(std::move(file)) {
    if (const char* old = std::getenv("DTRAIN_PROFILE")) previous = old;
    setenv("DTRAIN_PROFILE", path.c_str(), 1);
  }
  ~ProfileTo() {
    if (previous) {
      setenv("DTRAIN_PROFILE", previous->c_str(), 1);
    } else {
      unsetenv("DTRAIN_PROFILE");
    }
    std::filesystem::remove(path);
  }
  std::vector<nlohmann::json> records() const {
    std::vector<nlohmann::json> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  std::string path;
  std::optional<std::string> previous;
};

// Runs `steps` DDP steps of an MLP on 2 thread-ranks, 8 samples each.
void train(int steps, bool mark_optimizer, std::shared_ptr<CommHook> (*make_hook)()) {
  run_group(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    torch::manual_seed(1);
    torch::nn::Sequential net(torch::nn::Linear(20, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 4));
    DistributedDataParallelOptions options;
    options.first_bucket_cap_bytes = 4096;  // two buckets
    if (make_hook) options.comm_hook = make_hook();
    DistributedDataParallel<torch::nn::SequentialImpl> ddp(net.ptr(), group, options);
    torch::optim::SGD optimizer(net->parameters(), 0.01);
    at::Tensor x = torch::randn({8, 20}), y = torch::randint(0, 4, {8});
    for (int s = 0; s < steps; ++s) {
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
      if (mark_optimizer) {
        ProfileOptimizerStep timed;
        optimizer.step();
      } else {
        optimizer.step();
      }
    }
  });
}

int64_t parameter_bytes() { return (20 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4) * 4; }

TEST(DdpProfile, BreakdownAddsUpWithAKnownCommunicationDelay) {
  ProfileTo profile(testing::temp_dir("ddp-profile") + ".jsonl");
  const int steps = 6;
  train(steps, /*mark_optimizer=*/true,
        [] { return std::shared_ptr<CommHook>(std::make_shared<SlowHook>()); });
  auto records = profile.records();
  // Every step of both ranks: the last one too, since its optimizer step was marked.
  ASSERT_EQ(records.size(), size_t{2 * steps});
  int per_rank[2] = {0, 0};
  const double delay = std::chrono::duration<double>(kDelay).count();
  for (const auto& r : records) {
    SCOPED_TRACE(r.dump());
    for (const char* field :
         {"rank", "world_size", "strategy", "step", "step_s", "forward_s", "backward_s",
          "exposed_comm_s", "optimizer_s", "comm_s", "comm_bytes", "comm_ops", "samples", "time"}) {
      ASSERT_TRUE(r.contains(field)) << field;
    }
    int rank = r["rank"];
    ASSERT_TRUE(rank == 0 || rank == 1);
    EXPECT_EQ(r["step"].get<int>(), per_rank[rank]++);
    EXPECT_EQ(r["world_size"], 2);
    EXPECT_EQ(r["strategy"], "ddp");
    EXPECT_EQ(r["samples"], 8);
    EXPECT_EQ(r["comm_bytes"].get<int64_t>(), parameter_bytes());  // the two buckets' all-reduces
    EXPECT_EQ(r["comm_ops"], 2);
    EXPECT_TRUE(r["optimizer_marked"].get<bool>());
    double step = r["step_s"], forward = r["forward_s"], backward = r["backward_s"];
    double exposed = r["exposed_comm_s"], optimizer = r["optimizer_s"];
    EXPECT_GT(forward, 0);
    EXPECT_GT(backward, 0);
    EXPECT_GT(optimizer, 0);
    EXPECT_GT(r["comm_s"].get<double>(), 0);
    // The hook's wait is exposed communication, not backward.
    EXPECT_GE(exposed, delay);
    // The phases and the rest (between backward and the optimizer, after it) partition the step;
    // how large each is depends on the machine, so only the accounting is checked here.
    double other = r["other_s"];
    EXPECT_GE(other, 0);
    EXPECT_NEAR(forward + backward + exposed + optimizer + other, step, 1e-8);
    EXPECT_GT(r["time"].get<double>(), 1.7e9);
  }
}

TEST(DdpProfile, WithoutAMarkTheOptimizerIsTheTimeAfterBackwardAndTheLastStepIsNotWritten) {
  ProfileTo profile(testing::temp_dir("ddp-profile") + ".jsonl");
  train(4, /*mark_optimizer=*/false, nullptr);
  auto records = profile.records();
  ASSERT_EQ(records.size(), size_t{2 * 3});  // a step is written when the next begins
  for (const auto& r : records) {
    SCOPED_TRACE(r.dump());
    EXPECT_FALSE(r["optimizer_marked"].get<bool>());
    EXPECT_EQ(r["other_s"].get<double>(), 0.0);
    double sum = r["forward_s"].get<double>() + r["backward_s"].get<double>() +
                 r["exposed_comm_s"].get<double>() + r["optimizer_s"].get<double>();
    EXPECT_NEAR(sum, r["step_s"].get<double>(), 1e-6);
    EXPECT_EQ(r["comm_bytes"].get<int64_t>(), parameter_bytes());
  }
}

TEST(DdpProfile, OffByDefault) {
  // Without the variable nothing is recorded anywhere: not in the working directory (run in an
  // empty one), not on stdout or stderr.
  std::optional<std::string> previous;
  if (const char* old = std::getenv("DTRAIN_PROFILE")) previous = old;
  unsetenv("DTRAIN_PROFILE");
  EXPECT_FALSE(profiling_enabled());
  std::filesystem::path dir = testing::temp_dir("ddp-profile-off");
  std::filesystem::create_directories(dir);
  std::filesystem::path cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir);
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  train(2, true, nullptr);
  std::string out = ::testing::internal::GetCapturedStdout();
  std::string err = ::testing::internal::GetCapturedStderr();
  std::filesystem::current_path(cwd);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  EXPECT_EQ(out.find("step_s"), std::string::npos) << out;
  EXPECT_EQ(err.find("step_s"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
  if (previous) setenv("DTRAIN_PROFILE", previous->c_str(), 1);
}

TEST(DdpProfile, AnUnwritableFileIsAUsageErrorNamingTheVariable) {
  ProfileTo profile("/nonexistent-dir/profile.jsonl");
  try {
    train(1, false, nullptr);
    ADD_FAILURE() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_PROFILE='/nonexistent-dir/profile.jsonl'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dtrain
