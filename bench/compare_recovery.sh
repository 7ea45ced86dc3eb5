#!/usr/bin/env bash
# Recovery from a worker's kill -9 (issue 21), side by side on one host, the same trainer and fault:
#   in-place   dtrain run --recovery in-place: the survivors re-form and go on, the dead worker is
#              restarted alone and admitted as a newcomer (dtrain/recovery.h)
#   restart    dtrain run (--recovery restart): every worker restarts and resumes from the last
#              checkpoint
#   torchrun   torchrun 2.15 (--standalone): the same restart, torchrun's way
#
#   bench/compare_recovery.sh [runs]      (default 3 rounds; the sides alternate their order)
#
# Three workers of build/bin/train_fashion_mnist (--model mlp, checkpoints every CKPT_EVERY steps
# under restart and torchrun; none in place, which needs none to recover, so that its steps carry
# no checkpoint's cost; it can take them: doc/recovery.md). Rank 2 kills itself
# right after step KILL_AT (DTRAIN_TEST_KILL_AT_STEP, first run only). Rank 0 prints every step and
# the launcher's output is stamped line by line; reported per side: seconds from rank 0's line for
# step KILL_AT (the kill, to within a step) to its first line for step KILL_AT+1 (the job is past
# the fault: under restart that includes the restart, the checkpoint load and the steps redone
# since the checkpoint); for in-place also to its first line at 3 ranks again (the replacement,
# restarted alone, admitted). Medians of the rounds, and the paired ratios against torchrun.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${BUILD:-$here/build}
dtrain=$build/bin/dtrain
trainer=${TRAINER:-$build/bin/train_fashion_mnist}
torchrun=${TORCHRUN:-$here/.venv/bin/torchrun}
runs=${1:-3}
check_count bench/compare_recovery.sh "the number of runs" "$runs"
kill_at=${KILL_AT:-350}
ckpt_every=${CKPT_EVERY:-100}
need_executables "bench/compare_recovery.sh" "BUILD, TRAINER or TORCHRUN" "$dtrain" "$trainer" "$torchrun"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

run_side() {  # side log
  local side=$1 log=$2 dir="$work/ckpt-$RANDOM"
  local job=("$trainer" --model mlp --epochs 1 --log-every 1 --max-steps $((kill_at + 1000)))
  [ "$side" = in-place ] || job+=(--checkpoint-dir "$dir" --checkpoint-every "$ckpt_every")
  case $side in
    in-place) cmd=("$dtrain" run --nproc-per-node 3 --recovery in-place --max-restarts 1 -- "${job[@]}") ;;
    restart) cmd=("$dtrain" run --nproc-per-node 3 --recovery restart --max-restarts 1 -- "${job[@]}") ;;
    torchrun) cmd=("$torchrun" --standalone --nproc-per-node 3 --max-restarts 1 --monitor-interval 0.5
                   --no-python "${job[@]}") ;;
  esac
  DTRAIN_TEST_KILL_AT_STEP=2:$kill_at timeout 300 "${cmd[@]}" > >(stamp > "$log") 2>&1 || true
  sleep 0.3  # the stamping reader drains the last lines
  rm -rf "$dir"
  awk -v k="$kill_at" '
    / step [0-9]+ loss / { for (i = 2; i < NF; ++i) if ($i == "step") { s = $(i + 1); break }
                           if (s == k && !t0) t0 = $1; if (s == k + 1 && t0 && !t1) t1 = $1 }
    END { if (t0 && t1) printf "%.3f", t1 - t0; else printf "nan" }' "$log"
  if [ "$side" = in-place ]; then  # and to the first step back at 3 ranks (the newcomer admitted)
    awk -v k="$kill_at" '
      / step [0-9]+ loss / { for (i = 2; i < NF; ++i) if ($i == "step") { s = $(i + 1); break }
                             if (s == k && !t0) t0 = $1 }
      t0 && s > k && / world 3$/ && !t3 { t3 = $1 }
      END { if (t0 && t3) printf " %.3f", t3 - t0; else printf " nan" }' "$log" >> "$work/full-size"
  fi
}

declare -A times
sides=(in-place restart torchrun)
for round in $(seq "$runs"); do
  # Rotate which side goes first, so that no side always meets the machine in the same state.
  order=("${sides[@]:$((round % 3))}" "${sides[@]:0:$((round % 3))}")
  for side in "${order[@]}"; do
    t=$(run_side "$side" "$work/$side-$round.log")
    times[$side]="${times[$side]:-} $t"
    echo "round $round $side: ${t} s" >&2
  done
done
echo "kill -9 of rank 2 after step $kill_at -> rank 0's step $((kill_at + 1)) (median of $runs, seconds):"
for side in "${sides[@]}"; do echo "  $side: $(list_median "${times[$side]}")  [${times[$side]# }]"; done
echo "  in-place, to the first step back at 3 ranks (the newcomer admitted): $(list_median "$(cat "$work/full-size")")  [$(cat "$work/full-size")]"
echo "  paired ratio in-place / torchrun: $(ratio_summary "${times[in-place]# }" "${times[torchrun]# }")"
echo "  paired ratio restart / torchrun: $(ratio_summary "${times[restart]# }" "${times[torchrun]# }")"
