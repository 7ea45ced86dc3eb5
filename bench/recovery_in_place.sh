#!/usr/bin/env bash
# In-place recovery (issue 21): from a worker's kill -9 to the survivors' next completed step, and
# the steps around it, with the example trainer (--model mlp, 3 processes on this host, no launcher:
# the kill and the recovery are the trainer's own).
#
#   bench/recovery_in_place.sh [runs]        (default 5; needs build/bin/train_fashion_mnist)
#
# Rank 2 kills itself (DTRAIN_TEST_KILL_AT_STEP=2:STEP) right after committing step STEP; rank 0
# prints every step (--log-every 1), each line stamped as it arrives ($EPOCHREALTIME). Reported per
# run: the gap between rank 0's lines for steps STEP and STEP+1 (kill -> the survivors' next
# completed step: failure detection, the new generation, its Gloo and shared-memory connection,
# DDP's set-up, the step redone at 2 ranks) and, for scale, the median gap between two ordinary
# steps before the kill.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"  # check_count
trainer=${TRAINER:-$here/build/bin/train_fashion_mnist}
runs=${1:-5}
check_count bench/recovery_in_place.sh "the number of runs" "$runs"
step=${KILL_STEP:-300}
[ -x "$trainer" ] || { echo "bench/recovery_in_place.sh: build $trainer first" >&2; exit 2; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT


for run in $(seq "$runs"); do
  port=$((29900 + run))
  pids=()
  for r in 0 1 2; do
    env WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r LOCAL_RANK=$r \
      DTRAIN_RECOVERY=in-place DTRAIN_TEST_KILL_AT_STEP=2:$step \
      timeout 300 "$trainer" --model mlp --epochs 1 --log-every 1 --max-steps $((step + 50)) \
      > >(if [ $r = 0 ]; then stamp > "$work/rank0"; else cat > /dev/null; fi) 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}" 2>/dev/null || true
  sleep 0.2  # the stamping reader drains the last lines
  kill_gap=$(awk -v s="$step" '$2 == "step" { t[$3] = $1 } END { printf "%.3f", t[s + 1] - t[s] }' "$work/rank0")
  ordinary=$(awk -v s="$step" '$2 == "step" { t[$3] = $1 }
    END { for (i = s - 100; i < s; ++i) if ((i in t) && ((i + 1) in t)) print t[i + 1] - t[i] }' \
    "$work/rank0" | sort -g | awk '{ g[NR] = $1 } END { printf "%.4f", g[int((NR + 1) / 2)] }')
  echo "run $run: kill -> the survivors' next completed step ${kill_gap} s; an ordinary step ${ordinary} s (median)"
  grep -h "ready in" "$work/rank0" |
    sed 's/.*\(generation [0-9]* of [0-9]* ranks (was [0-9]*) ready in [^)]*)\).*failed after \([0-9.]* s\).*/  \1; the failed all-reduce gave up after \2/'
done
