#!/usr/bin/env bash
# On the GPU host, one call: the device weight generator and unfused pipeline tests, then the layer
# sweeps (flash-ep8 eager and graph, flash) and the torch peer beside them.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1
MEGAMOE_REQUIRE_GPU=1 timeout 200 node --test --test-reporter=spec dist-test/test/gpu/weightgen.test.js dist-test/test/gpu/unfused.test.js >"$out/test-gpu.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖|flash-ep8 T=|generation" "$out/test-gpu.txt" | cut -c1-200 | head -30
b() { timeout 150 node dist/cli/main.js bench --impl unfused "$@" 2>&1 | grep -E "^│" | awk -F'│' '{print $3,$5,$6,$7}' | tr -s ' '; }
echo "== flash-ep8 shared1"; b --shape flash-ep8 --shared 1 --out "$out/unfused-flash-ep8-shared1.json"
echo "== flash-ep8 shared1 graph"; b --shape flash-ep8 --shared 1 --graph --out "$out/unfused-graph-flash-ep8-shared1.json"
echo "== flash shared1"; b --shape flash --shared 1 --out "$out/unfused-flash-shared1.json"
echo "== torch flash-ep8"; timeout 120 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --out "$out/torch-flash-ep8-shared1.json" 2>&1 | tail -15
echo "== torch flash-ep8 graph"; timeout 100 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --graph --out "$out/torch-graph-flash-ep8-shared1.json" 2>&1 | tail -15
