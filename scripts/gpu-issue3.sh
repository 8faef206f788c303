#!/usr/bin/env bash
# On the GPU host (after `npm run build && npm run build:test && ../shared/gpu-host/bundle.sh` here):
# info with ceilings, the GPU tests, and the quantization benchmark; everything lands in $OUT.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$out/smi.txt"
node dist/cli/main.js info 2>&1 | tee "$out/info.txt"
node dist/cli/main.js info --json >"$out/info.json" 2>&1
MEGAMOE_REQUIRE_GPU=1 node --test --test-reporter=spec dist-test/test/gpu/*.test.js >"$out/test-gpu.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^ℹ (tests|pass|fail|skipped)|^✖|not ok" "$out/test-gpu.txt" | head -40
node dist/cli/main.js bench --impl quant --tokens 1,7,129,1024,4096,8192 --hidden 4096,7168 --out "$out/quant-fp32.json" 2>&1 | tee "$out/bench.txt"
node dist/cli/main.js bench --impl quant --tokens 4096,8192 --hidden 7168 --format ue8m0 --out "$out/quant-ue8m0.json" 2>&1 | tee -a "$out/bench.txt"
