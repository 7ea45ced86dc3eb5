"""What tests/python's training scripts share: the model, each rank's data, the single-process
reference and the checksum the C++ tests compare (tests/launcher/cli/launcher_test.cpp).

The reference trains one process on every rank's batch at once. With a mean loss and equal batch
sizes, its gradient is the average of the ranks' gradients, which is what DDP's all-reduce and
FSDP's reduce-scatter compute; so after the same steps its parameters equal the distributed ones up
to float32 summation order.
"""
import torch
import torch.nn as nn

STEPS = 4
BATCH_PER_RANK = 4


def make_model() -> nn.Module:
    # Every rank builds the same initial weights from the same seed (DDP would broadcast rank 0's
    # anyway; FSDP2 keeps each rank's own shard of what it built).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s inputs and targets at `step`; different on every rank and step."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH_PER_RANK, 8, generator=generator) + rank
    y = torch.randn(BATCH_PER_RANK, 3, generator=generator)
    return x, y


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def checksum(full_params: list[torch.Tensor]) -> str:
    """Two numbers over the full parameters: their sum, and a sum weighted by position (which also
    changes when values move between positions). repr-exact, so equal replicas print equal text."""
    flat = torch.cat([p.detach().flatten() for p in full_params]).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return f"sum={flat.sum().item()!r} weighted={(flat * weights).sum().item()!r}"


def train_reference(world_size: int) -> str:
    """The single-process run the distributed ones must match; returns its checksum."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    for step in range(STEPS):
        parts = [batch(rank, step) for rank in range(world_size)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return checksum(list(model.parameters()))
