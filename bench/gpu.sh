#!/usr/bin/env bash
# The GPU measurements of issue 23 in one command, each side by side with PyTorch on the same card and
# alternating sides round by round (medians of paired ratios, as bench/paired.sh says why):
#   1. DDP at world size 1 against plain LibTorch (bench_ddp, an MLP, with PyTorch's plain model and DDP
#      beside it), for a launch-bound and a compute-bound size;
#   2. DataParallel with 2 replicas on one GPU against nn.DataParallel over the same GPU twice, and one
#      replica (the plain model on the same global batch);
#   3. the main job: the trainer with --device cuda against PyTorch DDP + DataLoader (bench/main_job.sh);
#      (graph) the same with the trainer's step captured in a CUDA graph (--cuda-graph);
#   4. the trainer in fp32, bf16 and fp16 (bench/trainer_amp.sh);
#   5. the transformer: tokens/s and MFU against the same model in PyTorch (bench/gpt_vs_torch.sh).
# Each part is bounded by PART_TIMEOUT seconds (default 150) and says so when cut; a part that fails does
# not stop the others.
#   bench/gpu.sh [build dir] [part ...]     (parts: ddp dp main graph amp gpt; default all)
# Environment: PYTHON (the peers' python, default <repo>/.venv/bin/python), PEERS, REPEATS (3), DEVICE (cuda;
# cpu runs parts 1 and 2 on the CPU, to try the script on a machine without a GPU).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${1:-$here/build}
shift $(($# > 0 ? 1 : 0))
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(ddp dp main graph amp gpt)
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-3}
part_timeout=${PART_TIMEOUT:-150}
device=${DEVICE:-cuda}
export PYTHON="$python" REPEATS="$repeats"
dtrain=("$build/bin/dtrain" run --nproc-per-node 1 --)
bench_header "$python" "$0 $build ${parts[*]} (REPEATS=$repeats)"
echo "# GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"

# ms COMMAND...: the ms/step of a bench_ddp-style line, or the command's last line when there is none.
ms() {
  local out
  out=$(timeout 60 "$@" 2>&1)
  grep -o 'ms/step=[0-9.]*' <<<"$out" | tail -1 | cut -d= -f2 | grep . || { tail -1 <<<"$out" >&2; echo 0; }
}

# compare TITLE NAME=COMMAND...: every command once per round, the order rotating, then a table of the
# medians and the paired ratios of each against the first.
compare() {
  local title=$1 i j n names=() commands=() times=()
  shift
  for spec in "$@"; do names+=("${spec%%=*}") commands+=("${spec#*=}") times+=(""); done
  n=${#names[@]}
  for ((i = 0; i < repeats; i++)); do
    for ((j = 0; j < n; j++)); do
      local k=$(((i + j) % n))
      times[k]+="$(eval "ms ${commands[k]}") "
    done
  done
  echo
  echo "### $title"
  echo "| side | ms/step (median of $repeats) | / ${names[0]} (median of paired ratios, range) |"
  echo "|---|---:|---:|"
  for ((j = 0; j < n; j++)); do
    echo "| ${names[j]} | $(list_median "${times[j]}") | $(ratio_summary "${times[j]}" "${times[0]}") |"
  done
  echo "rounds: $(for ((j = 0; j < n; j++)); do printf '%s: %s; ' "${names[j]}" "${times[j]% }"; done)"
}

part_ddp() {
  echo
  echo "## 1. DDP at world size 1 against plain LibTorch, and PyTorch's plain model and DDP"
  # the compute-bound size first: it is the one that can show a 1% difference (at the launch-bound
  # size the rounds scatter by +-30%, seen on an H200)
  # DDP_SIZES: the sizes to measure, ';'-separated (default both)
  local size sizes
  IFS=';' read -r -a sizes <<<"${DDP_SIZES:---hidden 4096 --batch 1024 --steps 200;--hidden 1024 --batch 32 --steps 300}"
  for size in "${sizes[@]}"; do
    compare "MLP 784-H-H-10, $size, $device" \
      "plain-libtorch=${dtrain[*]} $build/bin/bench_ddp --device $device --no-ddp $size" \
      "dtrain-ddp=${dtrain[*]} $build/bin/bench_ddp --device $device $size" \
      "torch-plain=${dtrain[*]} $python $here/bench/torch_mlp_peer.py --mode plain --device $device $size" \
      "torch-ddp=${dtrain[*]} $python $here/bench/torch_mlp_peer.py --mode ddp --device $device $size"
  done
}

part_dp() {
  echo
  echo "## 2. DataParallel, 2 replicas on one GPU (B samples each), against nn.DataParallel on it twice"
  local size="--hidden 4096 --batch 512 --steps 100"
  # the single model on the same global batch (2 x 512)
  compare "MLP 784-H-H-10, $size per replica" \
    "libtorch-1-replica=$build/bin/bench_ddp --device $device --no-ddp --hidden 4096 --batch 1024 --steps 100" \
    "dtrain-dp-2=$build/bin/bench_ddp --device $device --dp 2 $size" \
    "torch-dp-2=$python $here/bench/torch_mlp_peer.py --mode dp --replicas 2 --device $device $size"
  # PyTorch's refusal, if it refuses, is a line of its own (the table shows 0 for it)
  "$python" "$here/bench/torch_mlp_peer.py" --mode dp --replicas 2 --device "$device" --steps 5 2>&1 | grep refused || true
}

part_main() {
  echo
  echo "## 3. The main job on the GPU: one rank, one epoch, against PyTorch DDP + DataLoader"
  NPROC=1 PEER_ARGS="--device cuda" "$here/bench/main_job.sh" "$build" "${PEERS:-$(find_peers)}" --device cuda
}

part_graph() {
  echo
  echo "## 3b. The main job with its step captured in a CUDA graph (--cuda-graph), against PyTorch"
  NPROC=1 PEER_ARGS="--device cuda" "$here/bench/main_job.sh" "$build" "${PEERS:-$(find_peers)}" --device cuda --cuda-graph
}

part_amp() {
  echo
  echo "## 4. The trainer on the GPU in fp32, bf16 and fp16"
  "$here/bench/trainer_amp.sh" "$build" cuda
}

part_gpt() {
  echo
  echo "## 5. The transformer against the same model in PyTorch"
  NPROC=1 "$here/bench/gpt_vs_torch.sh" "$build"
}

for part in "${parts[@]}"; do
  declare -F "part_$part" >/dev/null || { echo "bench/gpu.sh: unknown part '$part' (ddp dp main graph amp gpt)" >&2; exit 2; }
  start=$SECONDS
  # a subshell under timeout, so that one part cut short leaves the others their time
  export -f "part_$part" compare ms median ratios ratio_summary list_median find_peers
  export here build python repeats device
  timeout "$part_timeout" bash -c "dtrain=(${dtrain[*]}); part_$part" ||
    echo "bench/gpu.sh: part $part stopped (exit $?; cut at ${part_timeout}s if 124)"
  echo "# part $part: $((SECONDS - start)) s"
done
