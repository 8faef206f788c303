#!/usr/bin/env bash
# On the GPU host: the flash-ep8 layer sweep (eager and CUDA graph), and the torch peer beside it.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1
timeout 150 node dist/cli/main.js bench --impl unfused --shape flash-ep8 --shared 1 --out "$out/unfused-flash-ep8-shared1.json" 2>&1 | tail -32
timeout 150 node dist/cli/main.js bench --impl unfused --shape flash-ep8 --shared 1 --graph --out "$out/unfused-graph-flash-ep8-shared1.json" 2>&1 | tail -32
timeout 150 node dist/cli/main.js bench --impl unfused --shape flash-ep8 --shared 0 --out "$out/unfused-flash-ep8-shared0.json" 2>&1 | tail -32
timeout 150 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --out "$out/torch-flash-ep8-shared1.json" 2>&1 | tail -15
timeout 150 python3 bench/peers/torch_moe.py --shape flash-ep8 --shared 1 --graph --out "$out/torch-graph-flash-ep8-shared1.json" 2>&1 | tail -15
