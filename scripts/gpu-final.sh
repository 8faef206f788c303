#!/usr/bin/env bash
# On the GPU host, one call: the device weight generator and unfused pipeline tests, then the flash-ep8
# layer sweep and the torch peer beside it.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1
MEGAMOE_REQUIRE_GPU=1 timeout 150 node --test --test-reporter=spec dist-test/test/gpu/weightgen.test.js dist-test/test/gpu/unfused.test.js >"$out/test-gpu.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖|flash-ep8 T=|generat" "$out/test-gpu.txt" | cut -c1-200 | head -30
b() { timeout 60 node dist/cli/main.js bench --impl unfused "$@" 2>&1 | grep -E "^│" | awk -F'│' '{print $3,$5,$6,$7}' | tr -s ' '; }
echo "== flash-ep8 shared1"; b --shape flash-ep8 --shared 1 --out "$out/unfused-flash-ep8-shared1.json"
echo "== torch flash-ep8"; timeout 80 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --iters 10 --out "$out/torch-flash-ep8-shared1.json" 2>&1 | tail -15
