"""PyTorch's side of bench_ddp on one device: the same MLP 784-H-H-10, cross-entropy, SGD(lr=0.01), a fixed
synthetic batch, timed after 5 warm-up steps with the device's queue drained at both ends. Prints one line
as bench_ddp does:  torch-<mode> world=W params=P ms/step=T

  --mode plain  the bare model (bench_ddp --no-ddp)
  --mode ddp    DistributedDataParallel (run under `dtrain run`; nccl on cuda, gloo on cpu)
  --mode dp     nn.DataParallel over --replicas copies of the device (bench_ddp --dp N: B samples each)

nn.DataParallel with one GPU listed twice is what dtrain's DataParallel allows ("one GPU may be listed
twice"); where PyTorch refuses it, this prints its refusal as the line instead of a time.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["plain", "ddp", "dp"], default="plain")
p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--batch", type=int, default=32, help="samples per rank (dp: per replica)")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--replicas", type=int, default=2)
a = p.parse_args()

torch.set_num_threads(1)
local = int(os.environ.get("LOCAL_RANK", 0))
dev = torch.device("cuda", local % torch.cuda.device_count()) if a.device == "cuda" else torch.device("cpu")
if a.mode == "ddp":
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.hidden), nn.ReLU(),
                      nn.Linear(a.hidden, 10)).to(dev)
rows = a.batch * (a.replicas if a.mode == "dp" else 1)
world = dist.get_world_size() if a.mode == "ddp" else 1
try:
    if a.mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    elif a.mode == "dp":
        net = nn.DataParallel(model, device_ids=[dev.index] * a.replicas)
    else:
        net = model
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(rows, 784, device=dev)
    y = torch.randint(0, 10, (rows,), device=dev)

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    def drain():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if a.mode == "ddp":
            dist.barrier()

    for _ in range(5):
        step()
    drain()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    drain()
    ms = (time.perf_counter() - start) / a.steps * 1e3
    if local == 0:
        params = sum(t.numel() for t in model.parameters())
        print(f"torch-{a.mode} world={world} params={params} ms/step={ms:.2f} ({dev})", flush=True)
except Exception as e:  # nn.DataParallel may refuse a device listed twice: say so, as the result
    if local == 0:
        print(f"torch-{a.mode} refused: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
if a.mode == "ddp":
    dist.destroy_process_group()
