// What a DistributedPipeline needs of ShardedDataParallel to shard a stage's training state over
// the stage's data-parallel replicas (Note [ZeRO in a pipeline] in distributed_pipeline.cpp).
#pragma once

#include "dtrain/sharded.h"

namespace dtrain::detail {

// A pipeline step runs several forwards and backwards of one chunk, interleaved with other
// micro-batches', and only the last backward of each chunk may reduce its gradients. So a step is
// bracketed instead of driven by forward(): begin_step before the first forward, sync_next_backward
// before every backward pass, finish_step and end_step after the last.
struct ShardedPipelineSteps {
  // Checks the full parameters as forward() does and makes them current: stages 1-2 all-gather
  // the shards the optimizer changed, stage 3 gathers every unit and keeps them gathered until
  // end_step (as FSDP2 under torch.distributed.pipelining: no gather per micro-batch). Collective
  // over the data group. The chunk's module is then called directly, not through forward().
  static void begin_step(ShardedDataParallelBase& sdp);
  // Whether the next backward pass reduces the gradients accumulated so far (its last of the
  // step) or only accumulates them. The reductions that pass launches run on while the pipeline
  // goes on (its input gradient is sent upstream at once); finish_step waits for them.
  static void sync_next_backward(ShardedDataParallelBase& sdp, bool sync);
  // After the step's last pass: waits for its reductions and puts the reduced gradients on the
  // shards, ready for the optimizer. Throws what a reduction threw.
  static void finish_step(ShardedDataParallelBase& sdp);
  // Ends the step: stage 3 frees the full parameters again. A step that did not complete
  // (completed false: an exception) also waits out its reductions and drops the gradients its
  // passes accumulated, so the next step starts clean. No communication; never throws.
  static void end_step(ShardedDataParallelBase& sdp, bool completed) noexcept;
};

}  // namespace dtrain::detail
