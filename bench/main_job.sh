#!/usr/bin/env bash
# The main job against its PyTorch peer, side by side in one run: one epoch of 2-rank data-parallel training
# of the MLP on Fashion-MNIST, dtrain's train_fashion_mnist against shared/peers/torch_fmnist.py (Python DDP,
# DistributedSampler, DataLoader), both under `dtrain run --nproc-per-node 2` (OMP_NUM_THREADS=1 per rank),
# same model, optimizer, global batch 64 and learning rate. Alternates the two REPEATS times and prints the
# medians of samples/s (training loop only) and test accuracy, and their ratio.
#   bench/main_job.sh [build dir] [peer dir] [extra trainer flags...]     (REPEATS=3, NPROC=2)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
peers=${2:-$here/../shared/peers}
shift $(( $# > 2 ? 2 : $# ))
repeats=${REPEATS:-3}
nproc=${NPROC:-2}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
field() { grep -o "\"$1\": *[0-9.]*" | tail -1 | sed 's/.*: *//'; }
for need in "$build/bin/dtrain" "$build/bin/train_fashion_mnist" "$peers/torch_fmnist.py"; do
  [ -e "$need" ] || { echo "bench/main_job.sh: $need not found (build dir: $build, peer dir: $peers)" >&2; exit 2; }
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
ours_rate=() ours_acc=() theirs_rate=() theirs_acc=()
for ((i = 0; i < repeats; i++)); do
  line=$(run "dtrain train_fashion_mnist" "$build/bin/train_fashion_mnist" "$@")
  ours_rate+=("$(field samples_per_s <<<"$line")") ours_acc+=("$(field test_accuracy <<<"$line")")
  line=$(run "PyTorch torch_fmnist.py" /usr/bin/python3 "$peers/torch_fmnist.py")
  theirs_rate+=("$(field samples_per_s <<<"$line")") theirs_acc+=("$(field test_accuracy <<<"$line")")
done
ours=$(printf '%s\n' "${ours_rate[@]}" | median)
theirs=$(printf '%s\n' "${theirs_rate[@]}" | median)
echo "| program ($nproc ranks, 1 epoch) | samples/s (median of $repeats) | test accuracy (median) |"
echo "|---|---:|---:|"
echo "| dtrain train_fashion_mnist $* | $ours | $(printf '%s\n' "${ours_acc[@]}" | median) |"
echo "| PyTorch torch_fmnist.py | $theirs | $(printf '%s\n' "${theirs_acc[@]}" | median) |"
echo
echo "dtrain / PyTorch samples/s: $(awk -v a="$ours" -v b="$theirs" 'BEGIN {printf "%.2f", a / b}')"
echo "runs: dtrain ${ours_rate[*]}; PyTorch ${theirs_rate[*]}"
