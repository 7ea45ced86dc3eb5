#!/usr/bin/env bash
# Slurm's own preemption shrinks one training and its requeue regrows it: elastic_nodes_test.sh's set-up (one
# Slurm job per node of a two-host cluster, each a `dtrain run --nnodes 1:2` agent on one etcd rendezvous) in
# partition low of preempt_test.sh's cluster (lib.sh's preempt_conf: partition high preempts low by
# requeueing, GraceTime 5 s). An exclusive job of partition high pinned to the node without rank 0 (-w) takes
# that node alone: its node job's agent, started by srun, gets Slurm's SIGTERM at once and passes it on; its
# worker leaves at a step boundary and the other node's worker goes on at size 1 in place (Note [Leaving in
# place] in dtrain/recovery.h: no restart, no checkpoint), training while the high job runs (the high job ends when the test has seen 10 steps of it; while the
# test waits for Slurm alone, the worker is paused, so that three epochs outlast the stretch on any machine).
# The preempted node job's script waits after the stop until Slurm requeues it (doc/slurm.md); after the high
# job the requeued job starts again on the freed node, its agent joins, and the training grows back to size 2.
# Every sample of every epoch counts exactly once. Prints the time from the SIGTERM to the next step at size 1, and from the requeued job's start to the first step at size 2.
# Usage: preempt_regrow_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
command -v etcd >/dev/null || skip "etcd is not installed (Debian: etcd-server)"
[ -x "$bin/dtrain" ] || fail "$bin/dtrain is not built (cmake --build build --target dtrain_cli)"
start_cluster --two-hosts "${preempt_conf[@]}"

# Three epochs; the test pauses the worker at size 1 (SIGSTOP, SIGCONT) while it waits for Slurm alone (the
# GraceTime and slurmctld's 30-s check before the high job starts; the requeue after it ends), so that the
# training outlasts Slurm's part of the stretch at size 1 on a fast machine too, and at the same length on a
# slow one. It trains at size 1 for 10 steps before each pause and through the high job's first 10 steps.
# With two, about 6 s of training at size 1 was left for the requeued job's newcomer, which a CI run
# (ctest -j2) did not start within.
epochs=3

start_head_etcd

# One node job (doc/slurm.md's preemptable node job): the agent under srun, so that a preemption's SIGTERM
# reaches it at once (the batch shell gets one only when the GraceTime ends); after a stop by preemption the
# script waits for Slurm to requeue the job (one that ends in its GraceTime is not requeued). The default
# last-call window (30 s), not elastic_nodes' 2 s: when the requeued job's agent joins, the staying agent
# stops its worker before it rejoins, which took 4 s on a busy machine, and a round of MIN (1) nodes closes
# when the window has passed; with 2 s the newcomer formed a round of its own, and the staying agent then
# had to stop again and join a third. Rounds whose expected nodes all rejoin close without waiting for it.
cat >"$work/node.sh" <<JOB
#!/usr/bin/env bash
echo "node job \$SLURM_JOB_ID on \$(hostname) at \$(date +%s.%N), SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-0}"
srun --kill-on-bad-exit=1 "$bin/dtrain" run --nnodes 1:2 --nproc-per-node 1 --rdzv-backend etcd \
  --rdzv-endpoint $etcd_endpoint --rdzv-id slurm-preempt-regrow --max-restarts 5 -- \
  "$trainer" --epochs $epochs --log-every 1 --checkpoint-dir "$work/ckpt"
$(requeue_wait_lines)
JOB
submit() {
  on_head sbatch --parsable -p low --requeue --open-mode=append -w "$1" -N1 -n1 --output="$2" "$work/node.sh"
}
a=$(submit dtrain-node0 "$work/a.out") || fail "sbatch: $a"
b=$(submit dtrain-node1 "$work/b.out") || fail "sbatch: $b"
# The high job takes the node without rank 0.
find_staying_node "$a" "$work/a.out" "$b" "$work/b.out" 180
wait_line "$out" "^\[rank0\]: step 100 " 180

# last_step: rank 0's last step so far.
last_step() { grep -o "^\[rank0\]: step [0-9]*" "$out" | tail -n 1 | grep -o "[0-9]*$"; }
# wait_steps N: waits (at most 120 s) until rank 0 has made N steps more than now.
wait_steps() {
  local from
  from=$(last_step)
  for ((i = 0; i < 2400; ++i)); do
    (($(last_step) >= from + $1)) && return 0
    sleep 0.05
  done
  fail "rank 0 made fewer than $1 steps after step $from within 120 s: $(tail -n 3 "$out")"
}
pause() { pause_worker "^$trainer --epochs $epochs --log-every 1 --checkpoint-dir $work/ckpt"; }
resume() { resume_worker; }

# Preemption: the high job, exclusive on the other node. It runs until the test has seen the training go on
# at size 1 (10 steps after its start; $work/release), at most 300 s.
cat >"$work/high.sh" <<JOB
#!/usr/bin/env bash
echo "high starts at \$(date +%s.%N)"
for ((i = 0; i < 3000; ++i)); do
  [ -e "$work/release" ] && break
  sleep 0.1
done
echo "high ends at \$(date +%s.%N)"
JOB
high=$(on_head sbatch --parsable -p high -w "$node" -N1 --exclusive --output="$work/high.out" "$work/high.sh") ||
  fail "sbatch refused the high-priority job: $high"
read -r shrunk s1 < <(wait_shrunk_in_place "$out" 300) || exit 1
wait_steps 10
pause
wait_line "$work/high.out" "^high starts at " 120
resume
high_start=$(grep -o "^high starts at [0-9.]*" "$work/high.out" | grep -o "[0-9.]*$")
step_at_high_start=$(last_step)
wait_steps 10
pause
touch "$work/release"
wait_line "$work/high.out" "^high ends at " 30
step_at_high_end=$(last_step)
high_end=$(grep -o "^high ends at [0-9.]*" "$work/high.out" | grep -o "[0-9.]*$")
# While the high job ran: the training at size 1, on, not yet grown.
grep -qE "round 1:|joins the running round in place" "$out" &&
  fail "the training grew back while the high job ran: $(grep -E 'round' "$out")"
# (Now: slurmctld forgets a job MinJobAge after its end: 600 s on the tests' cluster.)
[[ "$(wait_job_end "$high" 30)" == "JobState=COMPLETED "* ]] || fail "the high-priority job $high did not complete"
((step_at_high_end >= step_at_high_start + 10)) ||
  fail "the training did not go on while the high job ran (step $step_at_high_start at its start," \
    "$step_at_high_end at its end, 120 s later)"
python3 -c "import sys; sys.exit(0 if $shrunk < $high_end else 1)" ||
  fail "the training shrank at $shrunk, after the high job ended ($high_end)"
# The leaver's line reaches its job's output through its agent and slurmstepd, which may be after the
# staying worker stepped on at size 1 (a CI run read the file first).
wait_line "$leave_out" "rank 1 left on SIGTERM after step $s1; the others go on without it" 10
# (The agent sees it at its next look at the rendezvous, after the workers have already re-formed.)
wait_line "$out" "in place: host $node (node [^)]*) left the job (received SIGTERM); the running round goes on in place" 10
grep -q "stopped by SIGTERM" "$out" && fail "the staying worker stopped: $(grep -v 'step [0-9]* loss' "$out")"
grep -q "received SIGTERM; passing SIGTERM to 1 worker" "$leave_out" || fail "$node's agent did not pass SIGTERM on"
grep -qx "preempted: waiting for Slurm to requeue the job" "$leave_out" ||
  fail "$node's job script did not see the preemption: $(grep -v 'step [0-9]* loss' "$leave_out" | tail -n 5)"
grep -q "preempted JobId=$leave has been requeued" "$cluster/slurmctld.log" ||
  fail "slurmctld did not requeue the preempted job $leave:" \
    "$(grep -i "preempt\|JobId=$leave" "$cluster/slurmctld.log" | tail -n 3)"
signalled=$(signal_time "$cluster/slurmd-$node.log" "$leave")
[ -n "$signalled" ] || fail "no 'Sent signal 15 to StepId=$leave.0' in $cluster/slurmd-$node.log"

# Regrow: Slurm requeues the preempted node job; after the high job it starts again on its node and joins.
# The worker goes on once the staying agent has let the requeued job's agent into the running round: its
# newcomer then starts (about 2 s on a quiet machine, more beside other tests) while the training goes on.
# Resumed at the requeued script's start instead, the training at size 1 ended before the newcomer asked
# to be admitted in a CI run (ctest -j2).
wait_line "$leave_out" "^node job $leave on $node at [0-9.]*, SLURM_RESTART_COUNT=1" 120
wait_line "$out" "joins the running round in place as node rank 1" 120
resume
read -r grown s2 < <(wait_grown_in_place "$out" 300) ||
  fail "the requeued node job $leave did not grow the training; its output: $(tail -n 20 "$leave_out" 2>&1)"
grep -q "joins the running round in place as node rank 1 (ranks 1..1)" "$out" ||
  fail "the staying agent did not admit $node in place"
grep -q "round 1:" "$out" && fail "a new round instead of in place: $(grep 'round' "$out")"
requeued=$(grep -o "^node job $leave on $node at [0-9.]*, SLURM_RESTART_COUNT=1" "$leave_out" |
  grep -o "at [0-9.]*" | grep -o "[0-9.]*$")
[ -n "$requeued" ] || fail "no second start of node job $leave: $(grep '^node job' "$leave_out")"
python3 -c "import sys; sys.exit(0 if $high_end < $requeued < $grown else 1)" ||
  fail "expected: the high job ended ($high_end), the requeued job started ($requeued), the training grew ($grown)"
grep -q "admitted into the running round 0 in place" "$leave_out" ||
  fail "the requeued node job was not admitted in place"

state=$(wait_job_end "$stay" 300)
[[ $state == "JobState=COMPLETED "* ]] || fail "node job $stay ended as '$state': $(tail -n 5 "$out")"
state=$(wait_job_end "$leave" 30)
[[ $state == "JobState=COMPLETED Restarts=1 "* ]] ||
  fail "node job $leave ended as '$state' (expected COMPLETED, Restarts=1): $(tail -n 5 "$leave_out")"
check_shrunk_and_regrown "$out" $epochs
echo "$name: preempted and shrunk in place after step $s1," \
  "$(python3 -c "print('%.2f' % ($shrunk - $signalled))") s from the SIGTERM to the next step at size 1;" \
  "steps $step_at_high_start to $step_at_high_end at size 1 while the high job ran; grew at step $s2," \
  "$(python3 -c "print('%.2f' % ($grown - $requeued))") s from the requeued job's start to the first step at" \
  "size 2; epoch_samples $(json "$out" epoch_samples), test_accuracy $(json "$out" test_accuracy)"
