#!/usr/bin/env bash
# Issue 11: where a 2-rank DDP step loses its time against one process with 2 intra-op threads (MLP H=1024,
# 64 samples per step), in one command. REPEATS interleaved rounds of:
#   A  1 process, 2 intra-op threads, 64 samples          (the reference of the 1.1x target)
#   B  DDP, 2 ranks x 32 samples, default options
#   C  DDP, 2 ranks x 32 samples, separate gradients (gradient_as_bucket_view off)
#   D  2 ranks each training alone on 32 samples, side by side (B's computation without communication)
#   E  1 rank alone, 32 samples                            (the same computation without a neighbour)
# Prints the median ms/step of each and its ratio to A, the median of B's and D's per-round ratios to A, then the mean per-step breakdown (DTRAIN_PROFILE)
# of the B, C and D runs, and the load average before and after.
#   bench/ddp_breakdown.sh [build dir]          (REPEATS=5 STEPS=200 by default)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
repeats=${REPEATS:-5}
steps=${STEPS:-200}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
ms_of() { grep -o 'ms/step=[0-9.]*' | tail -1 | cut -d= -f2; }
run() {  # run NAME NPROC ARGS...: one run, its ms/step appended to $work/NAME.ms, its records to NAME.jsonl
  local name=$1 nproc=$2
  shift 2
  DTRAIN_PROFILE=$work/$name.jsonl "$build/bin/dtrain" run --nproc-per-node "$nproc" -- \
    "$build/bin/bench_ddp" --hidden 1024 --steps "$steps" "$@" 2>&1 | ms_of >>"$work/$name.ms"
}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < repeats; i++)); do
  run A 1 --batch 64 --no-ddp --threads 2
  run B 2 --batch 32
  run C 2 --batch 32 --separate-grads
  run D 2 --batch 32 --local
  run E 1 --batch 32 --no-ddp
done
echo "load after:  $(cut -d' ' -f1-3 /proc/loadavg)"
a=$(median <"$work/A.ms")
echo
echo "| configuration | ms/step (median of $repeats) | / A |"
echo "|---|---:|---:|"
for name in A B C D E; do
  case $name in
    A) label="A: 1 process, 2 intra-op threads, 64 samples" ;;
    B) label="B: DDP, 2 ranks x 32 samples" ;;
    C) label="C: DDP, 2 ranks x 32, separate gradients" ;;
    D) label="D: 2 ranks alone side by side, 32 each, no communication" ;;
    E) label="E: 1 rank alone, 32 samples" ;;
  esac
  m=$(median <"$work/$name.ms")
  echo "| $label | $m | $(awk -v m="$m" -v a="$a" 'BEGIN {printf "%.2f", m / a}') |"
done
echo
# On a shared VM the host's load drifts between rounds and moves every configuration at once; the ratio of
# each round's B to the same round's A, taken minutes apart at most, is steadier than the ratio of medians.
for name in B D; do
  paired=$(paste -d' ' "$work/A.ms" "$work/$name.ms" | awk '{printf "%.3f\n", $2 / $1}')
  echo "$name / A per round: $(echo $paired) -> median $(echo "$paired" | median)"
done
echo
python3 - "$work" <<'PY'
import json, sys, statistics
work = sys.argv[1]
fields = ["step_s", "forward_s", "backward_s", "exposed_comm_s", "optimizer_s", "other_s", "comm_s"]
print("| run (mean per step, ms) | " + " | ".join(f[:-2] for f in fields) + " |")
print("|---|" + "---:|" * len(fields))
for name in "BCDE":
    try:
        records = [json.loads(l) for l in open(f"{work}/{name}.jsonl")]
    except FileNotFoundError:
        continue
    records = [r for r in records if r["step"] >= 5]  # warm-up steps out
    if not records:
        continue
    means = [1000 * statistics.mean(r[f] for r in records) for f in fields]
    print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
PY
