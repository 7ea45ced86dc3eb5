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
