#!/usr/bin/env bash
# The main job against its PyTorch peer, side by side in one run: one epoch of 2-rank data-parallel training
# of the MLP on Fashion-MNIST, dtrain's train_fashion_mnist against shared/peers/torch_fmnist.py (Python DDP,
# DistributedSampler, DataLoader), both under `dtrain run --nproc-per-node 2` (OMP_NUM_THREADS=1 per rank),
# same data, model, optimizer, learning rate and global batch. Each round runs both once, alternating which
# goes first; prints the medians of samples/s (training loop only) and test accuracy, and the median of the
# paired ratios dtrain / PyTorch of samples/s (above 1: dtrain faster), with their range.
#   bench/main_job.sh [build dir] [peer dir] [extra trainer flags...]
# Environment: BUILD, PEERS, PYTHON (the peer's python, default <repo>/.venv/bin/python), REPEATS=5, NPROC=2,
# PEER_ARGS (more flags for the peer alone, e.g. "--device cuda" beside the trainer's --device cuda).
#
# The batch: the trainer runs with its own default --batch-size (none is passed). That default was a global
# 64 and becomes 32 per rank (64 global at 2 ranks); either way the trainer reports the global batch it used
# ("global_batch" in its JSON line) and the peer is given that same global batch (torch_fmnist.py's
# --batch-size is global). Where the trainer does not report it, the peer gets PEER_BATCH (default 64).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
command="$0 $*"
build=${1:-${BUILD:-$here/build}}
peers=${2:-$(find_peers)}
shift $(( $# > 2 ? 2 : $# ))
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
nproc=${NPROC:-2}
field() { grep -o "\"$1\": *[0-9.]*" | tail -1 | sed 's/.*: *//'; }
for need in "$build/bin/dtrain" "$build/bin/train_fashion_mnist" "$peers/torch_fmnist.py" "$python"; do
  [ -e "$need" ] || { echo "bench/main_job.sh: $need not found (BUILD=$build, PEERS=$peers, PYTHON=$python)" >&2; exit 2; }
done
# run NAME COMMAND...: the program's final JSON line, or one line naming what failed and exit 1
run() {
  local name=$1 output
  shift
  if ! output=$("$build/bin/dtrain" run --nproc-per-node "$nproc" -- "$@" 2>&1) ||
     ! grep -q samples_per_s <<<"$output"; then
    # rank 0's own error line says why; the launcher's last line only says that it stopped
    local why
    why=$(grep -m1 '^\[rank0\]' <<<"$output" || tail -1 <<<"$output")
    echo "bench/main_job.sh: $name failed: $why" >&2
    exit 1
  fi
  grep samples_per_s <<<"$output" | tail -1
}
bench_header "$python" "$command (REPEATS=$repeats NPROC=$nproc)"
ours_rate="" ours_acc="" theirs_rate="" theirs_acc="" batch="" batch_note=""
for ((i = 0; i < repeats; i++)); do
  # the trainer goes first in round 0 (it tells the peer's batch), then the order alternates
  for who in $( ((i % 2)) && echo "theirs ours" || echo "ours theirs"); do
    if [ "$who" = ours ]; then
      line=$(run "dtrain train_fashion_mnist" "$build/bin/train_fashion_mnist" "$@")
      ours_rate+="$(field samples_per_s <<<"$line") " ours_acc+="$(field test_accuracy <<<"$line") "
      if [ -z "$batch" ]; then
        batch=$(field global_batch <<<"$line")
        [ -n "$batch" ] || { batch=${PEER_BATCH:-64}; batch_note=" (the trainer did not report global_batch; PEER_BATCH)"; }
      fi
    else
      # shellcheck disable=SC2086 # PEER_ARGS is a list of flags
      line=$(run "PyTorch torch_fmnist.py" "$python" "$peers/torch_fmnist.py" --batch-size "$batch" ${PEER_ARGS:-})
      theirs_rate+="$(field samples_per_s <<<"$line") " theirs_acc+="$(field test_accuracy <<<"$line") "
    fi
  done
done
echo "# global batch: $batch on both sides$batch_note; trainer flags: ${*:-(defaults)}"
echo
echo "| program ($nproc ranks, 1 epoch) | samples/s (median of $repeats) | test accuracy (median) |"
echo "|---|---:|---:|"
echo "| dtrain train_fashion_mnist $* | $(list_median "$ours_rate") | $(list_median "$ours_acc") |"
echo "| PyTorch torch_fmnist.py ${PEER_ARGS:-}| $(list_median "$theirs_rate") | $(list_median "$theirs_acc") |"
echo
echo "dtrain / PyTorch samples/s, median of paired ratios (range): $(ratio_summary "$ours_rate" "$theirs_rate")"
echo "rounds: samples/s dtrain ${ours_rate% }; PyTorch ${theirs_rate% }"
echo "rounds: accuracy dtrain ${ours_acc% }; PyTorch ${theirs_acc% }"
