#!/usr/bin/env bash
# Every program of a build that links LibTorch names libstdc++ before LibTorch (and libdtrain) among the
# libraries it needs. LibTorch 2.11's libtorch.so exports its own copies of std::filesystem functions that
# crash when called from outside it, and the loader binds a program's calls to the first library in that
# order that defines them: with libtorch first, every std::filesystem::remove_all in dtrain (checkpoints,
# spawn, recovery) jumped to address 0 (seen on 2.11; cmake/torch_targets.cmake sets the order).
# Usage: stdcxx_first_test.sh BUILD_DIR
set -euo pipefail
build=$1
checked=0 bad=()
while IFS= read -r -d '' file; do
  head -c 4 "$file" | grep -q 'ELF' || continue
  needed=$(readelf -d "$file" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  grep -q -E '^lib(torch|c10|dtrain)' <<<"$needed" || continue
  checked=$((checked + 1))
  first_torch=$(grep -n -m1 -E '^lib(torch|c10|dtrain)' <<<"$needed" | cut -d: -f1)
  stdcxx=$(grep -n -m1 '^libstdc++' <<<"$needed" | cut -d: -f1 || true)
  if [ -z "$stdcxx" ] || ((stdcxx > first_torch)); then
    bad+=("$(basename "$file"): $(tr '\n' ' ' <<<"$needed")")
  fi
done < <(find "$build/bin" -maxdepth 1 -type f -perm -u+x -print0)
if ((checked == 0)); then
  echo "stdcxx_first_test: no programs linking LibTorch under $build/bin: build first" >&2
  exit 1
fi
if ((${#bad[@]})); then
  printf 'stdcxx_first_test: LibTorch before libstdc++ in NEEDED: %s\n' "${bad[@]}" >&2
  echo "Likely cause: a program that links LibTorch without dtrain::dtrain or the link options of cmake/torch_targets.cmake." >&2
  exit 1
fi
echo "stdcxx_first_test: $checked programs link LibTorch, libstdc++ comes first in each"
