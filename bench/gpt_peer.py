"""train_gpt's transformer in plain PyTorch, for side-by-side speed on one GPU (bench/gpt_vs_torch.sh).

The model is tools/gpt/gpt.cpp layer for layer (Llama-shaped: RMSNorm, rotary embeddings in the rotate-half
convention, grouped key/value heads, SwiGLU), with the same parameter names ("block3.attention.wq.weight") and
PyTorch's default initialisation (as LibTorch's, not bit for bit). The data is train_gpt's: the corpus bytes as
tokens, non-overlapping windows of --seq-len + 1 bytes from the first 95%, dealt by DistributedSampler. The
optimizer is AdamW with LibTorch's defaults. Under a launcher that sets WORLD_SIZE (dtrain run, torchrun) the
ranks train in the layout the flags ask for (below; DistributedDataParallel without any), NCCL on cuda, Gloo on
cpu; without one, a single process.
    .venv/bin/python bench/gpt_peer.py --device cpu --steps 20 --max-bytes 200000
    build/bin/dtrain run --nproc-per-node 1 -- .venv/bin/python bench/gpt_peer.py --device cuda --amp bf16
    build/bin/dtrain run --nproc-per-node 4 -- .venv/bin/python bench/gpt_peer.py --device cpu --dp 2 --tp 2
Rank 0 prints one JSON line, with train_gpt's field names.

The layouts, with train_gpt's flags and PyTorch's own implementation of each (bench/gpt_layouts.sh), combined as
torchtitan combines them: --dp D x --pp P x --tp T ranks on one init_device_mesh (dp, pp, tp), tensor ranks
neighbours as in train_gpt's mesh (rank = (d * P + p) * T + t); --dp defaults to the world size / (T x P).
  (none)        DistributedDataParallel over the data dimension (over every rank when alone)
  --zero 3      FSDP2 over the data dimension: fully_shard on each block, then on the whole model (or stage)
  --tp T        DTensor's parallelize_module: wq, wk, wv, w1, w3 ColwiseParallel, wo and w2 RowwiseParallel (Megatron's
                split, as train_gpt's --tp); the embedding, the norms and the head replicated
  --tp T --sp   and DTensor's sequence parallelism, as torchtitan's Llama plan: the norms (SequenceParallel) and
                the residual stream hold a slice of the sequence, attention and the MLP all-gather it
                (PrepareModuleInput) and their output projections reduce-scatter it (RowwiseParallel to
                Shard(1)); the embedding by rows to a sequence slice, the head by columns back to whole logits
  --pp P        torch.distributed.pipelining: the blocks cut into P stages as train_gpt cuts them (the embedding on
                the first, the norm and the head on the last), --schedule gpipe or 1f1b, --micro-batches M
With --tp > 1 and more than one replica, --zero 0 uses PyTorch's replicate() (torch.distributed._composable.
replicate_with_fsdp: DDP's all-reduce of the gradients on FSDP2's machinery, each block and the whole model, as
torchtitan's apply_replicate_to_model), since DistributedDataParallel does not take DTensor parameters. With --pp,
FSDP2 keeps the parameters gathered between the micro-batches (reshard_after_forward=False, as torchtitan).
"""
import argparse
import contextlib
import gzip
import json
import os
import sys
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB = 256  # bytes as tokens
ROPE_THETA = 10000.0
NORM_EPS = 1e-5
HELDOUT_FRACTION = 0.05  # the corpus tail train_gpt keeps for validation; never trained on
DEFAULT_CORPUS = "/usr/share/dictd/gcide.dict.dz"


def fail(message):
    """A usage or environment error: one line, exit code 2 (house style)."""
    print(f"gpt_peer.py: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def model_flops_per_token(params, layers, width, seq_len):
    """Training FLOPs per token as the PaLM paper's appendix B counts them: 6N + 12·L·H·Q·T, where N is every
    parameter (the embedding and the head included), L the layers, H·Q the attention width (heads x head_dim
    = width) and T the sequence length. 6N is the forward (2N) and backward (4N) of the matmuls; the second
    term the attention scores and their weighted sum, which hold no parameters. train_gpt uses this formula
    too, so model_tflops compares like with like."""
    return 6 * params + 12 * layers * width * seq_len


def mlp_hidden(width, mlp_width=0):
    """GptConfig::hidden(): mlp_width, or 8/3 x width rounded up, then up to a multiple of 8."""
    if mlp_width > 0:
        return mlp_width
    raw = (8 * width + 2) // 3
    return (raw + 7) // 8 * 8


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim, seq, device):
    """cos and sin [seq, head_dim], float32: pair i (features i and i + d/2) turns at theta^(-2i/d)."""
    inverse = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inverse)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    half = x.size(-1) // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Attention(nn.Module):
    def __init__(self, width, heads, kv_heads, seq_len):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.wq = nn.Linear(width, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, width, bias=False)
        # Plain tensors, not buffers, as in gpt.cpp: a function of the config, so DDP must not broadcast them
        # every forward. Built once for seq_len on the default device (main builds the model under its device).
        self.cos, self.sin = rotary_tables(self.head_dim, seq_len, None)

    def forward(self, x):
        batch, seq, _ = x.shape
        cos, sin = self.cos[:seq], self.sin[:seq]

        def split(t, heads):  # [batch, heads, seq, head_dim], as scaled_dot_product_attention takes them
            return t.view(batch, seq, heads, self.head_dim).transpose(1, 2)

        q = rotate(split(self.wq(x), self.heads), cos, sin)
        k = rotate(split(self.wk(x), self.kv_heads), cos, sin)
        v = split(self.wv(x), self.kv_heads)
        if self.kv_heads != self.heads:  # each key/value head serves heads / kv_heads query heads
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(attended.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class Mlp(nn.Module):  # SwiGLU: w2(silu(w1 x) * w3 x); created in gpt.cpp's order w1, w2, w3
    def __init__(self, width, hidden):
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = RMSNorm(args.width)
        self.attention = Attention(args.width, args.heads, args.kv_heads, args.seq_len)
        self.mlp_norm = RMSNorm(args.width)
        self.mlp = Mlp(args.width, mlp_hidden(args.width))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def gpt(args):
    """gpt::Gpt: a Sequential of embedding, block0 .. block<L-1>, norm, head, children in that order."""
    children = [("embedding", nn.Embedding(VOCAB, args.width))]
    children += [(f"block{i}", Block(args)) for i in range(args.layers)]
    children += [("norm", RMSNorm(args.width)), ("head", nn.Linear(args.width, VOCAB, bias=False))]
    return nn.Sequential(OrderedDict(children))


class ByteWindows(Dataset):
    """datasets::ByteWindows: sample i is bytes [i*seq_len, (i+1)*seq_len + 1), input the first seq_len, target
    the last seq_len, int64."""

    def __init__(self, data, seq_len):
        if len(data) < seq_len + 1:
            fail(f"{len(data)} bytes of training text hold no window of --seq-len {seq_len} + 1; use a shorter"
                 " sequence or a larger --max-bytes")
        self.data, self.seq_len = data, seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        window = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]


def load_corpus(path, max_bytes):
    """The first 95% of the corpus (or of its first max_bytes) as uint8; gzip'd (dictzip included) or plain,
    told by the first two bytes, as tools/datasets reads it."""
    try:
        with open(path, "rb") as f:
            zipped = f.read(2) == b"\x1f\x8b"
        with (gzip.open if zipped else open)(path, "rb") as f:
            data = f.read(max_bytes if max_bytes > 0 else -1)
    except OSError as e:
        fail(f"text corpus {path}: {e.strerror or e}; install Debian's dict-gcide or set DTRAIN_TEXT_CORPUS"
             " (or --corpus) to another text file")
    if not data:
        fail(f"text corpus {path} is empty; point --corpus at a file with text in it")
    train = len(data) - int(len(data) * HELDOUT_FRACTION)
    return torch.frombuffer(bytearray(data[:train]), dtype=torch.uint8)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64, help="the model dimension")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank and step")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="steps run before the clock starts (allocator, kernels, --compile's compilation)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--amp", choices=("none", "bf16"), default="none", help="bf16: autocast over forward and loss")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                   help="auto: cuda:LOCAL_RANK where CUDA is available, else cpu")
    p.add_argument("--max-bytes", type=int, default=0, help="read only this much of the corpus (0: all)")
    p.add_argument("--corpus", default=os.environ.get("DTRAIN_TEXT_CORPUS") or DEFAULT_CORPUS,
                   help="text file, gzip'd or plain (default: $DTRAIN_TEXT_CORPUS, else GCIDE)")
    p.add_argument("--log-every", type=int, default=20, help="rank 0 prints the loss every N steps (0: never)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (give it --warmup-steps)")
    p.add_argument("--zero", type=int, choices=(0, 3), default=0,
                   help="3: FSDP2 over the data dimension (0: DDP)")
    p.add_argument("--dp", type=int, default=0,
                   help="data-parallel replicas (default: world size / (tp x pp); dp x tp x pp = world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks that split every block (DTensor)")
    p.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism (DTensor's SequenceParallel)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (torch.distributed.pipelining)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="with --pp")
    p.add_argument("--micro-batches", type=int, default=4, help="with --pp")
    args = p.parse_args()
    for name in ("layers", "width", "heads", "kv_heads", "seq_len", "batch_size", "steps", "tp", "pp",
                 "micro_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    if min(args.warmup_steps, args.max_bytes, args.log_every, args.dp) < 0:
        p.error("--warmup-steps, --max-bytes, --log-every and --dp: expected 0 or more")
    # GptConfig::check()'s rules, so that a config train_gpt refuses is refused here too.
    if args.width % args.heads != 0 or (args.width // args.heads) % 2 != 0:
        p.error(f"--width {args.width} / --heads {args.heads}: expected a whole, even head dimension "
                "(rotary embeddings rotate pairs of features)")
    if args.heads % args.kv_heads != 0:
        p.error(f"--heads {args.heads} does not divide by --kv-heads {args.kv_heads}")
    return args


def tensor_parallel(model, mesh, degree, sequence_parallel):
    """Megatron's split through DTensor, as torchtitan's Llama: query/key/value and the MLP's w1/w3 by columns
    (heads), the attention output and w2 by rows; each block's attention then holds heads / degree heads. With
    sequence_parallel, torchtitan's plan for the norms and the residual stream (see the module's docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "attention": gather,
                     "attention.wo": RowwiseParallel(output_layouts=Shard(1)), "mlp_norm": SequenceParallel(),
                     "mlp": gather, "mlp.w2": RowwiseParallel(output_layouts=Shard(1))})
        parallelize_module(model, mesh, {
            "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for name, child in model.named_children():
        if name.startswith("block"):
            parallelize_module(child, mesh, plan)
            child.attention.heads //= degree
            child.attention.kv_heads //= degree


def stage_module(model, stages, index):
    """Stage `index`'s part of the model: the blocks dealt as train_gpt deals them (as evenly as they go, the first
    stages taking one more), the embedding on the first stage, the norm and the head on the last."""
    children = list(model.named_children())
    blocks = [c for c in children if c[0].startswith("block")]
    per, extra = divmod(len(blocks), stages)
    begin = index * per + min(index, extra)
    mine = blocks[begin:begin + per + (1 if index < extra else 0)]
    if index == 0:
        mine = [children[0]] + mine
    if index == stages - 1:
        mine = mine + children[-2:]
    return nn.Sequential(OrderedDict(mine))


def data_parallel(module, args, mesh, device):
    """`module` (the model, or this rank's pipeline stage) over the mesh's data dimension, as torchtitan applies
    it: FSDP2 (--zero 3) or replicate (--zero 0 with --tp) on each block, then on the whole; DDP otherwise.
    FSDP2 under a pipeline keeps the parameters gathered between micro-batches (torchtitan's default there)."""
    if args.zero == 3 or args.tp > 1:
        from torch.distributed.fsdp import fully_shard
        if args.zero == 3:
            wrap = lambda m: fully_shard(m, mesh=mesh, reshard_after_forward=args.pp == 1)  # noqa: E731
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate
            wrap = lambda m: replicate(m, mesh=mesh)  # noqa: E731
        for name, child in module.named_children():
            if name.startswith("block"):
                wrap(child)
        return wrap(module)
    return nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                               process_group=mesh.get_group())


def main():
    args = parse()
    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device; use --device cpu or auto")
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    # train_gpt's gpt::check_degrees
    if world % (args.tp * args.pp):
        fail(f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} does not divide the world size {world}; run a"
             " multiple of their product, or change the degrees")
    dp = args.dp or world // (args.tp * args.pp)
    if dp * args.tp * args.pp != world:
        fail(f"--dp {dp} x --tp {args.tp} x --pp {args.pp} = {dp * args.tp * args.pp} ranks, but the world size is"
             f" {world}; their product must equal it (leave --dp out for {world} / (tp x pp))")
    if args.sp and (args.tp < 2 or args.seq_len % args.tp):
        fail(f"--sp needs --tp 2 or more dividing --seq-len {args.seq_len} (got --tp {args.tp})")
    if args.tp > 1 and (args.heads % args.tp or args.kv_heads % args.tp):
        fail(f"--tp {args.tp} does not divide --heads {args.heads} and --kv-heads {args.kv_heads}")
    if args.pp > 1 and args.batch_size % args.micro_batches:
        fail(f"--micro-batches {args.micro_batches} does not divide --batch-size {args.batch_size}")
    # This rank's place on the mesh, train_gpt's order (dtrain::make_rank_mesh): tensor ranks neighbours, then the
    # stages, then the replicas. init_device_mesh lays (dp, pp, tp) out row-major, the same order.
    replica, stage_index = rank // (args.pp * args.tp), rank // args.tp % args.pp
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (dp, args.pp, args.tp), mesh_dim_names=("dp", "pp", "tp"))

    torch.manual_seed(0)  # the same start on every rank (DDP broadcasts rank 0's; FSDP2 keeps each rank's own)
    with device:  # on the device from the start: the rotary tables are not buffers, which .to() would move
        model = gpt(args)
    params = sum(p.numel() for p in model.parameters())
    # In torchtitan's order: the tensor split (of the whole model: the --sp plan names the embedding, the norm and
    # the head), the pipeline's cut, the data dimension around this rank's part, then the pipeline stage.
    if args.tp > 1:
        tensor_parallel(model, mesh["tp"], args.tp, args.sp)
    if args.pp > 1:
        model = stage_module(model, args.pp, stage_index)
    # No data dimension for a single replica, but for --zero 3 or one rank under a launcher (DDP over that one
    # rank, as before the mesh, so that a one-GPU comparison keeps its layout).
    if distributed and (dp > 1 or args.zero == 3 or world == 1):
        model = data_parallel(model, args, mesh["dp"], device)
    schedule = None
    if args.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        def flat_loss(logits, targets):
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

        stage = PipelineStage(model, stage_index, args.pp, device, group=mesh["pp"].get_group())
        cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stage, n_microbatches=args.micro_batches, loss_fn=flat_loss)
    if args.compile:  # after DDP, as PyTorch's docs do it: DDPOptimizer then cuts the graph at bucket edges
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.01)

    windows = ByteWindows(load_corpus(args.corpus, args.max_bytes), args.seq_len)
    # A shuffled sampler with one replica when not distributed: the same order as rank 0 of one.
    # Tensor and pipeline ranks read the same windows: one replica of the data per data-parallel rank.
    sampler = DistributedSampler(windows, num_replicas=dp, rank=replica, shuffle=True, seed=0)
    loader = DataLoader(windows, batch_size=args.batch_size, sampler=sampler)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.amp == "bf16" \
        else contextlib.nullcontext

    def rank_mean(loss):  # the replicas' mean over the world, SUM then divide: Gloo has no AVG
        loss = loss.detach().float().clone()
        if distributed:
            dist.all_reduce(loss)
            # Each replica's tp ranks hold the same loss, on its last stage only (the other stages hold 0):
            # dp x tp copies of the losses summed.
            loss /= dp * args.tp
        return loss.item()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    total = args.warmup_steps + args.steps
    step, first_loss, last_loss, start = 0, 0.0, 0.0, None
    epoch = 0
    while step < total:
        sampler.set_epoch(epoch)
        epoch += 1
        for inputs, targets in loader:
            if step == total:
                break
            if step == args.warmup_steps:  # the clock covers the timed steps only
                sync()
                start = time.perf_counter()
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            if schedule is not None:
                losses = []
                last = stage_index == args.pp - 1
                with autocast():
                    schedule.step(*([inputs] if stage_index == 0 else []), target=targets if last else None,
                                  losses=losses if last else None)
                loss = torch.stack(losses).mean() if last else torch.zeros(())
            else:
                with autocast():
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
                loss.backward()
            optimizer.step()
            step += 1
            # As train_gpt: the ranks' mean only for the steps reported (the very first, warm-up or not, the
            # logged and the last), the same steps on every rank, inside the clock as there.
            logged = args.log_every > 0 and step % args.log_every == 0
            if step == 1 or logged or step == total:
                last_loss = rank_mean(loss)
                if step == 1:
                    first_loss = last_loss
                if logged and rank == 0:
                    print(f"step {step}: loss {last_loss:.4f}", flush=True)
    sync()
    seconds = time.perf_counter() - start

    tokens_per_s = args.steps * args.batch_size * args.seq_len * dp / seconds  # each replica's windows
    flops = model_flops_per_token(params, args.layers, args.width, args.seq_len)
    if rank == 0:
        print(json.dumps({
            "steps": args.steps, "warmup_steps": args.warmup_steps, "world_size": world, "pp": args.pp, "dp": dp,
            "tp": args.tp, "sp": args.sp, "zero": args.zero, "device": device.type,
            "amp": args.amp, "first_loss": round(first_loss, 6), "train_loss": round(last_loss, 6),
            "tokens_per_s": round(tokens_per_s, 3), "model_flops_per_token": flops,
            "model_tflops": float(f"{tokens_per_s * flops / 1e12:.6g}"), "params": params}), flush=True)
    if distributed:
        dist.destroy_process_group()
    # PyTorch 2.15 on the CPU sometimes aborts while the interpreter exits after DTensor's tensor
    # parallelism ("terminate called without an active exception", exit 134), with the work done and
    # its line printed; leave at once instead, so that a measured round is not lost to it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
