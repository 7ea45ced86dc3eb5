#!/usr/bin/env bash
# Slurm's own preemption, and `scancel --signal=TERM`, of a training job that saves on SIGTERM.
#  - Preemption (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE, GraceTime 5 s, KillWait 10 s): a
#    requeueable job of partition low (write_preemptable_job in lib.sh: srun of the trainer with
#    --checkpoint-dir, no --resume) is preempted mid-epoch by an exclusive job of partition high. Its tasks
#    get SIGTERM at once: the ranks agree on a step and rank 0 saves it within the GraceTime; the batch
#    script waits until Slurm requeues the job; the high job runs; the requeued job resumes from that step by
#    itself ("restarts": 1), uses every sample of the epoch exactly once, and ends with the loss and accuracy
#    of an undisturbed run.
#  - scancel --signal=TERM: the same stop and save, but the job ends (FAILED, exit code 143) and is not
#    requeued (the script does not wait: no preemption); a new run with --resume finishes the epoch, exactly
#    once, to the undisturbed run's loss and accuracy.
# Prints the preemption's timings (doc/slurm.md; medians from measure_preempt.sh).
# Usage: preempt_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
start_cluster "${preempt_conf[@]}"

# The undisturbed run, the reference. Batches of 2 per rank (15000 steps, about 9 s of training): with the
# default 32, CI's machine finished the epoch (1.2 s) before Slurm's preemption reached the job, and once
# with 4 (4.6 s) too, under load.
args=(--epochs 1 --log-every 20 --batch-size 2)
timeout 120 srun -p low -n2 --kill-on-bad-exit=1 "$trainer" "${args[@]}" >"$work/reference.out" 2>&1 ||
  fail "the reference run exited with $?: $(tail -n 5 "$work/reference.out")"
write_preemptable_job "$work/job.sh" "${args[@]}"

# check_stop OUT CKPT: the first attempt in OUT stopped on SIGTERM at a step both ranks agreed on, rank 0
# saved it in CKPT and exited 143; prints the step.
check_stop() {
  local stop_line step
  stop_line=$(grep -o "stopped by SIGTERM after step [0-9]*: saved [^;]*" "$1")
  [ -n "$stop_line" ] || fail "the job in $1 did not stop on SIGTERM and save: $(grep -v '^step\|^epoch' "$1")"
  step=${stop_line#stopped by SIGTERM after step }
  step=${step%%:*}
  [ "$stop_line" = "stopped by SIGTERM after step $step: saved $2/checkpoint-$step.ckpt" ] ||
    fail "unexpected stop line: $stop_line"
  grep -qE "tasks? 0(-1)?: Exited with exit code 143" "$1" || fail "rank 0 did not exit with 143 (stopped) in $1"
  echo "$step"
}

# check_exactly_once OUT STEP: the run in OUT resumed from STEP's checkpoint, trained only the rest of the
# epoch, and ended as the reference did.
check_exactly_once() {
  local samples=$(($2 * 4)) # 2 ranks x 2
  [ "$(json "$1" epoch_samples)" = "[60000]" ] || fail "epoch_samples is $(json "$1" epoch_samples), not [60000]"
  [ "$(json "$1" train_samples)" = $((60000 - samples)) ] ||
    fail "train_samples is $(json "$1" train_samples), not 60000 - $samples"
  local key
  for key in steps final_loss test_accuracy; do
    [ "$(json "$1" "$key")" = "$(json "$work/reference.out" "$key")" ] ||
      fail "\"$key\" is $(json "$1" "$key") in $1 but $(json "$work/reference.out" "$key") undisturbed"
  done
}

# Preemption.
out=$work/job.out
export CKPT=$work/ckpt
job=$(sbatch --parsable -p low --requeue -n2 --open-mode=append --output="$out" "$work/job.sh") ||
  fail "sbatch refused the job: $job"
wait_line "$out" "^step 100 "
# The training pauses (SIGSTOP) until slurmd has sent the preemption's SIGTERM, and goes on (SIGCONT) to
# take it: Slurm's part of the preemption takes its time, which a loaded CI machine once spent training the
# rest of the epoch (7 s, twice in a day) before the SIGTERM came.
tasks=$(pgrep -f "^$trainer .*--checkpoint-dir $CKPT") || fail "no trainer tasks of job $job found"
kill -STOP $tasks
high=$(sbatch --parsable -p high --exclusive --output="$work/high.out" --wrap 'echo "high ran at $(date +%s.%N)"') ||
  fail "sbatch refused the high-priority job: $high"
for ((i = 0; i < 600; ++i)); do
  grep -q "Sent signal 15 to StepId=$job.0$" "$cluster/slurmd.log" && break
  sleep 0.05
done
kill -CONT $tasks 2>/dev/null
state=$(wait_job_end "$job" 150)
[[ $state == "JobState=COMPLETED Restarts=1 ExitCode=0:0 " ]] ||
  fail "job $job ended as '$state' (expected COMPLETED, Restarts=1): $(tail -n 8 "$out")"
[[ "$(wait_job_end "$high" 10)" == "JobState=COMPLETED "* ]] || fail "the high-priority job $high did not complete"
# (Slurm names the preemptor only when it requeues at once; at the end of a GraceTime it says "Invalid".)
grep -q "preempted JobId=$job has been requeued to reclaim resources" "$cluster/slurmctld.log" ||
  fail "slurmctld did not preempt job $job: $(grep -i preempt "$cluster/slurmctld.log" | tail -n 3)"

step=$(check_stop "$out" "$CKPT") || exit 1
grep -qx "preempted: waiting for Slurm to requeue the job" "$out" ||
  fail "the batch script did not see the preemption (PreemptTime): $(grep -v '^step\|^epoch' "$out")"
# Saved within the GraceTime, long before KillWait's SIGKILL.
signalled=$(signal_time "$cluster/slurmd.log" "$job")
[ -n "$signalled" ] || fail "no 'Sent signal 15 to StepId=$job.0' in $cluster/slurmd.log"
saved=$(stat -c %.9Y "$CKPT/checkpoint-$step.ckpt")
save_s=$(python3 -c "print('%.3f' % ($saved - $signalled))")
# (slurmd stamps its log to the millisecond, truncated: a save within that millisecond reads 0.000 s, or
# a hair below.)
python3 -c "import sys; sys.exit(0 if -0.002 < $save_s < $preempt_grace_s else 1)" ||
  fail "the checkpoint was on disk $save_s s after the SIGTERM (expected within the GraceTime, $preempt_grace_s s)"
# The high job ran between the two attempts; the second resumed from the stop by itself.
high_ran=$(grep -o "^high ran at [0-9.]*" "$work/high.out" | grep -o "[0-9.]*$")
second=$(grep -o "^attempt SLURM_RESTART_COUNT=1 at [0-9.]*" "$out" | grep -o "[0-9.]*$")
[ -n "$high_ran" ] && [ -n "$second" ] || fail "no high job output or no second attempt in $out"
python3 -c "import sys; sys.exit(0 if $saved < $high_ran < $second else 1)" ||
  fail "expected: the stop saved ($saved), then the high job ran ($high_ran), then the job restarted ($second)"
grep -qF "restart 1: resumed from $CKPT/checkpoint-$step.ckpt at epoch 1, $((step * 4)) samples into it, step $step" \
  "$out" || fail "the requeued job did not resume from step $step: $(grep -v '^step\|^epoch' "$out")"
[ "$(json "$out" restarts)" = 1 ] || fail "\"restarts\" is $(json "$out" restarts), not 1"
check_exactly_once "$out" "$step"
echo "$name: preempted at step $step; saved $save_s s after the SIGTERM; requeued and resumed by itself;" \
  "final_loss $(json "$out" final_loss) as undisturbed"

# scancel --signal=TERM: the same stop and save, the job ends; --resume continues.
out=$work/term.out
export CKPT=$work/ckpt-term
job=$(sbatch --parsable -p low --requeue -n2 --open-mode=append --output="$out" "$work/job.sh") ||
  fail "sbatch refused the job: $job"
wait_line "$out" "^step 100 "
scancel --signal=TERM "$job" || fail "scancel --signal=TERM $job failed"
state=$(wait_job_end "$job" 60)
[[ $state == "JobState=FAILED Restarts=0 ExitCode=143:0 " ]] ||
  fail "job $job ended as '$state' (expected FAILED, Restarts=0, ExitCode=143:0): $(tail -n 8 "$out")"
step=$(check_stop "$out" "$CKPT") || exit 1
grep -q "^preempted" "$out" && fail "the batch script took scancel --signal=TERM for a preemption"
timeout 120 srun -p low -n2 --kill-on-bad-exit=1 "$trainer" "${args[@]}" --checkpoint-dir "$CKPT" --resume \
  >"$work/resume.out" 2>&1 || fail "the run with --resume exited with $?: $(tail -n 5 "$work/resume.out")"
grep -qF "resumed from $CKPT/checkpoint-$step.ckpt at epoch 1, $((step * 4)) samples into it, step $step" \
  "$work/resume.out" || fail "--resume did not continue from step $step: $(grep -v '^step\|^epoch' "$work/resume.out")"
[ "$(json "$work/resume.out" restarts)" = 0 ] || fail "\"restarts\" is $(json "$work/resume.out" restarts), not 0"
check_exactly_once "$work/resume.out" "$step"
echo "$name: scancel --signal=TERM stopped the job at step $step (FAILED, 143); --resume finished the epoch" \
  "as undisturbed"
