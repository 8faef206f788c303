#!/usr/bin/env bash
# On the GPU host: each grouped-GEMM tile alone on the small cases (a crash stays in its process), then
# the first failing one under compute-sanitizer.
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
    line=$(grep -E "fast|$tile" "$out/t.txt" | grep -v "^\s*at " | head -3 | tr '\n' ' ' | cut -c1-300)
    err=$(grep -m1 -E "Error|stalled" "$out/t.txt" | cut -c1-200)
    echo "$tile | $cs | rc=$rc | $line | $err"
    [[ $rc -ne 0 && -z $first ]] && first="$tile|$cs"
  done
done
if [[ -n $first ]]; then
  tile=${first%%|*}; cs=${first#*|}
  echo "== compute-sanitizer on $tile / $cs"
  MEGAMOE_GEMM_TILES=$tile MEGAMOE_GEMM_CASE="$cs" timeout 200 compute-sanitizer --tool memcheck --show-backtrace no \
    node --test dist-test/test/gpu/grouped-gemm.test.js >"$out/sanitizer.txt" 2>&1
  grep -E "=========" "$out/sanitizer.txt" | head -30
fi
