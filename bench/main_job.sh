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
ours_rate=() ours_acc=() theirs_rate=() theirs_acc=()
for ((i = 0; i < repeats; i++)); do
  line=$("$build/bin/dtrain" run --nproc-per-node "$nproc" -- "$build/bin/train_fashion_mnist" "$@" 2>&1 | grep samples_per_s)
  ours_rate+=("$(field samples_per_s <<<"$line")") ours_acc+=("$(field test_accuracy <<<"$line")")
  line=$("$build/bin/dtrain" run --nproc-per-node "$nproc" -- /usr/bin/python3 "$peers/torch_fmnist.py" 2>&1 | grep samples_per_s)
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
