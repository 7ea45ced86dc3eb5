"""PyTorch's own dist.all_reduce over gloo, the same sizes and timing rule as bench_allreduce
(max_iters as its --max-iters, default 1000). bench/compare_allreduce.sh runs the two alternately.
Run: dtrain run --nproc-per-node 3 -- .venv/bin/python bench/allreduce_peer.py [max_bytes [max_iters]]"""
import sys
import time

import torch
import torch.distributed as dist

max_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
max_iters = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
torch.set_num_threads(1)
dist.init_process_group("gloo")
n = dist.get_world_size()
if dist.get_rank() == 0:
    print(f"# torch.distributed.all_reduce (sum, float32), {n} ranks, gloo")
    print(f"{'bytes':>12} {'iters':>8} {'time_us':>12} {'algbw_GB/s':>12} {'busbw_GB/s':>12}")
size = 4
while size <= max_bytes:
    buf = torch.ones(size // 4)
    iters = min(max((64 << 20) // size, 5), max_iters)
    for _ in range(3):
        dist.all_reduce(buf)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    sec = elapsed.item()
    dist.barrier()
    if dist.get_rank() == 0:
        algbw = size / sec / 1e9
        busbw = algbw * 2 * (n - 1) / n if n > 1 else 0.0
        print(f"{size:>12} {iters:>8} {sec * 1e6:>12.1f} {algbw:>12.3f} {busbw:>12.3f}", flush=True)
    size *= 4
dist.destroy_process_group()
