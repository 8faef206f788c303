#!/usr/bin/env bash
# On the GPU host: the grouped-GEMM GPU test, the SASS check (QGMMA present), and the tile benchmark.
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit
nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -std=c++17 -I src/include -DBLOCK_M=128 -DBLOCK_N=128 \
  src/kernels/gemm/fp8_grouped_gemm.cu -o /tmp/gemm.cubin && cuobjdump --dump-sass /tmp/gemm.cubin >"$out/gemm.sass" 2>&1
echo "SASS: $(grep -c QGMMA "$out/gemm.sass") QGMMA, $(grep -c UTMALDG "$out/gemm.sass") UTMALDG lines"
MEGAMOE_REQUIRE_GPU=1 timeout 300 node --test --test-reporter=spec dist-test/test/gpu/grouped-gemm.test.js >"$out/test-gemm.txt" 2>&1
echo "gemm test rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖|FAIL|stalled|rel" "$out/test-gemm.txt" | head -60
timeout 200 node dist-test/scripts/gpu-gemm-bench.js "$out/gemm-bench.json" 2>&1 | tee "$out/gemm-bench.txt"
