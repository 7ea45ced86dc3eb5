#!/usr/bin/env bash
# Recovery from a host lost and from a link cut (issue 21), side by side on three namespace hosts, the same
# trainer and fault:
#   in-place   dtrain run, static nodes (--nnodes 3), in place (its default): the survivors re-form and go
#              on; after a link cut the cut-off worker, restarted alone, rejoins as a newcomer
#   restart    dtrain run --nnodes 2:3 --rdzv-backend c10d --recovery restart: the agents form a new round
#              without the lost node and every worker restarts from the last checkpoint
#   torchrun   torchrun 2.15 with the same elastic flags: the same restart, torchrun's way
#
#   bench/host_faults.sh [rounds]      (default 3; the sides rotate their order every round)
#
# The hosts are network namespaces on one bridge (a fourth namespace holds it), each with its own hostname
# and address 10.81.0.1-3; the script makes them and removes them when it exits, however it exits. One
# worker per host: build/bin/train_fashion_mnist (--model mlp, rank 0 prints every step; checkpoints every
# CKPT_EVERY steps under restart and torchrun). When host 0's output shows step FAULT_AT, host 2 is cut off:
#   host-loss  its link goes down, then every process in it is killed (a machine gone: nothing resets the
#              connections)
#   link-cut   its link goes down for CUT_S seconds and comes back
# Reported per side and fault: seconds from the fault to rank 0's first line for a later step (the job is
# past the fault: under restart that includes the new round, the restart, the checkpoint load and the steps
# redone), and, after a link cut, to rank 0's first step at 3 workers again (nan: not within WATCH_S after
# the link came back; a host loss is watched for 15 s).
# The elastic sides get the settings of bench/compare_elastic.sh's "matched" runs: --monitor-interval 0.5,
# keep_alive_interval=1, keep_alive_max_attempt=3, last_call_timeout=5.
# Environment: BUILD, TORCHRUN, FAULT_AT=300, CKPT_EVERY=100, CUT_S=5, WATCH_S=30, FAULTS="host-loss
# link-cut". Needs root (namespaces) and iproute2; says why and exits 2 where it cannot make the hosts.
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
watch_s=${WATCH_S:-30}
loss_watch_s=$((watch_s < 15 ? watch_s : 15))
for f in "$dtrain" "$trainer" "$torchrun"; do
  [ -x "$f" ] || { echo "$me: $f is not an executable (set BUILD or TORCHRUN)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "$me: network namespaces need root" >&2; exit 2; }

# Hosts ${ns[0..2]} (hostnames fault-host0..2, 10.81.0.1..3) and the switch ${ns[3]}.
ns=(dtrain-hf$$h0 dtrain-hf$$h1 dtrain-hf$$h2 dtrain-hf$$sw)
work=$(mktemp -d)
remove_hosts() {
  for host_ns in "${ns[@]}"; do
    ip netns pids "$host_ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$host_ns" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap remove_hosts EXIT
made=$( (for host_ns in "${ns[@]}"; do ip netns add "$host_ns" || exit 1; done
  ip -n "${ns[3]}" link add br0 type bridge && ip -n "${ns[3]}" link set br0 up || exit 1
  for host in 0 1 2; do
    ip -n "${ns[3]}" link add "port$host" type veth peer name eth0 netns "${ns[host]}" &&
      ip -n "${ns[3]}" link set "port$host" master br0 && ip -n "${ns[3]}" link set "port$host" up &&
      ip -n "${ns[host]}" addr add "10.81.0.$((host + 1))/24" dev eth0 &&
      ip -n "${ns[host]}" link set eth0 up && ip -n "${ns[host]}" link set lo up || exit 1
  done) 2>&1) ||
  { echo "$me: cannot make three namespace hosts (the kernel or the container refused): $made" >&2; exit 2; }

# on HOST COMMAND...: runs COMMAND on host 0, 1 or 2, with that host's hostname.
on() {
  local host=$1
  shift
  ip netns exec "${ns[host]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' "fault-host$host" "$@"
}
stamp() { while IFS= read -r line; do echo "$EPOCHREALTIME $line"; done; }
kill_hosts() {
  for host in 0 1 2; do ip netns pids "${ns[host]}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true; done
}

port=$((20000 + RANDOM % 20000))
# run_side SIDE FAULT LOG: one run; prints "SECONDS_TO_NEXT_STEP SECONDS_TO_FULL_SIZE" (nan where not seen)
run_side() {
  local side=$1 fault=$2 log=$3 dir="$work/ckpt-$RANDOM"
  port=$((port + 1))
  local job=("$trainer" --model mlp --epochs 100 --log-every 1)
  [ "$side" = in-place ] || job+=(--checkpoint-dir "$dir" --checkpoint-every "$ckpt_every")
  local elastic=(--nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "10.81.0.1:$port"
    --rdzv-id bench --max-restarts 3 --monitor-interval 0.5
    --rdzv-conf last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3)
  for host in 2 1 0; do
    local cmd
    case $side in
      in-place) cmd=("$dtrain" run --nnodes 3 --node-rank "$host" --nproc-per-node 1 --master-addr 10.81.0.1
                     --master-port "$port" --max-restarts 1 -- "${job[@]}") ;;
      restart) cmd=("$dtrain" run "${elastic[@]}" --recovery restart -- "${job[@]}") ;;
      # --local-addr: torchrun would give the workers node 0's hostname as MASTER_ADDR, which resolves
      # nowhere here (dtrain's agents publish an address).
      torchrun) cmd=("$torchrun" "${elastic[@]}" --local-addr "10.81.0.$((host + 1))" --no-python
                     "${job[@]}") ;;
    esac
    if [ $host = 0 ]; then
      on 0 env OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "${cmd[@]}" > >(stamp > "$log") 2>&1 &
    else
      sleep 0.2  # host 0 first: the elastic sides' c10d store lives in its agent
      on "$host" env OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "${cmd[@]}" \
        > "$log.host$host" 2>&1 &
    fi
  done
  # The fault, once rank 0 has printed step FAULT_AT (at most 120 s).
  local t_fault="" deadline=$((SECONDS + 120))
  while [ $SECONDS -lt $deadline ]; do
    if grep -q " step $fault_at " "$log" 2>/dev/null; then
      t_fault=$EPOCHREALTIME
      ip -n "${ns[2]}" link set eth0 down
      [ "$fault" = host-loss ] && { ip netns pids "${ns[2]}" | xargs -r kill -9 2>/dev/null || true; }
      break
    fi
    sleep 0.02
  done
  [ -n "$t_fault" ] || { echo "$me: $side never reached step $fault_at: $(tail -3 "$log")" >&2; kill_hosts; exit 1; }
  if [ "$fault" = link-cut ]; then
    sleep "$cut_s"
    ip -n "${ns[2]}" link set eth0 up
    sleep "$watch_s"
  else
    sleep "$loss_watch_s"  # nothing comes back after a host loss: only the next step is awaited
  fi
  kill_hosts
  sleep 0.3  # the stamping reader drains the last lines
  rm -rf "$dir"
  awk -v t0="$t_fault" -v k="$fault_at" '
    $1 > t0 && / step [0-9]+ loss / {
      for (i = 2; i < NF; ++i) if ($i == "step") { s = $(i + 1); break }
      if (s > k && !t1) t1 = $1
      if (t1 && / world 2$/) shrunk = 1
      if (shrunk && / world 3$/ && !t3) t3 = $1 }
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
sides=(in-place restart torchrun)
faults=(${FAULTS:-host-loss link-cut})
for round in $(seq "$rounds"); do
  order=("${sides[@]:$((round % 3))}" "${sides[@]:0:$((round % 3))}")
  for fault in "${faults[@]}"; do
    for side in "${order[@]}"; do
      read -r t1 t3 <<<"$(run_side "$side" "$fault" "$work/$side-$fault-$round.log")"
      next[$side,$fault]="${next[$side,$fault]:-} $t1"
      full[$side,$fault]="${full[$side,$fault]:-} $t3"
      echo "round $round, $fault, $side: next step after $t1 s, back at 3 workers after $t3 s" >&2
    done
  done
done
bench_header "$(dirname "$torchrun")/python" "$0 $* (FAULT_AT=$fault_at CKPT_EVERY=$ckpt_every CUT_S=$cut_s WATCH_S=$watch_s)"
echo
echo "| fault | side | to rank 0's next step, s (median of $rounds) | rounds | back at 3 workers, s | rounds |"
echo "|---|---|---:|---|---:|---|"
for fault in "${faults[@]}"; do
  for side in "${sides[@]}"; do
    echo "| $fault | $side | $(seen "${next[$side,$fault]}") | ${next[$side,$fault]# } |" \
      "$(seen "${full[$side,$fault]}") | ${full[$side,$fault]# } |"
  done
done
