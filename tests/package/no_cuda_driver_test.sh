#!/usr/bin/env bash
# Every program and library of a build starts on a machine without a GPU: none may need the CUDA driver
# (libcuda.so.1), directly or through what it links. LibTorch's CUDA build loads the driver itself, lazily, when
# a GPU is first used; a binary linked against the toolkit's driver stub (lib64/stubs/libcuda.so) would instead
# fail to start wherever no driver is installed, as on CI. Usage: no_cuda_driver_test.sh BUILD_DIR
set -euo pipefail
build=$1
checked=0 bad=()
while IFS= read -r -d '' file; do
  head -c 4 "$file" | grep -q 'ELF' || continue
  checked=$((checked + 1))
  # ldd lists what the loader would load, transitively; "libcuda.so" also catches "not found" entries.
  # Its output is taken whole first: under pipefail, `ldd | grep -q` can fail on ldd's SIGPIPE.
  needs=$(ldd "$file" 2>/dev/null || true)
  if grep -q 'libcuda\.so' <<<"$needs"; then
    bad+=("$file: $(grep -m1 'libcuda\.so' <<<"$needs" | tr -s ' \t' ' ')")
  fi
done < <(find "$build/bin" "$build/lib" -maxdepth 1 -type f \( -perm -u+x -o -name '*.so*' \) -print0)
if ((checked == 0)); then
  echo "no_cuda_driver_test: no programs or libraries under $build/bin and $build/lib: build first" >&2
  exit 1
fi
if ((${#bad[@]})); then
  printf 'no_cuda_driver_test: needs the CUDA driver (libcuda), so it cannot start without a GPU: %s\n' "${bad[@]}" >&2
  echo "Likely cause: CUDA::cuda_driver (the toolkit's lib64/stubs/libcuda.so) reached a target's link line." >&2
  exit 1
fi
echo "no_cuda_driver_test: $checked programs and libraries, none needs libcuda"
