"""An unmodified PyTorch FSDP2 program (torch.distributed.fsdp.fully_shard) on CPU over gloo:
`dtrain run` must run it as torchrun would.

Each Linear and then the whole model are sharded over a 1-D CPU mesh of every rank; after a few
optimizer steps each rank gathers the full parameters (DTensor.full_tensor(), a collective every
rank calls in the same order) and prints
  fsdp2 checksum rank=R sum=... weighted=...
which must be the same on every rank. `--reference W` prints the single-process run's
  fsdp2 checksum reference sum=... weighted=...
which they must match (see equivalence.py).
"""
import sys

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import equivalence

if len(sys.argv) == 3 and sys.argv[1] == "--reference":
    print(f"fsdp2 checksum reference {equivalence.train_reference(int(sys.argv[2]))}", flush=True)
    sys.exit(0)

dist.init_process_group("gloo")
rank = dist.get_rank()
# An explicit CPU mesh: the default one follows the accelerator, and a CUDA build on a machine with
# a GPU would put the shards there.
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = equivalence.make_model()
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = equivalence.make_optimizer(model.parameters())
for step in range(equivalence.STEPS):
    x, y = equivalence.batch(rank, step)
    opt.zero_grad()
    equivalence.loss_fn(model, x, y).backward()
    opt.step()
full = [p.full_tensor() for p in model.parameters()]
print(f"fsdp2 checksum rank={rank} {equivalence.checksum(full)}", flush=True)
dist.destroy_process_group()
