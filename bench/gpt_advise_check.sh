#!/usr/bin/env bash
# gpt_advise's predictions against train_gpt's measured tokens/s, layout by layout, on this machine (issue 20's
# starred item: "checked against the measured tokens/s of every layout that runs here"). gpt_advise times one
# block here with 1 thread (each of the $NPROC ranks gets one under `dtrain run`) and predicts every layout of
# $NPROC devices; each layout then runs as train_gpt under `dtrain run --nproc-per-node $NPROC`, REPEATS times,
# and the median of its tokens/s is set beside the prediction.
#   bench/gpt_advise_check.sh [build dir]
# Environment: BUILD, NPROC (2), REPEATS (3), BANDWIDTH_GBPS and LATENCY_US (the link between ranks of this
# host: dtrain's shared-memory all-reduce at 2 ranks moves 1-6 GB/s, ~85 us for a small message, doc/benchmarks.md;
# defaults 24 and 85), LAYOUTS (';'-separated train_gpt flags as gpt_advise writes them), SIZES (';'-separated
# model flags).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${BUILD:-$here/build}}
nproc=${NPROC:-2} repeats=${REPEATS:-3}
bandwidth=${BANDWIDTH_GBPS:-24} latency=${LATENCY_US:-85}
IFS=';' read -r -a layouts <<<"${LAYOUTS:---dp 2;--dp 2 --zero 3;--dp 1 --tp 2;--dp 1 --pp 2 --micro-batches 4}"
IFS=';' read -r -a sizes <<<"${SIZES:---layers 2 --width 64 --heads 4 --kv-heads 2 --seq-len 64 --batch-size 8;\
--layers 4 --width 256 --heads 8 --kv-heads 4 --seq-len 128 --batch-size 8}"
common="--warmup-steps 3 --device cpu --max-bytes 2000000 --log-every 0"
field() { grep -o "\"$1\":[^,}]*" | tail -1 | cut -d: -f2- | tr -d '"'; }

echo "# gpt_advise vs train_gpt: $nproc ranks on $(nproc) CPUs, $bandwidth Gbit/s, $latency us; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for size in "${sizes[@]}"; do
  steps=30
  [[ $size == *"--width 256"* ]] && steps=10
  advice=$("$build/bin/gpt_advise" --devices "$nproc" --memory-gb 1000 --bandwidth-gbps "$bandwidth" \
    --latency-us "$latency" --threads 1 --repeats 7 --json $size 2>/dev/null)
  echo
  echo "## $size (--steps $steps)"
  echo "| layout | predicted tokens/s | measured tokens/s (median of $repeats) | measured / predicted | predicted: why |"
  echo "|---|---:|---:|---:|---|"
  for layout in "${layouts[@]}"; do
    row=$("$here/.venv/bin/python" -c '
import json, sys
advice = json.loads(sys.argv[1])
for p in advice["fitting"] + advice["too_big"]:
    if p["flags"] == sys.argv[2]:
        print("%.0f|%s" % (p["tokens_per_s"], p["reason"])); break
else:
    print("-|not listed")' "$advice" "$layout")
    predicted=${row%%|*} why=${row#*|}
    rates=()
    for ((r = 0; r < repeats; r++)); do
      out=$(OMP_NUM_THREADS=1 "$build/bin/dtrain" run --nproc-per-node "$nproc" -- \
        "$build/bin/train_gpt" $size $layout $common --steps "$steps" 2>&1) || { echo "$out" | tail -2 >&2; continue; }
      rates+=("$(field tokens_per_s <<<"$out")")
    done
    measured=$(printf '%s\n' "${rates[@]}" | sort -g | awk '{a[NR]=$1} END {if (NR) printf "%.0f", a[int((NR+1)/2)]; else print "-"}')
    ratio=$(awk -v m="$measured" -v p="$predicted" 'BEGIN {if (m+0 > 0 && p+0 > 0) printf "%.2f", m/p; else print "-"}')
    echo "| $layout | $predicted | $measured | $ratio | $why |"
  done
done
