#!/usr/bin/env bash
# The trainer's speed and accuracy by device and precision, side by side in one run: one epoch of the MLP
# with 2 DDP ranks (cpu) or one rank per GPU (cuda), for fp32 and each --amp that device supports; each
# configuration runs REPEATS times, alternating with the others, and the medians are printed as markdown.
#   bench/trainer_amp.sh [build dir] [cpu|cuda ...]      (REPEATS=3; default devices: cpu, and cuda if seen)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
shift || true
devices=("$@")
if [ ${#devices[@]} -eq 0 ]; then
  devices=(cpu)
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && devices+=(cuda)
fi
repeats=${REPEATS:-3}

median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
field() { grep -o "\"$1\": *[0-9.]*" | tail -1 | sed 's/.*: *//'; }

configs=()
for device in "${devices[@]}"; do
  configs+=("$device none" "$device bf16")
  [ "$device" = cuda ] && configs+=("$device fp16")
done
declare -A rate acc
for ((i = 0; i < repeats; i++)); do
  for config in "${configs[@]}"; do
    read -r device amp <<<"$config"
    amp_flag=()
    [ "$amp" != none ] && amp_flag=(--amp "$amp")
    if [ "$device" = cpu ]; then
      launch=("$build/bin/dtrain" run --nproc-per-node 2 --)
    else
      launch=("$build/bin/dtrain" run --nproc-per-node "$(nvidia-smi -L | wc -l)" --)
    fi
    out=$("${launch[@]}" "$build/bin/train_fashion_mnist" --device "$device" "${amp_flag[@]}" 2>&1 | tail -1)
    rate[$config]+="$(echo "$out" | field samples_per_s) "
    acc[$config]+="$(echo "$out" | field test_accuracy) "
  done
done
echo "| device | amp | samples/s (median of $repeats) | test accuracy (median) |"
echo "|---|---|---:|---:|"
for config in "${configs[@]}"; do
  read -r device amp <<<"$config"
  r=$(printf '%s\n' ${rate[$config]} | median)
  a=$(printf '%s\n' ${acc[$config]} | median)
  echo "| $device | $amp | $r | $a |"
done
