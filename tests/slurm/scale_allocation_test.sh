#!/usr/bin/env bash
# `dtrain scale` inside an allocation measures the counts it is given there: a batch job of 3 tasks on the two
# nodes of a two-host cluster (sbatch -N2 -n3: SLURM_NTASKS=3, SLURM_JOB_NUM_NODES=2, no
# SLURM_NTASKS_PER_NODE) runs `dtrain scale` with no --nproc; it measures 1, 2 and 3 workers, each count one
# srun step of that many tasks on the fewest nodes that hold them (1 and 2 on one node, 3 on both), every
# rank of each count recording its steps. --nproc beyond the allocation is refused with one line naming
# SLURM_NTASKS (exit code 2) before anything runs.
# Usage: scale_allocation_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
[ -x "$bin/dtrain" ] || fail "$bin/dtrain is not built (cmake --build build --target dtrain_cli)"
start_cluster --two-hosts

cat >"$work/scale.sh" <<JOB
#!/usr/bin/env bash
echo "allocation \$SLURM_JOB_ID: SLURM_NTASKS=\${SLURM_NTASKS:-unset} SLURM_JOB_NUM_NODES=\$SLURM_JOB_NUM_NODES" \
  "SLURM_NTASKS_PER_NODE=\${SLURM_NTASKS_PER_NODE:-unset}" >&2
"$bin/dtrain" scale --nproc 2,4 -- "$trainer"
echo "--nproc 2,4: exit code \$?" >&2
exec "$bin/dtrain" scale --json --steps 5 --log-dir "$work/scale" -- "$trainer" --epochs 1
JOB
job=$(on_head sbatch --parsable -N2 -n3 --output="$work/scale.out" --error="$work/scale.err" "$work/scale.sh") ||
  fail "sbatch refused the job: $job"
state=$(wait_job_end "$job" 300)
[[ $state == "JobState=COMPLETED "* ]] || fail "job $job ended as '$state': $(tail -n 5 "$work/scale.err")"
err=$work/scale.err
grep -q "SLURM_NTASKS=3 SLURM_JOB_NUM_NODES=2 SLURM_NTASKS_PER_NODE=unset" "$err" ||
  fail "not the allocation this test asked for: $(grep '^allocation' "$err")"

# Beyond the allocation: refused at once.
refusal="dtrain scale: --nproc: 4 workers, but Slurm allocation $job gives 3 tasks (SLURM_NTASKS); ask for more"
refusal+=" (sbatch --ntasks) or leave --nproc out to measure the allocation's own counts"
grep -qxF "$refusal" "$err" ||
  fail "--nproc 2,4 in an allocation of 3 tasks was not refused naming SLURM_NTASKS: $(head -n 3 "$err")"
grep -qx -- "--nproc 2,4: exit code 2" "$err" || fail "--nproc 2,4 did not exit with code 2: $(head -n 3 "$err")"

# The allocation's own counts, each as an srun step on the fewest nodes.
grep -q "inside Slurm allocation $job: 3 task(s) on 2 node(s), 2 per node" "$err" ||
  fail "dtrain scale did not see the allocation: $(grep -v '^allocation' "$err" | head -n 3)"
for spec in "1 1 1" "2 1 2" "3 2 2"; do
  read -r n nodes per_node <<<"$spec"
  srun_line="running $n worker(s): srun --ntasks=$n --nodes=$nodes --ntasks-per-node=$per_node"
  grep -qF "$srun_line --kill-on-bad-exit=1 $trainer" "$err" ||
    fail "count $n was not an srun step of $n task(s) on $nodes node(s): $(grep 'running' "$err")"
done
# The report: exactly 1, 2 and 3 workers, each with every rank's records; each rank of a count saw the
# count as its world size (srun's SLURM_NTASKS, not a RANK/WORLD_SIZE of dtrain scale's own).
if ! python3 - "$work/scale.out" "$work/scale" <<'PY'; then
import json, sys
rows = json.load(open(sys.argv[1]))["runs"]
counts = [(r["workers"], r["ok"], r["source"], r.get("ranks_recorded")) for r in rows]
print("measured (workers, ok, source, ranks recorded):", counts)
if counts != [(n, True, "profile", n) for n in (1, 2, 3)]:
    sys.exit(1)
for n in (1, 2, 3):
    records = map(json.loads, open("%s/workers%d/profile.jsonl" % (sys.argv[2], n)))
    seen = {(r["rank"], r["world_size"]) for r in records}
    if seen != {(rank, n) for rank in range(n)}:
        print("count %d: records of (rank, world size) %s" % (n, sorted(seen)))
        sys.exit(1)
PY
  fail "dtrain scale did not measure exactly 1, 2 and 3 workers: $(cat "$work/scale.out")"
fi
# Step 2 (3 workers) ran on both nodes; steps 0 and 1 on one.
steps_on() {
  grep -o "launch task StepId=$job\.[0-9]*" "$cluster/slurmd-$1.log" | sort -u | grep -o "[0-9]*$" | tr '\n' ' '
}
on0=$(steps_on dtrain-node0) on1=$(steps_on dtrain-node1)
[[ " $on0 $on1 " == *" 2 "*" 2 "* ]] ||
  fail "the 3 workers' step did not span both nodes (node0: steps $on0; node1: $on1)"
[ "$(echo $on0 $on1 | wc -w)" = 4 ] ||
  fail "expected steps 0 and 1 on one node and 2 on both (node0: $on0; node1: $on1)"
measured=$(python3 -c "import json; print(', '.join('%d workers %.0f samples/s' % (r['workers'], r['samples_per_s'])
  for r in json.load(open('$work/scale.out'))['runs']))")
echo "$name: measured $measured, as srun steps 0 and 1 on one node and 2 on both; --nproc 2,4 refused (exit 2)"
