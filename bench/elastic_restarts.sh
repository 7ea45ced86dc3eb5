#!/usr/bin/env bash
# Elastic restarts of `dtrain run` (issue 8): what the launcher controls, on loopback, c10d backend.
#
#   bench/elastic_restarts.sh [runs]        (default 5 runs of each scenario; needs build/bin/dtrain)
#   BENCH_TRAINER=build/bin/train_fashion_mnist bench/elastic_restarts.sh 3
#                                           the same kills with the MLP trainer as the worker, to its
#                                           first completed step after the restart
#
# With BENCH_TRAINER the workers are the example trainer (--model mlp, DTRAIN_DEBUG=detail); the
# first completed step is marked by its log line for all_reduce #5 (step 2's first bucket; the MLP's
# step 1 uses #4), so it includes init_process_group, the data set load and one step of compute.
#
# Two agents (--nnodes 1:2, one /bin/sh worker each, default heartbeat 1 s x 3 and monitor interval
# 0.5 s unless ELASTIC_FLAGS adds others) and two faults:
#   worker kill: kill -9 of node 1's worker -> both nodes' workers restarted (TORCHELASTIC_RESTART_COUNT=1)
#   node loss:   kill -9 of node 1's agent  -> node 0's worker restarted alone (WORLD_SIZE 1)
# Times are taken from the kill to the moment each launcher line was written (each agent's stderr is
# stamped as it arrives) and to the restarted workers' first line: detection+stop (the agent's
# "worker failed"/"new round" line), rendezvous (to the "round N" line), process start (to the
# worker's first line). The trainer's checkpoint load and first step come after that and are not
# part of this measurement.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"  # check_count
dtrain=${DTRAIN:-$here/build/bin/dtrain}
runs=${1:-5}
check_count bench/elastic_restarts.sh "the number of runs" "$runs"
[ -x "$dtrain" ] || { echo "bench/elastic_restarts.sh: build $dtrain first" >&2; exit 2; }
work=$(mktemp -d)
[ -z "${KEEP:-}" ] || echo "bench/elastic_restarts.sh: keeping $work" >&2
trap 'kill $(jobs -p) 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT

now() { echo "$EPOCHREALTIME"; }

# The worker: its start time and identity, then wait for the finish file.
worker='echo "$(date +%s.%N) start rank=$RANK rc=$TORCHELASTIC_RESTART_COUNT ws=$WORLD_SIZE pid=$$" >> "$1/events"
while [ ! -e "$1/finish" ]; do sleep 0.05; done'

if [ -n "${BENCH_TRAINER:-}" ]; then
  trainer=$(cd "$(dirname "$BENCH_TRAINER")" && pwd)/$(basename "$BENCH_TRAINER")
  [ -x "$trainer" ] || { echo "bench/elastic_restarts.sh: BENCH_TRAINER: $trainer is not executable" >&2; exit 2; }
fi
# Keeps only the lines the trainer benchmark reads (the debug log has one line per collective).
filter() { grep --line-buffered -E 'dtrain run:|all_reduce #5 on' || true; }

# First stamp at or after time $2 of a line matching $3 in file $1; prints seconds since $2.
after() {
  awk -v t0="$2" -v pattern="$3" '$1 >= t0 && $0 ~ pattern { printf "%.3f", $1 - t0; found = 1; exit }
    END { if (!found) printf "nan" }' "$1"
}

wait_for() {  # file pattern count
  for _ in $(seq 1 1200); do  # 60 s: the trainer starts slowly on a loaded machine
    [ -f "$1" ] && [ "$(grep -c -- "$2" "$1" || true)" -ge "$3" ] && return 0
    sleep 0.05
  done
  echo "bench/elastic_restarts.sh: timed out waiting for '$2' in $1" >&2
  exit 1
}

# The agents' flags: two nodes at most, c10d on a free loopback port, the same job id.
agent_flags() {
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
    echo $((20000 + RANDOM % 20000)))
  echo "--nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port --rdzv-id bench" \
    "--rdzv-conf last_call_timeout=5 --max-restarts 3 --recovery restart ${ELASTIC_FLAGS:-}"
}

trainer_once() {  # scenario dir: the same as run_once with the trainer as the worker
  local scenario=$1 dir=$2
  mkdir -p "$dir"
  local flags
  read -r -a flags <<< "$(agent_flags)"
  local cmd=(env DTRAIN_DEBUG=detail "$trainer" --model mlp --epochs 1000)
  "$dtrain" run "${flags[@]}" -- "${cmd[@]}" > >(filter | stamp > "$dir/a.log") 2> >(filter | stamp >> "$dir/a.log") &
  local a=$!
  wait_for "$dir/a.log" "hosting the c10d" 1
  "$dtrain" run "${flags[@]}" -- "${cmd[@]}" > >(filter | stamp > "$dir/b.log") 2> >(filter | stamp >> "$dir/b.log") &
  local b=$!
  wait_for "$dir/a.log" "all_reduce #5 on" 1
  wait_for "$dir/b.log" "all_reduce #5 on" 1
  sleep 1
  local t0
  if [ "$scenario" = worker ]; then
    local victim
    victim=$(pgrep -P "$b" -f "$(basename "$trainer")" | head -1)  # not the output filters
    t0=$(now)
    kill -9 "$victim"
    wait_for "$dir/a.log" "all_reduce #5 on" 2
    wait_for "$dir/b.log" "all_reduce #5 on" 2
    echo "worker $(after "$dir/b.log" "$t0" "worker failed") $(after "$dir/b.log" "$t0" "round 1:") \
$(after "$dir/b.log" "$t0" "all_reduce #5 on") $(after "$dir/a.log" "$t0" "new round") \
$(after "$dir/a.log" "$t0" "round 1:") $(after "$dir/a.log" "$t0" "all_reduce #5 on")"
  else
    t0=$(now)
    kill -9 "$b"
    wait_for "$dir/a.log" "all_reduce #5 on" 2
    echo "node $(after "$dir/a.log" "$t0" "new round") $(after "$dir/a.log" "$t0" "round 1:") \
$(after "$dir/a.log" "$t0" "all_reduce #5 on")"
  fi
  kill "$a" "$b" 2>/dev/null || true
  wait "$a" 2>/dev/null || true
  wait "$b" 2>/dev/null || true
}

run_once() {  # scenario dir
  local scenario=$1 dir=$2
  mkdir -p "$dir"
  local flags
  read -r -a flags <<< "$(agent_flags)"
  "$dtrain" run "${flags[@]}" -- /bin/sh -c "$worker" sh "$dir" 2> >(stamp > "$dir/a.err") > /dev/null &
  local a=$!
  wait_for "$dir/a.err" "hosting the c10d" 1
  "$dtrain" run "${flags[@]}" -- /bin/sh -c "$worker" sh "$dir" 2> >(stamp > "$dir/b.err") > /dev/null &
  local b=$!
  wait_for "$dir/events" "rc=0" 2
  sleep 1  # let both settle into the round

  local t0 victim
  if [ "$scenario" = worker ]; then
    victim=$(awk '/rank=1 rc=0/ { sub("pid=", "", $NF); print $NF }' "$dir/events")
    t0=$(now)
    kill -9 "$victim"
    wait_for "$dir/events" "rc=1" 2
  else
    t0=$(now)
    kill -9 "$b"
    wait_for "$dir/events" "rc=1" 1
  fi
  local start_a start_b
  start_a=$(awk -v t0="$t0" '/rank=0 rc=1/ { printf "%.3f", $1 - t0; exit }' "$dir/events")
  start_b=$(awk -v t0="$t0" '/rank=1 rc=1/ { printf "%.3f", $1 - t0; exit }' "$dir/events")
  if [ "$scenario" = worker ]; then
    echo "worker $(after "$dir/b.err" "$t0" "worker failed") $(after "$dir/b.err" "$t0" "new round") \
$(after "$dir/b.err" "$t0" "round 1:") $start_b $(after "$dir/a.err" "$t0" "new round") \
$(after "$dir/a.err" "$t0" "round 1:") $start_a"
  else
    echo "node $(after "$dir/a.err" "$t0" "new round") $(after "$dir/a.err" "$t0" "round 1:") $start_a"
  fi
  touch "$dir/finish"
  wait "$a" 2>/dev/null || true
  wait "$b" 2>/dev/null || true
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

summarise() {  # file title columns...
  local file=$1 title=$2
  shift 2
  echo "$title"
  local c=2
  for name in "$@"; do
    values=$(awk -v c=$c '{ print $c }' "$file")
    printf '  %-46s %s [%s..%s]\n' "$name" "$(echo "$values" | median)" \
      "$(echo "$values" | sort -g | head -1)" "$(echo "$values" | sort -g | tail -1)"
    c=$((c + 1))
  done
}

once=run_once
[ -n "${BENCH_TRAINER:-}" ] && once=trainer_once
for scenario in worker node; do
  for i in $(seq 1 "$runs"); do $once "$scenario" "$work/$scenario$i"; done > "$work/$scenario.txt"
done

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(uname -n), $(nproc) cores, ${runs} runs each, worker: ${BENCH_TRAINER:-/bin/sh}, flags: ${ELASTIC_FLAGS:-defaults}"
if [ -n "${BENCH_TRAINER:-}" ]; then
  summarise "$work/worker.txt" "## worker kill (kill -9 of node 1's trainer), seconds after the kill, median [min..max]" \
    "node 1: failure seen, workers stopped" "node 1: rendezvous done" "node 1: first step done (restarted)" \
    "node 0: new round seen, workers stopped" "node 0: rendezvous done" "node 0: first step done (restarted)"
  summarise "$work/node.txt" "## node loss (kill -9 of node 1's agent), seconds after the kill" \
    "node 0: loss seen, workers stopped" "node 0: rendezvous done" "node 0: first step done at WORLD_SIZE 1"
else
  summarise "$work/worker.txt" "## worker kill (kill -9 of node 1's worker), seconds after the kill, median [min..max]" \
    "node 1: failure seen, workers stopped" "node 1: new round opened" "node 1: rendezvous done" \
    "node 1: restarted worker's first line" "node 0: new round seen, workers stopped" \
    "node 0: rendezvous done" "node 0: restarted worker's first line"
  summarise "$work/node.txt" "## node loss (kill -9 of node 1's agent), seconds after the kill" \
    "node 0: loss seen, workers stopped" "node 0: rendezvous done" "node 0: restarted worker's first line"
fi
