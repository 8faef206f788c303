#!/usr/bin/env bash
# The GPU work this repository still owes, in calls that fit the device tool's 600 s limit. Results go
# straight to $OUT (a killed command keeps what it wrote). Run after `npm run build && npx tsc -p
# tsconfig.json && bash ../shared/gpu-host/bundle.sh`, with carry [".gpuhost", "dist", "dist-test",
# ".fixtures"]:
#   PART=1  every GPU test: pipelines (fused current version vs unfused, bit-equality), gate, norm,
#           the prepared input; then the fused kernel's per-CTA timeline          (~4 min)
#   PART=12 the pipeline tests, then (if they pass) the timeline and PART=2       (~9 min)
#   PART=13 PART=12, then the decode-step benchmark and the flash sweeps
#   (pass MEGAMOE_COMMIT: the device's copy has no current git history)
#   PART=14 tests, timeline, decode step, sanitizers and the pro sweeps (with ARCHIVE=1)
#   PART=15 every GPU test file, the timeline, the flash-ep8 sweeps (with ARCHIVE=1)
#   PART=16 the pipeline tests, the timeline, flash-ep8 shared off at three T (with ARCHIVE=1)
#   ARCHIVE=1 returns everything as $OUT/all.tgz
#   PART=2  flash-ep8 sweeps, shared expert on and off, fused (every block M) + unfused + torch  (~8 min)
#   PART=3  flash sweeps on/off + the decode-step benchmark                        (~8 min)
#   PART=4  pro sweeps on/off                                                      (~8 min)
#   PART=5  compute-sanitizer memcheck, racecheck and synccheck on a small fused run  (~3 min)
set -uo pipefail
source .gpuhost/activate
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export MEGAMOE_CACHE_DIR=/tmp/megamoe-jit PYTHONUNBUFFERED=1 MEGAMOE_REQUIRE_GPU=1
T=1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192

sweep() {  # shape shared
  timeout 120 python3 bench/peers/torch_moe.py --shape "$1" --shared "$2" --tokens $T --iters 20 \
    --out "$out/torch-$1-shared$2.json" 2>&1 | tail -1
  timeout 200 node dist/cli/main.js bench --impl fused,unfused --configs --shape "$1" --shared "$2" --tokens $T \
    --iters 20 --peer "$out/torch-$1-shared$2.json" --out "$out/layers-$1-shared$2.json" \
    --plot "$out/layers-$1-shared$2.svg" 2>&1 | grep -vE "^[├┌└]" | grep -E "fused|floor|T=|written" | cut -c1-170
}

# ARCHIVE=1: everything the part writes comes back as $OUT/all.tgz (the device tool returns 8 files).
if [ -n "${ARCHIVE:-}" ] && [ -z "${INNER:-}" ]; then
  mkdir -p "$out/all"
  INNER=1 OUT="$out/all" timeout "${ARCHIVE_TIMEOUT:-540}" bash "$0"; rc=$?
  tar czf "$out/all.tgz" -C "$out/all" . && rm -rf "$out/all"
  exit $rc
fi

case "${PART:-1}" in
16)  # a kernel change on a small budget: the pipeline tests, the timeline, flash-ep8 at three T (ARCHIVE=1)
  timeout 120 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-pipelines.txt" 2>&1
  echo "pipelines rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-pipelines.txt" | head -20
  grep -q "^ℹ fail 0" "$out/test-pipelines.txt" || exit 1
  timeout 45 node dist-test/scripts/gpu-fused-trace.js flash-ep8 8192 >"$out/trace.txt" 2>&1
  grep -E "forward|epilogueNs|publishNs|mathDone|producerDone" "$out/trace.txt"
  timeout 90 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 \
    --tokens 64,512,8192 --iters 20 --out "$out/layers-flash-ep8-shared0.json" 2>&1 \
    | grep -vE "^[├┌└]" | grep -E "fused|floor" | cut -c1-120
  ;;
15)  # every GPU test file, the timeline, the flash-ep8 sweeps (ARCHIVE=1)
  timeout 330 node --test --test-reporter=spec $(find dist-test/test/gpu -name '*.test.js' | sort) \
    >"$out/test-gpu-all.txt" 2>&1
  echo "all GPU tests rc=$?"; grep -E "^ℹ (tests|pass|fail|skipped)|✖" "$out/test-gpu-all.txt" | head -20
  grep -q "^ℹ fail 0" "$out/test-gpu-all.txt" || exit 1
  timeout 60 node dist-test/scripts/gpu-fused-trace.js flash-ep8 1,64,512,8192 >"$out/trace.txt" 2>&1
  cat "$out/trace.txt"
  sweep flash-ep8 0; sweep flash-ep8 1
  ;;
14)  # PART=12's tests and timeline, the decode-step benchmark, the sanitizers, the pro sweeps (ARCHIVE=1)
  timeout 200 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-pipelines.txt" 2>&1
  echo "pipelines rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-pipelines.txt" | head -20
  grep -q "^ℹ fail 0" "$out/test-pipelines.txt" || exit 1
  timeout 60 node dist-test/scripts/gpu-fused-trace.js flash-ep8 1,64,512,8192 >"$out/trace.txt" 2>&1
  grep -E "forward|combineStart|^  end|placed" "$out/trace.txt"
  timeout 150 node dist/cli/main.js bench --impl step --shape flash-ep8 --layers 8 --tokens 8,32,128,256 --iters 20 \
    --out "$out/step-flash-ep8.json" 2>&1 | grep -vE "^[├┌└]" | tail -14
  PART=5 bash "$0"
  sweep pro 1; sweep pro 0
  ;;
1)
  timeout 240 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-pipelines.txt" 2>&1
  echo "pipelines rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-pipelines.txt" | head -20
  timeout 150 node --test --test-reporter=spec dist-test/test/gpu/gate.test.js dist-test/test/gpu/norm.test.js \
    dist-test/test/gpu/prepared-input.test.js >"$out/test-gate-norm-prepared.txt" 2>&1
  echo "gate/norm/prepared rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-gate-norm-prepared.txt" | head -20
  timeout 90 node dist-test/scripts/gpu-fused-trace.js flash-ep8 1,64,512,8192 >"$out/trace.txt" 2>&1
  tail -70 "$out/trace.txt"
  ;;
2) sweep flash-ep8 1; sweep flash-ep8 0 ;;
12)  # the pipeline tests on a new kernel version, then (only if they pass) its timeline and PART=2
  timeout 200 node --test --test-reporter=spec dist-test/test/gpu/unfused.test.js >"$out/test-pipelines.txt" 2>&1
  echo "pipelines rc=$?"; grep -E "^ℹ (tests|pass|fail)|✖" "$out/test-pipelines.txt" | head -20
  grep -q "^ℹ fail 0" "$out/test-pipelines.txt" || exit 1
  timeout 60 node dist-test/scripts/gpu-fused-trace.js flash-ep8 1,64,512,8192 >"$out/trace.txt" 2>&1
  grep -E "forward|combineStart|^  end|placed" "$out/trace.txt"
  sweep flash-ep8 1; sweep flash-ep8 0
  ;;
13)  # PART=12, then the decode-step benchmark and the flash sweeps
  PART=12 bash "$0" || exit 1
  timeout 150 node dist/cli/main.js bench --impl step --shape flash-ep8 --layers 8 --tokens 8,32,128,256 --iters 20 \
    --out "$out/step-flash-ep8.json" 2>&1 | grep -vE "^[├┌└]" | tail -14
  sweep flash 1; sweep flash 0
  ;;
3)
  sweep flash 1; sweep flash 0
  timeout 150 node dist/cli/main.js bench --impl step --shape flash-ep8 --layers 8 --tokens 8,32,128,256 --iters 20 \
    --out "$out/step-flash-ep8.json" 2>&1 | grep -vE "^[├┌└]" | tail -14
  ;;
4) sweep pro 1; sweep pro 0 ;;
5)
  for tool in memcheck racecheck synccheck; do
    MEGAMOE_JIT_LINEINFO=1 timeout 180 compute-sanitizer --tool $tool --print-limit 20 node dist-test/scripts/gpu-fused-small.js \
      >"$out/sanitizer-$tool.txt" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|tiny T=|Error" "$out/sanitizer-$tool.txt" | head -8
  done
  ;;
esac
