#!/usr/bin/env bash
# lab/soak: many forwards over random layer shapes through the fused and unfused GPU pipelines, checking
# for leaks, non-repeatable or fused≠unfused outputs, watchdog trips and non-finite outputs.
# The implementation is lab/soak.ts; on the GPU host it runs from dist-test (npx tsc -p tsconfig.json).
#   lab/soak.sh --help
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The GPU host has no Node of its own: the bundle's (bash ../shared/gpu-host/bundle.sh) when present.
if ! command -v node >/dev/null && [[ -f .gpuhost/activate ]]; then
  source .gpuhost/activate
  export MEGAMOE_CACHE_DIR=${MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit}
fi
if [[ -f dist-test/lab/soak.js ]]; then
  exec node dist-test/lab/soak.js "$@"
fi
exec node --import tsx lab/soak.ts "$@"
