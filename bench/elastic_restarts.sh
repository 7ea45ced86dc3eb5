#!/usr/bin/env bash
# Elastic restarts of `dtrain run` (issue 8): what the launcher controls, on loopback, c10d backend.
#
#   bench/elastic_restarts.sh [runs]        (default 5 runs of each scenario; needs build/bin/dtrain)
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
dtrain=${DTRAIN:-$here/build/bin/dtrain}
runs=${1:-5}
[ -x "$dtrain" ] || { echo "bench/elastic_restarts.sh: build $dtrain first" >&2; exit 2; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

now() { echo "$EPOCHREALTIME"; }
stamp() { while IFS= read -r line; do echo "$EPOCHREALTIME $line"; done; }  # no fork per line

# The worker: its start time and identity, then wait for the finish file.
worker='echo "$(date +%s.%N) start rank=$RANK rc=$TORCHELASTIC_RESTART_COUNT ws=$WORLD_SIZE pid=$$" >> "$1/events"
while [ ! -e "$1/finish" ]; do sleep 0.05; done'

# First stamp at or after time $2 of a line matching $3 in file $1; prints seconds since $2.
after() {
  awk -v t0="$2" -v pattern="$3" '$1 >= t0 && $0 ~ pattern { printf "%.3f", $1 - t0; found = 1; exit }
    END { if (!found) printf "nan" }' "$1"
}

wait_for() {  # file pattern count
  for _ in $(seq 1 400); do
    [ -f "$1" ] && [ "$(grep -c -- "$2" "$1" || true)" -ge "$3" ] && return 0
    sleep 0.05
  done
  echo "bench/elastic_restarts.sh: timed out waiting for '$2' in $1" >&2
  exit 1
}

run_once() {  # scenario dir
  local scenario=$1 dir=$2 port
  mkdir -p "$dir"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
    echo $((20000 + RANDOM % 20000)))
  local flags=(--nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id bench
    --rdzv-conf last_call_timeout=5 --max-restarts 3 ${ELASTIC_FLAGS:-})
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

for scenario in worker node; do
  for i in $(seq 1 "$runs"); do run_once "$scenario" "$work/$scenario$i"; done > "$work/$scenario.txt"
done

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(uname -n), $(nproc) cores, ${runs} runs each, flags: ${ELASTIC_FLAGS:-defaults}"
echo "## worker kill (kill -9 of node 1's worker), seconds after the kill, median [min..max]"
cols=("node 1: failure seen, workers stopped" "node 1: new round opened" "node 1: rendezvous done"
  "node 1: restarted worker's first line" "node 0: new round seen, workers stopped"
  "node 0: rendezvous done" "node 0: restarted worker's first line")
for c in $(seq 0 6); do
  values=$(awk -v c=$((c + 2)) '{ print $c }' "$work/worker.txt")
  printf '  %-42s %s [%s..%s]\n' "${cols[$c]}" "$(echo "$values" | median)" \
    "$(echo "$values" | sort -g | head -1)" "$(echo "$values" | sort -g | tail -1)"
done
echo "## node loss (kill -9 of node 1's agent), seconds after the kill"
cols=("node 0: loss seen, workers stopped" "node 0: rendezvous done" "node 0: restarted worker's first line")
for c in 0 1 2; do
  values=$(awk -v c=$((c + 2)) '{ print $c }' "$work/node.txt")
  printf '  %-42s %s [%s..%s]\n' "${cols[$c]}" "$(echo "$values" | median)" \
    "$(echo "$values" | sort -g | head -1)" "$(echo "$values" | sort -g | tail -1)"
done
