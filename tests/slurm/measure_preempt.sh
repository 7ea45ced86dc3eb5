#!/usr/bin/env bash
# Measures Slurm's preemption of the trainer (doc/slurm.md), on preempt_test.sh's cluster (partition high
# preempts low by requeueing, GraceTime 5 s, KillWait 10 s): RUNS times (default 3), the preemptable job of
# lib.sh (srun -n2 train_fashion_mnist --epochs 1 --checkpoint-dir) in partition low, an exclusive job in
# partition high submitted at step 100; prints for each run, then their medians (seconds):
#   signal    high job submitted -> SIGTERM sent to the low job's tasks (slurmd's log)
#   save      that SIGTERM -> the stop checkpoint on disk (its mtime)
#   high      that SIGTERM -> the high job starts (GraceTime, the requeue, the job's end)
#   start     that SIGTERM -> the requeued batch script starts (after the high job; cred_expire=5)
#   first     the requeued batch script starts -> its first training step (the step after the checkpoint's)
#   fresh     for comparison, the first attempt's batch script start -> its step 1 (nothing to load)
# Not a test: timings live in the docs. Usage: measure_preempt.sh BUILD_BIN_DIR [RUNS]
source "$(dirname "$0")/lib.sh"
runs=${2:-3}
start_cluster "${preempt_conf[@]}"
write_preemptable_job "$work/job.sh" --epochs 1 --log-every 1

rows=()
for ((run = 1; run <= runs; ++run)); do
  out=$work/job-$run.out
  export CKPT=$work/ckpt-$run
  job=$(sbatch --parsable -p low --requeue -n2 --open-mode=append --output="$out" "$work/job.sh") ||
    fail "sbatch: $job"
  fresh=""
  for ((i = 0; i < 3000; ++i)); do
    [ -z "$fresh" ] && grep -q "^step 1 " "$out" 2>/dev/null && fresh=$(now)
    grep -q "^step 100 " "$out" 2>/dev/null && break
    sleep 0.02
  done
  [ -n "$fresh" ] || fail "run $run: job $job did not start training in 60 s: $(tail -n 5 "$out" 2>&1)"
  wait_line "$out" "^step 100 "
  submitted=$(now)
  high=$(sbatch --parsable -p high --exclusive --output="$work/high-$run.out" \
    --wrap 'echo "high ran at $(date +%s.%N)"') || fail "sbatch: $high"
  # Watch the file at 20 ms for the requeued attempt's first step (the lines carry no time of their own).
  first=""
  for ((i = 0; i < 6000; ++i)); do
    if grep -q "^attempt SLURM_RESTART_COUNT=1 " "$out" 2>/dev/null; then
      stop_step=$(grep -o "stopped by SIGTERM after step [0-9]*" "$out" | grep -o "[0-9]*$")
      if [ -n "$stop_step" ] && grep -q "^step $((stop_step + 1)) " "$out"; then
        first=$(now)
        break
      fi
    fi
    sleep 0.02
  done
  [ -n "$first" ] || fail "run $run: no first step after the preemption in 120 s: $(tail -n 5 "$out")"
  [[ "$(wait_job_end "$job" 120)" == "JobState=COMPLETED Restarts=1 "* ]] ||
    fail "run $run: job $job ended as $(job_state "$job")"
  signalled=$(signal_time "$cluster/slurmd.log" "$job")
  saved=$(stat -c %.9Y "$CKPT/checkpoint-$stop_step.ckpt")
  high_ran=$(grep -o "^high ran at [0-9.]*" "$work/high-$run.out" | grep -o "[0-9.]*$")
  started=$(grep -o "^attempt SLURM_RESTART_COUNT=1 at [0-9.]*" "$out" | grep -o "[0-9.]*$")
  fresh_start=$(grep -o "^attempt SLURM_RESTART_COUNT=unset at [0-9.]*" "$out" | grep -o "[0-9.]*$")
  row=$(python3 -c "print(' '.join('%.2f' % x for x in ($signalled - $submitted, $saved - $signalled,
    $high_ran - $signalled, $started - $signalled, $first - $started, $fresh - $fresh_start)))") ||
    fail "run $run: a time is missing"
  echo "run $run: stopped after step $stop_step; signal save high start first fresh: $row"
  rows+=("$row")
done
echo "load average at the end: $(cut -d " " -f1-3 /proc/loadavg)"
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
cols = list(zip(*(map(float, l.split()) for l in sys.stdin)))
print("median of %d runs (s): signal %.2f, save %.2f, high %.2f, start %.2f, first %.2f, fresh %.2f" % ((len(cols[0]),) + tuple(statistics.median(c) for c in cols)))'
