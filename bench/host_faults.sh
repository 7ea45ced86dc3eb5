#!/usr/bin/env bash
# Recovery from a host lost and from a link cut (issue 21), side by side on three namespace hosts, the same
# trainer and fault:
#   in-place   dtrain run, static nodes (--nnodes 3), in place (its default): the survivors re-form and go
#              on; after a link cut the cut-off worker, restarted alone, rejoins as a newcomer
#   elastic-in-place
#              dtrain run --nnodes 2:3 --rdzv-backend c10d, in place: the survivors go on, the agents take
#              the lost node out of the running round, and a replacement host is admitted into it as a
#              newcomer (Note [Rounds in place])
#   restart    dtrain run --nnodes 2:3 --rdzv-backend c10d --recovery restart: the agents form a new round
#              without the lost node and every worker restarts from the last checkpoint
#   torchrun   torchrun 2.15 with the same elastic flags: the same restart, torchrun's way
#
#   bench/host_faults.sh [rounds]      (default 3; the sides rotate their order every round)
#
# The hosts are network namespaces on one bridge (a fourth namespace holds it), each with its own hostname
# and address 10.81.0.1-3, the names resolving through each host's own /etc/hosts (iproute2's
# /etc/netns/NAME/hosts: torchrun's c10d rendezvous looks its own hostname up and stops where it does not
# resolve); the script makes them and removes them when it exits, however it exits. One
# worker per host: build/bin/train_fashion_mnist (--model mlp, rank 0 prints every step; checkpoints every
# CKPT_EVERY steps under restart and torchrun). When host 0's output shows step FAULT_AT, host 2 is cut off:
#   host-loss  its link goes down, then every process in it is killed (a machine gone: nothing resets the
#              connections)
#   link-cut   its link goes down for CUT_S seconds and comes back
#   host-replaced
#              host-loss, then REPLACE_S seconds later host 2 comes back as a fresh machine: its link up
#              and the same launcher command started there again (the elastic sides only: a static job has
#              no way to take a new node in)
# Reported per side and fault: seconds from the fault to rank 0's first line for a step after the fault's
# silence (the steps in flight print right after the fault; then nothing for at least 0.5 s; then the job is
# past the fault: under restart that includes the new round, the restart, the checkpoint load and the steps
# redone), and, after a link cut or a replacement, to rank 0's first step at 3 workers again (nan: not within
# WATCH_S after the link came back or the new host started; a host loss is watched for DTRAIN_TIMEOUT_S + 15
# s). Every side's trainer gets
# DTRAIN_TIMEOUT_S (default here 20 s, the library's 600): the collective timeout, which is how workers
# under torchrun learn that a host is gone (torchrun's agents restart them once one fails); dtrain run's
# agents see it by their heartbeats, its in-place workers by theirs.
# The elastic sides get the settings of bench/compare_elastic.sh's "matched" runs: --monitor-interval 0.5,
# keep_alive_interval=1, keep_alive_max_attempt=3, last_call_timeout=5.
# Environment: BUILD, TORCHRUN, FAULT_AT=300, CKPT_EVERY=100, CUT_S=5, REPLACE_S=5, WATCH_S=30,
# FAULTS="host-loss link-cut host-replaced", DTRAIN_TIMEOUT_S=20,
# SIDES="in-place elastic-in-place restart torchrun", KEEP_LOGS=DIR (every host's output of every run, kept there). Needs root (namespaces) and iproute2; says why and exits 2 where it cannot make the hosts.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
me=bench/host_faults.sh
build=${BUILD:-$here/build}
dtrain=$build/bin/dtrain
trainer=$build/bin/train_fashion_mnist
torchrun=${TORCHRUN:-$here/.venv/bin/torchrun}
rounds=${1:-3}
check_count $me "the number of rounds" "$rounds"
fault_at=${FAULT_AT:-300}
ckpt_every=${CKPT_EVERY:-100}
cut_s=${CUT_S:-5}
replace_s=${REPLACE_S:-5}
watch_s=${WATCH_S:-30}
timeout_s=${DTRAIN_TIMEOUT_S:-20}
check_count $me "DTRAIN_TIMEOUT_S" "$timeout_s"
# After a host loss torchrun's workers learn of it from their collective's timeout; then they restart.
loss_watch_s=$((timeout_s + 15))
for var in FAULT_AT:$fault_at CKPT_EVERY:$ckpt_every CUT_S:$cut_s REPLACE_S:$replace_s WATCH_S:$watch_s; do
  check_count $me "${var%%:*}" "${var#*:}"
done
for side in ${SIDES:-}; do
  [[ $side =~ ^(in-place|elastic-in-place|restart|torchrun)$ ]] ||
    { echo "$me: SIDES: '$side': expected in-place, elastic-in-place, restart or torchrun" >&2; exit 2; }
done
for fault in ${FAULTS:-}; do
  [[ $fault =~ ^(host-loss|link-cut|host-replaced)$ ]] ||
    { echo "$me: FAULTS: '$fault': expected host-loss, link-cut or host-replaced" >&2; exit 2; }
done
need_executables "$me" "BUILD or TORCHRUN" "$dtrain" "$trainer" "$torchrun"
[ "$(id -u)" = 0 ] || { echo "$me: network namespaces need root" >&2; exit 2; }

# Hosts ${ns[0..2]} (hostnames fault-host0..2, 10.81.0.1..3) and the switch ${ns[3]}.
ns=(dtrain-hf$$h0 dtrain-hf$$h1 dtrain-hf$$h2 dtrain-hf$$sw)
work=$(mktemp -d)
remove_hosts() {
  for host_ns in "${ns[@]}"; do
    ip netns pids "$host_ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$host_ns" 2>/dev/null || true
    rm -rf "/etc/netns/$host_ns"
  done
  rmdir /etc/netns 2>/dev/null || true  # when no other namespace keeps files there
  if [ -n "${KEEP_LOGS:-}" ] && [ -d "$work" ]; then
    mkdir -p "$KEEP_LOGS" && cp "$work"/*.log* "$KEEP_LOGS/" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap remove_hosts EXIT
made=$( (for host_ns in "${ns[@]}"; do ip netns add "$host_ns" || exit 1; done
  ip -n "${ns[3]}" link add br0 type bridge && ip -n "${ns[3]}" link set br0 up || exit 1
  for host in 0 1 2; do
    mkdir -p "/etc/netns/${ns[host]}" &&
      printf '127.0.0.1 localhost\n10.81.0.1 fault-host0\n10.81.0.2 fault-host1\n10.81.0.3 fault-host2\n' \
        > "/etc/netns/${ns[host]}/hosts" || exit 1
    ip -n "${ns[3]}" link add "port$host" type veth peer name eth0 netns "${ns[host]}" &&
      ip -n "${ns[3]}" link set "port$host" master br0 && ip -n "${ns[3]}" link set "port$host" up &&
      ip -n "${ns[host]}" addr add "10.81.0.$((host + 1))/24" dev eth0 &&
      ip -n "${ns[host]}" link set eth0 up && ip -n "${ns[host]}" link set lo up || exit 1
  done) 2>&1) ||
  { echo "$me: cannot make three namespace hosts (the kernel or the container refused): $made" >&2; exit 2; }

# on HOST COMMAND...: runs COMMAND on host 0, 1 or 2, with that host's hostname.
on() { in_host "${ns[$1]}" "fault-host$1" "${@:2}"; }
# Ends a run: every process of every host, and host 2's link back up for the next.
kill_hosts() {
  for host in 0 1 2; do ip netns pids "${ns[host]}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true; done
  ip -n "${ns[2]}" link set eth0 up
}

# run_side SIDE FAULT LOG PORT: one run; prints "SECONDS_TO_NEXT_STEP SECONDS_TO_FULL_SIZE" (nan where not
# seen)
run_side() {
  local side=$1 fault=$2 log=$3 port=$4 dir="$work/ckpt-$RANDOM"
  local job=("$trainer" --model mlp --epochs 100 --log-every 1)
  [[ $side == *in-place ]] || job+=(--checkpoint-dir "$dir" --checkpoint-every "$ckpt_every")
  local elastic=(--nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "10.81.0.1:$port"
    --rdzv-id bench --max-restarts 3 --monitor-interval 0.5
    --rdzv-conf last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3)
  local -a cmds
  for host in 0 1 2; do
    local cmd
    case $side in
      in-place) cmd=("$dtrain" run --nnodes 3 --node-rank "$host" --nproc-per-node 1 --master-addr 10.81.0.1
                     --master-port "$port" --max-restarts 1 -- "${job[@]}") ;;
      elastic-in-place) cmd=("$dtrain" run "${elastic[@]}" -- "${job[@]}") ;;
      restart) cmd=("$dtrain" run "${elastic[@]}" --recovery restart -- "${job[@]}") ;;
      # --local-addr: torchrun would give the workers node 0's hostname as MASTER_ADDR, which resolves
      # nowhere here (dtrain's agents publish an address).
      torchrun) cmd=(env LOGLEVEL=INFO "$torchrun" "${elastic[@]}" --local-addr "10.81.0.$((host + 1))"
                     --no-python "${job[@]}") ;;
    esac
    # Every host's output, stamped: the trainer prints its steps on rank 0, wherever an elastic
    # round puts it (node ranks follow the order of joining).
    cmds[host]=$(printf '%q ' "${cmd[@]}")
    on "$host" env OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 DTRAIN_TIMEOUT_S="$timeout_s" "${cmd[@]}" \
      > >(stamp > "$log.host$host") 2>&1 &
    sleep 0.2  # host 0 first: the elastic sides' c10d store lives in its agent
  done
  # The fault, once rank 0 has printed step FAULT_AT (at most 120 s).
  local t_fault="" deadline=$((SECONDS + 120))
  while [ $SECONDS -lt $deadline ]; do
    if cat "$log".host* 2>/dev/null | grep -q " step $fault_at "; then
      t_fault=$EPOCHREALTIME
      ip -n "${ns[2]}" link set eth0 down
      [ "$fault" = link-cut ] || { ip netns pids "${ns[2]}" | xargs -r kill -9 2>/dev/null || true; }
      break
    fi
    sleep 0.02
  done
  if [ -z "$t_fault" ]; then
    kill_hosts
    local kept
    kept=$(mktemp -d /tmp/host_faults-failed.XXXXXX)
    cp "$log".host* "$kept/"
    echo "$me: $side never reached step $fault_at within 120 s; every host's output is in $kept" >&2
    return 1
  fi
  if [ "$fault" = link-cut ]; then
    sleep "$cut_s"
    ip -n "${ns[2]}" link set eth0 up
    sleep "$watch_s"
  elif [ "$fault" = host-replaced ]; then
    sleep "$replace_s"
    ip -n "${ns[2]}" link set eth0 up
    on 2 env OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 DTRAIN_TIMEOUT_S="$timeout_s" \
      bash -c "exec ${cmds[2]}" > >(stamp > "$log.host2-new") 2>&1 &
    sleep "$watch_s"
  else
    sleep "$loss_watch_s"  # nothing comes back after a host loss: only the next step is awaited
  fi
  kill_hosts
  sleep 0.3  # the stamping readers drain the last lines
  rm -rf "$dir"
  sort -n -s -k1,1 "$log".host* > "$log"
  # The steps in flight at the fault still print right after it; the job is past the fault at the
  # first step after a silence of half a second or more.
  # At 3 workers again: a step at world 3 after some at world 2 (the in-place sides print the world size),
  # or the first step after a new round of 3 workers (dtrain's agents say "WORLD_SIZE 3", torchrun's at
  # LOGLEVEL=INFO "group_world_size=3").
  awk -v t0="$t_fault" '
    BEGIN { last = t0 }
    $1 > t0 && (/round [0-9]+: node rank .*, WORLD_SIZE 3,/ || /group_world_size=3$/) { regrown = 1 }
    $1 > t0 && / step [0-9]+ loss / {
      if (!t1 && $1 - last >= 0.5) t1 = $1
      last = $1
      if (t1 && / world 2$/) shrunk = 1
      if (t1 && !t3 && ((shrunk && / world 3$/) || (regrown && !/ world [0-9]+$/))) t3 = $1 }
    END { printf "%s %s", (t1 ? sprintf("%.3f", t1 - t0) : "nan"), (t3 ? sprintf("%.3f", t3 - t0) : "nan") }' "$log"
}

# seen LIST: the median of the values that are not nan, and how many were seen when not all
seen() {
  local values n all
  values=$(tr ' ' '\n' <<<"$1" | grep . | grep -v nan || true)
  n=$(grep -c . <<<"$values" || true) all=$(tr ' ' '\n' <<<"$1" | grep -c . || true)
  [ "$n" -gt 0 ] || { echo "nan"; return; }
  echo "$(median <<<"$values")$([ "$n" = "$all" ] || echo " ($n of $all)")"
}

declare -A next full
port=$((20000 + RANDOM % 20000))
sides=(${SIDES:-in-place elastic-in-place restart torchrun})
faults=(${FAULTS:-host-loss link-cut host-replaced})
for round in $(seq "$rounds"); do
  turn=$((round % ${#sides[@]}))
  order=("${sides[@]:$turn}" "${sides[@]:0:$turn}")
  for fault in "${faults[@]}"; do
    for side in "${order[@]}"; do
      [ "$fault" = host-replaced ] && [ "$side" = in-place ] && continue  # static: no new node
      port=$((port + 2))
      times=$(run_side "$side" "$fault" "$work/$side-$fault-$round.log" "$port") || exit 1
      read -r t1 t3 <<<"$times"
      next[$side,$fault]="${next[$side,$fault]:-} $t1"
      full[$side,$fault]="${full[$side,$fault]:-} $t3"
      echo "round $round, $fault, $side: next step after $t1 s, back at 3 workers after $t3 s" >&2
    done
  done
done
bench_header "$(dirname "$torchrun")/python" "$0 $* (FAULT_AT=$fault_at CKPT_EVERY=$ckpt_every CUT_S=$cut_s REPLACE_S=$replace_s WATCH_S=$watch_s DTRAIN_TIMEOUT_S=$timeout_s SIDES=\"${sides[*]}\" FAULTS=\"${faults[*]}\")"
echo
echo "| fault | side | to rank 0's next step, s (median of $rounds) | rounds | back at 3 workers, s | rounds |"
echo "|---|---|---:|---|---:|---|"
for fault in "${faults[@]}"; do
  for side in "${sides[@]}"; do
    [ "$fault" = host-replaced ] && [ "$side" = in-place ] && continue
    echo "| $fault | $side | $(seen "${next[$side,$fault]}") | ${next[$side,$fault]# } |" \
      "$(seen "${full[$side,$fault]}") | ${full[$side,$fault]# } |"
  done
done
