"""PyTorch's side of tools/gpt/gpt_dcp_test.cpp, under `dtrain run --nproc-per-node 2`:

  gpt_dcp_interop.py EXPORT EXPECTED FSDP_DIR FSDP_EXPECTED

EXPORT is a DCP safetensors folder that train_gpt --tp 2 --pp 2 --export-dcp wrote (every rank its
ranges); EXPECTED a safetensors file of that run's whole state under the same names (the
parameters, optim.state.<name>.exp_avg, .exp_avg_sq, .step), which dtrain read from the run's own
checkpoint. Every rank
  1. builds a module with EXPECTED's parameter names and shapes (train_gpt's transformer, by name:
     "block0.attention.wq.weight" is a parameter of nested modules block0.attention.wq) and an
     AdamW over it, loads EXPORT into them with torch.distributed.checkpoint's
     HuggingFaceStorageReader (no_dist: each rank alone) and compares them with EXPECTED, exactly;
  2. builds the same module again with values drawn by name, shards it with FSDP2 (fully_shard) at
     this world size, takes two AdamW steps on made-up gradients and saves the parameters and
     AdamW's state with HuggingFaceStorageWriter(save_distributed=True) into FSDP_DIR; rank 0 writes
     the gathered state as FSDP_EXPECTED, which dtrain compares its load of FSDP_DIR with.
Prints "gpt dcp interop ok" on every rank at the end.
"""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

export_dir, expected_path, fsdp_dir, fsdp_expected_path = sys.argv[1:5]


def make_model(shapes, values=None):
    """Parameters named and shaped as `shapes` says, in nested modules; zeros, or values[name]."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        value = values[name] if values is not None else torch.zeros(shape)
        module.register_parameter(leaf, nn.Parameter(value.clone()))
    return root


def whole(t):  # a collective for a DTensor: every rank calls it in the same order
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state_table(model, opt):
    table = {name: whole(t) for name, t in model.state_dict().items()}
    for name, state in get_optimizer_state_dict(model, opt)["state"].items():
        for field, t in state.items():
            table[f"optim.state.{name}.{field}"] = whole(t)
    return table


def expect_equal(expected, actual, what):
    assert expected.keys() == actual.keys(), (
        f"{what}: names differ: only expected {sorted(expected.keys() - actual.keys())}, "
        f"only loaded {sorted(actual.keys() - expected.keys())}")
    for name, t in expected.items():
        assert actual[name].shape == t.shape, f"{what}: {name} is {actual[name].shape}, not {t.shape}"
        assert torch.equal(actual[name].to(t.dtype), t), f"{what}: {name} differs"


dist.init_process_group("gloo")
rank = dist.get_rank()
expected = load_file(expected_path)
shapes = {name: t.shape for name, t in expected.items() if not name.startswith("optim.")}

# 1. train_gpt's tensor x pipeline export into an unsharded model and AdamW: the model, then
# AdamW's state (its param_groups are not in the folder: allow_partial_load).
model = make_model(shapes)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = model.state_dict()
dcp.load(state, storage_reader=HuggingFaceStorageReader(export_dir), no_dist=True)
model.load_state_dict(state)
optim = get_optimizer_state_dict(model, opt)  # creates AdamW's state to load into
dcp.load({"optim": optim}, storage_reader=HuggingFaceStorageReader(export_dir),
         planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
set_optimizer_state_dict(model, opt, optim)
expect_equal(expected, state_table(model, opt), "train_gpt's export in an unsharded model")

# 2. FSDP2 at this world size: values drawn by name (the same on every rank), two AdamW steps on
# gradients made from the parameters, saved in DCP's safetensors storage. The matrices are drawn
# larger than train_gpt's initialisation, so that a run that starts from them starts elsewhere.
generator = torch.Generator().manual_seed(0)
values = {}
for name, shape in sorted(shapes.items()):
    noise = torch.randn(shape, generator=generator)
    values[name] = 1 + 0.1 * noise if len(shape) == 1 else 0.3 * noise
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = make_model(shapes, values)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.01 * (step + 1)
    opt.step()
state = dict(model.state_dict())
state["optim"] = {"state": get_optimizer_state_dict(model, opt)["state"]}
dcp.save(state, storage_writer=HuggingFaceStorageWriter(fsdp_dir, save_distributed=True))
table = state_table(model, opt)
if rank == 0:
    save_file(table, fsdp_expected_path)
dist.barrier()
print("gpt dcp interop ok", flush=True)
dist.destroy_process_group()
