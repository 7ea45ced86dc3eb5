#!/usr/bin/env bash
# dtrain's checkpoint saves against PyTorch's Distributed Checkpoint (torch.distributed.checkpoint), side by
# side in one run, on bench_checkpoint's workload (the trainer's MLP 784-256-128-10 with SGD momentum, batches
# of 64, one intra-op thread, --steps-between training steps between saves):
#   asynchronous: Checkpointer::save with async   against  dcp.async_save  (the time the loop is held)
#   blocking:     Checkpointer::save               against  dcp.save
# Both sides fsync what they write (DCP's FileSystemWriter syncs its files by default), and both make a new
# save wait for the previous one. Each round runs both sides once, alternating which goes first; reported per
# mode: each side's median of its per-run medians and the median (range) of the paired ratios dtrain / DCP
# (below 1: dtrain holds the loop for less).
#   bench/compare_checkpoint.sh [build dir]
# Environment: BUILD, PYTHON (default <repo>/.venv/bin/python), REPEATS=5, SAVES=10, STEPS_BETWEEN=100.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${1:-${BUILD:-$here/build}}
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
saves=${SAVES:-10}
between=${STEPS_BETWEEN:-100}
for need in "$build/bin/bench_checkpoint" "$here/bench/dcp_async_peer.py" "$python"; do
  [ -e "$need" ] || { echo "bench/compare_checkpoint.sh: $need not found (BUILD=$build, PYTHON=$python)" >&2; exit 2; }
done
dir=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-compare-checkpoint.XXXXXX")
trap 'rm -rf "$dir"' EXIT
field() { grep -o "\"$1\": *[^,}]*" | head -1 | sed 's/.*: *//' | tr -d '"'; }

bench_header "$python" "$0 $* (REPEATS=$repeats SAVES=$saves STEPS_BETWEEN=$between)"
declare -A held=() bytes=()
for ((round = 0; round < repeats; round++)); do
  for side in $( ((round % 2 == 0)) && echo "dtrain dcp" || echo "dcp dtrain"); do
    if [ "$side" = dtrain ]; then
      out=$("$build/bin/bench_checkpoint" --model mlp --saves "$saves" --steps-between "$between" \
        --dir "$dir/dtrain" 2>&1)
      for mode in blocking async; do
        line=$(grep "\"mode\":\"$mode\"" <<<"$out" | head -1)
        [ -n "$line" ] || { echo "bench/compare_checkpoint.sh: bench_checkpoint printed no $mode result: $(tail -1 <<<"$out")" >&2; exit 1; }
        held[dtrain_$mode]+=" $(field held_ms_median <<<"$line")"
        bytes[dtrain]=$(field file_bytes <<<"$line")
      done
    else
      for mode in blocking async; do
        line=$("$python" "$here/bench/dcp_async_peer.py" --mode "$mode" --saves "$saves" \
          --steps-between "$between" --dir "$dir/dcp" 2>/dev/null | grep held_ms_median | head -1) || true
        [ -n "$line" ] || { echo "bench/compare_checkpoint.sh: dcp_async_peer.py --mode $mode printed no result" >&2; exit 1; }
        held[dcp_$mode]+=" $(field held_ms_median <<<"$line")"
        bytes[dcp]=$(field file_bytes <<<"$line")
      done
    fi
  done
done
echo "# bytes on disk per checkpoint: dtrain ${bytes[dtrain]}, DCP ${bytes[dcp]}"
printf '%-10s %18s %15s %28s\n' mode "dtrain held (ms)" "DCP held (ms)" "dtrain/DCP median (range)"
for mode in blocking async; do
  printf '%-10s %18s %15s %28s\n' "$mode" "$(list_median "${held[dtrain_$mode]}")" \
    "$(list_median "${held[dcp_$mode]}")" "$(ratio_summary "${held[dtrain_$mode]}" "${held[dcp_$mode]}")"
done
