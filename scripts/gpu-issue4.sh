#!/usr/bin/env bash
# On the GPU host: the unfused pipeline's GPU tests (small shapes live, flash-ep8 against the sampled CPU
# references in .fixtures), then the layer benchmark sweeps. Everything lands in $OUT.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit MEGAMOE_REQUIRE_GPU=1
timeout 420 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-unfused.txt" 2>&1
echo "unfused test rc=$?"
grep -E "vs reference|^ℹ (tests|pass|fail)|✖|Error" "$out/test-unfused.txt" | cut -c1-220 | head -70
for shared in 1 0; do
  timeout 300 node dist/cli/main.js bench --impl unfused --shape flash-ep8 --shared $shared \
    --out "$out/unfused-flash-ep8-shared$shared.json" 2>&1 | tee "$out/bench-flash-ep8-shared$shared.txt"
done
export PYTHONUNBUFFERED=1
timeout 200 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --out "$out/torch-flash-ep8-shared1.json" 2>&1 | tail -16
timeout 100 python3 bench/peers/torch_moe.py --grouped-gemm-only --out "$out/torch-grouped-gemm.json" 2>&1 | tail -8
