#!/usr/bin/env bash
# DDP across two hosts over TCP, side by side with PyTorch's DDP on the same two hosts, on a free link and on
# a link capped with tbf; and, on the capped link, what `dtrain scale --link-gbps` predicts for two workers
# against what the trainer measures there, and what `dtrain scale --nnodes 2` measures across the two
# hosts itself (issue 21).
#
# The hosts are two network namespaces joined by one veth pair, each with its own hostname (resolving
# nowhere, as on a cluster whose nodes know each other only by address) and address, 10.79.0.1 and
# 10.79.0.2; the script makes them and removes them when it exits, however it exits. Each host runs one
# worker: dtrain's bench_ddp under `dtrain run --nnodes 2 --node-rank R` with nothing else set (dtrain
# binds the address that routes to MASTER_ADDR), PyTorch's torch_ddp_mlp.py (shared/peers) started by hand
# with torchrun's variables and GLOO_SOCKET_IFNAME=eth0 (without it, Gloo binds the address its hostname
# resolves to, and here it resolves to none). Both hosts share this machine's cores: one worker per core on
# the 2-vCPU VM. Each round runs both sides once, alternating which goes first; per point it prints the
# median ms/step of each side and the median of the paired ratios dtrain / PyTorch (below 1: dtrain faster).
#   bench/two_hosts.sh [build dir] [peer dir]
# Environment: BUILD, PEERS, PYTHON (the peer's python, default <repo>/.venv/bin/python), REPEATS=5,
# HIDDENS="256 1024 4096", CAP_GBPS=1 (the capped link's rate), COMPARE=1 and PREDICT=1 (0: skip the
# comparison with PyTorch, or the prediction part).
# Needs root (namespaces, tc) and iproute2; says why and exits 2 where it cannot make the hosts.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/paired.sh"
build=${1:-${BUILD:-$here/build}}
peers=${2:-$(find_peers)}
python=${PYTHON:-$here/.venv/bin/python}
repeats=${REPEATS:-5}
cap=${CAP_GBPS:-1}
batch=32
me=bench/two_hosts.sh
for need in "$build/bin/dtrain" "$build/bin/bench_ddp" "$build/bin/train_fashion_mnist" \
  "$peers/torch_ddp_mlp.py" "$python"; do
  [ -e "$need" ] || { echo "$me: $need not found (BUILD=$build, PEERS=$peers, PYTHON=$python)" >&2; exit 2; }
done
[[ $cap =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$me: CAP_GBPS='$cap': expected a rate in Gbit/s, e.g. 1" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$me: network namespaces need root" >&2; exit 2; }

# The two hosts: namespaces ${ns[0]} and ${ns[1]} (ns0 and ns1 for short), hostnames bench-host0 and
# bench-host1.
ns=(dtrain-bench$$h0 dtrain-bench$$h1)
ns0=${ns[0]} ns1=${ns[1]}
remove_hosts() {
  for host_ns in "${ns[@]}"; do
    ip netns pids "$host_ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$host_ns" 2>/dev/null || true
  done
}
trap remove_hosts EXIT
made=$( (ip netns add $ns0 && ip netns add $ns1 &&
  ip -n $ns0 link add eth0 type veth peer name eth0 netns $ns1 &&
  ip -n $ns0 addr add 10.79.0.1/24 dev eth0 && ip -n $ns1 addr add 10.79.0.2/24 dev eth0 &&
  for host_ns in "${ns[@]}"; do
    ip -n "$host_ns" link set eth0 up && ip -n "$host_ns" link set lo up || exit 1
  done) 2>&1) ||
  { echo "$me: cannot make two namespace hosts (the kernel or the container refused): $made" >&2; exit 2; }

# on HOST COMMAND...: runs COMMAND on host 0 or 1, with that host's hostname.
on() { in_host "${ns[$1]}" "bench-host$1" "${@:2}"; }
# cap_links RATE|off: tbf on both ends of the link (a burst of 1 MB: at least rate / HZ for 1 Gbit/s).
cap_links() {
  for host_ns in "${ns[@]}"; do
    if [ "$1" = off ]; then
      ip netns exec "$host_ns" tc qdisc del dev eth0 root 2>/dev/null || true
    else
      ip netns exec "$host_ns" tc qdisc replace dev eth0 root tbf rate "${1}gbit" burst 1mb latency 100ms
    fi
  done
}

ms_of() { grep -o 'ms/step=[0-9.]*' | tail -1 | cut -d= -f2; }
# both NAME COMMAND_FOR_HOST_0 COMMAND_FOR_HOST_1: runs the two at once, prints host 0's ms/step, or one
# line naming what failed and exits 1.
both() {
  local name=$1 out0 out1 pid ms
  out0=$(mktemp) out1=$(mktemp)
  eval "on 1 $3" >"$out1" 2>&1 &
  pid=$!
  eval "on 0 $2" >"$out0" 2>&1 || true
  wait $pid || true
  ms=$(ms_of <"$out0")
  [ -n "$ms" ] || { echo "$me: $name printed no ms/step: $(tail -2 "$out0" "$out1")" >&2; exit 1; }
  rm -f "$out0" "$out1"
  echo "$ms"
}
port=$((20000 + RANDOM % 20000))
dtrain_side() {  # HIDDEN STEPS
  port=$((port + 1))
  local run="$build/bin/dtrain run --nnodes 2 --nproc-per-node 1 --master-addr 10.79.0.1 --master-port $port"
  local prog="$build/bin/bench_ddp --hidden $1 --batch $batch --steps $2"
  both dtrain "$run --node-rank 0 -- $prog" "$run --node-rank 1 -- $prog"
}
torch_side() {  # HIDDEN STEPS
  port=$((port + 1))
  local env="env MASTER_ADDR=10.79.0.1 MASTER_PORT=$port WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1"
  env+=" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0"
  local prog="$python $peers/torch_ddp_mlp.py $2 $1 $batch"
  both PyTorch "$env RANK=0 GROUP_RANK=0 $prog" "$env RANK=1 GROUP_RANK=1 $prog"
}

bench_header "$python" "$0 $* (REPEATS=$repeats CAP_GBPS=$cap)"
if [ "${COMPARE:-1}" = 1 ]; then
  echo
  echo "| link | hidden | steps | dtrain ms/step | PyTorch ms/step | dtrain / PyTorch, median of paired ratios (range) |"
  echo "|---|---:|---:|---:|---:|---:|"
  log=""
  for link in free "$cap"; do
    cap_links "$([ "$link" = free ] && echo off || echo "$link")"
    label=$([ "$link" = free ] && echo "veth, no cap" || echo "tbf $link Gbit/s")
    for hidden in ${HIDDENS:-256 1024 4096}; do
      case $hidden in 256) steps=200 ;; 1024) steps=40 ;; *) steps=10 ;; esac
      ours="" theirs=""
      for ((i = 0; i < repeats; i++)); do
        for who in $( ((i % 2)) && echo "theirs ours" || echo "ours theirs"); do
          if [ "$who" = ours ]; then ours+="$(dtrain_side "$hidden" "$steps") "; else theirs+="$(torch_side "$hidden" "$steps") "; fi
        done
      done
      echo "| $label | $hidden | $steps | $(list_median "$ours") | $(list_median "$theirs") | $(ratio_summary "$ours" "$theirs") |"
      log+="$label H=$hidden: dtrain ${ours% }; PyTorch ${theirs% }"$'\n'
    done
  done
  echo
  echo "rounds (ms/step):"
  printf '%s' "$log"
fi

[ "${PREDICT:-1}" = 1 ] || exit 0
# The prediction against the measurement: the trainer's DDP (per-rank batch 64), `dtrain scale --nproc 1,2
# --link-gbps CAP` on this machine (the two workers over shared memory; the prediction swaps in the capped
# link), against the trainer's samples/s at 1 worker here and at 2 workers on the two capped hosts, one
# epoch each, REPEATS times.
trainer="$build/bin/train_fashion_mnist --strategy ddp --batch-size 64 --epochs 1"
samples_of() { grep -o '"samples_per_s": *[0-9.]*' | tail -1 | grep -o '[0-9.]*$'; }
predicted=$(OMP_NUM_THREADS=1 "$build/bin/dtrain" scale --nproc 1,2 --steps 50 --link-gbps "$cap" --json -- \
  $trainer | "$python" -c '
import json, sys
report = json.load(sys.stdin)
print("%.3g" % next(p["speedup_at_link"] for p in report["prediction"]["points"] if p["workers"] == 2))')
cap_links "$cap"
ones="" twos=""
for ((i = 0; i < repeats; i++)); do
  ones+="$(OMP_NUM_THREADS=1 "$build/bin/dtrain" run --nproc-per-node 1 -- $trainer 2>&1 | samples_of) "
  port=$((port + 1))
  run="$build/bin/dtrain run --nnodes 2 --nproc-per-node 1 --master-addr 10.79.0.1 --master-port $port"
  out1=$(mktemp)
  on 1 $run --node-rank 1 -- $trainer >"$out1" 2>&1 &
  twos+="$(on 0 $run --node-rank 0 -- $trainer 2>&1 | samples_of) "
  wait $! || true
  rm -f "$out1"
done
echo
echo "The trainer (DDP, 64 samples per rank) over the $cap Gbit/s link: 1 worker $(list_median "$ones") samples/s," \
  "2 workers on the two hosts $(list_median "$twos") samples/s: measured speed-up $(ratio_summary "$twos" "$ones");" \
  "dtrain scale --link-gbps $cap predicted ${predicted}x"
echo "rounds (samples/s): 1 worker ${ones% }; 2 hosts ${twos% }"

# `dtrain scale` across the two capped hosts (--nnodes 2, one worker each): the 1-worker count on host 0,
# the 2-worker count over the link, whose all-reduces the fit then takes its bandwidth from; and the
# prediction at 2 workers with --link-gbps CAP, the rate tbf is set to, against that measured point.
echo
echo "dtrain scale --nnodes 2 across the $cap Gbit/s link (trainer as above, --steps 50):"
for ((i = 0; i < repeats; i++)); do
  port=$((port + 10))
  scale="$build/bin/dtrain scale --nnodes 2 --nproc-per-node 1 --master-addr 10.79.0.1 --master-port $port"
  scale+=" --steps 50 --link-gbps $cap --json"
  on 1 env OMP_NUM_THREADS=1 $scale --node-rank 1 -- $trainer >/dev/null 2>&1 &
  on 0 env OMP_NUM_THREADS=1 $scale --node-rank 0 -- $trainer 2>/dev/null | "$python" -c '
import json, sys
report = json.load(sys.stdin)
two = next(r for r in report["runs"] if r["workers"] == 2)
point = next(p for p in report["prediction"]["points"] if p["workers"] == 2)
print("  round %d: 2 workers on %d hosts, %d ranks recorded: measured speed-up %.3f, ring bus %.2f Gbit/s;"
      " fitted %.2f Gbit/s (%s); predicted at --link-gbps %s: %.3fx" % (
      int(sys.argv[1]) + 1, two["nodes"], two["ranks_recorded"], two["speedup"], two["bus_gbps"],
      report["comm_model"]["bandwidth_gbps"], report["comm_model"]["how"].split(":")[0],
      sys.argv[2], point["speedup_at_link"]))' "$i" "$cap"
  wait $! || true
done
