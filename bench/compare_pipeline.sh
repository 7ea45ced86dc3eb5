#!/usr/bin/env bash
# dtrain's multi-process pipeline against PyTorch's torch.distributed.pipelining, on the same MLP, cut, batch and
# micro-batches, one process per stage on this host, one intra-op thread each:
#   dtrain: dtrain run --nproc-per-node P -- bench_pipeline --mode mlp --distributed --schedule S [--virtual-stages 2]
#   torch:  torchrun --standalone --nproc-per-node P bench/pipelining_peer.py --schedule S --boundaries (dtrain's)
# For each of gpipe, 1f1b, interleaved (V = 2) and zbh1 the two sides run back to back, in alternating order from
# round to round (dtrain first in odd rounds); each prints the median step of STEPS after one warm-up step. zbh1 is
# dtrain's zero-bubble schedule against PyTorch's ScheduleInterleavedZeroBubble with one chunk per rank (the same
# ZB-H1 order). PyTorch's other zero-bubble schedules (ScheduleInterleavedZeroBubble with V = 2,
# ScheduleZBVZeroBubble, ScheduleDualPipeV; the interleaved cut) run once a round too, each against dtrain's zbh1
# of the same round (rows torch:<name>): zero-bubble against zero-bubble, with different chunkings.
#
#   bench/compare_pipeline.sh [rounds]          (default 5)
#   BUILD=/work/main/build bench/compare_pipeline.sh 3
# Environment: BUILD (default ./build; bin/dtrain and bin/bench_pipeline), BENCH_PIPELINE (a bench_pipeline
# elsewhere), TORCHRUN (default .venv/bin/torchrun), P (stages, 2), MICRO (micro-batches, 4), HIDDEN (2048),
# BATCH (256), STEPS (10), ZB (the reference schedules, "interleaved-zb zbv dualpipev"; empty for none).
# Prints each round's step times, then per schedule the medians and the median [min..max] of the paired
# ratios dtrain/torch (below 1: dtrain faster).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"  # median
build=${BUILD:-$here/build}
dtrain=$build/bin/dtrain
bench=${BENCH_PIPELINE:-$build/bin/bench_pipeline}
torchrun=${TORCHRUN:-$here/.venv/bin/torchrun}
rounds=${1:-5}
check_count bench/compare_pipeline.sh "the number of rounds" "$rounds"
P=${P:-2} MICRO=${MICRO:-4} HIDDEN=${HIDDEN:-2048} BATCH=${BATCH:-256} STEPS=${STEPS:-10}
zb=${ZB-interleaved-zb zbv dualpipev}
need_executables "bench/compare_pipeline.sh" "BUILD, BENCH_PIPELINE or TORCHRUN" "$dtrain" "$bench" "$torchrun"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

common=(--hidden "$HIDDEN" --batch "$BATCH" --micro-batches "$MICRO" --steps "$STEPS")
step_ms() { grep -o '"step_ms": *[0-9.]*' | tail -1 | sed 's/.*: *//'; }
boundaries() { grep -o '"boundaries": *\[[0-9, ]*\]' | tail -1 | sed 's/.*\[//; s/\]//; s/ //g'; }

run_dtrain() {  # schedule virtual_stages -> prints the JSON line (and keeps the cut for the peer)
  local out
  out=$(timeout 300 "$dtrain" run --nproc-per-node "$P" -- "$bench" --mode mlp --distributed --schedule "$1" \
    --virtual-stages "$2" "${common[@]}" 2> "$work/dtrain.err") ||
    { echo "bench/compare_pipeline.sh: dtrain $1 failed:" >&2; tail -5 "$work/dtrain.err" >&2; exit 1; }
  echo "$out" | boundaries > "$work/cut.v$2"
  echo "$out" | step_ms
}

run_torch() {  # schedule virtual_stages
  [ -s "$work/cut.v$2" ] || run_dtrain "$([ "$2" = 1 ] && echo 1f1b || echo interleaved)" "$2" > /dev/null
  local out
  out=$(timeout 300 "$torchrun" --standalone --nproc-per-node "$P" "$here/bench/pipelining_peer.py" --schedule "$1" \
    --virtual-stages "$2" --boundaries "$(cat "$work/cut.v$2")" "${common[@]}" 2> "$work/torch.err") ||
    { echo "bench/compare_pipeline.sh: torch $1 failed:" >&2; tail -5 "$work/torch.err" >&2; exit 1; }
  echo "$out" | step_ms
}

torch_version=$("$(dirname "$torchrun")/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -n), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)," \
  "commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?'), torch $torch_version," \
  "P=$P M=$MICRO hidden=$HIDDEN batch=$BATCH steps=$STEPS, $rounds rounds"
echo "# round schedule dtrain_ms torch_ms ratio"
for r in $(seq 1 "$rounds"); do
  zbh1=
  for pair in gpipe:1 1f1b:1 interleaved:2 zbh1:1; do
    s=${pair%:*} v=${pair#*:}
    if [ $((r % 2)) = 1 ]; then
      d=$(run_dtrain "$s" "$v"); t=$(run_torch "$s" "$v")
    else
      t=$(run_torch "$s" "$v"); d=$(run_dtrain "$s" "$v")
    fi
    echo "$r $s $d $t $(awk -v d="$d" -v t="$t" 'BEGIN { printf "%.3f", d / t }')" | tee -a "$work/pairs"
    [ "$s" = zbh1 ] && zbh1=$d
  done
  for s in $zb; do
    t=$(run_torch "$s" 2)
    echo "$r torch:$s $zbh1 $t $(awk -v d="$zbh1" -v t="$t" 'BEGIN { printf "%.3f", d / t }')" | tee -a "$work/pairs"
  done
done

echo "# schedule | dtrain ms (median) | torch ms (median) | dtrain/torch: median of paired ratios [min..max]"
echo "# (torch:<zero-bubble> rows: dtrain's zbh1 of each round against that PyTorch zero-bubble schedule, V = 2)"
for s in $(awk '{ print $2 }' "$work/pairs" | awk '!seen[$0]++'); do
  col() { awk -v s="$s" -v c="$1" '$2 == s { print $c }' "$work/pairs"; }
  printf '%s | %s | %s | %s [%s..%s]\n' "$s" "$(col 3 | median)" "$(col 4 | median)" "$(col 5 | median)" \
    "$(col 5 | sort -g | head -1)" "$(col 5 | sort -g | tail -1)"
done
