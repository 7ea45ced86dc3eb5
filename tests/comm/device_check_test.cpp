// The check that stands before NCCL: two ranks on one GPU of one host are one clear line naming the
// ranks, the device, the host and the ways out; the same device index on different hosts is fine.
// (The store exchange around it runs only in a CUDA build, on the first CUDA collective.)
#include "comm/device_check.h"

#include <gtest/gtest.h>

namespace dtrain::detail {
namespace {

TEST(DeviceCheck, OneRankPerDeviceAndHostPasses) {
  EXPECT_EQ(describe_shared_device({{0, "gpu1/boot-a", 0},
                                    {1, "gpu1/boot-a", 1},
                                    {2, "gpu2/boot-b", 0},
                                    {3, "gpu2/boot-b", 1}}),
            "");
}

TEST(DeviceCheck, TwoRanksOnOneGpuAreNamedWithTheHostAndTheWayOut) {
  const std::string message =
      describe_shared_device({{0, "gpu1/boot-a", 0}, {1, "gpu1/boot-a", 0}, {2, "gpu2/boot-b", 0}});
  EXPECT_NE(message.find("ranks 0 and 1 share cuda:0 on host gpu1,"), std::string::npos) << message;
  EXPECT_NE(message.find("cuda:LOCAL_RANK"), std::string::npos) << message;
  EXPECT_NE(message.find("DTRAIN_CUDA_BACKEND=gloo"), std::string::npos) << message;
  EXPECT_EQ(message.find("boot-a"), std::string::npos)
      << message;  // the boot id is for matching only
}

TEST(DeviceCheck, ThreeRanksOnOneGpuAreAllNamed) {
  const std::string message =
      describe_shared_device({{4, "h/x", 1}, {5, "h/x", 0}, {6, "h/x", 1}, {7, "h/x", 1}});
  EXPECT_NE(message.find("ranks 4, 6 and 7 share cuda:1 on host h,"), std::string::npos) << message;
}

// Same hostname, different machines (containers): the boot id tells them apart.
TEST(DeviceCheck, SameHostnameOnAnotherMachineIsNotASharedGpu) {
  EXPECT_EQ(describe_shared_device({{0, "node/boot-a", 0}, {1, "node/boot-b", 0}}), "");
}

// Slurm's --gpus-per-task and torchrun users give each process one GPU through
// CUDA_VISIBLE_DEVICES: every rank trains on cuda:0, of different GPUs. NCCL compares the GPUs' PCI
// addresses, and so does the check; the same GPU under two indices is still one GPU.
TEST(DeviceCheck, TheGpuIsItsPciAddressNotItsIndex) {
  EXPECT_EQ(describe_shared_device(
                {{0, "gpu1/boot-a", 0, "0000:1a:00"}, {1, "gpu1/boot-a", 0, "0000:1b:00"}}),
            "");
  const std::string message = describe_shared_device(
      {{0, "gpu1/boot-a", 1, "0000:1a:00"}, {1, "gpu1/boot-a", 0, "0000:1a:00"}});
  EXPECT_NE(message.find("ranks 0 and 1 share cuda:1 (PCI 0000:1a:00) on host gpu1,"),
            std::string::npos)
      << message;
}

// Before DDP or ZeRO starts: two thread ranks of one process training on one GPU would deadlock in
// backward (autograd's one thread per device), so they are one line; processes sharing a GPU,
// threads on GPUs of their own and threads on the CPU are fine.
TEST(DeviceCheck, ThreadRanksTrainingOnOneGpuAreNamedWithTheWayOut) {
  const std::string message =
      describe_threads_sharing_a_gpu({{0, 11, 0}, {1, 22, 0}, {2, 33, 1}, {3, 33, 1}});
  EXPECT_NE(message.find("ranks 2 and 3 are threads of one process training on cuda:1"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("one process per rank"), std::string::npos) << message;
  EXPECT_EQ(describe_threads_sharing_a_gpu({{0, 11, 0}, {1, 22, 0}}), "");    // two processes
  EXPECT_EQ(describe_threads_sharing_a_gpu({{0, 11, 0}, {1, 11, 1}}), "");    // a GPU each
  EXPECT_EQ(describe_threads_sharing_a_gpu({{0, 11, -1}, {1, 11, -1}}), "");  // on the CPU
  EXPECT_EQ(describe_threads_sharing_a_gpu({{0, 11, 0}, {1, 11, -1}}), "");   // one on the CPU
}

TEST(DeviceCheck, TheProcessIdIsStableAndNotNegative) {
  EXPECT_EQ(own_process_id(), own_process_id());
  EXPECT_GE(own_process_id(), 0);
}

}  // namespace
}  // namespace dtrain::detail
