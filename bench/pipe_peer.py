"""PyTorch's own pipeline (torch.distributed.pipeline.sync.Pipe, Debian's python3-torch 1.13) on the model
of `bench_pipeline --mode mlp`: an MLP 784-H-H-H-10 cut into two stages at layer --boundary, --chunks
micro-batches, cross-entropy, forward + backward per step, median of --steps after one warm-up step.
Prints one JSON line.
  /usr/bin/python3 bench/pipe_peer.py --hidden 2048 --batch 256 --chunks 4 --boundary 4
"""
import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.pipeline.sync import Pipe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--boundary", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = args.hidden
    layers = [nn.Linear(784, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)]
    stages = nn.Sequential(nn.Sequential(*layers[: args.boundary]), nn.Sequential(*layers[args.boundary:]))
    # Pipe needs the RPC framework even in one process.
    with tempfile.TemporaryDirectory() as tmp:
        rpc.init_rpc("peer", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method="file://" + os.path.join(tmp, "rpc")))
        pipe = Pipe(stages, chunks=args.chunks, checkpoint="never")
        x, y = torch.randn(args.batch, 784), torch.randint(10, (args.batch,))

        def step():
            pipe.zero_grad()
            nn.functional.cross_entropy(pipe(x).local_value(), y).backward()

        step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1000)
        rpc.shutdown()
    times.sort()
    print(json.dumps({"peer": "torch Pipe", "hidden": h, "batch": args.batch, "chunks": args.chunks,
                      "boundary": args.boundary, "step_ms": round(times[len(times) // 2], 2)}))


if __name__ == "__main__":
    main()
