#!/usr/bin/env bash
# On the GPU host, one call: the device weight generator and unfused pipeline tests, then the torch
# peer and the flash-ep8 layer sweep beside it (ratio column and plot).
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1
T=1,2,8,64,512,1024,4096,8192
MEGAMOE_REQUIRE_GPU=1 timeout 130 node --test --test-reporter=spec dist-test/test/gpu/weightgen.test.js dist-test/test/gpu/unfused.test.js >"$out/test-gpu.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖|flash-ep8 T=" "$out/test-gpu.txt" | cut -c1-180 | head -24
timeout 70 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --tokens $T --iters 20 --out "$out/torch-flash-ep8-shared1.json" 2>&1 | tail -12
timeout 80 node dist/cli/main.js bench --impl unfused --shape flash-ep8 --shared 1 --tokens $T --iters 20 \
  --peer "$out/torch-flash-ep8-shared1.json" --out "$out/unfused-flash-ep8-shared1.json" --plot "$out/flash-ep8-shared1.svg" 2>&1 \
  | grep -vE "^[├┌└]" | tail -22
