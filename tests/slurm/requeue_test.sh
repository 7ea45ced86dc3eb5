#!/usr/bin/env bash
# Requeue: `sbatch --requeue` of a script that runs the trainer under srun with --checkpoint-dir and no
# --resume; `scontrol requeue` mid-epoch. Slurm SIGTERMs the tasks (KillWait 10 s before SIGKILL), the ranks
# agree on a step, rank 0 saves it and both exit 143; the requeued job (SLURM_RESTART_COUNT=1) resumes from
# that step by itself, reports "restarts": 1, uses every sample of the epoch exactly once, and ends with the
# loss and accuracy of an undisturbed run.
# Usage: requeue_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
start_cluster

# The undisturbed run, the reference. Batches of 2 per rank (15000 steps, about 8 s of training): with
# the default 32 an idle machine finished the epoch (1.4 s) before the requeue's SIGTERM arrived, and
# with 4 (3.9 s) a loaded one did once, its slurmctld slow to requeue.
args=(--epochs 1 --log-every 20 --batch-size 2)
timeout 120 srun -n2 --kill-on-bad-exit=1 "$trainer" "${args[@]}" >"$work/reference.out" 2>&1 ||
  fail "the reference run exited with $?: $(tail -n 5 "$work/reference.out")"

cat >"$work/job.sh" <<JOB
#!/usr/bin/env bash
echo "attempt SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-unset}"
srun --kill-on-bad-exit=1 "$trainer" ${args[*]} --checkpoint-dir "$work/ckpt"
status=\$?
echo "srun exited with \$status"
exit \$status
JOB
out=$work/job.out
job=$(sbatch --parsable --requeue -n2 --open-mode=append --output="$out" "$work/job.sh") ||
  fail "sbatch refused the job: $job"

# Requeue once the training is under way (step 100 of 7500), then wait for the job to finish.
for ((i = 0; i < 600; ++i)); do
  grep -q "^step 100 " "$out" 2>/dev/null && break
  sleep 0.1
done
grep -q "^step 100 " "$out" || fail "job $job did not reach step 100 in 60 s: $(tail -n 5 "$out" 2>&1)"
scontrol requeue "$job" || fail "scontrol requeue $job failed"
for ((i = 0; i < 1200; ++i)); do
  [[ "$(scontrol show job "$job" 2>&1)" == *JobState=COMPLETED* ]] && break
  [[ "$(scontrol show job "$job" 2>&1)" == *JobState=@(FAILED|CANCELLED|TIMEOUT)* ]] && break
  sleep 0.1
done
state=$(scontrol show job "$job" | grep -o "JobState=[A-Z_]*\|Restarts=[0-9]*" | tr '\n' ' ')
[[ $state == "JobState=COMPLETED Restarts=1 " ]] || fail "job $job ended as '$state' (expected COMPLETED, Restarts=1): $(tail -n 8 "$out")"

# The first attempt stopped at an agreed step and saved it; the second resumed from it by itself.
grep -qx "attempt SLURM_RESTART_COUNT=unset" "$out" || fail "no first attempt in $out"
grep -qx "attempt SLURM_RESTART_COUNT=1" "$out" || fail "no second attempt with SLURM_RESTART_COUNT=1 in $out"
stop_line=$(grep -o "stopped by SIGTERM after step [0-9]*: saved [^;]*" "$out")
[ -n "$stop_line" ] || fail "the first attempt did not stop on SIGTERM and save: $(grep -v '^step\|^epoch' "$out")"
step=${stop_line#stopped by SIGTERM after step }
step=${step%%:*}
[ "$stop_line" = "stopped by SIGTERM after step $step: saved $work/ckpt/checkpoint-$step.ckpt" ] ||
  fail "unexpected stop line: $stop_line"
# Rank 0 exits 143 once the checkpoint is on disk (rank 1 too, unless --kill-on-bad-exit ended it first).
grep -qE "tasks? 0(-1)?: Exited with exit code 143" "$out" || fail "rank 0 did not exit with 143 (stopped)"
samples=$((step * 4))  # 2 ranks x 2
grep -qF "restart 1: resumed from $work/ckpt/checkpoint-$step.ckpt at epoch 1, $samples samples into it, step $step" \
  "$out" || fail "the requeued job did not resume from step $step: $(grep -v '^step\|^epoch' "$out")"
grep -qx "srun exited with 0" "$out" || fail "the requeued job's srun did not succeed"

# Exactly once: the epoch's 60000 samples in the model, the requeued run trained only the rest, and the
# result is the undisturbed run's.
[ "$(json "$out" restarts)" = 1 ] || fail "\"restarts\" is $(json "$out" restarts), not 1"
[ "$(json "$out" epoch_samples)" = "[60000]" ] || fail "epoch_samples is $(json "$out" epoch_samples), not [60000]"
[ "$(json "$out" train_samples)" = $((60000 - samples)) ] ||
  fail "train_samples is $(json "$out" train_samples), not 60000 - $samples"
for key in steps final_loss test_accuracy; do
  [ "$(json "$out" "$key")" = "$(json "$work/reference.out" "$key")" ] ||
    fail "\"$key\" is $(json "$out" "$key") after the requeue but $(json "$work/reference.out" "$key") undisturbed"
done
echo "$name: requeued at step $step, resumed by itself; final_loss $(json "$out" final_loss) as undisturbed"
