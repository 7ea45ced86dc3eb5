"""PyTorch's side of tests/checkpoint/dcp_interop_test.cpp, under `dtrain run --nproc-per-node 2`:

  dcp_interop.py EXPORT EXPECTED FSDP_DIR FSDP_EXPECTED

EXPORT is a DCP safetensors folder that dtrain's save_dcp_safetensors wrote from a ZeRO run at
another world size; EXPECTED a safetensors file of that run's whole state under the same names
(parameters, buffers, optim.state.<name>.exp_avg, .exp_avg_sq, .step). Every rank
  1. loads EXPORT with torch.distributed.checkpoint's HuggingFaceStorageReader into an unsharded
     model and Adam (no_dist: each rank alone) and compares them with EXPECTED, exactly;
  2. loads it into the same model under FSDP2 (fully_shard) at this world size, gathers
     (full_tensor) and compares the same way;
  3. takes one more step under FSDP2 and saves the model and Adam's state with
     HuggingFaceStorageWriter(save_distributed=True) into FSDP_DIR; rank 0 writes the gathered state
     as FSDP_EXPECTED, which dtrain then compares its loads of FSDP_DIR with.
Prints "dcp interop ok" on every rank at the end.
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


def make_model():  # tests/checkpoint/dcp_support.h's make_dcp_model
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))


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


def load(model, opt, no_dist):
    """What a PyTorch user writes to load dtrain's export: the model, then Adam's state (its
    param_groups are not in the folder: allow_partial_load)."""
    reader = HuggingFaceStorageReader(export_dir)
    state = model.state_dict()
    dcp.load(state, storage_reader=reader, no_dist=no_dist)
    model.load_state_dict(state)
    optim = get_optimizer_state_dict(model, opt)  # creates Adam's state to load into
    dcp.load({"optim": optim}, storage_reader=HuggingFaceStorageReader(export_dir),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=no_dist)
    set_optimizer_state_dict(model, opt, optim)


dist.init_process_group("gloo")
rank = dist.get_rank()
expected = load_file(expected_path)

# 1. An unsharded model.
model = make_model()
opt = torch.optim.Adam(model.parameters(), lr=0.01)
load(model, opt, no_dist=True)
expect_equal(expected, state_table(model, opt), "unsharded model")

# 2. FSDP2 at this world size.
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = make_model()
for layer in model:
    if isinstance(layer, (nn.Linear, nn.BatchNorm1d)):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
load(model, opt, no_dist=False)
expect_equal(expected, state_table(model, opt), f"FSDP2 at {dist.get_world_size()} ranks")

# 3. One more step, saved by FSDP2 in DCP's safetensors storage. Only tensors: param_groups'
# numbers would turn a file into pickle bytes in front of the safetensors (torch 2.15).
torch.manual_seed(7)
x, y = torch.randn(12, 4), torch.randn(12, 3)
opt.zero_grad()
(model(x) - y).pow(2).mean().backward()
opt.step()
state = dict(model.state_dict())
state["optim"] = {"state": get_optimizer_state_dict(model, opt)["state"]}
dcp.save(state, storage_writer=HuggingFaceStorageWriter(fsdp_dir, save_distributed=True))
table = state_table(model, opt)
if rank == 0:
    save_file(table, fsdp_expected_path)
dist.barrier()
print("dcp interop ok", flush=True)
dist.destroy_process_group()
