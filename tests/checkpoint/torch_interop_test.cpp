// Replicated checkpoints and PyTorch (Note [Checkpoint file] in dtrain/checkpoint.h): PyTorch's
// torch.load(weights_only=True) opens what dtrain saved and, loaded into PyTorch's own model and
// optimizer, takes the next step exactly as dtrain does; dtrain loads what PyTorch saved with
// torch.save (its state dicts as they are) and takes the next step exactly as PyTorch does; a
// byte flipped in a PyTorch-written file is caught by the zip's CRC-32s. For each optimizer whose
// state dtrain writes in Python's form. The PyTorch side is tests/python/checkpoint_interop.py.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <memory>

#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
namespace optim = torch::optim;

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5),
                               torch::nn::ReLU(), torch::nn::Linear(5, 3));
}

void step(torch::nn::Sequential& model, optim::Optimizer& optimizer, const at::Tensor& x) {
  optimizer.zero_grad();
  model->forward(x).pow(2).mean().backward();
  optimizer.step();
}

double max_difference(torch::nn::Module& a, torch::nn::Module& b) {
  auto theirs = b.named_parameters();
  auto their_buffers = b.named_buffers();
  double worst = 0;
  for (const auto& item : a.named_parameters()) {
    worst = std::max(worst, (item.value() - theirs[item.key()]).abs().max().item<double>());
  }
  for (const auto& item : a.named_buffers()) {
    worst =
        std::max(worst, (item.value().to(at::kDouble) - their_buffers[item.key()].to(at::kDouble))
                            .abs()
                            .max()
                            .item<double>());
  }
  return worst;
}

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(torch::nn::Sequential&)>;

// dtrain trains 3 steps and saves; PyTorch loads, steps, compares and saves; dtrain loads that,
// steps and compares.
void expect_round_trip_through_pytorch(const std::string& name, const MakeOptimizer& make) {
  const std::string python = testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  const std::string dtrain_dir = testing::temp_dir("dtrain-interop-" + name);
  const std::string python_dir = dtrain_dir + "/from-python";

  torch::manual_seed(3);
  auto model = make_model();
  auto optimizer = make(model);
  for (int i = 0; i < 3; ++i) step(model, *optimizer, torch::randn({8, 6}));
  DistributedSampler sampler(100, 2, 0);
  sampler.set_epoch(2);
  sampler.advance(24);
  amp::GradScaler scaler(amp::GradScalerOptions{1024.0});
  TrainingState state{model.get(), optimizer.get(), &sampler, &scaler};
  state.step = 3;
  state.values["optimizer"] = name;
  state.tensors["batch4"] = torch::randn({8, 6});
  {
    // What the generator draws next, after the state is saved: the checkpoint holds the state of
    // before this draw (save() reads it before anything else draws).
    auto generator = at::detail::getDefaultCPUGenerator();
    at::Tensor rng = generator.get_state();
    state.tensors["rng_next"] = torch::rand({4});
    generator.set_state(rng);
  }
  CheckpointOptions options;
  options.dir = dtrain_dir;
  Checkpointer(options).save(state);
  step(model, *optimizer, state.tensors["batch4"]);
  options.prefix = "expected";
  TrainingState after_step_4{model.get()};
  after_step_4.step = 4;
  Checkpointer(options).save(after_step_4);

  auto result =
      testing::run_command(python + " " + DTRAIN_SOURCE_DIR +
                           "/tests/python/checkpoint_interop.py " + dtrain_dir + " " + python_dir);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("interop ok"), std::string::npos) << result.output;

  // PyTorch's checkpoint-4: model and optimizer as PyTorch's state_dict() gave them. Its
  // checkpoint-6 has a flipped byte and is skipped.
  torch::manual_seed(77);
  auto restored = make_model();
  auto restored_optimizer = make(restored);
  DistributedSampler restored_sampler(100, 2, 0);
  TrainingState into{restored.get(), restored_optimizer.get(), &restored_sampler};
  options.dir = python_dir;
  options.prefix = "checkpoint";
  auto loaded = Checkpointer(options).load_latest(into);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 4);
  ASSERT_EQ(loaded->skipped.size(), 1u);
  EXPECT_EQ(fs::path(loaded->skipped[0]).filename(), "checkpoint-6.ckpt");
  EXPECT_EQ(restored_sampler.state().epoch, 2);
  EXPECT_EQ(restored_sampler.state().samples_consumed, 32);
  EXPECT_LE(max_difference(*restored, *model), 1e-6);
  step(restored, *restored_optimizer, into.tensors.at("batch5"));

  auto expected = make_model();
  TrainingState expected_state{expected.get()};
  options.prefix = "expected";
  auto expected_loaded = Checkpointer(options).load_latest(expected_state);
  ASSERT_TRUE(expected_loaded.has_value());
  EXPECT_EQ(expected_loaded->step, 5);  // the file's name says it: the file holds no step
  EXPECT_LE(max_difference(*restored, *expected), 1e-6)
      << name << ": dtrain's step 5 from PyTorch's checkpoint differs from PyTorch's";
  fs::remove_all(dtrain_dir);
}

TEST(CheckpointInterop, SgdWithNesterovMomentum) {
  expect_round_trip_through_pytorch("SGD", [](torch::nn::Sequential& m) {
    return std::make_unique<optim::SGD>(m->parameters(),
                                        optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
  });
}

TEST(CheckpointInterop, AdamWithAmsgrad) {
  expect_round_trip_through_pytorch("Adam", [](torch::nn::Sequential& m) {
    return std::make_unique<optim::Adam>(m->parameters(),
                                         optim::AdamOptions(0.01).amsgrad(true).weight_decay(0.1));
  });
}

TEST(CheckpointInterop, AdamWInTwoParameterGroups) {
  expect_round_trip_through_pytorch("AdamW", [](torch::nn::Sequential& m) {
    std::vector<optim::OptimizerParamGroup> groups;
    auto params = m->parameters();
    groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + 2),
                        std::make_unique<optim::AdamWOptions>(optim::AdamWOptions(0.01)));
    groups.emplace_back(std::vector<at::Tensor>(params.begin() + 2, params.end()),
                        std::make_unique<optim::AdamWOptions>(
                            optim::AdamWOptions(0.02).betas({0.8, 0.95}).weight_decay(0.0)));
    return std::make_unique<optim::AdamW>(std::move(groups));
  });
}

TEST(CheckpointInterop, Adagrad) {
  expect_round_trip_through_pytorch("Adagrad", [](torch::nn::Sequential& m) {
    return std::make_unique<optim::Adagrad>(m->parameters(),
                                            optim::AdagradOptions(0.05).lr_decay(0.01));
  });
}

TEST(CheckpointInterop, CenteredRmspropWithMomentum) {
  expect_round_trip_through_pytorch("RMSprop", [](torch::nn::Sequential& m) {
    return std::make_unique<optim::RMSprop>(
        m->parameters(), optim::RMSpropOptions(0.01).momentum(0.5).centered(true));
  });
}

// A model trained by dtrain's trainer, evaluated in PyTorch from its checkpoint alone
// (tests/python/evaluate_trainer_checkpoint.py), scores what the trainer reported. Untrained
// weights score about 0.1; two predictions of 10000 may flip on summation order.
TEST(CheckpointInterop, PyTorchEvaluatesTheTrainersModelToItsAccuracy) {
  const std::string python = testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << testing::kNoPythonWithTorch;
  if (!testing::have_fashion_mnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string dir = testing::temp_dir("dtrain-interop-trainer");
  auto trained = testing::run_command(testing::bin("train_fashion_mnist") +
                                      " --max-steps 300 --checkpoint-dir " + dir);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const double reported = testing::json_number(trained.output, "test_accuracy");
  ASSERT_GT(reported, 0.5) << trained.output;
  auto evaluated = testing::run_command(python + " " + DTRAIN_SOURCE_DIR +
                                        "/tests/python/evaluate_trainer_checkpoint.py " + dir +
                                        "/checkpoint-300.ckpt " + testing::fashion_mnist_dir());
  ASSERT_EQ(evaluated.exit_code, 0) << evaluated.output;
  const auto at = evaluated.output.rfind("accuracy ");
  ASSERT_NE(at, std::string::npos) << evaluated.output;
  EXPECT_NEAR(std::stod(evaluated.output.substr(at + 9)), reported, 2e-4) << evaluated.output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtrain
