#!/usr/bin/env bash
# train_gpt in each layout against PyTorch's own implementation of that layout on the same model, same sizes and
# the same number of ranks (bench/gpt_peer.py: DDP, FSDP2's fully_shard, DTensor's parallelize_module,
# torch.distributed.pipelining), eager against eager, on the CPU: bench/gpt_vs_torch.sh once per layout and size,
# each side under `dtrain run --nproc-per-node $NPROC` with the same flags, sides alternating round by round.
# Prints gpt_vs_torch.sh's table for each, then one summary line per layout and size: the median (range) of the
# paired ratios dtrain / PyTorch of tokens/s (above 1: dtrain faster).
#   bench/gpt_layouts.sh [build dir]
# Environment: BUILD, PYTHON, REPEATS (3), NPROC (2), LAYOUTS (';'-separated flags, default the four below),
# SIZES (';'-separated model flags, default a small model and one whose matrix products take most of the step).
# A layout may combine them on one mesh, --dp x --tp x --pp = NPROC on both sides (the peer's mesh in
# gpt_peer.py's docstring); the combined rows of doc/benchmarks.md:
#   NPROC=4 LAYOUTS="--tp 2 --pp 2 --micro-batches 4;--dp 2 --pp 2 --micro-batches 4;--dp 2 --tp 2;--dp 2 --tp 2 --zero 3" bench/gpt_layouts.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${BUILD:-$here/build}}
export REPEATS=${REPEATS:-3} NPROC=${NPROC:-2}
IFS=';' read -r -a layouts <<<"${LAYOUTS:-;--zero 3;--tp 2;--pp 2 --micro-batches 4 --schedule 1f1b}"
IFS=';' read -r -a sizes <<<"${SIZES:---layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 64 --batch-size 8 --steps 30;\
--layers 4 --width 256 --heads 8 --kv-heads 4 --seq-len 128 --batch-size 8 --steps 10}"
common="--warmup-steps 3 --device cpu --max-bytes 2000000 --log-every 0"
summary=()
for size in "${sizes[@]}"; do
  for layout in "${layouts[@]}"; do
    echo
    echo "## ${layout:-DDP} at $NPROC ranks: $size"
    out=$(GPT_ARGS="$size $common $layout" EXTRA_PEER_ROW="" "$here/bench/gpt_vs_torch.sh" "$build" 2>&1) ||
      { echo "$out" | tail -3; summary+=("| ${layout:-DDP} | $size | failed |"); continue; }
    echo "$out"
    ratio=$(grep -o "median of paired ratios (range): .*" <<<"$out" | head -1 | sed 's/.*: //')
    summary+=("| ${layout:-(DDP)} | ${size% --steps*} | $ratio |")
  done
done
echo
echo "## Summary: dtrain train_gpt / PyTorch tokens/s, median of paired ratios (range), $NPROC ranks, $REPEATS rounds"
echo "| layout | model | dtrain / PyTorch |"
echo "|---|---|---:|"
printf '%s\n' "${summary[@]}"
