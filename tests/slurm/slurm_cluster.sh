#!/usr/bin/env bash
# A one-machine Slurm cluster for the tests, everything in one folder: a munged on its own socket and key,
# slurmctld and one slurmd (this host, its CPUs) on a free port pair, their state, spool, pid and log files.
# Nothing outside the folder is read or written, and only the processes this script started are stopped.
#
#   slurm_cluster.sh start DIR   writes DIR/slurm.conf, starts the daemons, waits (at most 30 s) until the
#                                node is idle; then SLURM_CONF=DIR/slurm.conf points srun/sbatch/... at it.
#                                Exit 0: up. Exit 77: Slurm cannot run here (not root, a package missing, a
#                                daemon refused), the reason in one line on stderr, nothing left running.
#                                With DTRAIN_REQUIRE_SLURM=1, such a machine is an error (exit 1) instead.
#   slurm_cluster.sh stop DIR    cancels the cluster's jobs, stops its daemons (by pid) and removes DIR.
#
# The cluster: root runs everything (SlurmUser=root); no cgroups (proctrack/linuxproc, task/none), so it runs
# in containers; JobRequeue=1 and KillWait=10 s (a SIGTERMed step has 10 s before its SIGKILL); a requeued job
# may start again after cred_expire=5 s (Slurm's default is 120 s).
set -uo pipefail

usage() {
  echo "usage: slurm_cluster.sh start|stop DIR" >&2
  exit 2
}
(($# == 2)) || usage
action=$1
dir=$2

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

stop() {
  [ -d "$dir" ] || return 0
  if [ ! -f "$dir/pids" ] && [ -n "$(ls -A "$dir")" ]; then
    echo "slurm_cluster: not removing $dir: it holds files but no cluster (no $dir/pids)" >&2
    return 1
  fi
  if [ -f "$dir/pids" ]; then
    # Jobs first, so that slurmd can end their steps; then the daemons; then whatever of the jobs is left.
    SLURM_CONF=$dir/slurm.conf scancel --quiet --user="$(id -un)" 2>/dev/null
    SLURM_CONF=$dir/slurm.conf wait_for 3 bash -c '[ -z "$(squeue --noheader 2>/dev/null)" ]'
    # The Slurm daemons, then munged (they may still want it to say goodbye).
    end_pids $(awk '$2 != "munged" { print $1 }' "$dir/pids")
    end_pids $(awk '$2 == "munged" { print $1 }' "$dir/pids")
    local pid
    for pid in $(cluster_pids); do kill -KILL "$pid" 2>/dev/null; done
  fi
  rm -rf "$dir"
}

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

  local host cpus ports
  host=$(hostname -s)
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

  local socket=$dir/munge/munge.socket
  cat >"$dir/slurm.conf" <<CONF
ClusterName=dtrain-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
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
MinJobAge=60
FirstJobId=$first_job_id
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

  # munged: its own key, socket, pid, log and seed files; -F keeps it our child, so its pid is ours.
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none && chmod 400 "$dir/munge/munge.key" ||
    cannot "cannot write a munge key in $dir/munge"
  munged -F --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed" >>"$dir/munged.log" 2>&1 &
  echo "$! munged" >>"$dir/pids"
  wait_for 10 test -S "$socket" || cannot "munged did not open its socket $socket within 10 s"

  export SLURM_CONF=$dir/slurm.conf
  setsid slurmctld -D -i -f "$SLURM_CONF" >>"$dir/slurmctld.out" 2>&1 </dev/null &
  echo "$! slurmctld" >>"$dir/pids"
  setsid slurmd -D -f "$SLURM_CONF" >>"$dir/slurmd.out" 2>&1 </dev/null &
  echo "$! slurmd" >>"$dir/pids"
  if ! wait_for 30 bash -c '[[ "$(sinfo --noheader --responding --format=%t 2>/dev/null)" == idle ]]'; then
    local pid name
    while read -r pid name; do
      kill -0 "$pid" 2>/dev/null || cannot "$name exited (its log: $dir/$name.log)"
    done <"$dir/pids"
    cannot "the node did not become idle within 30 s (sinfo: $(sinfo --noheader 2>&1 | head -n 1))"
  fi
}

case "$action" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
