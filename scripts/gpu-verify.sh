#!/usr/bin/env bash
# On the GPU host, short: the pipeline's GPU tests (small shapes live; flash-ep8, flash and pro against
# the sampled CPU references in .fixtures), and `megamoe run` on the GPU backend.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
MEGAMOE_REQUIRE_GPU=1 timeout 120 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-unfused.txt" 2>&1
echo "unfused test rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖| T=[0-9]+ \(" "$out/test-unfused.txt" | cut -c1-150 | head -30
timeout 25 node dist/cli/main.js run --shape flash-ep8 --tokens 64 2>&1 | tee "$out/run.txt"
