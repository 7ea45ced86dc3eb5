#!/usr/bin/env bash
# ZeRO stages 1-3 against DDP, side by side: bytes per rank against the ZeRO formulas, peak RSS, step time
# and communication per step at N = 1, 2, 4 (rank 0's line of each run; medians of REPEATS runs for the
# step time), then the widest MLP each mode trains within BUDGET_MB per rank.
#   bench/sharded_memory.sh [build dir]      (HIDDEN=1024 LAYERS=4 STEPS=20 REPEATS=3 BUDGET_MB=128)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
hidden=${HIDDEN:-1024}
layers=${LAYERS:-4}
steps=${STEPS:-20}
repeats=${REPEATS:-3}
budget=${BUDGET_MB:-128}
field() { grep -o "\"$1\":[^,}]*" | head -1 | cut -d: -f2 | tr -d '"'; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
run() {  # run NPROC ARGS...: rank 0's JSON line
  local nproc=$1
  shift
  "$build/bin/dtrain" run --nproc-per-node "$nproc" -- "$build/bin/bench_sharded" "$@" 2>/dev/null |
    grep '"rank":0\|sharded-budget' | head -1
}

echo "uptime: $(uptime)"
echo "MLP 784-${hidden}x${layers}-10, Adam, batch 32 per rank, one thread per rank"
echo
echo "| mode | N | Ψ | params MB | grads MB | Adam MB | total MB | formula MB | vs formula | peak sampled MB | peak RSS MB | ms/step | comm MB/step (wire) | vs DDP |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
mb() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
for n in 1 2 4; do
  for mode in ddp 1 2 3; do
    times=()
    line=""
    for ((i = 0; i < repeats; i++)); do
      line=$(run "$n" --mode "$mode" --hidden "$hidden" --layers "$layers" --steps "$steps")
      times+=("$(echo "$line" | field ms_per_step)")
    done
    echo "| $mode | $n | $(echo "$line" | field params) | $(mb "$(echo "$line" | field param_bytes)") |" \
      "$(mb "$(echo "$line" | field grad_bytes)") | $(mb "$(echo "$line" | field optimizer_bytes)") |" \
      "$(mb "$(echo "$line" | field total_bytes)") | $(mb "$(echo "$line" | field formula_bytes)") |" \
      "$(echo "$line" | field vs_formula) | $(mb "$(echo "$line" | field peak_sampled_bytes)") |" \
      "$(echo "$line" | field peak_rss_mb) | $(printf '%s\n' "${times[@]}" | median) |" \
      "$(mb "$(echo "$line" | field comm_wire_bytes_per_step)") | $(echo "$line" | field wire_vs_ddp) |"
  done
done
echo
echo "Widest MLP 784-Hx${layers}-10 whose training state stays within ${budget} MiB per rank:"
echo
echo "| mode | N | widest H | Ψ | peak RSS MB |"
echo "|---|---:|---:|---:|---:|"
for n in 1 2 4; do
  for mode in ddp 1 2 3; do
    line=$(run "$n" --mode "$mode" --layers "$layers" --budget-mb "$budget")
    echo "| $mode | $n | $(echo "$line" | field widest_hidden) | $(echo "$line" | field params) | $(echo "$line" | field peak_rss_mb) |"
  done
done
