#!/usr/bin/env bash
# The cost of being ready to recover in place (issue 21) when nothing fails: the example trainer's
# DDP job (--model mlp, 2 workers on this host, one epoch of Fashion-MNIST) under `dtrain run`
# with --recovery in-place (dtrain::ResilientDataParallel: the admission count riding on the
# gradients' all-reduce, a store poll every 100 ms on another thread, the step as a function,
# batches taken from the sampler one at a time) against the same job under --recovery restart (plain
# DDP). The two sides alternate; reported: samples/s of each, and the median of the paired ratios.
#
#   bench/recovery_overhead.sh [rounds]     (default 5)
#
# This is the trainer's in-place path against its usual path, everything included: what a user
# of the trainer pays, not the recovery machinery alone.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${BUILD:-$here/build}
rounds=${1:-5}
check_count bench/recovery_overhead.sh "the number of rounds" "$rounds"
[ -x "$build/bin/train_fashion_mnist" ] || { echo "bench/recovery_overhead.sh: build the trainer first" >&2; exit 2; }

# run MODE: the trainer's final JSON line under --recovery MODE
run() {
  "$build/bin/dtrain" run --nproc-per-node 2 --recovery "$1" -- "$build/bin/train_fashion_mnist" \
    --model mlp --epochs 1 2>/dev/null | grep '"samples_per_s"' | tail -1
}
field() { grep -o "\"$1\":[0-9.e+-]*" | head -1 | cut -d: -f2; }
# share LINE: rank 0's readiness cost (dtrain::ReadinessCost: admission all-reduces plus the
# heartbeat thread's CPU time) as a percentage of its training time
share() {
  awk -v a="$(field admission_s <<<"$1")" -v h="$(field heartbeat_cpu_s <<<"$1")" \
      -v t="$(field train_time_s <<<"$1")" 'BEGIN { printf "%.3f", 100 * (a + h) / t }'
}

in_place="" restart="" shares=""
for round in $(seq "$rounds"); do
  if [ $((round % 2)) = 1 ]; then
    line=$(run in-place); b=$(run restart | field samples_per_s)
  else
    b=$(run restart | field samples_per_s); line=$(run in-place)
  fi
  a=$(field samples_per_s <<<"$line") s=$(share "$line")
  echo "round $round: in-place $a samples/s (readiness $s% of training time), restart $b samples/s" >&2
  in_place="$in_place $a" restart="$restart $b" shares="$shares $s"
done
echo "samples/s, median of $rounds: in-place $(list_median "$in_place"), restart $(list_median "$restart")"
echo "in-place / restart, median of the paired ratios: $(ratio_summary "${in_place# }" "${restart# }")"
echo "readiness cost measured inside the in-place runs, % of training time: median $(list_median "$shares") (max $(tr ' ' '\n' <<<"$shares" | grep . | sort -g | tail -1))"
