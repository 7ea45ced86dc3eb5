#!/usr/bin/env bash
# A project that builds dtrain along with itself (add_subdirectory) links the same dtrain::dtrain and
# dtrain::launcher as one that finds the installed package: tests/package/consumer, configured and generated
# with -DDTRAIN_SOURCE_DIR. Only configured: building it would compile the whole library a second time, and
# an unknown dtrain:: target is already an error when CMake generates. Only dtrain's library and launcher are
# configured (a consumer's build leaves out the tests, benchmarks, examples and tools).
# Usage: subdirectory_test.sh SOURCE_DIR TORCH_PREFIX WORK_DIR
set -euo pipefail
source=$1 torch_prefix=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
if ! cmake -S "$source/tests/package/consumer" -B "$work/build" -DDTRAIN_SOURCE_DIR="$source" \
  -DCMAKE_PREFIX_PATH="$torch_prefix" >"$work/configure.log" 2>&1; then
  echo "subdirectory_test: a project with add_subdirectory(dtrain) does not configure:" >&2
  tail -30 "$work/configure.log" >&2
  exit 1
fi
for option in DTRAIN_BUILD_TESTS DTRAIN_BUILD_BENCHMARKS DTRAIN_BUILD_EXAMPLES DTRAIN_BUILD_TRAINER; do
  if ! grep -q "^$option:BOOL=OFF" "$work/build/CMakeCache.txt"; then
    echo "subdirectory_test: $option is not OFF in a consumer's build" >&2
    exit 1
  fi
done
[ -s "$work/build/launcher_path.txt" ] || { echo "subdirectory_test: no launcher path was generated" >&2; exit 1; }
rm -rf "$work"
