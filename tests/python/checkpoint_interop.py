"""PyTorch's side of tests/checkpoint/torch_interop_test.cpp: a dtrain checkpoint is a torch.save file
of plain state dicts, and a torch.save file of Python's state dicts is a dtrain checkpoint.

    checkpoint_interop.py DTRAIN_DIR PYTHON_DIR

DTRAIN_DIR holds dtrain's checkpoint-3.ckpt (a model and optimizer after three steps, the batch of
step 4 among its tensors, the optimizer's name among its values) and expected-4.ckpt (dtrain's model
after step 4). This script opens both with weights_only=True, loads the state into PyTorch's own
model and optimizer, takes step 4 and compares with dtrain's; then it writes into PYTHON_DIR its own
checkpoint-4.ckpt (model.state_dict() as it is, an OrderedDict with _metadata) and expected-5.ckpt
(its model after step 5), and checkpoint-6.ckpt: checkpoint-4 with one byte of a tensor flipped,
which dtrain must refuse. Prints "interop ok max_diff=D" or exits non-zero naming what differs.
"""

import os
import shutil
import struct
import sys
import zipfile

import torch

TOLERANCE = 1e-6  # the same ATen kernels on both sides; a lost optimizer state moves ~1e-3


def model():
    # Parameter and buffer names as dtrain's test model: Sequential(Linear, BatchNorm1d, ReLU, Linear).
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
                               torch.nn.Linear(5, 3))


def optimizer(name, net, saved_groups):
    # The saved groups' parameters in order (load_state_dict matches them by position), with
    # hyperparameters unlike dtrain's: load_state_dict must bring dtrain's.
    params, groups = list(net.parameters()), []
    for group in saved_groups:
        groups.append({"params": params[:len(group["params"])]})
        params = params[len(group["params"]):]
    params = groups
    return {"SGD": lambda: torch.optim.SGD(params, lr=1.0),
            "Adam": lambda: torch.optim.Adam(params),
            "AdamW": lambda: torch.optim.AdamW(params),
            "Adagrad": lambda: torch.optim.Adagrad(params),
            "RMSprop": lambda: torch.optim.RMSprop(params)}[name]()


def step(net, opt, x):
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    opt.step()


def max_diff(net, expected):
    worst = 0.0
    for name, tensor in net.state_dict().items():
        worst = max(worst, (tensor.double() - expected[name].double()).abs().max().item())
    return worst


def flip_a_tensor_byte(source, target):
    """Copies source to target with one byte in the middle of its largest tensor record flipped."""
    shutil.copyfile(source, target)
    with zipfile.ZipFile(target) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(target, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_size, extra_size = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_size + extra_size + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def main():
    dtrain_dir, python_dir = sys.argv[1], sys.argv[2]
    saved = torch.load(os.path.join(dtrain_dir, "checkpoint-3.ckpt"), weights_only=True)
    expected = torch.load(os.path.join(dtrain_dir, "expected-4.ckpt"), weights_only=True)
    for key, kind in (("format", int), ("step", int), ("model", dict), ("optimizer", dict),
                      ("sampler", dict), ("rng", torch.Tensor), ("tensors", dict), ("values", dict)):
        if not isinstance(saved.get(key), kind):
            sys.exit(f"checkpoint-3.ckpt: '{key}' is {type(saved.get(key)).__name__}, not {kind.__name__}")
    if saved["step"] != 3 or saved["sampler"] != {"epoch": 2, "samples_consumed": 24}:
        sys.exit(f"checkpoint-3.ckpt: step {saved['step']}, sampler {saved['sampler']}")
    name = saved["values"]["optimizer"]

    # dtrain's RNG state is torch.get_rng_state()'s: the same numbers follow.
    torch.set_rng_state(saved["rng"])
    if not torch.equal(torch.rand(4), saved["tensors"]["rng_next"]):
        sys.exit("checkpoint-3.ckpt: its rng does not draw what dtrain drew next")
    if "grad_scaler" in saved:
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(saved["grad_scaler"])
        if scaler.get_scale() != 1024.0:
            sys.exit(f"checkpoint-3.ckpt: GradScaler scale {scaler.get_scale()}, dtrain's 1024")

    net = model()
    net.load_state_dict(saved["model"])  # strict: every name matches
    opt = optimizer(name, net, saved["optimizer"]["param_groups"])
    opt.load_state_dict(saved["optimizer"])
    step(net, opt, saved["tensors"]["batch4"])
    diff = max_diff(net, expected["model"])
    if diff > TOLERANCE:
        sys.exit(f"{name}: PyTorch's step 4 from dtrain's checkpoint differs from dtrain's by {diff}")

    os.makedirs(python_dir, exist_ok=True)
    batch5 = torch.randn(8, 6)
    torch.save({"step": 4, "model": net.state_dict(), "optimizer": opt.state_dict(),
                "sampler": {"epoch": 2, "samples_consumed": 32}, "rng": torch.get_rng_state(),
                "tensors": {"batch5": batch5}, "values": {"optimizer": name}},
               os.path.join(python_dir, "checkpoint-4.ckpt"))
    step(net, opt, batch5)
    torch.save({"model": net.state_dict()}, os.path.join(python_dir, "expected-5.ckpt"))
    flip_a_tensor_byte(os.path.join(python_dir, "checkpoint-4.ckpt"),
                       os.path.join(python_dir, "checkpoint-6.ckpt"))
    print(f"interop ok max_diff={diff:.3g}")


if __name__ == "__main__":
    main()
