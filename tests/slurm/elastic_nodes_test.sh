#!/usr/bin/env bash
# Shrink and regrow under the scheduler: one training spread over one Slurm job per node of a two-host
# cluster (slurm_cluster.sh --two-hosts), each job a `dtrain run --nnodes 1:2` agent with one worker, the
# trainer, joining one etcd rendezvous (etcd on the head node). Cancelling the job of the node that does not
# hold rank 0 (scancel: SIGTERM to its agent, which passes it on and leaves the rendezvous) makes its worker
# leave at a step boundary, and the other worker goes on at size 1 in place (Note [Leaving in place] in
# dtrain/recovery.h): no restart, no checkpoint. A new job on the freed node joins and the training grows back
# to size 2 in place (Note [Rounds in place]): the running round admits the node, its worker joins as a
# newcomer and takes the state from a live peer, and the staying worker never stops.
# Every sample of every epoch counts exactly once. Prints the time from scancel to the next step at size 1
# and from the new node job's start to the first step at size 2.
# Usage: elastic_nodes_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
command -v etcd >/dev/null || skip "etcd is not installed (Debian: etcd-server)"
[ -x "$bin/dtrain" ] || fail "$bin/dtrain is not built (cmake --build build --target dtrain_cli)"
start_cluster --two-hosts

start_head_etcd

# Four epochs: about 1.7 s each at size 1 on a quiet machine, so that the stretch at size 1 and the growth
# back fit inside the training on a busy one too.
epochs=4

# One node job: the agent, its one worker the trainer (see epochs above). The
# default last-call window (30 s): with 2 s, on a busy machine the new node job's agent formed a round of
# its own while the staying agent was still stopping its worker (3.6 s), and the staying agent then joined
# a third round (preempt_regrow_test.sh, doc/slurm.md).
cat >"$work/node.sh" <<JOB
#!/usr/bin/env bash
echo "node job \$SLURM_JOB_ID on \$(hostname) at \$(date +%s.%N)"
exec "$bin/dtrain" run --nnodes 1:2 --nproc-per-node 1 --rdzv-backend etcd --rdzv-endpoint $etcd_endpoint \
  --rdzv-id slurm-elastic --max-restarts 5 -- \
  "$trainer" --epochs $epochs --log-every 1 --checkpoint-dir "$work/ckpt"
JOB
submit() { on_head sbatch --parsable -w "$1" -N1 -n1 --output="$2" "$work/node.sh"; }
a=$(submit dtrain-node0 "$work/a.out") || fail "sbatch: $a"
b=$(submit dtrain-node1 "$work/b.out") || fail "sbatch: $b"
# The scheduler takes back the node without rank 0.
find_staying_node "$a" "$work/a.out" "$b" "$work/b.out" 90
wait_line "$out" "^\[rank0\]: step 100 " 60

# Shrink: the scheduler takes node 1 back.
cancelled=$(now)
on_head scancel "$leave" || fail "scancel $leave failed"
read -r shrunk s1 < <(wait_shrunk_in_place "$out" 60) || exit 1
# The leaver's line reaches its job's output through its agent and slurmstepd, which may be after the
# staying worker stepped on at size 1 (a CI run read the file first).
wait_line "$leave_out" "rank 1 left on SIGTERM after step $s1; the others go on without it" 10
# (The agent sees it at its next look at the rendezvous, after the workers have already re-formed.)
wait_line "$out" "in place: host $node (node [^)]*) left the job (received SIGTERM); the running round goes on in place" 10
grep -q "round 1:" "$out" && fail "a new round instead of in place: $(grep 'round' "$out")"
grep -q "stopped by SIGTERM" "$out" && fail "the staying worker stopped: $(grep -v 'step [0-9]* loss' "$out")"
grep -q "received SIGTERM; passing SIGTERM to 1 worker" "$leave_out" || fail "$node's agent did not pass SIGTERM on"
# (Now: slurmctld forgets a job MinJobAge after its end: 600 s on the tests' cluster.)
[[ "$(wait_job_end "$leave" 30)" == "JobState=CANCELLED "* ]] || fail "node job $leave is not CANCELLED"

# Regrow: a new node job on node 1 joins. The staying worker is paused while Slurm starts the job (with two
# epochs the training at size 1 ended before the newcomer came in two runs on a busy machine), and goes on once
# the job's script runs.
pause_worker "^$trainer --epochs $epochs --log-every 1 --checkpoint-dir $work/ckpt"
c=$(submit "$node" "$work/c.out") || { resume_worker; fail "sbatch: $c"; }
wait_line "$work/c.out" "^node job $c on $node at " 60
resume_worker
read -r grown s2 < <(wait_grown_in_place "$out" 60) ||
  fail "the new node job $c did not grow the training; its output: $(tail -n 20 "$work/c.out" 2>&1);" \
    "squeue: $(on_head squeue 2>&1 | tail -n 5)"
grep -q "joins the running round in place as node rank 1 (ranks 1..1)" "$out" ||
  fail "the staying agent did not admit $node in place"
grep -q "admitted into the running round 0 in place" "$work/c.out" ||
  fail "the new node job was not admitted in place: $(grep -v 'step [0-9]* loss' "$work/c.out" | tail -n 5)"
grep -q "round 1:" "$out" && fail "a new round instead of in place: $(grep 'round' "$out")"
c_started=$(grep -o "^node job $c on $node at [0-9.]*" "$work/c.out" | grep -o "[0-9.]*$")

state=$(wait_job_end "$stay" 120)
[[ $state == "JobState=COMPLETED "* ]] || fail "node job $stay ended as '$state': $(tail -n 5 "$out")"
[[ "$(wait_job_end "$c" 10)" == "JobState=COMPLETED "* ]] || fail "node job $c did not complete"
check_shrunk_and_regrown "$out" $epochs
echo "$name: shrunk at step $s1, $(python3 -c "print('%.2f' % ($shrunk - $cancelled))") s from scancel to the" \
  "next step at size 1; grew at step $s2, $(python3 -c "print('%.2f' % ($grown - $c_started))") s from the new" \
  "node job's start to the first step at size 2; epoch_samples $(json "$out" epoch_samples), test_accuracy" \
  "$(json "$out" test_accuracy)"
