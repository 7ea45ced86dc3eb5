#!/usr/bin/env bash
# dtrain's train_gpt against the same transformer in PyTorch (bench/gpt_peer.py), side by side in one run: both
# under `dtrain run --nproc-per-node $NPROC` with the same flags (a Llama-shaped model, bf16 autocast, on the
# GPU by default), DDP over NCCL where NPROC > 1. Each round runs every side once, rotating which goes first;
# prints the medians of tokens/s, model TFLOP/s and MFU, and the median (range) of the paired ratios
# dtrain / PyTorch of tokens/s (above 1: dtrain faster).
#   bench/gpt_vs_torch.sh [build dir]
# Environment: BUILD, PYTHON (the peer's python, default <repo>/.venv/bin/python), REPEATS=5, NPROC=1,
# GPT_ARGS (the flags both sides get; default below), PEAK_TFLOPS=989 (one GPU's dense bf16 peak: H100/H200
# SXM), EXTRA_PEER_ROW=compile (a third side: the peer under torch.compile).
#
# Both sides count model FLOPs the same way (6N + 12·L·width·T per token, PaLM's appendix B: see
# model_flops_per_token in gpt_peer.py), and tokens/s covers the timed steps only, after --warmup-steps.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
command="$0 $*"
usage_error() { echo "bench/gpt_vs_torch.sh: $*" >&2; exit 2; }
[ $# -le 1 ] || usage_error "$# arguments: expected at most one, the build dir (model flags go in GPT_ARGS)"
build=${1:-${BUILD:-$here/build}}
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
nproc=${NPROC:-1}
peak=${PEAK_TFLOPS:-989}
extra=${EXTRA_PEER_ROW:-}
read -r -a args <<<"${GPT_ARGS:---layers 8 --width 1024 --heads 16 --kv-heads 4 --seq-len 1024 --batch-size 8 \
--steps 30 --warmup-steps 5 --amp bf16 --device cuda --max-bytes 20000000 --log-every 0}"
[[ $repeats =~ ^[1-9][0-9]*$ ]] || usage_error "REPEATS=$repeats: expected a whole number of rounds, 1 or more"
[[ $nproc =~ ^[1-9][0-9]*$ ]] || usage_error "NPROC=$nproc: expected a whole number of ranks, 1 or more"
awk -v p="$peak" 'BEGIN {exit !(p ~ /^[0-9]*\.?[0-9]+$/ && p + 0 > 0)}' ||
  usage_error "PEAK_TFLOPS=$peak: expected one GPU's peak in TFLOP/s, above 0 (989: H100/H200 SXM dense bf16)"
[[ $extra =~ ^(|compile)$ ]] || usage_error "EXTRA_PEER_ROW=$extra: expected compile, or unset for no third side"
for need in "$build/bin/dtrain" "$build/bin/train_gpt" "$here/bench/gpt_peer.py" "$python"; do
  [ -e "$need" ] || usage_error "$need not found (BUILD=$build, PYTHON=$python)"
done
# Anything with an exponent too: a tiny model's model_tflops prints as 1.2e-05.
field() { grep -o "\"$1\": *[-0-9.eE+]*" | tail -1 | sed 's/.*: *//'; }

# run NAME COMMAND...: the program's final JSON line, or one line naming the side and rank 0's error, and exit 1
run() {
  local name=$1 output why
  shift
  if ! output=$("$build/bin/dtrain" run --nproc-per-node "$nproc" -- "$@" 2>&1) ||
     ! grep -q tokens_per_s <<<"$output"; then
    # rank 0's last line says why (train_gpt's one error line; the exception that ends a Python traceback);
    # the launcher's own last line only says that it stopped
    why=$(grep '^\[rank0\]' <<<"$output" | tail -1 || true)
    echo "bench/gpt_vs_torch.sh: $name failed: ${why:-$(tail -1 <<<"$output")}" >&2
    exit 1
  fi
  grep tokens_per_s <<<"$output" | tail -1
}

sides=(ours theirs)
[ "$extra" = compile ] && sides+=(compiled)
declare -A name=([ours]="dtrain train_gpt" [theirs]="PyTorch gpt_peer.py"
                 [compiled]="PyTorch gpt_peer.py --compile")
declare -A rate tflops loss flops
bench_header "$python" "$command (REPEATS=$repeats NPROC=$nproc EXTRA_PEER_ROW=${extra:-none})"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
echo "# GPU: ${gpu:-none seen by nvidia-smi}"
echo "# GPT_ARGS: ${args[*]} (train_gpt also gets --eval-windows 4: its validation after the clock stops)"
for ((i = 0; i < repeats; i++)); do
  for ((j = 0; j < ${#sides[@]}; j++)); do  # round i starts with side i mod the number of sides
    who=${sides[(i + j) % ${#sides[@]}]}
    case $who in
      ours) line=$(run "${name[$who]}" "$build/bin/train_gpt" "${args[@]}" --eval-windows 4) ;;
      theirs) line=$(run "${name[$who]}" "$python" "$here/bench/gpt_peer.py" "${args[@]}") ;;
      compiled) line=$(run "${name[$who]}" "$python" "$here/bench/gpt_peer.py" "${args[@]}" --compile) ;;
    esac
    for f in tokens_per_s model_tflops train_loss model_flops_per_token; do
      [ -n "$(field $f <<<"$line")" ] ||
        { echo "bench/gpt_vs_torch.sh: ${name[$who]}'s JSON line has no $f (an older build?): $line" >&2; exit 1; }
    done
    rate[$who]+="$(field tokens_per_s <<<"$line") " tflops[$who]+="$(field model_tflops <<<"$line") "
    loss[$who]+="$(field train_loss <<<"$line") " flops[$who]=$(field model_flops_per_token <<<"$line")
  done
done
# The same flags should build the same model: FLOPs per token differ where the parameter counts do, that is
# where gpt.cpp and gpt_peer.py have drifted apart (or the two formulas have). Compared as numbers: C++ may
# print 849792.0 where Python prints 849792.
awk -v a="${flops[ours]}" -v b="${flops[theirs]}" 'BEGIN {exit !(a + 0 == b + 0)}' ||
  echo "# WARNING: model_flops_per_token differ: train_gpt ${flops[ours]}, gpt_peer.py ${flops[theirs]};" \
    "the models (or the formulas) are not the same"

echo
echo "Medians of $repeats rounds. MFU = model TFLOP/s / ($nproc x PEAK_TFLOPS $peak); 989 is one H100/H200 SXM's"
echo "dense bf16 peak."
echo
echo "| program ($nproc rank(s)) | tokens/s | model TFLOP/s | MFU | train loss |"
echo "|---|---:|---:|---:|---:|"
for who in "${sides[@]}"; do
  awk -v r="$(list_median "${rate[$who]}")" -v t="$(list_median "${tflops[$who]}")" -v p="$peak" -v n="$nproc" \
    -v l="$(list_median "${loss[$who]}")" -v who="${name[$who]}" \
    'BEGIN {printf "| %s | %.0f | %.4g | %.1f%% | %.4f |\n", who, r, t, 100 * t / (p * n), l}'
done
echo
for who in "${sides[@]:1}"; do
  echo "dtrain / ${name[$who]} tokens/s, median of paired ratios (range):" \
    "$(ratio_summary "${rate[ours]}" "${rate[$who]}")"
done
for who in "${sides[@]}"; do
  awk -v l="${rate[$who]}" -v who="${name[$who]}" 'BEGIN {
    printf "rounds: tokens/s %s", who; n = split(l, x, " "); for (i = 1; i <= n; i++) printf " %.0f", x[i]; print ""
  }'
done
