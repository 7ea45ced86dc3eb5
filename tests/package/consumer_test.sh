#!/usr/bin/env bash
# Installs the dtrain of a build tree into a fresh prefix, builds tests/package/consumer (a user's project:
# find_package(dtrain), dtrain::dtrain) against it, and runs the consumer on 2 ranks under the installed
# launcher. Usage: consumer_test.sh BUILD_DIR SOURCE_DIR WORK_DIR
set -euo pipefail
build=$1 source=$2 work=$3
rm -rf "$work"
mkdir -p "$work"

cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
for f in include/dtrain/ddp.h lib/cmake/dtrain/dtrainConfig.cmake bin/dtrain; do
  [ -e "$work/prefix/$f" ] || { echo "consumer_test: the install lacks $f" >&2; exit 1; }
done
# LibTorch's libraries come from the consumer's own find_package(Torch), not from paths of this build.
if grep -l 'libc10' "$work/prefix"/lib/cmake/dtrain/dtrainTargets*.cmake; then
  echo "consumer_test: the installed targets name LibTorch's libraries by this build's paths" >&2
  exit 1
fi
if find "$work/prefix" -name '*_test*' -o -name 'bench_*' | grep -q .; then
  echo "consumer_test: tests or benchmarks were installed:" >&2
  find "$work/prefix" -name '*_test*' -o -name 'bench_*' >&2
  exit 1
fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Only the install prefix: the package itself must find the LibTorch dtrain was built against.
cmake -S "$source/tests/package/consumer" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" >"$work/configure.log" ||
  { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }

"$(cat "$work/build/launcher_path.txt")" run --nproc-per-node 2 -- "$work/build/consumer"
