#!/usr/bin/env bash
# srun -N2 spans two hosts: a cluster of two slurmd nodes, each in a network namespace of its own with its
# own hostname, address and spool folder (slurm_cluster.sh --two-hosts). One task per node finds its rank,
# the world size and the master (the first node of SLURM_STEP_NODELIST, by name) in Slurm's variables, and
# the two ranks train DDP across the hosts to the same loss and accuracy as two ranks on one node. Skips
# (exit 77) with the reason where the kernel or the container refuses namespaces.
# Usage: srun_two_hosts_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
start_cluster --two-hosts

args=(--max-steps 100 --seed 3)
# Each task says where it runs, then becomes the trainer.
where='echo "rank $SLURM_PROCID on $(hostname)"; exec "$0" "$@"'
on_head timeout 120 srun -N2 -n2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$where" "$trainer" \
  "${args[@]}" >"$work/two.out" 2>&1 || fail "srun -N2 exited with $?: $(tail -n 5 "$work/two.out")"
on_head timeout 120 srun -N1 -n2 -w dtrain-node0 --kill-on-bad-exit=1 bash -c "$where" "$trainer" \
  "${args[@]}" >"$work/one.out" 2>&1 || fail "srun -N1 exited with $?: $(tail -n 5 "$work/one.out")"

for line in "rank 0 on dtrain-node0" "rank 1 on dtrain-node1"; do
  grep -qx "$line" "$work/two.out" || fail "srun -N2: no '$line': $(grep '^rank' "$work/two.out")"
done
[ "$(grep -cx "rank [01] on dtrain-node0" "$work/one.out")" = 2 ] ||
  fail "srun -N1 -w dtrain-node0: not both ranks on dtrain-node0: $(grep '^rank' "$work/one.out")"
for key in world_size steps train_samples final_loss test_accuracy; do
  two=$(json "$work/two.out" "$key")
  one=$(json "$work/one.out" "$key")
  [ -n "$two" ] || fail "no \"$key\" in srun -N2's JSON line: $(tail -n 3 "$work/two.out")"
  [ "$two" = "$one" ] || fail "\"$key\" is $two across two hosts but $one on one node (the same 2-rank DDP)"
done
[ "$(json "$work/two.out" world_size)" = 2 ] || fail "srun -N2's world_size is not 2"
echo "$name: srun -N2 across dtrain-node0 and dtrain-node1 trains as two ranks on one node: final_loss" \
  "$(json "$work/two.out" final_loss), test_accuracy $(json "$work/two.out" test_accuracy)"
