#!/usr/bin/env bash
# The DDP wrapper's own costs and knobs, side by side in one run (medians of REPEATS runs each):
#   wrapper cost at world size 1 (DDP vs no wrapper), overlap on vs off, bucket-size sweep, and
#   DataParallel (2 replicas) vs DDP (2 processes) vs one process with 2 intra-op threads.
#   bench/ddp_costs.sh [build dir]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
repeats=${REPEATS:-3}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
ms_of() { grep -o 'ms/step=[0-9.]*' | tail -1 | cut -d= -f2; }
# point LABEL NPROC ARGS...: prints "| LABEL | median ms/step |"
point() {
  local label=$1 nproc=$2
  shift 2
  local runs=()
  for ((i = 0; i < repeats; i++)); do
    runs+=("$("$build/bin/dtrain" run --nproc-per-node "$nproc" -- "$build/bin/bench_ddp" "$@" 2>&1 | ms_of)")
  done
  echo "| $label | $(printf '%s\n' "${runs[@]}" | median) |"
}

echo "### Wrapper cost at world size 1 (batch 32)"
echo "| configuration | ms/step |"
echo "|---|---:|"
for h in 256 1024 4096; do
  steps=$([ $h = 4096 ] && echo 10 || echo 100)
  point "H=$h, no wrapper" 1 --hidden $h --batch 32 --steps $steps --no-ddp
  point "H=$h, DDP" 1 --hidden $h --batch 32 --steps $steps
done

echo
echo "### Overlap and bucket size, 2 ranks, H=1024, batch 32 per rank"
echo "| configuration | ms/step |"
echo "|---|---:|"
point "overlap on, 25 MiB buckets (default)" 2 --hidden 1024 --batch 32 --steps 60
point "overlap off, 25 MiB buckets" 2 --hidden 1024 --batch 32 --steps 60 --no-overlap
for mb in 1 4 100; do
  point "overlap on, $mb MiB buckets" 2 --hidden 1024 --batch 32 --steps 60 --bucket-mb $mb
done
point "overlap on, 25 MiB, separate gradients (gradient_as_bucket_view off)" 2 --hidden 1024 --batch 32 --steps 60 --separate-grads
DTRAIN_SHM=0 point "overlap on, 25 MiB buckets, Gloo only (DTRAIN_SHM=0)" 2 --hidden 1024 --batch 32 --steps 60


echo
echo "### Two workers in one step: DataParallel vs DDP vs intra-op threads (64 samples per step, H=1024)"
echo "| configuration | ms/step |"
echo "|---|---:|"
point "DataParallel, 2 CPU replicas, 1 process" 1 --hidden 1024 --batch 32 --steps 60 --dp 2
point "DataParallel, 2 CPU replicas, outputs gathered for one loss" 1 --hidden 1024 --batch 32 --steps 60 --dp 2 --dp-gather
point "DDP, 2 processes" 2 --hidden 1024 --batch 32 --steps 60
point "1 process, 2 intra-op threads, no wrapper" 1 --hidden 1024 --batch 64 --steps 60 --no-ddp --threads 2
point "1 process, 1 thread, no wrapper (reference)" 1 --hidden 1024 --batch 64 --steps 60 --no-ddp
