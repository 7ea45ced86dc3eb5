#!/usr/bin/env bash
# Shrink and regrow under the scheduler: one training spread over one Slurm job per node of a two-host
# cluster (slurm_cluster.sh --two-hosts), each job a `dtrain run --nnodes 1:2` agent with one worker, the
# trainer, joining one etcd rendezvous (etcd on the head node). Cancelling the job of the node that does not
# hold rank 0 (scancel: SIGTERM to its agent, which passes it on and leaves the rendezvous) stops the
# training at a step both ranks agree on, with a checkpoint; the other agent restarts its worker at size 1
# from it; a new job on the freed node joins and the training grows back to size 2 the same way. These are
# elastic restarts from a checkpoint, not in place: dtrain's in-place recovery is for static nodes only.
# Every sample of both epochs counts exactly once. Prints the time from scancel to the next step at size 1
# and from the new node job's start to the first step at size 2.
# Usage: elastic_nodes_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
command -v etcd >/dev/null || skip "etcd is not installed (Debian: etcd-server)"
[ -x "$bin/dtrain" ] || fail "$bin/dtrain is not built (cmake --build build --target dtrain_cli)"
start_cluster --two-hosts

# etcd on the head node, stopped (by pid) before the cluster.
etcd_url=http://10.78.0.1:2379
on_head etcd --name=dtrain-test --data-dir="$work/etcd" --listen-client-urls=$etcd_url \
  --advertise-client-urls=$etcd_url --listen-peer-urls=http://10.78.0.1:2380 \
  --initial-advertise-peer-urls=http://10.78.0.1:2380 --initial-cluster=dtrain-test=http://10.78.0.1:2380 \
  --log-level=warn >"$work/etcd.log" 2>&1 &
stop_first=$!

# One node job: the agent, its one worker the trainer (2 epochs: time enough to shrink and regrow). The
# default last-call window (30 s): with 2 s, on a busy machine the new node job's agent formed a round of
# its own while the staying agent was still stopping its worker (3.6 s), and the staying agent then joined
# a third round (preempt_regrow_test.sh, doc/slurm.md).
cat >"$work/node.sh" <<JOB
#!/usr/bin/env bash
echo "node job \$SLURM_JOB_ID on \$(hostname) at \$(date +%s.%N)"
exec "$bin/dtrain" run --nnodes 1:2 --nproc-per-node 1 --rdzv-backend etcd --rdzv-endpoint 10.78.0.1:2379 \
  --rdzv-id slurm-elastic --max-restarts 5 -- \
  "$trainer" --epochs 2 --log-every 1 --checkpoint-dir "$work/ckpt"
JOB
submit() { on_head sbatch --parsable -w "$1" -N1 -n1 --output="$2" "$work/node.sh"; }
a=$(submit dtrain-node0 "$work/a.out") || fail "sbatch: $a"
b=$(submit dtrain-node1 "$work/b.out") || fail "sbatch: $b"
# The agents take node ranks in the order they join: the one of node rank 0 (rank 0's, which prints the
# training) stays, the other node's job is the one the scheduler takes back.
for ((i = 0; i < 1800; ++i)); do
  grep -q "round 0: node rank 0 of 2, WORLD_SIZE 2" "$work/a.out" 2>/dev/null && break
  grep -q "round 0: node rank 0 of 2, WORLD_SIZE 2" "$work/b.out" 2>/dev/null && break
  sleep 0.05
done
if grep -q "round 0: node rank 0 of 2" "$work/a.out"; then
  out=$work/a.out stay=$a leave=$b leave_out=$work/b.out node=dtrain-node1
elif grep -q "round 0: node rank 0 of 2" "$work/b.out"; then
  out=$work/b.out stay=$b leave=$a leave_out=$work/a.out node=dtrain-node0
else
  fail "no round 0 of 2 nodes within 90 s: $(tail -n 3 "$work/a.out" "$work/b.out")"
fi
wait_line "$out" "^\[rank0\]: step 100 " 60

# wait_step FILE RESTART: waits (at most 60 s, watching every 20 ms) for the first step after "restart
# RESTART: resumed from ... step S" in FILE; prints the time it appeared and S.
wait_step() {
  local resumed s
  for ((i = 0; i < 3000; ++i)); do
    resumed=$(grep -o "restart $2: resumed from .*, step [0-9]*" "$1")
    if [ -n "$resumed" ]; then
      s=${resumed##* }
      grep -q "^\[rank0\]: step $((s + 1)) " "$1" && echo "$(now) $s" && return 0
    fi
    sleep 0.02
  done
  fail "no step after restart $2 in $1 within 60 s: $(grep -v 'step [0-9]* loss' "$1" | tail -n 5)"
}

# Shrink: the scheduler takes node 1 back.
cancelled=$(now)
on_head scancel "$leave" || fail "scancel $leave failed"
read -r shrunk s1 < <(wait_step "$out" 1) || exit 1
grep -q "stopped by SIGTERM after step $s1: saved $work/ckpt/checkpoint-$s1.ckpt" "$out" ||
  fail "the training did not stop at step $s1 with a checkpoint: $(grep -v 'step [0-9]* loss' "$out")"
# (As the agent notices first: its worker's stop while the node leaves, or the node gone.)
grep -qE "host $node \(node [^)]*\) (leaves|left the job)" "$out" || fail "the staying agent did not see $node leave"
grep -q "round 1: node rank 0 of 1, WORLD_SIZE 1" "$out" || fail "no round 1 at WORLD_SIZE 1"
grep -q "received SIGTERM; passing SIGTERM to 1 worker" "$leave_out" || fail "$node's agent did not pass SIGTERM on"
# (Now: slurmctld forgets a job MinJobAge after its end: 600 s on the tests' cluster.)
[[ "$(wait_job_end "$leave" 30)" == "JobState=CANCELLED "* ]] || fail "node job $leave is not CANCELLED"

# Regrow: a new node job on node 1 joins.
c=$(submit "$node" "$work/c.out") || fail "sbatch: $c"
read -r grown s2 < <(wait_step "$out" 2) || exit 1
grep -q "waiting to join: the job grows" "$out" || fail "the staying agent did not see $node join"
grep -q "round 2: node rank 0 of 2, WORLD_SIZE 2" "$out" || fail "no round 2 at WORLD_SIZE 2"
grep -q "round 2: node rank 1 of 2" "$work/c.out" || fail "the new node job did not join round 2"
c_started=$(grep -o "^node job $c on $node at [0-9.]*" "$work/c.out" | grep -o "[0-9.]*$")

state=$(wait_job_end "$stay" 120)
[[ $state == "JobState=COMPLETED "* ]] || fail "node job $stay ended as '$state': $(tail -n 5 "$out")"
[[ "$(wait_job_end "$c" 10)" == "JobState=COMPLETED "* ]] || fail "node job $c did not complete"
# Exactly once: both epochs' 60000 samples in the model, over three world sizes (2, 1, 2).
[ "$(json "$out" epoch_samples)" = "[60000,60000]" ] || fail "epoch_samples is $(json "$out" epoch_samples)"
[ "$(json "$out" restarts)" = 2 ] || fail "\"restarts\" is $(json "$out" restarts), not 2"
[ "$(json "$out" world_size)" = 2 ] || fail "the training did not end at world size 2"
python3 -c "import sys; sys.exit(0 if $(json "$out" test_accuracy) > 0.8 else 1)" ||
  fail "test_accuracy $(json "$out" test_accuracy) (an undisturbed run reaches 0.85 and more)"
echo "$name: shrunk at step $s1, $(python3 -c "print('%.2f' % ($shrunk - $cancelled))") s from scancel to the" \
  "next step at size 1; grew at step $s2, $(python3 -c "print('%.2f' % ($grown - $c_started))") s from the new" \
  "node job's start to the first step at size 2; epoch_samples [60000,60000], test_accuracy" \
  "$(json "$out" test_accuracy)"
