#!/usr/bin/env bash
# Measures a requeue of the trainer under Slurm (doc/slurm.md), on this test's one-machine cluster: RUNS times
# (default 5), `sbatch --requeue` of srun -n2 train_fashion_mnist --checkpoint-dir (1 epoch), `scontrol
# requeue` at step 100, and prints for each run, then their medians (seconds):
#   save      scontrol requeue -> the stop checkpoint on disk (its mtime)
#   start     scontrol requeue -> the requeued batch script starts (Slurm: cred_expire=5, sched_interval=1)
#   first     the requeued batch script starts -> its first training step (the step after the checkpoint's)
#   total     scontrol requeue -> that first step
#   fresh     for comparison, the first attempt's batch script start -> its step 1 (nothing to load)
# Not a test: timings live in the docs. Usage: measure_requeue.sh BUILD_BIN_DIR [RUNS]
source "$(dirname "$0")/lib.sh"
runs=${2:-5}
start_cluster

cat >"$work/job.sh" <<JOB
#!/usr/bin/env bash
echo "attempt \${SLURM_RESTART_COUNT:-0} \$(date +%s.%N)"
srun --kill-on-bad-exit=1 "$trainer" --epochs 1 --log-every 1 --checkpoint-dir "\$CKPT"
status=\$?
echo "srun exited with \$status at \$(date +%s.%N)"
exit \$status
JOB

rows=()
for ((run = 1; run <= runs; ++run)); do
  out=$work/job-$run.out
  export CKPT=$work/ckpt-$run
  job=$(sbatch --parsable --requeue -n2 --open-mode=append --output="$out" "$work/job.sh") || fail "sbatch: $job"
  fresh=""
  for ((i = 0; i < 3000; ++i)); do
    [ -z "$fresh" ] && grep -q "^step 1 " "$out" 2>/dev/null && fresh=$(now)
    grep -q "^step 100 " "$out" 2>/dev/null && break
    sleep 0.02
  done
  [ -n "$fresh" ] || fail "run $run: job $job did not start training in 60 s: $(tail -n 5 "$out" 2>&1)"
  fresh_start=$(grep -o "^attempt 0 [0-9.]*" "$out" | grep -o "[0-9.]*$")
  t0=$(now)
  scontrol requeue "$job" || fail "scontrol requeue $job failed"
  # Watch the file at 20 ms for the requeued attempt's first step (the lines carry no time of their own).
  first=""
  for ((i = 0; i < 6000; ++i)); do
    if grep -q "^attempt 1 " "$out" 2>/dev/null; then
      stop_step=$(grep -o "stopped by SIGTERM after step [0-9]*" "$out" | grep -o "[0-9]*$")
      if [ -n "$stop_step" ] && grep -q "^step $((stop_step + 1)) " "$out"; then
        first=$(now)
        break
      fi
    fi
    sleep 0.02
  done
  [ -n "$first" ] || fail "run $run: no first step after the requeue in 120 s: $(tail -n 5 "$out")"
  for ((i = 0; i < 1200; ++i)); do
    [[ "$(scontrol show job "$job")" == *JobState=COMPLETED* ]] && break
    sleep 0.1
  done
  saved=$(stat -c %.9Y "$CKPT/checkpoint-$stop_step.ckpt")
  started=$(grep -o "^attempt 1 [0-9.]*" "$out" | grep -o "[0-9.]*$")
  row=$(python3 -c "print(' '.join('%.2f' % x for x in ($saved - $t0, $started - $t0, $first - $started, $first - $t0, $fresh - $fresh_start)))")
  echo "run $run: stopped after step $stop_step; save start first total fresh: $row"
  rows+=("$row")
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
cols = list(zip(*(map(float, l.split()) for l in sys.stdin)))
print("median of %d runs (s): save %.2f, start %.2f, first %.2f, total %.2f, fresh %.2f" % ((len(cols[0]),) + tuple(statistics.median(c) for c in cols)))'
