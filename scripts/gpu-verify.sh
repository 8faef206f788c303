#!/usr/bin/env bash
# On the GPU host, short: the pipeline's GPU tests, and the CLI's run/check on the GPU backend.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
MEGAMOE_REQUIRE_GPU=1 timeout 150 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-unfused.txt" 2>&1
echo "unfused test rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-unfused.txt" | head
timeout 40 node dist/cli/main.js run --shape flash-ep8 --tokens 64 2>&1 | tee "$out/run.txt"
timeout 40 node dist/cli/main.js check --shape tiny --tokens 64 2>&1 | tee "$out/check.txt"
