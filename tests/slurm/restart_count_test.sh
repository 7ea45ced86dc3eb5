#!/usr/bin/env bash
# A run that Slurm requeued resumes by itself: SLURM_RESTART_COUNT above 0 counts as a restart just as
# TORCHELASTIC_RESTART_COUNT does (dtrain::LaunchInfo::restarts, which the trainer reads), and the final JSON
# line's "restarts" reports the larger of the two. No cluster needed: the variables are set by hand, on one rank.
# Usage: restart_count_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
[ -x "$trainer" ] || fail "$trainer is not built (cmake --build build --target train_fashion_mnist)"
data=${DTRAIN_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
[ -e "$data/train-images-idx3-ubyte" ] || [ -e "$data/train-images-idx3-ubyte.gz" ] ||
  skip "Fashion-MNIST is not in \$DTRAIN_FASHION_MNIST_DIR or $data (Debian: dataset-fashion-mnist)"
work=$(mktemp -d /tmp/dtrain-restart-count.XXXXXX)
trap 'rm -rf "$work"' EXIT
ckpt=$work/ckpt
# The variables of a launcher or a job around this test must not leak in.
unset TORCHELASTIC_RESTART_COUNT SLURM_RESTART_COUNT SLURM_PROCID RANK WORLD_SIZE

"$trainer" --max-steps 10 --checkpoint-dir "$ckpt" >"$work/first.out" 2>&1 ||
  fail "the first run exited with $?: $(tail -n 3 "$work/first.out")"
[ "$(json "$work/first.out" restarts)" = 0 ] || fail "the first run's \"restarts\" is not 0"

# Requeued by Slurm: no --resume, yet it continues from step 10.
SLURM_RESTART_COUNT=1 "$trainer" --max-steps 20 --checkpoint-dir "$ckpt" >"$work/requeued.out" 2>&1 ||
  fail "the requeued run exited with $?: $(tail -n 3 "$work/requeued.out")"
grep -qF "restart 1: resumed from $ckpt/checkpoint-10.ckpt at epoch 1, 320 samples into it, step 10" \
  "$work/requeued.out" || fail "the requeued run did not resume from step 10: $(head -n 3 "$work/requeued.out")"
[ "$(json "$work/requeued.out" restarts)" = 1 ] || fail "the requeued run's \"restarts\" is not 1"
[ "$(json "$work/requeued.out" epoch_samples)" = "[640]" ] ||
  fail "the requeued run's epoch_samples is $(json "$work/requeued.out" epoch_samples), not [640]"

# Both set: the larger wins (they may count the same requeue; see restart_count()).
TORCHELASTIC_RESTART_COUNT=1 SLURM_RESTART_COUNT=3 "$trainer" --max-steps 30 --checkpoint-dir "$ckpt" \
  >"$work/both.out" 2>&1 || fail "the run with both counts exited with $?: $(tail -n 3 "$work/both.out")"
[ "$(json "$work/both.out" restarts)" = 3 ] ||
  fail "with TORCHELASTIC_RESTART_COUNT=1 and SLURM_RESTART_COUNT=3, \"restarts\" is $(json "$work/both.out" restarts), not 3"

# A count that is not one: a usage error (exit 2) naming the variable.
SLURM_RESTART_COUNT=x "$trainer" --max-steps 40 --checkpoint-dir "$ckpt" >"$work/bad.out" 2>&1
rc=$?
((rc == 2)) || fail "SLURM_RESTART_COUNT=x exited with $rc, not 2"
grep -q "SLURM_RESTART_COUNT 'x': expected a non-negative integer" "$work/bad.out" ||
  fail "SLURM_RESTART_COUNT=x: no message naming it: $(tail -n 2 "$work/bad.out")"
echo "$name: SLURM_RESTART_COUNT resumes without --resume and is reported as \"restarts\""
