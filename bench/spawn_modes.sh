#!/usr/bin/env bash
# dtrain::spawn: DDP with ranks as threads of one process against ranks as processes (bench_spawn), in one
# command: REPEATS alternating runs per rank count, medians of ms/step and of start-up (spawn() to every
# rank's first finished step).
#   bench/spawn_modes.sh [build dir]        (REPEATS=5 STEPS=200 by default)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
repeats=${REPEATS:-5}
steps=${STEPS:-200}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
field() { grep -o "$1=[0-9.]*" | tail -1 | cut -d= -f2; }
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| ranks | threads ms/step | processes ms/step | threads / processes | threads start-up s | processes start-up s |"
echo "|---:|---:|---:|---:|---:|---:|"
for ranks in 1 2; do
  t_ms=() p_ms=() t_up=() p_up=()
  for ((i = 0; i < repeats; i++)); do
    out=$("$build/bin/bench_spawn" --mode threads --ranks $ranks --hidden 1024 --batch 32 --steps "$steps" 2>&1)
    t_ms+=("$(field ms/step <<<"$out")") t_up+=("$(field startup_s <<<"$out")")
    out=$("$build/bin/bench_spawn" --mode processes --ranks $ranks --hidden 1024 --batch 32 --steps "$steps" 2>&1)
    p_ms+=("$(field ms/step <<<"$out")") p_up+=("$(field startup_s <<<"$out")")
  done
  a=$(printf '%s\n' "${t_ms[@]}" | median) b=$(printf '%s\n' "${p_ms[@]}" | median)
  echo "| $ranks | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", a / b}') |" \
    "$(printf '%s\n' "${t_up[@]}" | median) | $(printf '%s\n' "${p_up[@]}" | median) |"
done
echo "load after:  $(cut -d' ' -f1-3 /proc/loadavg)"
