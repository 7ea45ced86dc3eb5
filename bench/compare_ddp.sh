#!/usr/bin/env bash
# Side by side, in one run: dtrain's bench_ddp against PyTorch's Python DDP peer (shared/peers/run_torch_peer.sh
# and torch_ddp_mlp.py, started by hand on loopback) on the same workload, for each world size and hidden width.
# Each round runs both sides once, alternating which goes first; per point it prints the median ms/step of
# each side and the median of the paired ratios dtrain / PyTorch (below 1: dtrain faster), with their range.
#   bench/compare_ddp.sh [build dir] [peer dir]
# Environment: BUILD (build dir, default <repo>/build), PEERS (peer dir), PYTHON (the peer's python, default
# <repo>/.venv/bin/python), REPEATS=5 rounds, WORLDS="1 2 4", HIDDENS="256 1024 4096".
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${1:-${BUILD:-$here/build}}
peers=${2:-$(find_peers)}
export PYTHON=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
batch=32
for need in "$build/bin/dtrain" "$build/bin/bench_ddp" "$peers/run_torch_peer.sh" "$PYTHON"; do
  [ -e "$need" ] || { echo "bench/compare_ddp.sh: $need not found (BUILD=$build, PEERS=$peers, PYTHON=$PYTHON)" >&2; exit 2; }
done
ms_of() { grep -o 'ms/step=[0-9.]*' | tail -1 | cut -d= -f2; }
# side NAME COMMAND...: the command's ms/step, or one line naming what failed and exit 1
side() {
  local name=$1 out ms
  shift
  out=$("$@" 2>&1) || true
  ms=$(ms_of <<<"$out")
  [ -n "$ms" ] || { echo "bench/compare_ddp.sh: $name printed no ms/step: $(tail -1 <<<"$out")" >&2; exit 1; }
  echo "$ms"
}

bench_header "$PYTHON" "$0 $* (REPEATS=$repeats)"
echo
echo "| ranks | hidden | steps | dtrain ms/step | PyTorch ms/step | dtrain / PyTorch, median of paired ratios (range) |"
echo "|---:|---:|---:|---:|---:|---:|"
log=""
for world in ${WORLDS:-1 2 4}; do
  for hidden in ${HIDDENS:-256 1024 4096}; do
    case $hidden in 256) steps=200 ;; 1024) steps=60 ;; *) steps=10 ;; esac
    ours="" theirs=""
    for ((i = 0; i < repeats; i++)); do
      for who in $( ((i % 2)) && echo "theirs ours" || echo "ours theirs"); do
        if [ "$who" = ours ]; then
          ours+="$(side dtrain "$build/bin/dtrain" run --nproc-per-node "$world" -- "$build/bin/bench_ddp" \
            --hidden "$hidden" --batch "$batch" --steps "$steps") "
        else
          theirs+="$(side PyTorch env N="$world" "$peers/run_torch_peer.sh" "$steps" "$hidden" "$batch") "
        fi
      done
    done
    echo "| $world | $hidden | $steps | $(list_median "$ours") | $(list_median "$theirs") | $(ratio_summary "$ours" "$theirs") |"
    log+="N=$world H=$hidden: dtrain ${ours% }; PyTorch ${theirs% }"$'\n'
  done
done
echo
echo "rounds (ms/step):"
printf '%s' "$log"
