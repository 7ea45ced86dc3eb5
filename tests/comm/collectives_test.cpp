// Tier-1 tests of dtrain's collectives: ranks as threads over one in-memory store, world sizes
// 1..5, buffer sizes that do not divide evenly by the world size.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <fstream>
#include <string>

#include "support/thread_ranks.h"

namespace dtrain {
namespace {

using testing::run_group;

// World sizes and element counts swept by every collective test (1 and primes catch remainder
// bugs).
const std::vector<int> kWorldSizes = {1, 2, 3, 4, 5};
const std::vector<int64_t> kCounts = {1, 7, 1000, 12347};

// The value rank r contributes at element i: distinct per rank and element, exact in float32.
at::Tensor contribution(int rank, int64_t count) {
  return torch::arange(count, torch::kFloat32) + 1000.0f * static_cast<float>(rank + 1);
}

// Both all-reduce transports: shared memory (ranks on one host, the default) and Gloo.
class AllReduceTransports : public ::testing::TestWithParam<bool> {};

TEST_P(AllReduceTransports, SumAverageMinMax) {
  for (int world : kWorldSizes) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_group(
        world,
        [&](int rank, ProcessGroup& group) {
          for (int64_t count : kCounts) {
            at::Tensor expected_sum = torch::zeros({count});
            for (int r = 0; r < world; ++r) expected_sum += contribution(r, count);

            at::Tensor sum = contribution(rank, count);
            group.all_reduce(sum);
            EXPECT_TRUE(torch::equal(sum, expected_sum)) << "sum, count " << count;

            at::Tensor average = contribution(rank, count);
            group.all_reduce(average, ReduceOp::kAvg);
            EXPECT_TRUE(torch::allclose(average, expected_sum / world))
                << "average, count " << count;

            at::Tensor max = contribution(rank, count);
            group.all_reduce(max, ReduceOp::kMax);
            EXPECT_TRUE(torch::equal(max, contribution(world - 1, count)));

            at::Tensor min = contribution(rank, count);
            group.all_reduce(min, ReduceOp::kMin);
            EXPECT_TRUE(torch::equal(min, contribution(0, count)));
          }
        },
        std::chrono::seconds(60), GetParam());
  }
}

TEST_P(AllReduceTransports, LargerThanOneChunkAndEveryRankBitIdentical) {
  // 2.5 shared-memory chunks of float32 plus an odd tail; doubles and int64 too.
  const int64_t count = (int64_t{5} << 20) / 2 / 4 * 2 + 3;
  run_group(
      3,
      [&](int rank, ProcessGroup& group) {
        at::Tensor mine = torch::linspace(-1, 1, count) * (rank + 1) / 7.0;
        at::Tensor sum = mine.clone();
        group.all_reduce(sum);
        at::Tensor expected = torch::linspace(-1, 1, count) * 6 / 7.0;
        EXPECT_TRUE(torch::allclose(sum, expected, 1e-5, 1e-6));
        std::vector<at::Tensor> everyone(3);
        for (auto& t : everyone) t = torch::empty_like(sum);
        group.all_gather(everyone, sum);
        for (auto& t : everyone) EXPECT_TRUE(torch::equal(t, sum)) << "ranks disagree bit for bit";
        at::Tensor longs = torch::full({1000003}, int64_t{rank + 1}, torch::kInt64);
        group.all_reduce(longs, ReduceOp::kProduct);
        EXPECT_EQ(longs[1000002].item<int64_t>(), 6);
        at::Tensor doubles = torch::full({777}, 0.5 * (rank + 1), torch::kFloat64);
        group.all_reduce(doubles, ReduceOp::kAvg);
        EXPECT_DOUBLE_EQ(doubles[776].item<double>(), 1.0);
      },
      std::chrono::seconds(60), GetParam());
}

INSTANTIATE_TEST_SUITE_P(SharedMemoryAndGloo, AllReduceTransports, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "SharedMemory" : "Gloo";
                         });

TEST(Collectives, AsyncAllReducesOverlapAndComplete) {
  run_group(3, [&](int rank, ProcessGroup& group) {
    std::vector<at::Tensor> buckets;
    std::vector<Work> works;
    for (int b = 0; b < 4; ++b) {
      buckets.push_back(torch::full({1001 + b}, static_cast<float>(rank + b)));
      works.push_back(group.all_reduce_async(buckets.back()));
    }
    for (int b = 0; b < 4; ++b) {
      works[b].wait();
      EXPECT_TRUE(works[b].is_completed());
      // ranks 0,1,2 contribute b, b+1, b+2.
      EXPECT_TRUE(torch::equal(buckets[b], torch::full({1001 + b}, static_cast<float>(3 * b + 3))));
    }
  });
}

TEST(Collectives, BroadcastFromEveryRoot) {
  for (int world : kWorldSizes) {
    run_group(world, [&](int rank, ProcessGroup& group) {
      for (int root = 0; root < world; ++root) {
        at::Tensor tensor = contribution(rank, 12347);
        group.broadcast(tensor, root);
        EXPECT_TRUE(torch::equal(tensor, contribution(root, 12347)))
            << "world " << world << " root " << root;
      }
    });
  }
}

TEST(Collectives, AllGatherAndReduceScatter) {
  for (int world : kWorldSizes) {
    run_group(world, [&](int rank, ProcessGroup& group) {
      for (int64_t count : kCounts) {
        std::vector<at::Tensor> gathered(world);
        for (auto& t : gathered) t = torch::empty({count});
        group.all_gather(gathered, contribution(rank, count));
        for (int r = 0; r < world; ++r)
          EXPECT_TRUE(torch::equal(gathered[r], contribution(r, count)));

        // inputs[j] on rank r is contribution(r * world + j): rank j receives the sum over r.
        std::vector<at::Tensor> inputs;
        for (int j = 0; j < world; ++j) inputs.push_back(contribution(rank * world + j, count));
        at::Tensor output = torch::empty({count});
        group.reduce_scatter(output, inputs);
        at::Tensor expected = torch::zeros({count});
        for (int r = 0; r < world; ++r) expected += contribution(r * world + rank, count);
        EXPECT_TRUE(torch::equal(output, expected)) << "world " << world << " count " << count;
      }
    });
  }
}

// The sharding collectives on both transports (shared memory natively, Gloo through its fallback),
// in their asynchronous form, with outputs / inputs that are views into one flat buffer as
// ShardedDataParallel passes them, including sizes past one shared-memory chunk (4 MiB per slot; a
// reduce-scatter's slot holds a chunk of each of the N pieces) and two operations in flight at
// once.
TEST_P(AllReduceTransports, AsyncAllGatherAndReduceScatterIntoFlatBuffers) {
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_group(
        world,
        [&](int rank, ProcessGroup& group) {
          for (int64_t count : {int64_t{1}, int64_t{12347}, (int64_t{3} << 20) / 4 + 5}) {
            at::Tensor flat = torch::full({world * count}, -1.0f);
            std::vector<at::Tensor> outputs;
            for (int r = 0; r < world; ++r) outputs.push_back(flat.narrow(0, r * count, count));
            at::Tensor mine = contribution(rank, count);
            Work gathered = group.all_gather_async(outputs, mine);

            at::Tensor grads = torch::empty({world * count});
            for (int j = 0; j < world; ++j)
              grads.narrow(0, j * count, count).copy_(contribution(rank * world + j, count));
            std::vector<at::Tensor> inputs;
            for (int j = 0; j < world; ++j) inputs.push_back(grads.narrow(0, j * count, count));
            at::Tensor output = torch::empty({count});
            Work scattered = group.reduce_scatter_async(output, inputs, ReduceOp::kAvg);
            gathered.wait();
            scattered.wait();
            for (int r = 0; r < world; ++r) {
              EXPECT_TRUE(torch::equal(outputs[r], contribution(r, count)))
                  << "count " << count << " from " << r;
            }
            at::Tensor expected = torch::zeros({count});
            for (int r = 0; r < world; ++r) expected += contribution(r * world + rank, count);
            EXPECT_TRUE(torch::allclose(output, expected / world)) << "count " << count;
          }
        },
        std::chrono::seconds(60), GetParam());
  }
}

// What rank `rank` puts in its input for rank `piece`: small integers (-3..3), so that every sum,
// product, minimum and maximum over up to four ranks is exact in each dtype below (bfloat16 and
// int8 too), and the comparison with the local reference can be exact.
at::Tensor small_piece(int rank, int piece, int64_t count, at::ScalarType type) {
  return ((torch::arange(count, torch::kInt64) * 5 + 3 * rank + 2 * piece) % 7 - 3).to(type);
}

// Every reduce operation and every dtype a reduce-scatter may get, world sizes 1..4, pieces whose
// length does not divide by the world size, inputs as separate tensors and as views of one flat
// buffer, a contiguous output and a strided one. Over Gloo (Note [Reduce-scatter over Gloo] in
// src/comm/process_group.cpp) and over shared memory where it carries the dtype; the reference is
// computed locally. kAvg gets inputs multiplied by the world size, so that its quotient is exact.
TEST_P(AllReduceTransports, ReduceScatterEveryOpAndDtypeMatchesALocalReference) {
  const std::vector<at::ScalarType> types = {torch::kFloat32, torch::kFloat64, torch::kBFloat16,
                                             torch::kFloat16, torch::kInt32,   torch::kInt64,
                                             torch::kInt8};
  const std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                                     ReduceOp::kProduct};
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_group(
        world,
        [&](int rank, ProcessGroup& group) {
          for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{1001}}) {
            for (at::ScalarType type : types) {
              for (ReduceOp op : ops) {
                if (op == ReduceOp::kAvg && !at::isFloatingType(type)) continue;
                const int scale = op == ReduceOp::kAvg ? world : 1;
                at::Tensor expected = small_piece(0, rank, count, type);
                for (int r = 1; r < world; ++r) {
                  at::Tensor theirs = small_piece(r, rank, count, type);
                  if (op == ReduceOp::kSum || op == ReduceOp::kAvg) expected = expected + theirs;
                  if (op == ReduceOp::kMax) expected = torch::maximum(expected, theirs);
                  if (op == ReduceOp::kMin) expected = torch::minimum(expected, theirs);
                  if (op == ReduceOp::kProduct) expected = expected * theirs;
                }
                for (bool flat : {false, true}) {
                  std::vector<at::Tensor> inputs;
                  at::Tensor buffer = torch::empty({world * count}, type);
                  for (int j = 0; j < world; ++j) {
                    at::Tensor piece = small_piece(rank, j, count, type) * scale;
                    if (flat) piece = buffer.narrow(0, j * count, count).copy_(piece);
                    inputs.push_back(piece);
                  }
                  // Even elements of a twice-as-long tensor when `flat`: a strided output.
                  at::Tensor holder = torch::full({2 * count}, 99, type);
                  at::Tensor output =
                      flat ? holder.slice(0, 0, 2 * count, 2) : holder.narrow(0, 0, count);
                  group.reduce_scatter(output, inputs, op);
                  EXPECT_TRUE(torch::equal(output, expected))
                      << c10::toString(type) << " op " << static_cast<int>(op) << " count " << count
                      << (flat ? " flat" : " separate") << ": got " << output.slice(0, 0, 7)
                      << " expected " << expected.slice(0, 0, 7);
                  if (flat) {
                    EXPECT_TRUE(torch::equal(holder.slice(0, 1, 2 * count, 2),
                                             torch::full({count}, 99, type)))
                        << "the output's neighbours were written";
                  }
                }
              }
            }
          }
        },
        std::chrono::seconds(120), GetParam());
  }
}

// Bytes this process has written to files and sockets so far (Linux's /proc/self/io, summed over
// its threads: here every rank); -1 where it cannot be read.
int64_t bytes_written_by_process() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

// A reduce-scatter over Gloo moves each rank's piece for rank r to rank r and nothing else: with N
// ranks and pieces of C bytes, N (N-1) C bytes in all (each rank's N-1 pieces for the others). The
// all-reduce of all N pieces it used to be, like c10d's own Gloo reduce_scatter, wrote twice that
// (Note [Reduce-scatter over Gloo]). Counted by the kernel, not timed; the bound leaves 10% for
// Gloo's headers and the log.
TEST(Collectives, ReduceScatterOverGlooSendsOnlyThePiecesOtherRanksNeed) {
  if (bytes_written_by_process() < 0) GTEST_SKIP() << "/proc/self/io is not readable here";
  const int64_t count = int64_t{1} << 20;  // 4 MiB of float32 per piece
  for (int world : {2, 3, 4}) {
    std::atomic<int64_t> written{0};
    run_group(
        world,
        [&](int rank, ProcessGroup& group) {
          std::vector<at::Tensor> inputs;
          for (int j = 0; j < world; ++j) inputs.push_back(torch::full({count}, 1.0f));
          at::Tensor output = torch::empty({count});
          group.barrier();
          const int64_t before = bytes_written_by_process();
          group.barrier();
          group.reduce_scatter(output, inputs);
          group.barrier();
          if (rank == 0) written = bytes_written_by_process() - before;
          group.barrier();
          EXPECT_TRUE(torch::equal(output, torch::full({count}, static_cast<float>(world))));
        },
        std::chrono::seconds(60), /*shared_memory=*/false);
    const int64_t needed = int64_t{world} * (world - 1) * count * 4;
    EXPECT_GE(written.load(), needed) << "world " << world;
    EXPECT_LE(written.load(), needed + needed / 10)
        << "world " << world << ": an all-reduce of every piece writes " << 2 * needed;
  }
}

TEST(Collectives, SendRecvAroundARing) {
  for (int world : {2, 3, 5}) {
    run_group(world, [&](int rank, ProcessGroup& group) {
      int right = (rank + 1) % world;
      int left = (rank + world - 1) % world;
      at::Tensor received = torch::empty({777});
      // Even ranks send first, odd ranks receive first: no cycle of blocked sends on odd rings
      // either, because Gloo's send completes once the data is handed to the transport.
      if (rank % 2 == 0) {
        group.send(contribution(rank, 777), right, /*tag=*/5);
        group.recv(received, left, /*tag=*/5);
      } else {
        group.recv(received, left, /*tag=*/5);
        group.send(contribution(rank, 777), right, /*tag=*/5);
      }
      EXPECT_TRUE(torch::equal(received, contribution(left, 777)));
      group.barrier();
    });
  }
}

TEST(Collectives, IntegerAndDoubleTensors) {
  run_group(4, [&](int rank, ProcessGroup& group) {
    at::Tensor ints = torch::full({33}, rank + 1, torch::kInt64);
    group.all_reduce(ints);
    EXPECT_EQ(ints[32].item<int64_t>(), 10);
    at::Tensor doubles = torch::full({5}, 0.1 * (rank + 1), torch::kFloat64);
    group.all_reduce(doubles, ReduceOp::kAvg);
    EXPECT_NEAR(doubles[0].item<double>(), 0.25, 1e-15);
    EXPECT_THROW(group.all_reduce(ints, ReduceOp::kAvg), UsageError);
  });
}

TEST(SubGroups, NewGroupRunsItsOwnCollectives) {
  run_group(5, [&](int rank, ProcessGroup& group) {
    auto odd = group.new_group({1, 3});
    auto even = group.new_group({0, 2, 4});
    if (rank % 2 == 1) {
      ASSERT_TRUE(odd);
      EXPECT_FALSE(even);
      EXPECT_EQ(odd->size(), 2);
      EXPECT_EQ(odd->global_rank(), rank);
      at::Tensor t = torch::full({3}, static_cast<float>(rank));
      odd->all_reduce(t);
      EXPECT_EQ(t[0].item<float>(), 4.0f);
    } else {
      ASSERT_TRUE(even);
      EXPECT_FALSE(odd);
      EXPECT_EQ(even->rank(), rank / 2);
      at::Tensor t = torch::full({3}, static_cast<float>(rank));
      even->all_reduce(t);
      EXPECT_EQ(t[0].item<float>(), 6.0f);
    }
    group.barrier();
  });
}

TEST(SubGroups, RankMeshSplitsDataAndPipeline) {
  // 6 ranks as 3 replicas x 2 stages: rank = data_index * 2 + stage.
  run_group(6, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    RankMesh mesh = make_rank_mesh(group, 2);
    EXPECT_EQ(mesh.data_size, 3);
    EXPECT_EQ(mesh.data_index, rank / 2);
    EXPECT_EQ(mesh.pipeline_index, rank % 2);
    ASSERT_TRUE(mesh.data_group);
    ASSERT_TRUE(mesh.pipeline_group);
    EXPECT_EQ(mesh.data_group->size(), 3);
    EXPECT_EQ(mesh.pipeline_group->size(), 2);

    at::Tensor same_stage = torch::full({1}, static_cast<float>(rank));
    mesh.data_group->all_reduce(same_stage);
    float stage = static_cast<float>(rank % 2);
    EXPECT_EQ(same_stage.item<float>(), 3 * stage + 6);  // ranks stage, stage+2, stage+4

    at::Tensor same_replica = torch::full({1}, static_cast<float>(rank));
    mesh.pipeline_group->all_reduce(same_replica);
    EXPECT_EQ(same_replica.item<float>(), 4.0f * (rank / 2) + 1);  // ranks 2d and 2d+1
  });
  EXPECT_THROW(
      run_group(4,
                [&](int, const std::shared_ptr<ProcessGroup>& group) { make_rank_mesh(group, 3); }),
      UsageError);
}

// The members of `g`, as ranks of the job.
std::vector<int> members(const ProcessGroup& g) {
  std::vector<int> ranks;
  for (int r = 0; r < g.size(); ++r) ranks.push_back(g.global_rank_of(r));
  return ranks;
}

// data × pipeline × tensor meshes: rank = (d * pipeline + p) * tensor + t. Each rank's three groups
// must hold exactly the ranks that share the other two indices, and each must carry its own
// collectives.
class RankMesh3D : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(RankMesh3D, EachGroupHoldsTheRanksThatShareTheOtherTwoIndices) {
  auto [data, pipeline, tensor] = GetParam();
  auto rank_of = [&](int d, int p, int t) { return (d * pipeline + p) * tensor + t; };
  run_group(data * pipeline * tensor, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    RankMesh mesh = make_rank_mesh(group, pipeline, tensor);
    EXPECT_EQ(mesh.data_size, data);
    EXPECT_EQ(mesh.pipeline_size, pipeline);
    EXPECT_EQ(mesh.tensor_size, tensor);
    EXPECT_EQ(rank_of(mesh.data_index, mesh.pipeline_index, mesh.tensor_index), rank);
    ASSERT_TRUE(mesh.data_group && mesh.pipeline_group && mesh.tensor_group);

    std::vector<int> want_data, want_pipeline, want_tensor;
    for (int d = 0; d < data; ++d)
      want_data.push_back(rank_of(d, mesh.pipeline_index, mesh.tensor_index));
    for (int p = 0; p < pipeline; ++p)
      want_pipeline.push_back(rank_of(mesh.data_index, p, mesh.tensor_index));
    for (int t = 0; t < tensor; ++t)
      want_tensor.push_back(rank_of(mesh.data_index, mesh.pipeline_index, t));
    EXPECT_EQ(members(*mesh.data_group), want_data);
    EXPECT_EQ(members(*mesh.pipeline_group), want_pipeline);
    EXPECT_EQ(members(*mesh.tensor_group), want_tensor);
    EXPECT_EQ(mesh.data_group->rank(), mesh.data_index);
    EXPECT_EQ(mesh.pipeline_group->rank(), mesh.pipeline_index);
    EXPECT_EQ(mesh.tensor_group->rank(), mesh.tensor_index);

    // The groups really are separate: each sum covers its own members only.
    auto sum_of = [](const std::vector<int>& ranks) {
      float s = 0;
      for (int r : ranks) s += static_cast<float>(r);
      return s;
    };
    for (auto [g, want] : {std::pair{mesh.data_group.get(), &want_data},
                           std::pair{mesh.pipeline_group.get(), &want_pipeline},
                           std::pair{mesh.tensor_group.get(), &want_tensor}}) {
      at::Tensor t = torch::full({3}, static_cast<float>(rank));
      g->all_reduce(t);
      EXPECT_EQ(t[2].item<float>(), sum_of(*want)) << g->name();
    }
  });
}

// (data, pipeline, tensor): 2x2x2, 3x2x2, tensor only, data x tensor, and the 2-D mesh.
INSTANTIATE_TEST_SUITE_P(Shapes, RankMesh3D,
                         ::testing::Values(std::tuple{2, 2, 2}, std::tuple{3, 2, 2},
                                           std::tuple{1, 1, 4}, std::tuple{2, 1, 3},
                                           std::tuple{3, 2, 1}));

TEST(SubGroups, RankMeshRejectsSizesThatDoNotDivideTheGroup) {
  for (auto [pipeline, tensor] :
       {std::pair{3, 2}, std::pair{2, 3}, std::pair{1, 0}, std::pair{0, 2}, std::pair{1, 16}}) {
    SCOPED_TRACE("pipeline " + std::to_string(pipeline) + " tensor " + std::to_string(tensor));
    try {
      run_group(8, [&](int, const std::shared_ptr<ProcessGroup>& group) {
        make_rank_mesh(group, pipeline, tensor);
      });
      ADD_FAILURE() << "expected a UsageError";
    } catch (const UsageError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("make_rank_mesh"), std::string::npos) << what;
      EXPECT_NE(what.find("tensor_size=" + std::to_string(tensor)), std::string::npos) << what;
      EXPECT_NE(what.find("group size 8"), std::string::npos) << what;
    }
  }
}

TEST(Collectives, RanksPassingDifferentSizesAreNamedNotPaired) {
  // Through shared memory the ranks compare each operation's size, dtype and op at its first
  // barrier, before anyone reads a peer's data. A back-to-back sequence checks that a rank running
  // ahead into the next operation cannot be mistaken for a mismatch, and then a real mismatch at
  // operation #41.
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<std::string> errors(world);
    run_group(
        world,
        [&](int rank, ProcessGroup& group) {
          for (int i = 0; i < 40; ++i) {
            at::Tensor t = torch::full({1 + (i % 3) * 100000}, static_cast<float>(rank));
            group.all_reduce(t);
            ASSERT_EQ(t[0].item<float>(), static_cast<float>(world * (world - 1) / 2))
                << "operation " << i;
          }
          at::Tensor mismatched = torch::zeros({rank == world - 1 ? 11 : 10});
          try {
            group.all_reduce(mismatched);
            errors[rank] = "no error";
          } catch (const UsageError& e) {
            errors[rank] = e.what();
          }
        },
        std::chrono::seconds(20));
    for (int rank = 0; rank < world; ++rank) {
      SCOPED_TRACE(errors[rank]);
      EXPECT_NE(errors[rank].find("all_reduce #41"), std::string::npos);
      EXPECT_NE(errors[rank].find("passed different tensors (numel, dtype) or ops"),
                std::string::npos);
      EXPECT_EQ(errors[rank].find("peer lost"), std::string::npos);
      EXPECT_NE(errors[rank].find("Every rank must pass the same shape, dtype and op"),
                std::string::npos);
    }
  }
}

TEST(Collectives, BadArgumentsAreUsageErrors) {
  run_group(2, [&](int rank, ProcessGroup& group) {
    at::Tensor t = torch::zeros({2});
    EXPECT_THROW(group.broadcast(t, 2), UsageError);
    std::vector<at::Tensor> too_few{torch::zeros({2})};
    EXPECT_THROW(group.all_gather(too_few, t), UsageError);
    EXPECT_THROW(group.send(t, -1), UsageError);
    try {
      group.broadcast(t, 7);
      ADD_FAILURE() << "broadcast from rank 7 of 2 was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("root=7 is not a rank"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace dtrain
