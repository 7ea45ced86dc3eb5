# What the Slurm tests share (sourced): a cluster of their own for the test's lifetime, the trainer, the
# final JSON line's fields, and how a test fails or skips. The test's first argument is the build's bin/.
# ctest registers every test with SKIP_RETURN_CODE 77 (tests/CMakeLists.txt).
set -uo pipefail

bin=${1:?usage: $0 BUILD_BIN_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
trainer=$bin/train_fashion_mnist
name=$(basename "$0" .sh)

fail() {
  echo "$name: FAILED: $*" >&2
  exit 1
}

skip() {
  echo "$name: SKIPPED: $*"
  exit 77
}

# Starts this test's cluster in a fresh folder (exported: SLURM_CONF; set: cluster, work, a folder for the
# test's own files) and stops it when the test exits, however it exits. Skips where Slurm cannot run. The
# arguments go to `slurm_cluster.sh start DIR`: --two-hosts, then slurm.conf lines.
start_cluster() {
  [ -x "$trainer" ] || fail "$trainer is not built (cmake --build build --target train_fashion_mnist)"
  local data=${DTRAIN_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
  [ -e "$data/train-images-idx3-ubyte" ] || [ -e "$data/train-images-idx3-ubyte.gz" ] ||
    skip "Fashion-MNIST is not in \$DTRAIN_FASHION_MNIST_DIR or $data (Debian: dataset-fashion-mnist)"
  cluster=$(mktemp -d /tmp/dtrain-slurm.XXXXXX)
  work=$(mktemp -d /tmp/dtrain-slurm-work.XXXXXX)
  # DTRAIN_KEEP_TEST_FILES=1 keeps the test's files (its job output, checkpoints) for a look afterwards.
  # DTRAIN_KEEP_TEST_FILES=1 keeps the daemons' logs there too.
  # A test's own helpers on the cluster (pids in $stop_first) go before it.
  trap '[ -n "${stop_first:-}" ] && kill $stop_first 2>/dev/null && sleep 1
        [ "${DTRAIN_KEEP_TEST_FILES:-0}" = 1 ] && cp "$cluster"/*.log "$work/" 2>/dev/null
        bash "$here/slurm_cluster.sh" stop "$cluster"
        [ "${DTRAIN_KEEP_TEST_FILES:-0}" = 1 ] && echo "$name: kept $work" || rm -rf "$work"' EXIT
  local reason rc
  reason=$(bash "$here/slurm_cluster.sh" start "$cluster" "$@" 2>&1)
  rc=$?
  ((rc == 77)) && skip "$reason"
  ((rc == 0)) || fail "$reason"
  export SLURM_CONF=$cluster/slurm.conf
  [ -s "$cluster/netns" ] && head_ns=$(sed -n 1p "$cluster/netns")
}

# Runs "$@" where the cluster's clients run (srun, sbatch, scontrol, ...): on the head node's namespace in a
# --two-hosts cluster, here otherwise.
head_ns=""
on_head() {
  if [ -n "$head_ns" ]; then
    nsenter --net="/run/netns/$head_ns" "$@"
  else
    "$@"
  fi
}

# job_state JOB: "JobState=... Restarts=N ExitCode=A:B " of a job.
job_state() {
  on_head scontrol show job "$1" 2>&1 | grep -o "JobState=[A-Z_]*\|Restarts=[0-9]*\|ExitCode=[0-9:]*" | tr '\n' ' '
}

# wait_job_end JOB [SECONDS]: waits (at most SECONDS, 120 by default) until JOB is over (COMPLETED, FAILED,
# CANCELLED, TIMEOUT), then prints job_state.
wait_job_end() {
  local tries=$((${2:-120} * 10))
  for ((i = 0; i < tries; ++i)); do
    [[ "$(job_state "$1")" == *JobState=@(COMPLETED|FAILED|CANCELLED|TIMEOUT)* ]] && break
    sleep 0.1
  done
  job_state "$1"
}

# wait_line FILE REGEX [SECONDS]: waits (at most SECONDS, 60 by default) until a line of FILE matches; fails
# naming FILE's last lines otherwise.
wait_line() {
  local tries=$((${3:-60} * 20))
  for ((i = 0; i < tries; ++i)); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  fail "no line matching '$2' in $1 within ${3:-60} s: $(tail -n 5 "$1" 2>&1)"
}

# The end of a preemptable batch script, after its srun: after a SIGTERM stop (143) while the job is being
# preempted it waits, since Slurm requeues a preempted job only when its GraceTime is over, and one that has
# ended by then is over (FAILED), not requeued. Printed for a batch script's heredoc.
requeue_wait_lines() {
  cat <<'LINES'
status=$?
echo "srun exited with $status"
if ((status == 143)) && scontrol show job "$SLURM_JOB_ID" | grep -q "PreemptTime=[0-9]"; then
  echo "preempted: waiting for Slurm to requeue the job"
  sleep infinity
fi
exit $status
LINES
}

# A preemptable training job: the batch script that preempt_test.sh and measure_preempt.sh submit, as
# doc/slurm.md shows it. It prints when it starts, then runs the trainer under srun with the arguments given
# here and --checkpoint-dir "$CKPT" (no --resume: a requeued run resumes by itself). After a SIGTERM stop
# (143) while the job is being preempted it waits: Slurm requeues a preempted job only when its GraceTime is
# over, and one that has ended by then is over (FAILED), not requeued.
# Usage: write_preemptable_job FILE TRAINER_ARG...
write_preemptable_job() {
  local file=$1
  shift
  cat >"$file" <<JOB
#!/usr/bin/env bash
echo "attempt SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-unset} at \$(date +%s.%N)"
srun --kill-on-bad-exit=1 "$trainer" $* --checkpoint-dir "\$CKPT"
$(requeue_wait_lines)
JOB
}

# The preemption of preempt_test.sh and measure_preempt.sh: jobs of partition high preempt those of low by
# requeueing them; a preempted job's tasks get SIGTERM at once and everything of the job its SIGCONT,
# SIGTERM and, KillWait (10 s) later, SIGKILL when GraceTime (5 s) is over.
preempt_grace_s=5
preempt_conf=(
  "PreemptType=preempt/partition_prio"
  "PreemptMode=REQUEUE"
  "PartitionName=low Nodes=ALL PriorityTier=1 PreemptMode=REQUEUE GraceTime=$preempt_grace_s MaxTime=INFINITE State=UP"
  "PartitionName=high Nodes=ALL PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP"
)

# signal_time LOG JOB: when slurmstepd sent SIGTERM (15) to step 0 of JOB, in seconds since the epoch, from
# slurmd's log (SlurmdDebug=verbose logs "Sent signal 15 to StepId=JOB.0" with milliseconds).
signal_time() {
  python3 - "$1" "$2" <<'PY'
import datetime, re, sys
pattern = re.compile(r"^\[([0-9T:.-]+)\].*Sent signal 15 to StepId=%s\.0$" % re.escape(sys.argv[2]))
for line in open(sys.argv[1], errors="replace"):
    m = pattern.match(line.rstrip("\n"))
    if m:
        print("%.3f" % datetime.datetime.fromisoformat(m.group(1)).timestamp())
        break
PY
}

# json FILE KEY: KEY of the last JSON line in FILE (`dtrain run`'s "[rank0]: " prefix allowed), as JSON (a
# list prints as [60000]); empty if there is none.
json() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
lines = [m.group(1) for m in map(re.compile(r"^(?:\[rank\d+\]: )?(\{.*)").match, open(sys.argv[1], errors="replace")) if m]
if lines:
    value = json.loads(lines[-1]).get(sys.argv[2])
    print("" if value is None else json.dumps(value, separators=(",", ":")))
PY
}

# Seconds since the epoch, with milliseconds.
now() { date +%s.%N | cut -c1-14; }

# What the two-host elastic tests (elastic_nodes_test.sh, preempt_regrow_test.sh) share: one Slurm job per
# node, each a `dtrain run --nnodes 1:2` agent with one worker, meeting in one etcd rendezvous.

# start_head_etcd: a one-member etcd on the head node of a --two-hosts cluster, at $etcd_endpoint; stopped (by
# pid, $stop_first) before the cluster.
etcd_endpoint=10.78.0.1:2379
start_head_etcd() {
  on_head etcd --name=dtrain-test --data-dir="$work/etcd" --listen-client-urls="http://$etcd_endpoint" \
    --advertise-client-urls="http://$etcd_endpoint" --listen-peer-urls=http://10.78.0.1:2380 \
    --initial-advertise-peer-urls=http://10.78.0.1:2380 --initial-cluster=dtrain-test=http://10.78.0.1:2380 \
    --log-level=warn >"$work/etcd.log" 2>&1 &
  stop_first=$!
}

# find_staying_node JOB_A OUT_A JOB_B OUT_B SECONDS: the agents take node ranks in the order they join; the
# one of node rank 0 (rank 0's, which prints the training) stays, the other node's job is the one the test
# takes away. Waits (at most SECONDS) for round 0 of 2 nodes, then sets out and stay (the staying job's output
# and id), leave and leave_out (the other's), and node (the node the other runs on).
find_staying_node() {
  local round0="round 0: node rank 0 of 2, WORLD_SIZE 2"
  for ((i = 0; i < $5 * 20; ++i)); do
    grep -q "$round0" "$2" 2>/dev/null && break
    grep -q "$round0" "$4" 2>/dev/null && break
    sleep 0.05
  done
  if grep -q "$round0" "$2"; then
    out=$2 stay=$1 leave=$3 leave_out=$4 node=dtrain-node1
  elif grep -q "$round0" "$4"; then
    out=$4 stay=$3 leave=$1 leave_out=$2 node=dtrain-node0
  else
    fail "no round 0 of 2 nodes within $5 s: $(tail -n 3 "$2" "$4")"
  fi
}

# wait_shrunk_in_place FILE SECONDS: waits (at most SECONDS, watching every 20 ms) for rank 0's first step at
# world size 1 in FILE, after the other node's worker left in place (Note [Leaving in place] in
# dtrain/recovery.h); prints the time it appeared and the step before it (the last one at size 2).
wait_shrunk_in_place() {
  local s
  for ((i = 0; i < $2 * 50; ++i)); do
    s=$(grep -m1 "^\[rank0\]: step [0-9]* .* world 1$" "$1" | awk '{print $3}')
    [ -n "$s" ] && echo "$(now) $((s - 1))" && return 0
    sleep 0.02
  done
  fail "the training did not go on at size 1 in $1 within $2 s: $(grep -v 'step [0-9]* loss' "$1" | tail -n 5)"
}

# pause_worker PATTERN / resume_worker: SIGSTOP and SIGCONT to the one worker left at size 1 (the staying
# node's), found by its command line (pgrep -f PATTERN), so that the training outlasts the scheduler's part of
# a stretch on any machine. The worker that left may still be exiting when the other goes on: waited for, at
# most 15 s.
paused_worker=""
pause_worker() {
  for ((i = 0; i < 300; ++i)); do
    paused_worker=$(pgrep -f "$1")
    [ "$(echo $paused_worker | wc -w)" = 1 ] && break
    sleep 0.05
  done
  [ "$(echo $paused_worker | wc -w)" = 1 ] || fail "expected one worker at size 1, found pids '$paused_worker'"
  kill -STOP "$paused_worker"
}
resume_worker() {
  [ -n "$paused_worker" ] && kill -CONT "$paused_worker"
  paused_worker=""
}

# wait_grown_in_place FILE SECONDS: waits until the agent whose output is FILE admitted a node into its
# running round in place (Note [Rounds in place]) and rank 0 printed a step at world size 2 after that;
# prints "TIME STEP".
wait_grown_in_place() {
  local at s
  for ((i = 0; i < $2 * 50; ++i)); do
    at=$(grep -n -m1 "joins the running round in place" "$1" | cut -d: -f1)
    if [ -n "$at" ]; then
      s=$(tail -n +"$at" "$1" | grep -m1 "^\[rank0\]: step [0-9]* .* world 2$" | awk '{print $3}')
      [ -n "$s" ] && echo "$(now) $s" && return 0
    fi
    sleep 0.02
  done
  fail "the training did not grow back in place in $1 within $2 s: $(grep -v 'step [0-9]* loss' "$1" | tail -n 5)"
}

# check_shrunk_and_regrown FILE EPOCHS: the training in FILE used every sample of its EPOCHS epochs exactly
# once over three world sizes (2, 1, 2), ended at world size 2 without a restart, after 1 departure in place
# (the shrink: the node left on SIGTERM, its peer went on) and 1 admission in place (the regrow), and
# learned.
check_shrunk_and_regrown() {
  local expected
  expected=$(python3 -c "print('[' + ','.join(['60000'] * $2) + ']')")
  [ "$(json "$1" epoch_samples)" = "$expected" ] ||
    fail "epoch_samples is $(json "$1" epoch_samples), not $expected"
  [ "$(json "$1" restarts)" = 0 ] || fail "\"restarts\" is $(json "$1" restarts), not 0"
  [ "$(json "$1" departed)" = 1 ] || fail "\"departed\" is $(json "$1" departed), not 1"
  [ "$(json "$1" admitted)" = 1 ] || fail "\"admitted\" is $(json "$1" admitted), not 1"
  [ "$(json "$1" world_size)" = 2 ] || fail "the training did not end at world size 2"
  python3 -c "import sys; sys.exit(0 if $(json "$1" test_accuracy) > 0.8 else 1)" ||
    fail "test_accuracy $(json "$1" test_accuracy) (an undisturbed run reaches 0.85 and more)"
}
