#!/usr/bin/env bash
# Side by side, in one run: dtrain's bench_ddp against PyTorch's Python DDP peer (shared/peers/) on the same
# workload, for each world size and hidden width; prints a markdown table of ms/step and their ratio.
# Each point runs dtrain and PyTorch alternately, REPEATS times, and reports the medians.
#   bench/compare_ddp.sh [build dir] [peer dir]      (REPEATS=3 STEPS_SCALE=1 by default)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
peers=${2:-$here/../shared/peers}
repeats=${REPEATS:-3}
batch=32

median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
ms_of() { grep -o 'ms/step=[0-9.]*' | tail -1 | cut -d= -f2; }

echo "| ranks | hidden | steps | dtrain ms/step | PyTorch ms/step | dtrain / PyTorch |"
echo "|---:|---:|---:|---:|---:|---:|"
for world in 1 2 4; do
  for hidden in 256 1024 4096; do
    case $hidden in 256) steps=200 ;; 1024) steps=60 ;; *) steps=10 ;; esac
    ours=() theirs=()
    for ((i = 0; i < repeats; i++)); do
      ours+=("$("$build/bin/dtrain" run --nproc-per-node "$world" -- "$build/bin/bench_ddp" --hidden "$hidden" \
        --batch "$batch" --steps "$steps" 2>&1 | ms_of)")
      theirs+=("$(N=$world "$peers/run_torch_peer.sh" "$steps" "$hidden" "$batch" 2>&1 | ms_of)")
    done
    a=$(printf '%s\n' "${ours[@]}" | median)
    b=$(printf '%s\n' "${theirs[@]}" | median)
    echo "| $world | $hidden | $steps | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", a / b}') |"
  done
done
