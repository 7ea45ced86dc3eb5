"""bench_checkpoint's PyTorch peer: how long torch.distributed.checkpoint.async_save (DCP) holds the
training loop, on the same MLP, optimizer, batch and cadence as `bench_checkpoint --model mlp`.

    dcp_async_peer.py [--saves 20] [--steps-between 100] [--dir DIR] [--mode async|blocking]

Prints one JSON line with bench_checkpoint's keys: held_ms_median (the time dcp.async_save, or
dcp.save in blocking mode, takes to return), held_ms_p90, train_step_ms_median and, for async,
save_and_wait_ms_median (async_save followed at once by the future's result). One intra-op thread,
as one rank of the trainer and as bench_checkpoint. Without a process group DCP saves as one rank.
"""

import argparse
import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed.checkpoint as dcp


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--steps-between", type=int, default=100)
    parser.add_argument("--dir", default="/tmp/dtrain-bench-dcp")
    parser.add_argument("--mode", choices=("async", "blocking"), default="async")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def train_step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    train_step()  # momentum buffers exist from here on
    shutil.rmtree(args.dir, ignore_errors=True)

    def save(step):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        path = os.path.join(args.dir, f"checkpoint-{step}")
        if args.mode == "async":
            return dcp.async_save(state, checkpoint_id=path)
        dcp.save(state, checkpoint_id=path)
        return None

    held, steps, written = [], [], []
    pending = None
    for i in range(args.saves):
        start = time.perf_counter()
        if pending is not None:  # as dtrain's Checkpointer: a new save waits for the previous one
            pending.result()
        pending = save(i)
        held.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        for _ in range(args.steps_between):
            train_step()
        steps.append((time.perf_counter() - start) * 1e3 / args.steps_between)
    if pending is not None:
        pending.result()
    if args.mode == "async":
        for i in range(max(5, args.saves // 4)):
            start = time.perf_counter()
            save(args.saves + i).result()
            written.append((time.perf_counter() - start) * 1e3)
    folder = os.path.join(args.dir, f"checkpoint-{args.saves - 1}")
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    held.sort()
    line = {"model": "mlp", "mode": args.mode, "file_bytes": size, "saves": args.saves,
            "held_ms_median": round(statistics.median(held), 3),
            "held_ms_p90": round(held[min(len(held) - 1, len(held) * 9 // 10)], 3),
            "train_step_ms_median": round(statistics.median(steps), 3)}
    if written:
        line["save_and_wait_ms_median"] = round(statistics.median(written), 3)
    print(json.dumps(line))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
