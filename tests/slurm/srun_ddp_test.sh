#!/usr/bin/env bash
# srun launches the trainer with no dtrain launcher: each task finds its rank, the world size and the
# master's address and port in Slurm's own variables (src/comm/launch_env.cpp: SLURM_PROCID, SLURM_NTASKS,
# the first host of SLURM_STEP_NODELIST, port 15000 + SLURM_JOB_ID % 20000), and the two ranks train DDP to
# the same loss and accuracy as `dtrain run --nproc-per-node 2` of the same command.
# Usage: srun_ddp_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
start_cluster

args=(--max-steps 100 --seed 3)
timeout 120 srun -n2 --kill-on-bad-exit=1 "$trainer" "${args[@]}" >"$work/srun.out" 2>&1 ||
  fail "srun -n2 exited with $?: $(tail -n 5 "$work/srun.out")"
timeout 120 "$bin/dtrain" run --nproc-per-node 2 -- "$trainer" "${args[@]}" >"$work/run.out" 2>&1 ||
  fail "dtrain run exited with $?: $(tail -n 5 "$work/run.out")"

for key in world_size steps train_samples final_loss test_accuracy; do
  srun_value=$(json "$work/srun.out" "$key")
  run_value=$(json "$work/run.out" "$key")
  [ -n "$srun_value" ] || fail "no \"$key\" in srun's JSON line: $(tail -n 3 "$work/srun.out")"
  [ "$srun_value" = "$run_value" ] ||
    fail "\"$key\" is $srun_value under srun but $run_value under dtrain run (the same 2-rank DDP)"
done
[ "$(json "$work/srun.out" world_size)" = 2 ] || fail "srun's world_size is not 2"
echo "$name: srun -n2 and dtrain run --nproc-per-node 2 agree: final_loss $(json "$work/srun.out" final_loss)," \
  "test_accuracy $(json "$work/srun.out" test_accuracy)"
