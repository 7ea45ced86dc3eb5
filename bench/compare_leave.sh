#!/usr/bin/env bash
# A node taken back on SIGTERM (issue 21: scale down, nothing lost), side by side on one host, the same
# trainer and the same signal:
#   in-place   dtrain run --recovery in-place: the leaving node's worker leaves at a step boundary and the
#              other goes on, re-formed (Note [Leaving in place] in include/dtrain/recovery.h)
#   restart    dtrain run --recovery restart: every rank stops at an agreed step, rank 0 saves it, the
#              staying agent restarts its worker at the smaller size from that checkpoint
#   torchrun   torchrun 2.15: the same stop and save; torchrun's staying agent restarts its worker in a new
#              rendezvous round
#
#   bench/compare_leave.sh [runs]      (default 3 rounds; the sides alternate their order)
#
# Two agents of one elastic c10d rendezvous on 127.0.0.1 (--nnodes 1:2, one worker each of
# build/bin/train_fashion_mnist --model mlp, checkpoints every CKPT_EVERY steps so that SIGTERM stops with a
# save). The agent started second (it does not host the rendezvous store, so the job can go on without it)
# gets SIGTERM once rank 0 has printed step LEAVE_AT. Reported per side: seconds from the SIGTERM (the
# script's clock) to the first line of the step after the one the job shrank at ("left on SIGTERM after step
# S" or "stopped by SIGTERM after step S": step S+1, at size 1). Medians of the rounds, and the paired ratios
# against torchrun. torchrun runs with its own rendezvous defaults (5 s keep-alives, a 30 s last call);
# TORCHRUN_RDZV_CONF (e.g. keep_alive_interval=1,last_call_timeout=1) gives it other ones. SIDES picks sides;
# KEEP=1 keeps the logs.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${BUILD:-$here/build}
dtrain=$build/bin/dtrain
trainer=${TRAINER:-$build/bin/train_fashion_mnist}
torchrun=${TORCHRUN:-$here/.venv/bin/torchrun}
runs=${1:-3}
check_count bench/compare_leave.sh "the number of runs" "$runs"
leave_at=${LEAVE_AT:-300}
check_count bench/compare_leave.sh "LEAVE_AT, a step" "$leave_at"
ckpt_every=${CKPT_EVERY:-100}
check_count bench/compare_leave.sh "CKPT_EVERY, a number of steps" "$ckpt_every"
sides=(${SIDES:-in-place restart torchrun})
for side in "${sides[@]}"; do
  [[ $side =~ ^(in-place|restart|torchrun)$ ]] ||
    { echo "bench/compare_leave.sh: SIDES: '$side': expected in-place, restart or torchrun" >&2; exit 2; }
done
need_executables "bench/compare_leave.sh" "BUILD, TRAINER or TORCHRUN" "$dtrain" "$trainer" "$torchrun"
work=$(mktemp -d)
[ -z "${KEEP:-}" ] || echo "bench/compare_leave.sh: logs kept in $work" >&2
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The largest step rank 0 has printed in the two logs so far.
last_step() { cat "$@" 2>/dev/null | grep -o " step [0-9]* loss" | awk '{ if ($2 > m) m = $2 } END { print m + 0 }'; }

run_side() {  # side log-prefix
  local side=$1 log=$2 dir="$work/ckpt-$RANDOM" port
  port=$(free_port)
  local job=("$trainer" --model mlp --epochs 1 --log-every 1 --max-steps $((leave_at + 300))
             --checkpoint-dir "$dir" --checkpoint-every "$ckpt_every")
  local rdzv=(--nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port"
              --rdzv-id "leave-$RANDOM" --max-restarts 1)
  case $side in
    in-place) cmd=("$dtrain" run "${rdzv[@]}" --recovery in-place -- "${job[@]}") ;;
    restart) cmd=("$dtrain" run "${rdzv[@]}" --recovery restart -- "${job[@]}") ;;
    torchrun) cmd=("$torchrun" "${rdzv[@]}" ${TORCHRUN_RDZV_CONF:+--rdzv-conf "$TORCHRUN_RDZV_CONF"}
                   --monitor-interval 0.5 --no-python "${job[@]}") ;;
  esac
  timeout 300 "${cmd[@]}" > >(stamp > "$log.a") 2>&1 &
  local a=$!
  sleep 1  # the first agent hosts the rendezvous store
  timeout 300 "${cmd[@]}" > >(stamp > "$log.b") 2>&1 &
  local b=$!
  pids=("$a" "$b")
  for ((i = 0; i < 3000; ++i)); do
    (($(last_step "$log.a" "$log.b") >= leave_at)) && break
    sleep 0.02
  done
  local signalled=$EPOCHREALTIME
  # The agent itself, as a scheduler signals it: timeout's child other than the stamping reader (a bash).
  for p in $(pgrep -P "$b"); do [ "$(cat "/proc/$p/comm" 2>/dev/null)" = bash ] || kill -TERM "$p" || true; done
  wait "$a" "$b" || true
  pids=()
  sleep 0.3  # the stamping readers drain the last lines
  rm -rf "$dir"
  sort -s -g -k1,1 "$log.a" "$log.b" | awk -v t0="$signalled" '
    !s && /(left|stopped) on SIGTERM after step [0-9]+|stopped by SIGTERM after step [0-9]+/ {
      for (i = 1; i < NF; ++i) if ($i == "step") { s = $(i + 1); sub(/[^0-9].*/, "", s) }
    }
    s && / step [0-9]+ loss / { for (i = 2; i < NF; ++i) if ($i == "step" && $(i + 1) == s + 1 && $1 > t0 && !t1) t1 = $1 }
    END { if (t1) printf "%.3f", t1 - t0; else printf "nan" }'
}

declare -A times
for round in $(seq "$runs"); do
  # Rotate which side goes first, so that no side always meets the machine in the same state.
  order=("${sides[@]:$((round % 3))}" "${sides[@]:0:$((round % 3))}")
  for side in "${order[@]}"; do
    t=$(run_side "$side" "$work/$side-$round")
    times[$side]="${times[$side]:-} $t"
    echo "round $round $side: ${t} s" >&2
  done
done
echo "SIGTERM to the second node's agent after rank 0's step $leave_at -> the first step at size 1 past the" \
  "shrink (median of $runs, seconds):"
for side in "${sides[@]}"; do echo "  $side: $(list_median "${times[$side]}")  [${times[$side]# }]"; done
for side in in-place restart; do
  if [ -n "${times[$side]:-}" ] && [ -n "${times[torchrun]:-}" ]; then
    echo "  paired ratio $side / torchrun: $(ratio_summary "${times[$side]# }" "${times[torchrun]# }")"
  fi
done
