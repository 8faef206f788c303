#!/usr/bin/env bash
# On the GPU host, one call: the unfused pipeline's GPU tests, then the layer sweeps the unfused issue
# still lacked, each beside the torch peer run in the same call: flash-ep8 without the shared expert,
# flash with and without it.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1
T=1,2,8,64,512,1024,4096,8192
MEGAMOE_REQUIRE_GPU=1 timeout 150 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-unfused.txt" 2>&1
echo "unfused gpu tests rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-unfused.txt" | cut -c1-180 | head -20
for case in "flash-ep8 0" "flash 1" "flash 0"; do
  set -- $case
  timeout 90 python3 bench/peers/torch_moe.py --shape "$1" --shared "$2" --tokens $T --iters 20 \
    --out "$out/torch-$1-shared$2.json" 2>&1 | tail -3
  timeout 100 node dist/cli/main.js bench --impl unfused --shape "$1" --shared "$2" --tokens $T --iters 20 \
    --peer "$out/torch-$1-shared$2.json" --out "$out/unfused-$1-shared$2.json" --plot "$out/$1-shared$2.svg" 2>&1 \
    | grep -vE "^[├┌└]" | tail -14
done
