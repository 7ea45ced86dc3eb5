"""An unmodified PyTorch DDP program: `dtrain run` must run it as torchrun would."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8) + dist.get_rank()
for _ in range(3):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
# After DDP steps every rank holds the same weights.
w = model.module.weight.detach().clone()
gathered = [torch.empty_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, w)
same = all(torch.equal(g, w) for g in gathered)
print(f"ddp rank={dist.get_rank()} world={dist.get_world_size()} in_sync={same}", flush=True)
dist.destroy_process_group()
