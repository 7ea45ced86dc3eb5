#!/usr/bin/env bash
# The transformer's model FLOPs utilisation and memory per rank, layout by layout (issue 20,
# "Speed"):
# (a) this machine's own float32 matrix-multiply peak per core: torch.mm of two n x n squares from
#     the project's environment (the LibTorch train_gpt links), one intra-op thread as each rank of
#     `dtrain run` has under OMP_NUM_THREADS=1, the best of MM_REPEATS at each of MM_SIZES; then
#     each layout's MFU = train_gpt's model_tflops / (ranks x that peak), and against the cores the
#     ranks share (fewer than the ranks when they outnumber this machine's CPUs);
# (b) each layout's peak resident set per rank (train_gpt's peak_rss_mb: rank 0, peak_rss_mb_max:
#     the largest rank) against gpt_advise's predicted bytes for the worst rank. The baseline
#     (LibTorch, the corpus, the process group's shared memory) is the same layout run with a tiny
#     model, whose own state is a few KiB; RSS minus that baseline is set beside the prediction.
# Each layout runs REPEATS times with MODEL (medians), once with the tiny model.
#   bench/gpt_mfu_memory.sh [build dir]
# Environment: BUILD (build dir), PYTHON (.venv/bin/python: the torch for (a)), MODEL (the model's
# flags, given to train_gpt and gpt_advise alike), STEPS (5 timed), WARMUP (2), REPEATS (3),
# LAYOUTS2 and LAYOUTS4 (';'-separated layouts at 2 and 4 ranks, as gpt_advise writes them),
# MM_SIZES ("1024 2048"), MM_REPEATS (5). Every rank runs with OMP_NUM_THREADS=1. Prints markdown.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${BUILD:-$here/build}}
python=${PYTHON:-$here/.venv/bin/python}
model=${MODEL:---layers 4 --width 512 --heads 8 --kv-heads 4 --seq-len 128 --batch-size 8}
steps=${STEPS:-5} warmup=${WARMUP:-2} repeats=${REPEATS:-3}
mm_sizes=${MM_SIZES:-1024 2048} mm_repeats=${MM_REPEATS:-5}
IFS=';' read -r -a layouts2 <<<"${LAYOUTS2:---dp 2;--dp 2 --zero 1;--dp 2 --zero 3;--dp 1 --tp 2;\
--dp 1 --tp 2 --sp;--dp 1 --pp 2 --micro-batches 4;--dp 2 --recompute}"
IFS=';' read -r -a layouts4 <<<"${LAYOUTS4:---dp 2 --pp 2 --micro-batches 4 --zero 3;\
--dp 1 --tp 2 --pp 2 --micro-batches 4}"
# Small enough that its parameters, gradients, AdamW state and activations are a few KiB, and valid
# in every layout above (tp 2 divides its heads and sequence, pp 2 its layers, 4 micro-batches its
# batch).
tiny="--layers 2 --width 16 --heads 2 --kv-heads 2 --seq-len 8 --batch-size 4"
common="--device cpu --max-bytes 2000000 --log-every 0 --eval-windows 4"

for tool in train_gpt gpt_advise dtrain; do
  [[ -x $build/bin/$tool ]] || {
    echo "gpt_mfu_memory.sh: $build/bin/$tool: not found; build it (cmake --build $build --target" \
      "train_gpt gpt_advise dtrain_cli) or give the build dir as the first argument" >&2
    exit 2
  }
done
"$python" -c 'import torch' 2>/dev/null || {
  echo "gpt_mfu_memory.sh: PYTHON=$python: cannot import torch; point PYTHON at the project's" \
    "environment (.venv/bin/python)" >&2
  exit 2
}
for var in STEPS:$steps WARMUP:$warmup REPEATS:$repeats MM_REPEATS:$mm_repeats; do
  [[ ${var#*:} =~ ^[1-9][0-9]*$ ]] || {
    echo "gpt_mfu_memory.sh: ${var%%:*}=${var#*:}: expected a positive integer" >&2
    exit 2
  }
done
for n in $mm_sizes; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || {
    echo "gpt_mfu_memory.sh: MM_SIZES=\"$mm_sizes\": expected positive integers (matrix sides)" >&2
    exit 2
  }
done

field() { grep -o "\"$1\":[^,}]*" | tail -1 | cut -d: -f2- | tr -d '"'; }
median() {
  sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'
}
of() { while read -r line; do field "$1" <<<"$line"; done <<<"$lines" | median; }  # over $lines
run() {  # run NPROC FLAGS...: train_gpt's JSON line (rank 0's), or the failure on stderr and exit 1
  local nproc=$1 out
  shift
  if ! out=$(OMP_NUM_THREADS=1 "$build/bin/dtrain" run --nproc-per-node "$nproc" -- \
    "$build/bin/train_gpt" "$@" $common --steps "$steps" --warmup-steps "$warmup" 2>&1); then
    echo "gpt_mfu_memory.sh: train_gpt $* at $nproc ranks failed:" >&2
    echo "$out" | tail -3 >&2
    exit 1
  fi
  grep '"peak_rss_mb"' <<<"$out" | tail -1
}

echo "# train_gpt: MFU and memory per rank on $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo |
  cut -d: -f2- | sed 's/^ *//'))"
echo "uptime before: $(uptime)"
echo

# (a) The peak.
peak_rows=$(OMP_NUM_THREADS=1 "$python" - "$mm_repeats" $mm_sizes <<'EOF'
import sys, time, torch
torch.set_num_threads(1)
repeats = int(sys.argv[1])
for n in map(int, sys.argv[2:]):
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    torch.mm(a, b, out=c)  # warm-up: the kernel's buffers and the pages of c
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    print(n, "%.1f" % (2 * n**3 / best / 1e9))
EOF
)
torch_version=$("$python" -c 'import torch; print(torch.__version__)')
echo "## Float32 matrix-multiply peak, one thread (torch $torch_version, torch.mm, best of $mm_repeats)"
echo
echo "| n x n | GFLOP/s |"
echo "|---:|---:|"
while read -r n gflops; do echo "| $n | $gflops |"; done <<<"$peak_rows"
peak=$(awk '$2 > p {p = $2} END {print p}' <<<"$peak_rows")
echo
echo "Peak per core: $peak GFLOP/s (the largest above)."
echo

# (b) Each layout against the advisor, and its MFU.
echo "## Layouts: $model, --steps $steps --warmup-steps $warmup, $common; medians of $repeats runs"
echo
echo "| ranks | layout | predicted MiB/rank (activations) | baseline MiB | peak RSS MiB rank 0 / max | max - baseline | measured / predicted | tokens/s | model TFLOP/s | MFU (ranks x peak) | MFU (cores used) |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for nproc in 2 4; do
  if ((nproc == 2)); then layouts=("${layouts2[@]}"); else layouts=("${layouts4[@]}"); fi
  ((${#layouts[@]})) || continue
  advice=$("$build/bin/gpt_advise" --devices "$nproc" --memory-gb 100 --bandwidth-gbps 24 \
    --threads 1 --repeats 1 --all --json $model)
  cores=$((nproc < $(nproc) ? nproc : $(nproc)))
  for layout in "${layouts[@]}"; do
    predicted=$("$python" -c '
import json, sys
advice = json.loads(sys.argv[1])
for p in advice["fitting"] + advice["too_big"]:
    if p["flags"] == sys.argv[2]:
        print("%.1f %.1f" % (p["memory_bytes"] / 2**20, p["activation_bytes"] / 2**20)); break
else:
    print("- -")' "$advice" "$layout")
    read -r total activations <<<"$predicted"
    base=$(run "$nproc" $tiny $layout | field peak_rss_mb_max)
    lines=$(for ((r = 0; r < repeats; r++)); do run "$nproc" $model $layout; done)
    rss0=$(of peak_rss_mb) rss=$(of peak_rss_mb_max) tflops=$(of model_tflops)
    awk -v n="$nproc" -v l="$layout" -v t="$total" -v a="$activations" -v b="$base" -v r0="$rss0" \
      -v r="$rss" -v tok="$(of tokens_per_s)" -v tf="$tflops" -v peak="$peak" \
      -v cores="$cores" 'BEGIN {
        ratio = (t + 0 > 0) ? sprintf("%.2f", (r - b) / t) : "-"
        printf "| %d | `%s` | %s (%s) | %.0f | %.0f / %.0f | %.0f | %s | %.0f | %.4f ",
          n, l, t, a, b, r0, r, r - b, ratio, tok, tf
        printf "| %.1f%% | %.1f%% |\n", 100 * tf * 1e3 / (n * peak), 100 * tf * 1e3 / (cores * peak)
      }'
  done
done
echo
echo "uptime after: $(uptime)"
