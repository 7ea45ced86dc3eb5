"""An unmodified PyTorch DDP program: `dtrain run` must run it as torchrun would.

Under a launcher (RANK, WORLD_SIZE, MASTER_ADDR, ... set) it trains a small model with
DistributedDataParallel over gloo and prints, per rank,
  ddp rank=R world=W in_sync=True|False
  ddp checksum rank=R sum=... weighted=...
With `--reference W` it trains the same model in one process on the data of all W ranks and prints
  ddp checksum reference sum=... weighted=...
which the distributed checksums must match (see equivalence.py).
"""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import equivalence

if len(sys.argv) == 3 and sys.argv[1] == "--reference":
    print(f"ddp checksum reference {equivalence.train_reference(int(sys.argv[2]))}", flush=True)
    sys.exit(0)

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(equivalence.make_model())
opt = equivalence.make_optimizer(model.parameters())
for step in range(equivalence.STEPS):
    x, y = equivalence.batch(rank, step)
    opt.zero_grad()
    equivalence.loss_fn(model, x, y).backward()
    opt.step()
# After DDP steps every rank holds the same weights.
w = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, w)
same = all(torch.equal(g, w) for g in gathered)
print(f"ddp rank={rank} world={dist.get_world_size()} in_sync={same}", flush=True)
print(f"ddp checksum rank={rank} {equivalence.checksum(list(model.module.parameters()))}",
      flush=True)
dist.destroy_process_group()
