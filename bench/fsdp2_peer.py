"""PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) on bench_sharded's workload, for side-by-side
comparison with dtrain's ZeRO stages (bench/compare_sharded.sh).

Workload, as bench/bench_sharded.cpp: MLP 784-H-...-H-10 with --layers hidden layers, Adam(lr=1e-4), a fixed
synthetic batch of --batch samples per rank, one intra-op thread per rank, CPU, gloo. Every Linear is its own
FSDP2 unit (fully_shard on each Linear, then on the root), as dtrain's stage 3 makes every child with
parameters a unit. --reshard-after-forward 1 frees a unit's gathered parameters after its forward and gathers
them again in backward (ZeRO-3); 0 keeps them from forward to the end of backward (FSDP2 still frees them
after backward, so between steps both hold 16Ψ/N, unlike dtrain's stage 2, which keeps the full parameters).

Bytes are counted as bench_sharded counts them: each tensor storage once, by what it holds. Parameters: every
unit's sharded parameter (its padded local shard) plus its gathered full parameter while that storage is
allocated; gradients: the sharded gradients plus any full gradient not yet reduce-scattered; optimizer: Adam's
exp_avg and exp_avg_sq (their local shards). Adam's scalar `step` tensors (4 bytes each) are left out;
LibTorch's Adam, which bench_sharded counts, keeps its step as a plain integer. "Between steps" is the census
after optimizer.step() (the gradients are still held then, as in bench_sharded, whose zero_grad opens the next
step); "peak sampled" is the largest census taken after each unit's forward (before its parameters are freed), when
its full gradient has been accumulated (before the reduce-scatter), after backward and after the step.

Run under a launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (dtrain run, torchrun):
    dtrain run --nproc-per-node 2 -- .venv/bin/python bench/fsdp2_peer.py --reshard-after-forward 1
Rank 0 prints one JSON line (field names as bench_sharded's where they mean the same).
"""
import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--hidden", type=int, default=1024, help="hidden width")
parser.add_argument("--layers", type=int, default=4, help="hidden layers")
parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
parser.add_argument("--steps", type=int, default=20, help="timed steps")
parser.add_argument("--reshard-after-forward", type=int, choices=(0, 1), default=1,
                    help="1: free gathered parameters after forward (ZeRO-3); 0: keep them until backward ends")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
n, rank = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh("cpu", (n,))


torch.manual_seed(0)
layers, width = [], 784
for _ in range(args.layers):
    layers += [nn.Linear(width, args.hidden), nn.ReLU()]
    width = args.hidden
layers.append(nn.Linear(width, 10))
model = nn.Sequential(*layers)
psi = sum(p.numel() for p in model.parameters())
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh, reshard_after_forward=bool(args.reshard_after_forward))
fully_shard(model, mesh=mesh, reshard_after_forward=bool(args.reshard_after_forward))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
units = [m for m in model.modules() if isinstance(m, FSDPModule)]


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


class Census:
    def __init__(self):
        self.seen, self.params, self.grads, self.optimizer = set(), 0, 0, 0

    def add(self, t, kind):
        if t is None:
            return
        storage = local(t).untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            setattr(self, kind, getattr(self, kind) + storage.nbytes())

    def total(self):
        return self.params + self.grads + self.optimizer


class Run:
    def __init__(self):
        self.peak = Census()

    def census(self):
        c = Census()
        fsdp_params = []
        for unit in units:
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is not None:
                fsdp_params += group.fsdp_params
        for fp in fsdp_params:
            c.add(fp.sharded_param, "params")
            c.add(getattr(fp, "_unsharded_param", None), "params")  # storage size 0 once freed
        for fp in fsdp_params:
            c.add(fp.sharded_param.grad, "grads")
            full = getattr(fp, "_unsharded_param", None)
            c.add(full.grad if full is not None else None, "grads")
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                c.add(state.get(key), "optimizer")
        return c

    def sample(self):
        c = self.census()
        if c.total() > self.peak.total():
            self.peak = c


run = Run()
# Sample while a unit's full parameters are held: after its forward, before FSDP2's own forward hook frees them
# (prepend=True runs ours first), and in backward once its full gradient exists, before the reduce-scatter.
for layer in model:
    if isinstance(layer, nn.Linear):
        layer.register_forward_hook(lambda *_: run.sample(), prepend=True)
x = torch.randn(args.batch, 784)
y = torch.randint(0, 10, (args.batch,))


def step():
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    run.sample()
    optimizer.step()
    run.sample()


for _ in range(3):  # warm-up, as bench_sharded: Adam's state exists from the first step
    step()
for unit in units:  # the full parameters exist (and keep their identity) from the first all-gather on
    group = unit._get_fsdp_state()._fsdp_param_group
    for fp in group.fsdp_params if group is not None else []:
        fp.unsharded_param.register_post_accumulate_grad_hook(lambda _: run.sample())
dist.barrier()
start = time.perf_counter()
for _ in range(args.steps):
    step()
dist.barrier()
ms = (time.perf_counter() - start) / args.steps * 1e3
steady = run.census()
if rank == 0:
    print(json.dumps({
        "bench": "fsdp2", "reshard_after_forward": args.reshard_after_forward, "world": n, "rank": rank,
        "torch": torch.__version__, "params": psi, "param_bytes": steady.params, "grad_bytes": steady.grads,
        "optimizer_bytes": steady.optimizer, "total_bytes": steady.total(), "formula_bytes": 16 * psi / n,
        "vs_formula": round(steady.total() / (16 * psi / n), 4), "peak_sampled_bytes": run.peak.total(),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "ms_per_step": round(ms, 2)}), flush=True)
dist.destroy_process_group()
