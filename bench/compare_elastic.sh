#!/usr/bin/env bash
# Elastic recovery of `dtrain run` against torchrun, the same C++ trainer under both (torchrun --no-python), on
# loopback with the c10d rendezvous. Two faults:
#   worker: one agent, --nnodes 1 --nproc-per-node 2, --max-restarts 3; kill -9 of the rank-1 trainer.
#   node:   two agents, --nnodes 1:2 --nproc-per-node 1; kill -9 of node 1 (its agent and its trainer at once:
#           a machine that disappears; the agent started second, so node 0 keeps the rendezvous store).
# The trainer (--model mlp, default batch) checkpoints every CKPT_EVERY steps into a folder both nodes see and
# prints "step S" after every step on rank 0 (--log-every 1); a restarted run resumes from the newest checkpoint
# and says "resumed from ... step S". The kill comes once rank 0 has passed step KILL_AT. Measured, in seconds
# from the kill (every launcher line is stamped as it arrives): "resumed" (the restarted rank 0 has loaded the
# checkpoint) and "first step" (its first completed step after the restart); and in steps: the last step
# rank 0 logged before the kill minus the step it resumed from (work redone), and the world size afterwards.
# The launchers alternate (dtrain first in odd runs).
#
#   bench/compare_elastic.sh worker|node [runs]         (default 3)
# Environment: BUILD (default ./build: bin/dtrain, bin/train_fashion_mnist), TRAINER (another trainer binary),
# TORCHRUN (default .venv/bin/torchrun), SETTINGS=matched|defaults (default matched: both launchers with a
# 0.5 s monitor interval, heartbeats every 1 s with 3 missed = lost, last_call_timeout 5 s; defaults: each
# launcher's own), CKPT_EVERY (500), KILL_AT (750), KEEP=1 keeps the logs.
# torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for a dtrain trainer (set here): by default its rank-0
# agent hosts the workers' store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), where dtrain's rank 0
# wants to host it itself.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"  # median
build=${BUILD:-$here/build}
dtrain=$build/bin/dtrain
trainer=${TRAINER:-$build/bin/train_fashion_mnist}
torchrun=${TORCHRUN:-$here/.venv/bin/torchrun}
scenario=${1:-}
runs=${2:-3}
check_count bench/compare_elastic.sh "the number of runs (the second argument)" "$runs"
settings=${SETTINGS:-matched}
ckpt_every=${CKPT_EVERY:-500}
kill_at=${KILL_AT:-750}
[ "$scenario" = worker ] || [ "$scenario" = node ] ||
  { echo "bench/compare_elastic.sh: scenario '$scenario': expected worker or node" >&2; exit 2; }
[ "$settings" = matched ] || [ "$settings" = defaults ] ||
  { echo "bench/compare_elastic.sh: SETTINGS '$settings': expected matched or defaults" >&2; exit 2; }
need_executables "bench/compare_elastic.sh" "BUILD, TRAINER or TORCHRUN" "$dtrain" "$trainer" "$torchrun"
work=$(mktemp -d)
cores=$(getconf _NPROCESSORS_ONLN)
tag="bench-elastic-$$"  # in the environment of every agent and worker: the clean-up finds them by it

# Agents and workers carry $tag in their environment; kill those left (by pid), never by name.
tagged_pids() {
  grep -l -s -a -F "BENCH_ELASTIC_TAG=$tag" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true
}
cleanup() {
  local pids
  pids=$(tagged_pids)
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  [ -n "${KEEP:-}" ] && echo "bench/compare_elastic.sh: logs in $work" >&2 || rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

now() { echo "$EPOCHREALTIME"; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
    echo $((20000 + RANDOM % 20000))
}

descendants() {  # pid: all its descendants
  local c
  for c in $(pgrep -P "$1" || true); do echo "$c"; descendants "$c"; done
}

trainer_pids() {  # agent pid: its trainers (comm is cut to 15 characters)
  local p
  for p in $(descendants "$1"); do
    [ "$(cat /proc/"$p"/comm 2>/dev/null)" = "$(basename "$trainer" | cut -c1-15)" ] && echo "$p"
  done
  return 0
}

# Boot time to 10 ms (/proc/stat's btime is whole seconds): now minus the uptime.
boot=$(awk -v now="$EPOCHREALTIME" '{ printf "%.3f", now - $1 }' /proc/uptime)
started_at() {  # pid: its start, seconds since the epoch (10 ms resolution)
  awk -v btime="$boot" -v hz="$(getconf CLK_TCK)" \
    '{ sub(/.*\) /, ""); printf "%.2f", btime + $20 / hz }' /proc/"$1"/stat 2>/dev/null
}

env_of() {  # pid name
  tr '\0' '\n' < /proc/"$1"/environ 2>/dev/null | sed -n "s/^$2=//p"
}

last_step() {  # files...: the highest "step S" rank 0 printed
  cat "$@" 2>/dev/null | grep -o -E 'step [0-9]+ loss' | awk '{ if ($2 > m) m = $2 } END { print m + 0 }'
}

wait_until() {  # seconds command...: polls every 50 ms
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.05
  done
}

launch() {  # launcher log [rdzv-conf]: one agent in the background; its pid in $launched
  local launcher=$1 log=$2 conf=${3:-}
  local flags=(--rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id bench --max-restarts 3)
  if [ "$scenario" = worker ]; then flags+=(--nnodes 1 --nproc-per-node 2); else flags+=(--nnodes 1:2 --nproc-per-node 1); fi
  # The same spelling works for both.
  [ "$settings" = defaults ] || {
    flags+=(--monitor-interval 0.5)
    conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3${conf:+,$conf}
  }
  [ -z "$conf" ] || flags+=(--rdzv-conf "$conf")
  local cmd=("$trainer" --model mlp --epochs 1000 --checkpoint-dir "$dir/ckpt" --checkpoint-every "$ckpt_every"
    --log-every 1)
  if [ "$launcher" = torchrun ]; then
    BENCH_ELASTIC_TAG=$tag "$torchrun" "${flags[@]}" --no-python "${cmd[@]}" > >(stamp > "$log") 2>&1 &
  else
    # torchrun's kind of recovery: every worker restarts (in place, dtrain run's default, is
    # bench/compare_recovery.sh's)
    BENCH_ELASTIC_TAG=$tag "$dtrain" run "${flags[@]}" --recovery restart -- "${cmd[@]}" > >(stamp > "$log") 2>&1 &
  fi
  launched=$!
}

first_after() {  # file t0 pattern: seconds from t0 to the first line at or after t0 matching pattern
  awk -v t0="$2" -v p="$3" '$1 >= t0 && $0 ~ p { printf "%.2f", $1 - t0; f = 1; exit } END { if (!f) printf "nan" }' "$1"
}

# First "step" line after the first "resumed from" line at or after t0.
first_step_after_resume() {  # file t0
  awk -v t0="$2" '$1 >= t0 && /resumed from/ { r = 1; next } r && /step [0-9]+ loss/ { printf "%.2f", $1 - t0; f = 1; exit }
    END { if (!f) printf "nan" }' "$1"
}

resumed_step() {  # file t0: the step the restart resumed from
  awk -v t0="$2" '$1 >= t0 && /resumed from/ { sub(/.*step /, ""); print $1 + 0; f = 1; exit } END { if (!f) print "nan" }' "$1"
}

has_step_past() { [ "$(last_step "$@")" -ge "$kill_at" ]; }
first_step_after_resume_ok() { [ "$(first_step_after_resume "$1" "$2")" != nan ]; }

stop_run() {  # agents...: SIGTERM to them (they stop their workers), then SIGKILL to whatever is left of this run
  local p left
  kill "$@" 2>/dev/null || true
  for p in "$@"; do wait_until 30 bash -c "! kill -0 $p 2>/dev/null" || true; done
  left=$(tagged_pids)
  [ -z "$left" ] || kill -9 $left 2>/dev/null || true
  for p in "$@"; do wait "$p" 2>/dev/null || true; done
}

once() {  # launcher run-number: prints one result line, or a "# ... failed" line
  local launcher=$1
  dir=$work/$launcher$2
  mkdir -p "$dir"
  port=$(free_port)
  local a b="" t0 victims world_before="" p
  launch "$launcher" "$dir/a.log"
  a=$launched
  if [ "$scenario" = node ]; then
    if [ "$launcher" = torchrun ]; then
      # Both agents start together (node 1 only connects to node 0's store): torchrun's Python start-up takes
      # seconds, and a node that joins after last_call_timeout makes a second round at once, a restart that
      # torchrun does not count (TORCHELASTIC_RESTART_COUNT stays 0, so the trainer would not resume).
      launch "$launcher" "$dir/b.log" is_host=false
    else
      # The second agent once the first holds the rendezvous store (its port listens).
      wait_until 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null ||
        { echo "# $launcher run $2 failed: the first agent never listened on $port"; stop_run "$a"; return 0; }
      launch "$launcher" "$dir/b.log"
    fi
    b=$launched
  fi
  if ! wait_until 120 has_step_past "$dir/a.log" ${b:+"$dir/b.log"}; then
    echo "# $launcher run $2 failed: rank 0 never reached step $kill_at: $(tail -1 "$dir/a.log" | cut -c1-200)"
    stop_run "$a" $b
    return 0
  fi
  if [ "$scenario" = worker ]; then
    for p in $(trainer_pids "$a"); do [ "$(env_of "$p" RANK)" = 1 ] && victims=$p; done
    world_before=$(env_of "$victims" WORLD_SIZE)
  else
    victims="$b $(descendants "$b")"
    world_before=$(env_of "$(trainer_pids "$b" | head -1)" WORLD_SIZE)
  fi
  if [ "$world_before" != 2 ]; then
    echo "# $launcher run $2 failed: WORLD_SIZE '$world_before' before the kill, not 2"
    stop_run "$a" $b
    return 0
  fi
  t0=$(now)
  kill -9 $victims
  local before
  before=$(awk -v t0="$t0" '$1 < t0' "$dir/a.log" ${b:+"$dir/b.log"} | grep -o -E 'step [0-9]+ loss' |
    awk '{ if ($2 > m) m = $2 } END { print m + 0 }')
  local world_after=nan respawn=nan s resumed_at
  if wait_until 120 first_step_after_resume_ok "$dir/a.log" "$t0"; then
    world_after=$(env_of "$(trainer_pids "$a" | head -1)" WORLD_SIZE)
    # The last restarted trainer's process start (the launcher's part: detection, stop, rendezvous, spawn).
    for p in $(trainer_pids "$a"); do
      s=$(started_at "$p")
      [ -z "$s" ] || respawn=$(awk -v s="$s" -v t0="$t0" -v r="$respawn" 'BEGIN { d = s - t0; printf "%.2f", (r == "nan" || d > r) ? d : r }')
    done
  fi
  resumed_at=$(resumed_step "$dir/a.log" "$t0")
  echo "$launcher $respawn $(first_after "$dir/a.log" "$t0" 'resumed from') $(first_step_after_resume "$dir/a.log" "$t0")" \
    "$before $resumed_at $(awk -v b="$before" -v r="$resumed_at" 'BEGIN { if (r == "nan") print "nan"; else print b - r }')" \
    "${world_before}->${world_after:-?}"
  stop_run "$a" $b
}

torch_version=$("$(dirname "$torchrun")/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -n), $cores cores, load $(cut -d' ' -f1-3 /proc/loadavg)," \
  "commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?'), torchrun $torch_version," \
  "scenario $scenario, settings $settings, checkpoint every $ckpt_every steps, kill after step $kill_at, $runs runs"
echo "# launcher respawned_s resumed_s first_step_s last_step_before_kill resumed_from_step steps_redone world_before->after"
for i in $(seq 1 "$runs"); do
  if [ $((i % 2)) = 1 ]; then order="dtrain torchrun"; else order="torchrun dtrain"; fi
  for l in $order; do once "$l" "$i" | tee -a "$work/results"; done
done

echo "# launcher | respawned s | resumed s | first step s | steps redone: median [min..max]; world sizes"
for l in dtrain torchrun; do
  col() { awk -v l="$l" -v c="$1" '$1 == l { print $c }' "$work/results"; }
  range() { echo "$(col "$1" | median) [$(col "$1" | sort -g | head -1)..$(col "$1" | sort -g | tail -1)]"; }
  echo "$l | $(range 2) | $(range 3) | $(range 4) | $(range 7); $(col 8 | sort | uniq -c | xargs)"
done
if grep -q nan "$work/results"; then echo "# nan: no restarted step within 120 s"; fi
# Paired ratios of the first step after the restart (dtrain/torchrun, the same run number).
awk '$1 == "dtrain" { d[++i] = $4 } $1 == "torchrun" { t[++j] = $4 }
  END { for (k = 1; k <= i && k <= j; ++k) if (t[k] > 0) print d[k] / t[k] }' "$work/results" > "$work/ratios"
[ ! -s "$work/ratios" ] || echo "# first step dtrain/torchrun: median of paired ratios $(median < "$work/ratios")" \
  "[$(sort -g "$work/ratios" | head -1)..$(sort -g "$work/ratios" | tail -1)]"
