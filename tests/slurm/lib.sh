# What the Slurm tests share (sourced): a cluster of their own for the test's lifetime, the trainer, the
# final JSON line's fields, and how a test fails or skips. The test's first argument is the build's bin/.
# ctest registers every test with SKIP_RETURN_CODE 77 (tests/CMakeLists.txt).
set -uo pipefail

bin=${1:?usage: $0 BUILD_BIN_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
trainer=$bin/train_fashion_mnist
name=$(basename "$0" .sh)

fail() {
  echo "$name: FAILED: $*" >&2
  exit 1
}

skip() {
  echo "$name: SKIPPED: $*"
  exit 77
}

# Starts this test's cluster in a fresh folder (exported: SLURM_CONF; set: cluster, work, a folder for the
# test's own files) and stops it when the test exits, however it exits. Skips where Slurm cannot run.
start_cluster() {
  [ -x "$trainer" ] || fail "$trainer is not built (cmake --build build --target train_fashion_mnist)"
  local data=${DTRAIN_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
  [ -e "$data/train-images-idx3-ubyte" ] || [ -e "$data/train-images-idx3-ubyte.gz" ] ||
    skip "Fashion-MNIST is not in \$DTRAIN_FASHION_MNIST_DIR or $data (Debian: dataset-fashion-mnist)"
  cluster=$(mktemp -d /tmp/dtrain-slurm.XXXXXX)
  work=$(mktemp -d /tmp/dtrain-slurm-work.XXXXXX)
  # DTRAIN_KEEP_TEST_FILES=1 keeps the test's files (its job output, checkpoints) for a look afterwards.
  trap 'bash "$here/slurm_cluster.sh" stop "$cluster"
        [ "${DTRAIN_KEEP_TEST_FILES:-0}" = 1 ] && echo "$name: kept $work" || rm -rf "$work"' EXIT
  local reason rc
  reason=$(bash "$here/slurm_cluster.sh" start "$cluster" 2>&1)
  rc=$?
  ((rc == 77)) && skip "$reason"
  ((rc == 0)) || fail "$reason"
  export SLURM_CONF=$cluster/slurm.conf
}

# json FILE KEY: KEY of the last JSON line in FILE (`dtrain run`'s "[rank0]: " prefix allowed), as JSON (a
# list prints as [60000]); empty if there is none.
json() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
lines = [m.group(1) for m in map(re.compile(r"^(?:\[rank\d+\]: )?(\{.*)").match, open(sys.argv[1], errors="replace")) if m]
if lines:
    value = json.loads(lines[-1]).get(sys.argv[2])
    print("" if value is None else json.dumps(value, separators=(",", ":")))
PY
}

# Seconds since the epoch, with milliseconds.
now() { date +%s.%N | cut -c1-14; }
