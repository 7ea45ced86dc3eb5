#!/usr/bin/env bash
# A rank that fails ends the whole srun step within seconds, not after a timeout:
#  - at start-up, before its peers could notice: rank 0 alone finds a checkpoint in --checkpoint-dir without
#    --resume (only rank 0 judges the folder) and exits 2, while rank 1 waits in init_process_group for the
#    store rank 0 would have hosted. A store that never appeared looks like one not yet started, so dtrain
#    cannot tell; srun --kill-on-bad-exit=1 ends rank 1 (without it, rank 1 waits out the store's timeout).
#  - mid-run, without --kill-on-bad-exit: rank 1 is SIGKILLed after step 20; rank 0's next all-reduce fails
#    at once naming the rank that died (dtrain sees the peer's connection close), and it exits 1.
# Usage: rank_failure_test.sh BUILD_BIN_DIR
source "$(dirname "$0")/lib.sh"
start_cluster
bound=30  # seconds; the store's start-up timeout is 600 s

"$trainer" --max-steps 2 --checkpoint-dir "$work/ckpt" >"$work/first.out" 2>&1 ||
  fail "the run that makes a checkpoint exited with $?: $(tail -n 3 "$work/first.out")"

start=$(now)
timeout 60 srun -n2 --kill-on-bad-exit=1 "$trainer" --max-steps 50 --checkpoint-dir "$work/ckpt" \
  >"$work/startup.out" 2>&1
rc=$?
elapsed=$(python3 -c "print(round($(now) - $start, 1))")
((rc != 0 && rc != 124)) || fail "srun exited with $rc (expected a failure, before the 60 s timeout)"
grep -q "already holds a checkpoint" "$work/startup.out" ||
  fail "rank 0 did not refuse the folder: $(tail -n 3 "$work/startup.out")"
python3 -c "import sys; sys.exit(0 if $elapsed < $bound else 1)" ||
  fail "the step took $elapsed s to end after rank 0 failed at start-up (bound: $bound s)"
echo "$name: rank 0 failed at start-up; srun --kill-on-bad-exit=1 ended the step in $elapsed s"

start=$(now)
DTRAIN_TEST_KILL_AT_STEP=1:20 timeout 60 srun -n2 "$trainer" --max-steps 100000 >"$work/midrun.out" 2>&1
rc=$?
elapsed=$(python3 -c "print(round($(now) - $start, 1))")
((rc != 0 && rc != 124)) || fail "srun exited with $rc (expected a failure, before the 60 s timeout)"
grep -q "rank 0/2: all_reduce #[0-9]* on group 'default' failed after .*group rank 1 (pid [0-9]*) exited" \
  "$work/midrun.out" || fail "rank 0 did not name the rank that died: $(grep -m 3 -v '^epoch' "$work/midrun.out")"
python3 -c "import sys; sys.exit(0 if $elapsed < $bound else 1)" ||
  fail "the step took $elapsed s to end after rank 1 died mid-run (bound: $bound s)"
echo "$name: rank 1 died mid-run; rank 0 noticed by itself and the step ended in $elapsed s"
