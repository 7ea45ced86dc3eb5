#!/usr/bin/env bash
# A LibTorch outside dtrain's supported range is one clear line at configure time, for dtrain's own build
# and for a user's find_package(dtrain) alike (both go through cmake/dtrainFindTorch.cmake).
#
# No LibTorch outside the range is installed here (PyPI's 2.10 is another 5 GB; 2.16 does not exist yet),
# so the test gives dtrain_find_torch a Torch package that only declares its version: the macro reads
# nothing else of it before it refuses. Its first case, 2.15.0 through the same fake package, must be
# accepted: that shows the refusals below come from the version and from nothing else in the fake.
# Usage: torch_range_test.sh SOURCE_DIR WORK_DIR
set -euo pipefail
source=$1 work=$2
rm -rf "$work"
mkdir -p "$work"

# configure VERSION: writes a Torch package declaring VERSION and configures a project that calls
# dtrain_find_torch on it; prints CMake's output, returns CMake's exit status.
configure() {
  local version=$1 dir=$work/$1
  mkdir -p "$dir/torch/share/cmake/Torch" "$dir/project"
  cat >"$dir/torch/share/cmake/Torch/TorchConfigVersion.cmake" <<VERSION
set(PACKAGE_VERSION "$version")
set(PACKAGE_VERSION_COMPATIBLE TRUE)
VERSION
  cat >"$dir/torch/share/cmake/Torch/TorchConfig.cmake" <<'CONFIG'
set(TORCH_INSTALL_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../..")
set(TORCH_LIBRARIES "")
set(Torch_FOUND TRUE)
CONFIG
  cat >"$dir/project/CMakeLists.txt" <<PROJECT
cmake_minimum_required(VERSION 3.25)
project(torch_range_probe LANGUAGES NONE)
include("$source/cmake/dtrainFindTorch.cmake")
dtrain_find_torch("$dir/torch/share/cmake/Torch")
message(STATUS "accepted LibTorch \${Torch_VERSION}")
PROJECT
  cmake -S "$dir/project" -B "$dir/build" 2>&1
}

if ! out=$(configure 2.15.0); then
  echo "torch_range_test: LibTorch 2.15.0 (in the range) was refused:" >&2
  echo "$out" >&2
  exit 1
fi
grep -q 'accepted LibTorch 2.15.0' <<<"$out" || {
  echo "torch_range_test: 2.15.0 configured but was not reported as accepted:" >&2
  echo "$out" >&2
  exit 1
}

for version in 2.10.0 2.16.0 1.13.1; do
  if out=$(configure "$version"); then
    echo "torch_range_test: LibTorch $version (outside 2.11 to 2.15) was accepted:" >&2
    echo "$out" >&2
    exit 1
  fi
  # The message: the range, the LibTorch found and its version, and what to do, on one line of CMake's
  # error block.
  line=$(grep -F "dtrain supports LibTorch 2.11 to 2.15, but" <<<"$out" || true)
  for part in "is LibTorch $version" "point CMAKE_PREFIX_PATH or Torch_DIR" "$work/$version/torch"; do
    if ! grep -qF -- "$part" <<<"$line"; then
      echo "torch_range_test: LibTorch $version: the refusal does not say '$part' on its line:" >&2
      echo "$out" >&2
      exit 1
    fi
  done
done
echo "torch_range_test: 2.15.0 accepted; 2.10.0, 2.16.0 and 1.13.1 each refused in one line"
