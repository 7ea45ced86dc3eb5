#!/usr/bin/env bash
# A Slurm cluster for the tests, everything in one folder: a munged on its own socket and key, slurmctld and
# slurmd on a free port pair, their state, spool, pid and log files. By default one node, this host with its
# CPUs; with --two-hosts two nodes, each a slurmd in a network namespace of its own, with its own hostname,
# address and spool folder. Only the processes (and namespaces) this script made are stopped (removed).
#
#   slurm_cluster.sh start DIR [--two-hosts] [LINE...]
#                                writes DIR/slurm.conf (each LINE appended to it: a partition, preemption),
#                                starts the daemons, waits (at most 30 s) until every node is idle; then
#                                SLURM_CONF=DIR/slurm.conf points srun/sbatch/... at it. Exit 0: up. Exit 77:
#                                Slurm cannot run here (not root, a package missing, a daemon or the kernel
#                                refused), the reason in one line on stderr, nothing left running. With
#                                DTRAIN_REQUIRE_SLURM=1, such a machine is an error (exit 1) instead.
#   slurm_cluster.sh stop DIR    cancels the cluster's jobs, stops its daemons (by pid), removes its
#                                namespaces and DIR.
#
# The cluster: root runs everything (SlurmUser=root); no cgroups (proctrack/linuxproc, task/none), so it runs
# in containers; JobRequeue=1 and KillWait=10 s (a SIGTERMed step has 10 s before its SIGKILL); a requeued job
# may start again after cred_expire=5 s (Slurm's default is 120 s); a finished job stays in `scontrol show
# job` for MinJobAge=600 s (the tests read a job's end state minutes later on a busy machine; with 60 s,
# slurm.preempt found its high-priority job already forgotten).
#
# --two-hosts: namespaces dtslurmPORTa and dtslurmPORTb joined by a veth pair, nodes dtrain-node0 (10.78.0.1)
# and dtrain-node1 (10.78.0.2), each slurmd under its own hostname (unshare --uts). Node 0 is also the head:
# slurmctld runs there, and so must every client (DIR/netns names the namespaces; tests/slurm/lib.sh's
# on_head runs a command there). The node names resolve through DIR/hosts, bound over /etc/hosts in the
# daemons' own mount namespace (so in their jobs' too), as a cluster's name service would. The daemons
# enter their network namespace with nsenter, not `ip netns exec`, which would mount a sysfs of its own
# and hide /sys/fs/cgroup, without which slurmd does not start.
set -uo pipefail

usage() {
  echo "usage: slurm_cluster.sh start DIR [--two-hosts] [SLURM_CONF_LINE...] | stop DIR" >&2
  exit 2
}
(($# >= 2)) || usage
action=$1
dir=$2
shift 2
two_hosts=0
if [ "${1:-}" = --two-hosts ]; then
  two_hosts=1
  shift
fi
extra_lines=("$@")
[ "$action" = start ] || ((${#extra_lines[@]} == 0 && two_hosts == 0)) || usage

# Waits until "$@" succeeds, polling every 0.2 s, for at most $timeout seconds.
wait_for() {
  local timeout=$1
  shift
  local tries=$((timeout * 5))
  for ((i = 0; i < tries; ++i)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}

# Ends the processes we started (pids from DIR/pids, never found by name): SIGTERM to all at once, SIGKILL to
# those still there after 5 s.
end_pids() {
  local pid left
  (($#)) || return 0
  kill -TERM "$@" 2>/dev/null
  for ((i = 0; i < 25; ++i)); do
    left=()
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left+=("$pid"); done
    ((${#left[@]})) || return 0
    sleep 0.2
  done
  kill -KILL "${left[@]}" 2>/dev/null
}

# The processes of this cluster's jobs: those whose environment names this cluster's slurm.conf (slurmstepd
# inherits slurmd's, a batch script sbatch's, a task srun's), less this script and its callers (a test that
# exported SLURM_CONF). Found by pid through /proc, never by name.
cluster_pids() {
  local ancestors=" " pid=$$ env
  while ((pid > 1)); do
    ancestors+="$pid "
    pid=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ')
    [ -n "$pid" ] || break
  done
  for env in $(grep -lzxF "SLURM_CONF=$dir/slurm.conf" /proc/[0-9]*/environ 2>/dev/null); do
    pid=${env#/proc/}
    pid=${pid%/environ}
    [[ $ancestors == *" $pid "* ]] || echo "$pid"
  done
}

# Runs "$@" where the cluster's clients run: on the head node's namespace with --two-hosts, else here.
on_head() {
  if [ -s "$dir/netns" ]; then
    nsenter --net="/run/netns/$(sed -n 1p "$dir/netns")" "$@"
  else
    "$@"
  fi
}

# Whether all $1 nodes answer and are idle (a node is listed once per partition).
nodes_idle() {
  [ "$(on_head sinfo --noheader --responding --Node --format='%N %t' 2>/dev/null | sort -u |
    awk '$2 == "idle"' | wc -l)" = "$1" ]
}

stop() {
  [ -d "$dir" ] || return 0
  if [ ! -f "$dir/pids" ] && [ -n "$(ls -A "$dir")" ]; then
    echo "slurm_cluster: not removing $dir: it holds files but no cluster (no $dir/pids)" >&2
    return 1
  fi
  if [ -f "$dir/pids" ]; then
    # Jobs first, so that slurmd can end their steps; then the daemons; then whatever of the jobs is left.
    export SLURM_CONF=$dir/slurm.conf
    on_head scancel --quiet --user="$(id -un)" 2>/dev/null
    wait_for 3 jobs_gone
    # The Slurm daemons, then munged (they may still want it to say goodbye).
    end_pids $(awk '$2 != "munged" { print $1 }' "$dir/pids")
    end_pids $(awk '$2 == "munged" { print $1 }' "$dir/pids")
    local pid
    for pid in $(cluster_pids); do kill -KILL "$pid" 2>/dev/null; done
  fi
  # --two-hosts: the namespaces (each takes its end of the veth pair, and so the pair, with it), named
  # in DIR/netns before they were made.
  if [ -f "$dir/netns" ]; then
    local ns
    while read -r ns; do
      [ -n "$ns" ] && ip netns del "$ns" 2>/dev/null
    done <"$dir/netns"
  fi
  rm -rf "$dir"
}

jobs_gone() { [ -z "$(on_head squeue --noheader 2>/dev/null)" ]; }

# Exit 77 (or 1 with DTRAIN_REQUIRE_SLURM=1) with the reason; whatever was started is stopped first.
cannot() {
  local reason="slurm_cluster: cannot run Slurm here: $1"
  if [ -f "$dir/pids" ]; then
    local log
    for log in "$dir"/*.log; do
      [ -s "$log" ] && reason+="; $(basename "$log"): $(tail -n 1 "$log")"
    done
  fi
  stop
  echo "$reason" >&2
  [ "${DTRAIN_REQUIRE_SLURM:-0}" = 1 ] && exit 1
  exit 77
}

start() {
  [ "$(id -u)" = 0 ] || cannot "not root (the test cluster's daemons run as root, SlurmUser=root)"
  local tool
  for tool in munged slurmctld slurmd srun sbatch scontrol scancel squeue sinfo python3; do
    command -v "$tool" >/dev/null ||
      cannot "$tool is not installed (Debian: munge slurmctld slurmd slurm-client; scripts/bootstrap installs them)"
  done
  mkdir -p "$dir" || cannot "cannot create $dir"
  dir=$(cd "$dir" && pwd)
  [ -z "$(ls -A "$dir")" ] || {
    echo "slurm_cluster: $dir is not empty; start a cluster in a new or empty folder" >&2
    exit 2
  }
  # munged wants its socket's folders open to all (execute) and its key readable by root alone.
  chmod 755 "$dir"
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
  chmod 755 "$dir/munge"
  : >"$dir/pids"

  local cpus ports
  cpus=$(nproc)
  ((cpus < 2)) && cpus=2  # config_overrides lets a one-core machine run the two-rank tests too
  # Two ports free now (bound and released at once; the kernel hands out distinct ones).
  ports=$(python3 -c 'import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("", 0))
print(*(x.getsockname()[1] for x in s))') || cannot "python3 could not find two free ports"
  read -r ctld_port slurmd_port <<<"$ports"
  # Job ids start at the controller's port, not at 1: a Slurm job's ranks meet on port 15000 + job id %
  # 20000 (src/comm/launch_env.cpp), and two clusters of tests running at once would otherwise both
  # hand out job 1.
  local first_job_id=$ctld_port

  # The nodes: names, addresses, and the command prefix that runs a daemon on each.
  local names addrs ctld_host nodes_line
  if ((two_hosts)); then
    names=(dtrain-node0 dtrain-node1)
    addrs=(10.78.0.1 10.78.0.2)
    make_hosts "${names[@]}" "${addrs[@]}"
    ctld_host="${names[0]}(${addrs[0]})"
    nodes_line="NodeName=${names[0]} NodeAddr=${addrs[0]} CPUs=$cpus State=UNKNOWN
NodeName=${names[1]} NodeAddr=${addrs[1]} CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=${names[0]},${names[1]} Default=YES MaxTime=INFINITE State=UP"
    mkdir -p "$dir/spool/${names[0]}" "$dir/spool/${names[1]}"
  else
    names=("$(hostname -s)")
    ctld_host="${names[0]}(127.0.0.1)"
    nodes_line="NodeName=${names[0]} NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=${names[0]} Default=YES MaxTime=INFINITE State=UP"
  fi
  # One node's slurmd files are named as before; two nodes' carry the node's name (%n).
  local per_node=""
  ((two_hosts)) && per_node="-%n"

  local socket=$dir/munge/munge.socket
  cat >"$dir/slurm.conf" <<CONF
ClusterName=dtrain-test
SlurmctldHost=$ctld_host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool${per_node:+/%n}
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd$per_node.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd$per_node.log
SlurmctldDebug=info
SlurmdDebug=verbose
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
InactiveLimit=0
MinJobAge=600
FirstJobId=$first_job_id
$nodes_line
CONF
  local line
  for line in "${extra_lines[@]}"; do echo "$line" >>"$dir/slurm.conf"; done

  # munged: its own key, socket, pid, log and seed files; -F keeps it our child, so its pid is ours. Its
  # socket is a file: the namespaces' daemons reach it too.
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none && chmod 400 "$dir/munge/munge.key" ||
    cannot "cannot write a munge key in $dir/munge"
  munged -F --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed" >>"$dir/munged.log" 2>&1 &
  echo "$! munged" >>"$dir/pids"
  wait_for 10 test -S "$socket" || cannot "munged did not open its socket $socket within 10 s"

  export SLURM_CONF=$dir/slurm.conf
  if ((two_hosts)); then
    local ns
    mapfile -t ns <"$dir/netns"
    on_node "${ns[0]}" "${names[0]}" slurmctld -D -i -f "$SLURM_CONF" >>"$dir/slurmctld.out" 2>&1 </dev/null &
    echo "$! slurmctld" >>"$dir/pids"
    for i in 0 1; do
      on_node "${ns[i]}" "${names[i]}" slurmd -D -N "${names[i]}" -f "$SLURM_CONF" \
        >>"$dir/slurmd-${names[i]}.out" 2>&1 </dev/null &
      echo "$! slurmd-${names[i]}" >>"$dir/pids"
    done
  else
    setsid slurmctld -D -i -f "$SLURM_CONF" >>"$dir/slurmctld.out" 2>&1 </dev/null &
    echo "$! slurmctld" >>"$dir/pids"
    setsid slurmd -D -f "$SLURM_CONF" >>"$dir/slurmd.out" 2>&1 </dev/null &
    echo "$! slurmd" >>"$dir/pids"
  fi
  if ! wait_for 30 nodes_idle "${#names[@]}"; then
    local pid name
    while read -r pid name; do
      kill -0 "$pid" 2>/dev/null || cannot "$name exited (its log: $dir/$name.log)"
    done <"$dir/pids"
    cannot "not all ${#names[@]} node(s) became idle within 30 s (sinfo: $(on_head sinfo --noheader --Node 2>&1 | tr '\n' ';'))"
  fi
}

# --two-hosts: two namespaces joined by a veth pair, named in DIR/netns before they are made (so that stop
# removes whatever was made), each with its address; DIR/hosts names both nodes.
# Usage: make_hosts NAME0 NAME1 ADDR0 ADDR1
make_hosts() {
  local tool
  for tool in ip nsenter unshare hostname; do
    command -v "$tool" >/dev/null || cannot "$tool is not installed (Debian: iproute2, util-linux, hostname)"
  done
  local ns=("dtslurm${ctld_port}a" "dtslurm${ctld_port}b") link=dts$ctld_port
  local names=("$1" "$2") addrs=("$3" "$4") devs=("${link}a" "${link}b")
  printf '%s\n' "${ns[@]}" >"$dir/netns"
  local script="set -e; ip netns add ${ns[0]}; ip netns add ${ns[1]}"
  script+="; ip link add ${devs[0]} type veth peer name ${devs[1]}"
  local h
  for h in 0 1; do
    script+="; ip link set ${devs[h]} netns ${ns[h]}; ip -n ${ns[h]} addr add ${addrs[h]}/24 dev ${devs[h]}"
    script+="; ip -n ${ns[h]} link set ${devs[h]} up; ip -n ${ns[h]} link set lo up"
  done
  local out
  out=$(sh -c "$script" 2>&1) || cannot "cannot make two namespace hosts (ip netns, veth): $out"
  printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${addrs[0]}" "${names[0]}" "${addrs[1]}" "${names[1]}" \
    >"$dir/hosts"
}

# Runs "$@" (it must not fork: its pid is ours) in network namespace $1 under the hostname $2, with
# DIR/hosts as its /etc/hosts. nsenter, unshare and sh each exec the next.
on_node() {
  local netns=$1 host=$2
  shift 2
  exec setsid nsenter --net="/run/netns/$netns" unshare --uts --mount sh -c \
    'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"' "$host" "$dir/hosts" "$@"
}

case "$action" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
