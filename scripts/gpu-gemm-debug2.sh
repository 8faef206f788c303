#!/usr/bin/env bash
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}; mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit MEGAMOE_REQUIRE_GPU=1
node dist-test/scripts/gpu-gemm-sass.js /tmp/tiny.cubin m64n128 469 256 256 8
cuobjdump --dump-sass /tmp/tiny.cubin > "$out/tiny.sass"
grep -n "/\*44[0-9a-f]0\*/" "$out/tiny.sass" | head -20
MEGAMOE_GEMM_TILES=m64n128 MEGAMOE_GEMM_CASE="tiny L1" timeout 120 compute-sanitizer --tool memcheck --show-backtrace no \
  node --test dist-test/test/gpu/grouped-gemm.test.js >"$out/sanitizer.txt" 2>&1
grep -E "=========" "$out/sanitizer.txt" | grep -E "at |thread" | sort | uniq -c | sort -rn | head -40
