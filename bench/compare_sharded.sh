#!/usr/bin/env bash
# dtrain's ZeRO stages against PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, CPU, gloo), side by side in
# one run, on bench_sharded's workload (MLP 784-1024x4-10, Adam, batch 32 per rank, one thread per rank):
#   dtrain stage 3  against  FSDP2 reshard_after_forward=True   (both: parameters, gradients, Adam state sharded)
#   dtrain stage 2  against  FSDP2 reshard_after_forward=False  (FSDP2's nearest to ZeRO-2: it keeps the
#                            gathered parameters from forward through backward, but frees them after backward,
#                            so between steps it holds 16Ψ/N where stage 2 holds 4Ψ + 12Ψ/N)
# Bytes per rank are counted the same way on both sides (bench/fsdp2_peer.py's docstring): between steps, and
# the largest sampled during a step. Each round runs both sides of a pair once, alternating which goes first;
# ms/step is reported as the median of each side and the median of the paired ratios dtrain / FSDP2 (below 1:
# dtrain faster), with their range. Bytes do not vary between rounds (the last round's are shown).
#   bench/compare_sharded.sh [build dir]
# Environment: BUILD, PYTHON (default <repo>/.venv/bin/python), REPEATS=5, WORLDS="2 4", STEPS=10, HIDDEN=1024,
# LAYERS=4, PAIRS="3:1 2:0" (dtrain stage : FSDP2 reshard_after_forward).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${1:-${BUILD:-$here/build}}
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
steps=${STEPS:-10}
hidden=${HIDDEN:-1024}
layers=${LAYERS:-4}
for need in "$build/bin/dtrain" "$build/bin/bench_sharded" "$here/bench/fsdp2_peer.py" "$python"; do
  [ -e "$need" ] || { echo "bench/compare_sharded.sh: $need not found (BUILD=$build, PYTHON=$python)" >&2; exit 2; }
done
field() { grep -o "\"$1\": *[^,}]*" | head -1 | sed 's/.*: *//' | tr -d '"'; }
mb() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
# side NAME NPROC COMMAND...: rank 0's JSON line, or one line naming what failed and exit 1
side() {
  local name=$1 nproc=$2 out line
  shift 2
  out=$("$build/bin/dtrain" run --nproc-per-node "$nproc" -- "$@" 2>&1) || true
  line=$(grep '"rank": *0' <<<"$out" | grep ms_per_step | head -1 | sed 's/^\[rank[0-9]*\]: *//')
  [ -n "$line" ] || { echo "bench/compare_sharded.sh: $name at $nproc ranks printed no result: $(tail -1 <<<"$out")" >&2; exit 1; }
  echo "$line"
}

bench_header "$python" "$0 $* (REPEATS=$repeats STEPS=$steps)"
echo "# MLP 784-${hidden}x${layers}-10, Adam, batch 32 per rank, one thread per rank; MB = MiB per rank"
echo
echo "| N | dtrain | FSDP2 | dtrain MB between steps | FSDP2 MB between steps | dtrain peak sampled MB | FSDP2 peak sampled MB | dtrain ms/step | FSDP2 ms/step | dtrain / FSDP2 ms, median of paired ratios (range) |"
echo "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"
log=""
for world in ${WORLDS:-2 4}; do
  for pair in ${PAIRS:-3:1 2:0}; do
    stage=${pair%:*} raf=${pair#*:}
    ours="" theirs="" a="" b=""
    for ((i = 0; i < repeats; i++)); do
      for who in $( ((i % 2)) && echo "theirs ours" || echo "ours theirs"); do
        if [ "$who" = ours ]; then
          a=$(side "dtrain stage $stage" "$world" "$build/bin/bench_sharded" --mode "$stage" --hidden "$hidden" \
            --layers "$layers" --steps "$steps")
          ours+="$(field ms_per_step <<<"$a") "
        else
          b=$(side "FSDP2 reshard_after_forward=$raf" "$world" "$python" "$here/bench/fsdp2_peer.py" \
            --reshard-after-forward "$raf" --hidden "$hidden" --layers "$layers" --steps "$steps")
          theirs+="$(field ms_per_step <<<"$b") "
        fi
      done
    done
    [ "$(field params <<<"$a")" = "$(field params <<<"$b")" ] ||
      { echo "bench/compare_sharded.sh: the two models differ: $(field params <<<"$a") against $(field params <<<"$b") parameters" >&2; exit 1; }
    raf_name=$([ "$raf" = 1 ] && echo "reshard_after_forward=True" || echo "reshard_after_forward=False")
    echo "| $world | ZeRO-$stage | $raf_name | $(mb "$(field total_bytes <<<"$a")") | $(mb "$(field total_bytes <<<"$b")") |" \
      "$(mb "$(field peak_sampled_bytes <<<"$a")") | $(mb "$(field peak_sampled_bytes <<<"$b")") |" \
      "$(list_median "$ours") | $(list_median "$theirs") | $(ratio_summary "$ours" "$theirs") |"
    log+="N=$world stage $stage / FSDP2 raf=$raf: dtrain ${ours% }; FSDP2 ${theirs% }"$'\n'
    log+="  dtrain: $a"$'\n'"  FSDP2:  $b"$'\n'
  done
done
echo
echo "rounds (ms/step) and each side's last JSON line:"
printf '%s' "$log"
