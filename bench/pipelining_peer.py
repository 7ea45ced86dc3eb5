"""PyTorch's multi-process pipeline (torch.distributed.pipelining: PipelineStage and its schedules, Gloo on CPU)
on the model of `bench_pipeline --mode mlp --distributed`: an MLP 784-H-H-H-10 (torch.manual_seed(0)) cut into
P·V chunks at --boundaries (the layer indices dtrain's balance_by_parameters chose: bench_pipeline prints them),
one process per stage, --micro-batches micro-batches, cross-entropy (mean per micro-batch), forward + backward
per step with the gradients set to None before each step, one intra-op thread per process. Chunk placement is
PyTorch's: chunk c on rank c % P ("loop", as dtrain's interleaved schedule) for gpipe, 1f1b, interleaved,
interleaved-zb and looped-bfs; rank r holds chunks r and 2P-1-r ("V" shape) for zbv and dualpipev. Rank 0
prints one JSON line: the median step of --steps after one warm-up step, as bench_pipeline measures it. zbh1 is
ScheduleInterleavedZeroBubble with one chunk per rank (its ZB1P order is then ZB-H1's, the order dtrain's zbh1
runs), on the cut of 1f1b.
  torchrun --nproc-per-node 2 bench/pipelining_peer.py --schedule 1f1b --boundaries 4 --micro-batches 4
  torchrun --nproc-per-node 2 bench/pipelining_peer.py --schedule zbv --boundaries 2,4,6 --micro-batches 4
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble)

try:  # newer than 2.6
    from torch.distributed.pipelining import ScheduleDualPipeV
except ImportError:
    ScheduleDualPipeV = None

# name: (class, chunks per rank: None = 1, "one" = 1 passed as a list (a multi-stage schedule), "V" = 2 in V
# shape, "loop" = V from --virtual-stages)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, None),
    "1f1b": (Schedule1F1B, None),
    "interleaved": (ScheduleInterleaved1F1B, "loop"),
    "looped-bfs": (ScheduleLoopedBFS, "loop"),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, "loop"),
    "zbh1": (ScheduleInterleavedZeroBubble, "one"),
    "zbv": (ScheduleZBVZeroBubble, "V"),
    "dualpipev": (ScheduleDualPipeV, "V"),
}


def mlp(hidden):
    torch.manual_seed(0)
    h = hidden
    return [nn.Linear(784, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=[k for k, v in SCHEDULES.items() if v[0] is not None], default="1f1b")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank for the looped schedules")
    parser.add_argument("--boundaries", required=True,
                        help="layer indices where the model is cut, P·V-1 of them (e.g. 4, or 2,4,6)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()

    cls, placement = SCHEDULES[args.schedule]
    chunks_per_rank = 1 if placement in (None, "one") else (2 if placement == "V" else args.virtual_stages)
    n_chunks = ranks * chunks_per_rank
    cuts = [int(b) for b in args.boundaries.split(",")]
    if len(cuts) != n_chunks - 1:
        parser.error(f"--boundaries {args.boundaries}: {args.schedule} on {ranks} ranks needs {n_chunks - 1} cuts")
    layers = mlp(args.hidden)
    edges = [0] + cuts + [len(layers)]
    chunks = [nn.Sequential(*layers[edges[c]:edges[c + 1]]) for c in range(n_chunks)]
    if placement == "V":
        mine = [rank, 2 * ranks - 1 - rank]
    else:
        mine = [rank + k * ranks for k in range(chunks_per_rank)]
    stages = [PipelineStage(chunks[c], c, n_chunks, torch.device("cpu")) for c in mine]
    loss_fn = nn.functional.cross_entropy
    schedule = cls(stages[0] if placement is None else stages, n_microbatches=args.micro_batches, loss_fn=loss_fn)

    torch.manual_seed(1)
    x, y = torch.randn(args.batch, 784), torch.randint(10, (args.batch,))
    first, last = 0 in mine, n_chunks - 1 in mine

    def step():
        for s in stages:
            s.submod.zero_grad(set_to_none=True)
        schedule.step(*([x] if first else []), target=y if last else None)

    step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    dist.barrier()
    if rank == 0:
        times.sort()
        print(json.dumps({"peer": "torch.distributed.pipelining", "torch": torch.__version__,
                          "schedule": args.schedule, "class": cls.__name__, "stages": ranks,
                          "chunks_per_rank": chunks_per_rank, "micro_batches": args.micro_batches,
                          "hidden": args.hidden, "batch": args.batch, "boundaries": cuts,
                          "step_ms": round(times[len(times) // 2], 2)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
