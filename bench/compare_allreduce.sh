#!/usr/bin/env bash
# All-reduce time against PyTorch, side by side in one run: dtrain's bench_allreduce with its default transport
# (shared memory, all ranks on one host), the same with DTRAIN_SHM=0 (c10d Gloo over loopback, PyTorch's own
# transport) and bench/allreduce_peer.py (torch.distributed.all_reduce, gloo), all under `dtrain run`, float32
# sum, the slowest rank's mean time per all-reduce. Each round runs the three once, rotating which goes first;
# per size it prints each side's median time and the medians of the paired ratios dtrain / PyTorch (below 1:
# dtrain faster), with their range.
#   bench/compare_allreduce.sh [build dir]
# Environment: BUILD, PYTHON (default <repo>/.venv/bin/python), REPEATS=5, WORLDS="2 3", MAX_ITERS=200 (per
# size, both sides), SIZES (bytes to report; the sweep runs 4, 16, 64, ... up to the largest of them).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${1:-${BUILD:-$here/build}}
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
max_iters=${MAX_ITERS:-200}
sizes=${SIZES:-4 1024 65536 262144 1048576 4194304 16777216 67108864}
max_bytes=$(tr ' ' '\n' <<<"$sizes" | sort -n | tail -1)
for need in "$build/bin/dtrain" "$build/bin/bench_allreduce" "$here/bench/allreduce_peer.py" "$python"; do
  [ -e "$need" ] || { echo "bench/compare_allreduce.sh: $need not found (BUILD=$build, PYTHON=$python)" >&2; exit 2; }
done
# side NAME WORLD: "bytes time_us" per size of one run of that side
side() {
  local out
  case $1 in
    shm) out=$("$build/bin/dtrain" run --nproc-per-node "$2" -- "$build/bin/bench_allreduce" \
           --max-bytes "$max_bytes" --max-iters "$max_iters" 2>&1) || true ;;
    gloo) out=$(DTRAIN_SHM=0 "$build/bin/dtrain" run --nproc-per-node "$2" -- "$build/bin/bench_allreduce" \
           --max-bytes "$max_bytes" --max-iters "$max_iters" 2>&1) || true ;;
    torch) out=$("$build/bin/dtrain" run --nproc-per-node "$2" -- "$python" "$here/bench/allreduce_peer.py" \
           "$max_bytes" "$max_iters" 2>&1) || true ;;
  esac
  local rows
  # dtrain run prefixes each line of a rank's output with "[rankN]: "
  rows=$(sed 's/^\[rank[0-9]*\]: *//' <<<"$out" | awk '$1 ~ /^[0-9]+$/ && NF >= 5 {print $1, $3}')
  [ "$(wc -l <<<"$rows")" -ge "$(wc -w <<<"$sizes")" ] ||
    { echo "bench/compare_allreduce.sh: side $1 at $2 ranks printed no table: $(tail -1 <<<"$out")" >&2; exit 1; }
  echo "$rows"
}
human() { awk -v b="$1" 'BEGIN {if (b >= 1048576) printf "%g MiB", b / 1048576; else if (b >= 1024) printf "%g KiB", b / 1024; else printf "%d", b}'; }

bench_header "$python" "$0 $* (REPEATS=$repeats MAX_ITERS=$max_iters)"
declare -A times
sides=(shm gloo torch)
log=""
for world in ${WORLDS:-2 3}; do
  for ((i = 0; i < repeats; i++)); do
    for ((k = 0; k < 3; k++)); do
      s=${sides[$(( (i + k) % 3 ))]}
      rows=$(side "$s" "$world")
      while read -r bytes us; do times[$world:$s:$bytes]+="$us "; done <<<"$rows"
    done
  done
  echo
  echo "**$world ranks** (µs per all-reduce, medians of $repeats rounds; ratios: medians of the paired ratios, range)"
  echo
  echo "| bytes | dtrain shm µs | dtrain Gloo µs | PyTorch gloo µs | dtrain shm / PyTorch | dtrain Gloo / PyTorch |"
  echo "|---:|---:|---:|---:|---:|---:|"
  for b in $sizes; do
    a=${times[$world:shm:$b]} g=${times[$world:gloo:$b]} t=${times[$world:torch:$b]}
    echo "| $(human "$b") | $(list_median "$a") | $(list_median "$g") | $(list_median "$t") |" \
      "$(ratio_summary "$a" "$t") | $(ratio_summary "$g" "$t") |"
    log+="N=$world $b B: shm ${a% }; Gloo ${g% }; PyTorch ${t% }"$'\n'
  done
done
echo
echo "rounds (µs):"
printf '%s' "$log"
