#!/usr/bin/env bash
# Diagnosis of the grouped GEMM on the GPU host: each tile alone on the small cases (a crash stays in
# its own process), then the first failing one under compute-sanitizer, with the SASS of its cubin
# (look up the faulting PC the sanitizer prints: `grep '/\*<pc>\*/' $OUT/first.sass`).
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit MEGAMOE_REQUIRE_GPU=1
first=""
for tile in m64n128 m128n128 m64n256 m128n256 plan-1cta; do
  for cs in "tiny L1" "tiny L2" "empty groups" "384 groups"; do
    MEGAMOE_GEMM_TILES=$tile MEGAMOE_GEMM_CASE="$cs" timeout 60 node --test --test-reporter=spec dist-test/test/gpu/grouped-gemm.test.js >"$out/t.txt" 2>&1
    rc=$?
    err=$(grep -m1 -E "Error|stalled" "$out/t.txt" | cut -c1-200)
    echo "$tile | $cs | rc=$rc | $err"
    [[ $rc -ne 0 && -z $first ]] && first="$tile|$cs"
  done
done
if [[ -n $first ]]; then
  tile=${first%%|*}; cs=${first#*|}
  [[ $tile == plan-1cta ]] && tile=m64n128
  echo "== compute-sanitizer on $tile / $cs"
  MEGAMOE_GEMM_TILES=$tile MEGAMOE_GEMM_CASE="$cs" timeout 200 compute-sanitizer --tool memcheck --show-backtrace no \
    node --test dist-test/test/gpu/grouped-gemm.test.js >"$out/sanitizer.txt" 2>&1
  grep -E "=========" "$out/sanitizer.txt" | grep -E "at |thread" | sort | uniq -c | sort -rn | head -20
  # The tiny L1 problem's shape (469 rows, N=K=256, 8 groups); edit for another case.
  node dist-test/scripts/gpu-gemm-sass.js /tmp/first.cubin "$tile" 469 256 256 8 && cuobjdump --dump-sass /tmp/first.cubin >"$out/first.sass"
fi
