#!/usr/bin/env bash
# On the GPU host, one call: a fused-kernel smoke check, the GPU pipeline tests (unfused and fused side
# by side, bit-equality between them), then flash-ep8 sweeps of both pipelines. Everything lands in
# $OUT/fused.tar (one file: the device tool returns a limited number of files).
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
# Results go straight to $OUT unless TAR=1 (then one tar file: the device tool returns a limited number of
# files, and a command killed at its time limit never reaches an EXIT trap).
if [ "${TAR:-0}" = 1 ]; then work=$(mktemp -d); trap 'tar -C "$work" -cf "$out/fused.tar" .' EXIT; else work=$out; fi
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1
timeout 60 node dist/cli/main.js check --shape tiny --tokens 7 --backend cuda 2>&1 | tail -6
timeout 60 node dist/cli/main.js check --shape flash-ep8 --tokens 3 --backend cuda 2>&1 | tail -3
[ "${TESTS:-1}" = 1 ] && {
MEGAMOE_REQUIRE_GPU=1 timeout ${TEST_TIMEOUT:-300} node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$work/test-pipelines.txt" 2>&1
echo "pipeline tests rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖|differs|stall|gave up" "$work/test-pipelines.txt" | cut -c1-220 | head -30
grep -E "fused .*T=(1|7|1024|4096) " "$work/test-pipelines.txt" | cut -c1-200 | head -12
}
# Sweeps: "shape shared" pairs; each beside the torch peer run in the same call.
for case in ${SWEEPS:-"flash-ep8:1"}; do
  shape=${case%:*}; shared=${case#*:}
  peer=${PEER_FILE:-$work/torch-$shape-shared$shared.json}  # PEER_FILE: a peer measured in an earlier call
  [ -n "${PEER_FILE:-}" ] || timeout 100 python3 bench/peers/torch_moe.py --shape "$shape" --shared "$shared" \
    --tokens ${SWEEP_T:-1,8,64,512,4096,8192} --iters 20 --out "$peer" 2>&1 | tail -2
  timeout ${SWEEP_TIMEOUT:-200} node dist/cli/main.js bench --impl fused,unfused --configs --shape "$shape" --shared "$shared" \
    --tokens ${SWEEP_T:-1,8,64,512,4096,8192} --iters 20 --peer "$peer" \
    --out "$work/layers-$shape-shared$shared.json" --plot "$work/layers-$shape-shared$shared.svg" 2>&1 \
    | grep -vE "^[├┌└]" | grep -E "fused|floor|T=|written" | cut -c1-160 | tail -${SWEEP_LINES:-40}
done
# Where the time goes: per-CTA timelines of the fused kernel.
[ -n "${TRACE_T:-}" ] && timeout 120 node dist-test/scripts/gpu-fused-trace.js "${TRACE_SHAPE:-flash-ep8}" "$TRACE_T" 2>&1 | tee "$work/trace.txt" | tail -80
true
