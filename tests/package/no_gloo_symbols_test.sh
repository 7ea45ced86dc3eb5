#!/usr/bin/env bash
# libdtrain compiles against Debian's Gloo headers (libgloo-dev), an older snapshot than the Gloo compiled into
# LibTorch. That is safe while dtrain only holds Gloo objects through c10d (shared_ptr<gloo::transport::Device>
# made inside LibTorch) and emits no Gloo code of its own: a gloo:: function or vtable defined in libdtrain.so
# would be built from the old headers and could be bound in place of LibTorch's (ELF interposition), with
# whatever layout differences the two snapshots have. Usage: no_gloo_symbols_test.sh BUILD_DIR
set -euo pipefail
library=$1/lib/libdtrain.so
[ -e "$library" ] || { echo "no_gloo_symbols_test: $library is missing: build first" >&2; exit 1; }
defined=$(nm -DC --defined-only "$library" | grep -E '(^| )(vtable for |typeinfo for )?gloo::' || true)
if [ -n "$defined" ]; then
  echo "no_gloo_symbols_test: libdtrain.so defines Gloo code compiled from the system's Gloo headers:" >&2
  echo "$defined" | head -5 >&2
  echo "Likely cause: a source file other than src/comm/process_group.cpp uses Gloo, or calls into an inline" \
    "Gloo function; go through c10d::ProcessGroupGloo instead." >&2
  exit 1
fi
echo "no_gloo_symbols_test: libdtrain.so defines no gloo:: symbols"
