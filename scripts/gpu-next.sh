#!/usr/bin/env bash
# The GPU work this repository still owes, in calls that fit the device tool's 600 s limit. Results go
# straight to $OUT (a killed command keeps what it wrote). Run after `npm run build && npx tsc -p
# tsconfig.json && bash ../shared/gpu-host/bundle.sh`, with carry [".gpuhost", "dist", "dist-test",
# ".fixtures"]:
#   PART=1  the pipeline tests (fused vs unfused, bit-equality), gate, norm, the prepared input; then the
#           fused kernel's per-CTA timeline                                          (~4 min)
#   PART=2  flash-ep8 sweeps, shared expert on and off, fused (every block M) + unfused + torch
#   PART=3  flash sweeps on/off + the decode-step benchmark
#   PART=4  pro sweeps on/off
#   PART=5  compute-sanitizer memcheck, racecheck and synccheck on a small fused run  (~3 min)
#   PART=12 the pipeline tests, then (if they pass) the timeline and PART=2
#   PART=13 PART=12, then the decode-step benchmark and the flash sweeps
#   PART=14 the pipeline tests, timeline, decode step, sanitizers and the pro sweeps (with ARCHIVE=1)
#   PART=15 every GPU test file, the timeline, the flash-ep8 sweeps (with ARCHIVE=1)
#   PART=16 the pipeline tests, the timeline, flash-ep8 shared off at three T (with ARCHIVE=1)
#   PART=17 the pipeline, gate and norm tests, the fused kernel's SASS, the timeline at three T,
#           flash-ep8 shared off at six T (with ARCHIVE=1)
#   PART=18 every GPU test file, the sanitizers, the timeline at four T, the decode step (with ARCHIVE=1)
#   PART=19 every GPU test file, racecheck, the grouped GEMM against torch, flash-ep8 shared off at every
#           T in 4 interleaved rounds, the timeline, memcheck and synccheck (ARCHIVE=1; a smaller call:
#           SWEEP_T, TRACE_T token lists, SKIP_SANITIZERS=1 leaves out memcheck and synccheck)
#   PART=20 the pipeline tests, the timeline at T = 1 and 8192, flash-ep8 at three T in 2 rounds (ARCHIVE=1)
#   PART=21 the TMA weight-stream probe (layouts, CTA counts, boxes, ring depths), then PART=20 (ARCHIVE=1)
#   PART=22 Nsight Compute on the fused kernel (T = 1, 64, 4096) and the unfused pipeline's GEMMs (T = 4096)
#   PART=23 the pipeline tests, the timeline at T = 1 and 64, flash-ep8 at five T in 2 rounds, and the fused
#           kernel's stall reasons at T = 4096 (Nsight Compute) (ARCHIVE=1)
#   PART=24 the gate, norm and prepared-input tests, the gate's two logits paths timed, the decode step
#   PART=25 PART=24, then the sanitizers (PART=5) (ARCHIVE=1)
#   PART=26 the pipeline tests, the timeline at T = 1 and 8192, flash-ep8 shared off at six T in 2 rounds,
#           the gate timed (ARCHIVE=1)
#   PART=27 the pipeline tests (240 s), then the flash-ep8 sweep, shared off, every T, with the torch peer
#   PART=28 the flash sweep, shared off, every T, with the torch peer (ARCHIVE=1)
#   PART=29 the pipeline tests (240 s), the timeline at T = 1 and 8192, flash-ep8 and flash at a few T in 2 rounds
#   PART=30 A/B of the fused kernel's switches (AB_VARIANTS: MEGAMOE_JIT_DEFINES values separated by spaces,
#           "-" for none): each variant's bit-equality check, then its timeline on flash-ep8 and flash in
#           two rounds, and the SASS of the default BLOCK_M 128 build (ARCHIVE=1)
#   PART=31 one sweep with the torch peer: SWEEP_SHAPE (default pro), SWEEP_SHARED (default 0) (ARCHIVE=1)
#   PART=32 the sanitizers (PART=5), then the pipeline tests (240 s) (ARCHIVE=1)
#   PART=33 the shared-expert-on sweeps with the torch peer: pro, flash-ep8, flash (ARCHIVE=1)
#   PART=34 Nsight Compute's per-instruction stall samples (SASS) of the fused kernel at flash-ep8 T = 4096 and
#           of the grouped GEMM (the unfused pipeline's, T = 4096), as CSV (ARCHIVE=1)
#   PART=35 the grouped GEMM's tests, then every tile timed per variant (AB_VARIANTS as in PART=30, default
#           "- GEMM_PIPELINED_PROMOTION=0") in two rounds, beside torch._scaled_grouped_mm (ARCHIVE=1)
#   PART=36 every GPU test file (300 s), the grouped GEMM against torch, pro unfused at small T (ARCHIVE=1)
#   PART=37 the tensor cores' rate in the mainloops' wgmma shapes (probe_wgmma_n128/256), twice (ARCHIVE=1)
#   PART=39 the fused kernel without its tensor work (MEGAMOE_DIAG_SKIP_MMA=1) against the kernel, flash-ep8 and
#           flash at decode and mid T in 2 rounds each, with the timeline at flash-ep8 T = 64; then the grouped
#           GEMM against torch._scaled_grouped_mm in 3 alternating rounds (ARCHIVE=1)
#   PART=40 the grouped GEMM's plan against torch._scaled_grouped_mm in 2 alternating rounds, each case on
#           quantized-looking and on uniformly random codes; the GEMM without its tensor work; the fused
#           kernel's timeline at flash-ep8 T = 4096 with and without it; the wgmma-rate probe (ARCHIVE=1)
#   PART=41 swap-AB: the small bit-equality check on every block M, the pipeline tests (240 s), then the
#           fused kernel's every block M at decode and mid T on flash-ep8 and flash in 2 rounds (ARCHIVE=1)
#   PART=42 compute-sanitizer memcheck on the small run's swap-AB block Ms, the grouped GEMM's plan on both
#           code distributions beside torch, then racecheck and synccheck on them (ARCHIVE=1)
#   PART=43 the flash-ep8 sweeps, shared expert off and on, with the torch peer (ARCHIVE=1)
#   PART=44 why large-T timings move: the fused kernel at flash-ep8 T = 4096 in 4 rounds while nvidia-smi logs
#           the SM clock, power and throttle reasons every 100 ms (ARCHIVE=1)
#   PART=45 every GPU test file, then the flash and pro sweeps, shared expert off and on (ARCHIVE=1)
#   PART=46 the grouped GEMM and torch._scaled_grouped_mm while nvidia-smi logs the SM clock and power every
#           50 ms, each phase's start and end marked in $OUT/phases.txt (ARCHIVE=1)
#   PART=47 the grouped GEMM and torch._scaled_grouped_mm one kernel at a time under Nsight Compute (each
#           kernel alone, the two at the same clock): duration and SM clock per launch, as CSV (ARCHIVE=1)
#   PART=48 the B-multicast cluster tile (m128n256x2, reverted: it lives on the local branch exp-cluster-multicast,
#           where these two parts run): the grouped GEMM's tests on every tile, m128n256 and
#           m128n256x2 beside torch._scaled_grouped_mm in 2 alternating rounds, both at M = 4096 under Nsight
#           Compute (equal clocks), then memcheck, racecheck and synccheck on the cluster tile's tiny cases
#           (ARCHIVE=1)
#   PART=49 A/B of the cluster tile's switches (AB_VARIANTS as in PART=30, default: none, release.cluster
#           arrives, no multicast): m128n256 and m128n256x2 at M = 512 and 4096 per variant in two rounds, then
#           the warps' stall reasons of each tile at flash L1 M = 4096 (Nsight Compute) (ARCHIVE=1)
#   PART=50 the grouped GEMM's tests with each of AB_VARIANTS (as in PART=30; default: none, TMA-store epilogue),
#           then A/B of them (plus no epilogue) on GEMM_TILES (default m128n256) at M = 512 and 4096 in two
#           rounds, torch's beside each (ARCHIVE=1). It ran at 74f39d2 (direct epilogue, no epilogue, no tensor
#           work) and 1e088f9 (per-box TMA epilogue); both epilogue switches were removed after.
#   PART=51 the grouped GEMM with its CTAs' start staggered (GEMM_STAGGER_NS) against the plain kernel and the
#           kernel without its epilogue, M = 512 and 4096, two rounds, torch's beside each (ARCHIVE=1; ran at
#           6ed0880: the stagger and the per-box TMA switch were removed after it)
#   PART=52 the grouped GEMM's tests (both epilogues), then the plan's tile with the staged and the TMA epilogue
#           at M = 64, 512 and 4096 in two rounds, torch's beside each (ARCHIVE=1; the whole-tile TMA epilogue
#           is on the local branch exp-epilogue-tma, f580567, where this part ran)
#   PART=53 the expert-parallel layer's GPU test (ranks on one device, both pipelines, against the CPU)
#   PART=54 PART=53 and the weight generator's GPU test, then `megamoe check --ranks 8` on flash (every
#           rank on the GPU, weights made there) and on tiny
#   PART=55–59 ran at the commits their results name, where their switches existed (since removed: run
#           that commit's script to repeat one):
#   PART=55 A from registers (GEMM_A_FROM_REGISTERS=1, 418f3ac): the grouped GEMM's tests with it, then m128n256
#           and m64n256 with and without it beside torch._scaled_grouped_mm in 2 rounds (ARCHIVE=1)
#   PART=56 how the two math warpgroups keep pace (GEMM_WG_SCHEDULE 1, 2, and 2 with A from registers; 660d02c): the
#           grouped GEMM's tests with each, then each beside the plain kernel and torch in 2 rounds (ARCHIVE=1)
#   PART=57 where the m128n256 mainloop's time goes, with turns (GEMM_WG_SCHEDULE=2, d59fea4): the loads from fixed
#           tiles (GEMM_DIAG_FIXED_TILES: 1 A, 2 B, 3 both; L2 hits only), without the epilogue, beside
#           the plain kernel and torch in 2 rounds (ARCHIVE=1)
#   PART=58 the epilogue, with turns (5cb2988): staged but not stored (GEMM_DIAG_SKIP_EPILOGUE=2), not at all (=1), stored
#           streaming (GEMM_STORE_STREAMING=1, tested first), beside the plain kernel and torch in 2 rounds (ARCHIVE=1)
#   PART=59 warpgroup 1 lagging warpgroup 0 (GEMM_WG_SCHEDULE=3, GEMM_WG_LAG 1, 2, 3, abd902f; tested first) against
#           turns (GEMM_WG_SCHEDULE=2) and the plain kernel, beside torch in 2 rounds (ARCHIVE=1)
#   PART=60 turns by default: every GPU test file, the plan's grouped GEMM with and without turns
#           (GEMM_WG_TURNS=0) beside torch in 2 rounds, `bench --impl grouped-gemm --peer`, and the flash
#           unfused pipeline at large T beside the torch peer (ARCHIVE=1)
#   PART=61 turns (the default) against none (GEMM_WG_TURNS=0) in 3 rounds of rotated order; SASS of
#           diag/*.cubin if present (ARCHIVE=1). At 1c4cfbb it also timed GEMM_WG_TURNS=2 (turns on every tile,
#           one K loop: the default since) against that commit's default (turns where both warpgroups have rows)
#   PART=62 compute-sanitizer memcheck, racecheck and synccheck on the grouped GEMM's small test cases (every
#           tile; the turns' named barriers, partial tiles) (ARCHIVE=1)
#   PART=63 the grouped GEMM's plan and torch._scaled_grouped_mm in 4 alternating rounds at M = 512 and 4096
#           per group (the large-M ratio through the clock's spread) (ARCHIVE=1)
#   PART=64 tile order in panels of GEMM_PANEL_M m-blocks (8, 16; at e4823c5, removed since): the grouped GEMM's tests with 8, then each
#           beside the plain order and torch at M = 2048 and 4096 per group in 2 rounds (ARCHIVE=1)
#   PART=65 the deferred epilogue: the grouped-GEMM tests with it (the default), then 4 rounds of torch,
#           deferred and not (GEMM_DEFERRED_EPILOGUE=0), rotated, at the plan's tiles, M = 64, 512, 4096; the
#           first two rounds also time no epilogue at all (GEMM_DIAG_SKIP_EPILOGUE=1); the unfused tests with it,
#           and flash unfused at T = 2048, 8192 with and without it (ARCHIVE=1)
#   PART=66 PART=47 again at M = 512 and 4096 per group, with and without the deferred epilogue: each kernel's
#           duration and SM clock under Nsight Compute (--clock-control none) (ARCHIVE=1)
#   PART=67 fewer CTAs under the power cap: the plan's grouped GEMM on 132, 124 and 116 CTAs (GEMM_MAX_CTAS)
#           beside torch, 3 rounds, M = 512 and 4096 per group (ARCHIVE=1)
#   PART=68 a version's check: every GPU test file, the sanitizers on the grouped GEMM's small cases, `bench --impl
#           grouped-gemm --peer` and flash unfused beside the torch peer (ARCHIVE=1)
#   PART=69 the grouped-GEMM and unfused tests
#   PART=71 the grouped GEMM on the torch peer's data (GEMM_CODES=gaussian) and on the default codes, beside
#           torch, 2 rounds, M = 512 and 4096 per group (ARCHIVE=1)
#   PART=72 sustained clocks: torch._scaled_grouped_mm, the plan's grouped GEMM and, where the ignored folder mc/
#           holds another build (package.json, src/include, src/kernels, dist-test), that build's plan, in 3
#           rounds of rotated order at M = 512 and 4096 per group, each case after WARMUP_MS (default 1500) of
#           untimed runs, while nvidia-smi logs the SM clock and power every 20 ms; then each row's clock and
#           power in its timed window (scripts/clock-windows.py). mc's grouped-GEMM tests run first (ARCHIVE=1).
#           SUSTAINED_IMPLS instead picks the list: torch, ours, ours:DEFINES (a MEGAMOE_JIT_DEFINES value), mc;
#           TORCH_ARGS adds arguments to the torch peer's runs (e.g. --blockwise); ROUNDS (default 3) and ITERS
#           (timed runs per case, default 100); WARMUP_MS=0 ITERS=20 is the usual benchmark's protocol
#   PART=73 the expert-parallel GPU test (PART=53), then `bench --impl grouped-gemm` beside the torch peer with
#           --blockwise (PyTorch's block-scaled GEMM beside its rowwise grouped GEMM), first as usual, then
#           sustained (--warmup-ms 1000 --iters 100 both), while nvidia-smi logs the clock and power (ARCHIVE=1)
# ARCHIVE=1 returns everything as $OUT/all.tgz (ARCHIVE_TIMEOUT: seconds for the part, default 540).
# Pass MEGAMOE_COMMIT: the device's copy of the tree has no current git history.
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

gpu_tests() {  # seconds report test files...: runs them into $out/<report>, prints the summary
  local seconds=$1 report=$2
  shift 2
  timeout "$seconds" node --test --test-reporter=spec "$@" >"$out/$report" 2>&1
  echo "$report rc=$?"; grep -E "^ℹ (tests|pass|fail|skipped)|✖" "$out/$report" | head -20
}

passed() { grep -q "^ℹ fail 0" "$out/$1"; }  # report

sanitizer() {  # tool: compute-sanitizer on a small fused run, into $out/sanitizer-<tool>.txt
  MEGAMOE_JIT_LINEINFO=1 timeout 180 compute-sanitizer --tool "$1" --print-limit 20 node dist-test/scripts/gpu-fused-small.js \
    >"$out/sanitizer-$1.txt" 2>&1
  echo "$1 rc=$?"; grep -E "ERROR SUMMARY|tiny T=|Error" "$out/sanitizer-$1.txt" | head -8
}

pipeline_tests() { gpu_tests "$1" test-pipelines.txt dist-test/test/gpu/unfused.test.js; }  # seconds

torch_gemm() {  # report [lines]: torch._scaled_grouped_mm alone on the flash expert shapes, into $out/<report>
  timeout 90 python3 bench/peers/torch_moe.py --grouped-gemm-only --out "$out/$1" 2>&1 | tail -"${2:-1}"
}

gemm_tiles() {  # name [seconds]: scripts/gpu-gemm-bench.ts into $out/<name>.json and .txt, printed (the caller's
  # GEMM_TILES, GEMM_CODES and MEGAMOE_JIT_DEFINES apply)
  timeout "${2:-150}" node dist-test/scripts/gpu-gemm-bench.js "$out/$1.json" >"$out/$1.txt" 2>&1
  echo "$1 rc=$?"; cat "$out/$1.txt"
}

gemm_sanitizers() {  # seconds: memcheck, racecheck and synccheck on the grouped GEMM's small test cases
  for tool in memcheck racecheck synccheck; do
    for c in tiny "empty groups"; do
      tag=${c// /-}
      MEGAMOE_GEMM_CASE=$c MEGAMOE_JIT_LINEINFO=1 timeout "$1" compute-sanitizer --tool $tool --print-limit 20 \
        node --test dist-test/test/gpu/grouped-gemm.test.js >"$out/sanitizer-gemm-$tool-$tag.txt" 2>&1
      echo "$tool $c rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^ℹ (pass|fail)" "$out/sanitizer-gemm-$tool-$tag.txt" | head -4
    done
  done
}

cli_rows() {  # torch report: `bench --impl grouped-gemm` beside $out/<report>, then flash unfused beside the torch peer
  timeout 120 node dist/cli/main.js bench --impl grouped-gemm --peer "$out/$1" \
    --out "$out/grouped-gemm.json" 2>&1 | grep -vE "^[├┌└]" | cut -c1-150
  timeout 120 python3 bench/peers/torch_moe.py --shape flash --shared 0 --tokens 512,2048,8192 --iters 20 \
    --out "$out/torch-flash-shared0.json" 2>&1 | tail -1
  timeout 150 node dist/cli/main.js bench --impl unfused --shape flash --shared 0 --tokens 512,2048,8192 --iters 20 \
    --rounds 2 --peer "$out/torch-flash-shared0.json" --out "$out/layers-flash-shared0-unfused.json" 2>&1 \
    | grep -vE "^[├┌└]" | grep -E "unfused|floor" | cut -c1-150
}

clock_log() {  # in the background: the SM clock, power and temperature every 20 ms into $out/smi.csv (the
  # caller kills $!; scripts/clock-windows.py reads it)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 20 \
    >"$out/smi.csv" 2>&1 &
}

fused_trace() {  # seconds tokens: the fused kernel's per-CTA timeline on flash-ep8, into $out/trace.txt
  timeout "$1" node dist-test/scripts/gpu-fused-trace.js flash-ep8 "$2" >"$out/trace.txt" 2>&1
}

step_bench() {
  timeout 150 node dist/cli/main.js bench --impl step --shape flash-ep8 --layers 8 --tokens 8,32,128,256 --iters 20 \
    --out "$out/step-flash-ep8.json" 2>&1 | grep -vE "^[├┌└]" | tail -14
}

# ARCHIVE=1: everything the part writes comes back as $OUT/all.tgz (the device tool returns 8 files).
if [ -n "${ARCHIVE:-}" ] && [ -z "${INNER:-}" ]; then
  mkdir -p "$out/all"
  INNER=1 OUT="$out/all" timeout "${ARCHIVE_TIMEOUT:-540}" bash "$0"; rc=$?
  tar czf "$out/all.tgz" -C "$out/all" . && rm -rf "$out/all"
  exit $rc
fi

case "${PART:-1}" in
1)
  pipeline_tests 240
  gpu_tests 150 test-gate-norm-prepared.txt dist-test/test/gpu/gate.test.js dist-test/test/gpu/norm.test.js \
    dist-test/test/gpu/prepared-input.test.js
  fused_trace 90 1,64,512,8192
  tail -70 "$out/trace.txt"
  ;;
2) sweep flash-ep8 1; sweep flash-ep8 0 ;;
3) sweep flash 1; sweep flash 0; step_bench ;;
4) sweep pro 1; sweep pro 0 ;;
5) sanitizer memcheck; sanitizer racecheck; sanitizer synccheck ;;
12)  # the pipeline tests on a new kernel version, then (only if they pass) its timeline and PART=2
  pipeline_tests 200; passed test-pipelines.txt || exit 1
  fused_trace 60 1,64,512,8192
  grep -E "forward|combineStart|^  end|placed" "$out/trace.txt"
  sweep flash-ep8 1; sweep flash-ep8 0
  ;;
13)  # PART=12, then the decode-step benchmark and the flash sweeps
  PART=12 bash "$0" || exit 1
  step_bench
  sweep flash 1; sweep flash 0
  ;;
14)  # PART=12's tests and timeline, the decode-step benchmark, the sanitizers, the pro sweeps (ARCHIVE=1)
  pipeline_tests 200; passed test-pipelines.txt || exit 1
  fused_trace 60 1,64,512,8192
  grep -E "forward|combineStart|^  end|placed" "$out/trace.txt"
  step_bench
  PART=5 bash "$0"
  sweep pro 1; sweep pro 0
  ;;
15)  # every GPU test file, the timeline, the flash-ep8 sweeps (ARCHIVE=1)
  gpu_tests 330 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  passed test-gpu-all.txt || exit 1
  fused_trace 60 1,64,512,8192
  cat "$out/trace.txt"
  sweep flash-ep8 0; sweep flash-ep8 1
  ;;
16)  # a kernel change on a small budget: the pipeline tests, the timeline, flash-ep8 at three T (ARCHIVE=1)
  pipeline_tests 120; passed test-pipelines.txt || exit 1
  fused_trace 45 8192
  grep -E "forward|epilogueNs|publishNs|mathDone|producerDone" "$out/trace.txt"
  timeout 90 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 \
    --tokens 64,512,8192 --iters 20 --out "$out/layers-flash-ep8-shared0.json" 2>&1 \
    | grep -vE "^[├┌└]" | grep -E "fused|floor" | cut -c1-120
  ;;
17)  # a kernel change: its tests, its SASS (nvcc + cuobjdump), the timeline, flash-ep8 at six T (ARCHIVE=1)
  gpu_tests 200 test-pipelines.txt dist-test/test/gpu/unfused.test.js dist-test/test/gpu/gate.test.js \
    dist-test/test/gpu/norm.test.js dist-test/test/gpu/prepared-input.test.js
  passed test-pipelines.txt || exit 1
  for bm in 64 128; do
    nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -cubin -Isrc/include -DHIDDEN=4096 -DINTER=2048 \
      -DSHARED_INTER=2048 -DNUM_EXPERTS=32 -DTOP_K=6 -DBLOCK_M=$bm -DNUM_STAGES=4 -o "$out/fused-$bm.cubin" \
      src/kernels/megamoe/megamoe.cu && cuobjdump -sass "$out/fused-$bm.cubin" >"$out/fused-$bm.sass"
    rm -f "$out/fused-$bm.cubin"
  done
  fused_trace 60 1,64,8192
  grep -E "forward|epilogueNs|publishNs|mathDone|producerDone|stageFull" "$out/trace.txt"
  timeout 150 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 \
    --tokens 1,8,64,512,4096,8192 --iters 20 --out "$out/layers-flash-ep8-shared0.json" 2>&1 \
    | grep -vE "^[├┌└]" | grep -E "fused|floor" | cut -c1-120
  ;;
18)  # a version's checks: every GPU test file, the sanitizers, the timeline, the decode step (ARCHIVE=1)
  gpu_tests 200 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  passed test-gpu-all.txt || exit 1
  PART=5 bash "$0"
  fused_trace 60 1,64,512,8192
  grep -E "forward|epilogueNs|publishNs|mathDone" "$out/trace.txt"
  step_bench
  ;;
19)  # a session's last call (ARCHIVE=1): every GPU test file, racecheck, the grouped GEMM against torch,
     # flash-ep8 shared off at every T in 4 interleaved rounds, the timeline, memcheck and synccheck
  gpu_tests 200 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  sanitizer racecheck
  torch_gemm "torch-grouped-gemm.json" 3
  timeout 120 node dist/cli/main.js bench --impl grouped-gemm --peer "$out/torch-grouped-gemm.json" \
    --out "$out/grouped-gemm.json" 2>&1 | grep -vE "^[├┌└]" | cut -c1-150
  timeout 200 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 --tokens "${SWEEP_T:-$T}" \
    --iters 20 --rounds 4 --out "$out/layers-flash-ep8-shared0.json" --plot "$out/layers-flash-ep8-shared0.svg" 2>&1 \
    | grep -vE "^[├┌└]" | grep -E "fused|floor" | grep -v eager | cut -c1-120
  fused_trace 60 "${TRACE_T:-1,64,512,8192}"
  grep -E "forward|epilogueNs|publishNs|mathDone" "$out/trace.txt"
  [ -n "${SKIP_SANITIZERS:-}" ] || { sanitizer memcheck; sanitizer synccheck; }
  ;;
20)  # a small check of a version: the pipeline tests, its timeline, a short sweep in rounds (ARCHIVE=1)
  pipeline_tests 120
  fused_trace 45 1,8192
  grep -E "forward|l1EndLast|l2ReadyFirst|l2EndFirst|mathDone" "$out/trace.txt"
  timeout 90 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 --tokens 1,64,4096 --iters 20 \
    --rounds 2 --out "$out/layers-flash-ep8-shared0.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "fused|floor" | cut -c1-120
  ;;
22)  # Nsight Compute (hardware counters; clocks left alone): one launch per case, text reports in $out
  for case in "fused 1 megamoe_fused 1" "fused 64 megamoe_fused 1" "fused 4096 megamoe_fused 1" \
    "unfused 4096 megamoe_fp8_grouped_gemm 2"; do
    set -- $case
    timeout 150 ncu --clock-control none -k "$3" --launch-count "$4" --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section LaunchStats --metrics \
      sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,dram__bytes_read.sum.per_second \
      node dist/cli/main.js bench --impl "$1" --shape flash-ep8 --shared 0 --tokens "$2" --iters 20 \
      >"$out/ncu-$1-T$2.txt" 2>&1
    echo "ncu $1 T=$2 rc=$?"
    grep -E "gmma|Duration|Throughput|Busy|lts__t_bytes|dram__bytes|Stall|Issued Warp|No Eligible|Registers" "$out/ncu-$1-T$2.txt" | head -40
  done
  ;;
24)  # the router: its tests (both logits paths), both paths timed alone, the decode step that uses it
  gpu_tests 240 test-gate-norm-prepared.txt dist-test/test/gpu/gate.test.js dist-test/test/gpu/norm.test.js \
    dist-test/test/gpu/prepared-input.test.js
  grep -E "exact.*max weight|fast.*max weight" "$out/test-gate-norm-prepared.txt" | sort -t' ' -k1,1 | head -40
  timeout 120 node dist-test/scripts/gpu-gate-bench.js --out "$out/gate.json" 2>&1 | tee "$out/gate.txt"
  step_bench
  ;;
25) PART=24 bash "$0"; PART=5 bash "$0" ;;
30)
  variants=${AB_VARIANTS:-"-"}
  for v in $variants; do
    tag=${v//[^A-Za-z0-9]/_}
    MEGAMOE_JIT_DEFINES=${v#-} timeout 90 node dist-test/scripts/gpu-fused-small.js >"$out/small-$tag.txt" 2>&1
    echo "small $v rc=$?"; tail -3 "$out/small-$tag.txt"
  done
  nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -cubin -Isrc/include -DHIDDEN=4096 -DINTER=2048 \
    -DSHARED_INTER=2048 -DNUM_EXPERTS=32 -DTOP_K=6 -DBLOCK_M=128 -DNUM_STAGES=4 -o "$out/fused-128.cubin" \
    src/kernels/megamoe/megamoe.cu && cuobjdump -sass "$out/fused-128.cubin" >"$out/fused-128.sass"
  rm -f "$out/fused-128.cubin"
  for round in 1 2; do
    for v in $variants; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} timeout 60 node dist-test/scripts/gpu-fused-trace.js flash-ep8 "${AB_T:-1,64,512,4096}" \
        >"$out/ab-flash-ep8-$tag-$round.txt" 2>&1
      echo "flash-ep8 $v round $round"; grep -E "forward|publishNs|stageEmptyWaitNs|epilogueNs" "$out/ab-flash-ep8-$tag-$round.txt"
    done
  done
  for v in $variants; do
    tag=${v//[^A-Za-z0-9]/_}
    MEGAMOE_JIT_DEFINES=${v#-} timeout 90 node dist-test/scripts/gpu-fused-trace.js flash "${AB_FLASH_T:-128,1024}" \
      >"$out/ab-flash-$tag.txt" 2>&1
    echo "flash $v"; grep -E "forward|publishNs|stageEmptyWaitNs|epilogueNs" "$out/ab-flash-$tag.txt"
  done
  ;;
27) pipeline_tests 240; sweep flash-ep8 0 ;;
31) sweep "${SWEEP_SHAPE:-pro}" "${SWEEP_SHARED:-0}" ;;
32) PART=5 bash "$0"; pipeline_tests 240 ;;
33) sweep pro 1; sweep flash-ep8 1; sweep flash 1 ;;
35)
  gpu_tests 200 test-grouped-gemm.txt dist-test/test/gpu/grouped-gemm.test.js
  torch_gemm "torch-grouped-gemm.json" 8
  for round in 1 2; do
    for v in ${AB_VARIANTS:-- GEMM_PIPELINED_PROMOTION=0}; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} gemm_tiles "gemm-tiles-$tag-$round"
    done
  done
  ;;
36)
  gpu_tests 300 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  torch_gemm "torch-grouped-gemm.json" 3
  timeout 120 node dist/cli/main.js bench --impl grouped-gemm --peer "$out/torch-grouped-gemm.json" \
    --out "$out/grouped-gemm.json" 2>&1 | grep -vE "^[├┌└]" | cut -c1-150
  timeout 90 node dist/cli/main.js bench --impl unfused --shape pro --shared 0 --tokens 1,2,4,8,16,32,64 --iters 20 \
    --out "$out/layers-pro-unfused-small.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "unfused|floor" | cut -c1-120
  ;;
39)
  for v in - MEGAMOE_DIAG_SKIP_MMA=1; do
    tag=${v//[^A-Za-z0-9]/_}
    for shape in flash-ep8:1,8,64,256,512,4096 flash:8,64,256; do
      MEGAMOE_JIT_DEFINES=${v#-} timeout 120 node dist/cli/main.js bench --impl fused --shape "${shape%%:*}" --shared 0 \
        --tokens "${shape#*:}" --iters 20 --rounds 2 --out "$out/fused-$tag-${shape%%:*}.json" 2>&1 \
        | grep -vE "^[├┌└]" | grep -E "fused" | cut -c1-120
    done
    MEGAMOE_JIT_DEFINES=${v#-} timeout 60 node dist-test/scripts/gpu-fused-trace.js flash-ep8 64 >"$out/trace-$tag.txt" 2>&1
    echo "trace $v rc=$?"
  done
  for round in 1 2 3; do
    torch_gemm "torch-grouped-gemm-$round.json"
    timeout 120 node dist/cli/main.js bench --impl grouped-gemm --peer "$out/torch-grouped-gemm-$round.json" \
      --out "$out/grouped-gemm-$round.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "flash" | cut -c1-150
  done
  ;;
40)
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json"
    GEMM_TILES=plan GEMM_CODES=quantized,uniform-bytes gemm_tiles "gemm-codes-$round"
  done
  MEGAMOE_JIT_DEFINES=GEMM_DIAG_SKIP_MMA=1 GEMM_TILES=plan gemm_tiles gemm-skip-mma
  for v in - MEGAMOE_DIAG_SKIP_MMA=1; do
    tag=${v//[^A-Za-z0-9]/_}
    MEGAMOE_JIT_DEFINES=${v#-} timeout 90 node dist-test/scripts/gpu-fused-trace.js flash-ep8 4096 >"$out/trace-4096-$tag.txt" 2>&1
    echo "trace $v rc=$?"; cat "$out/trace-4096-$tag.txt"
  done
  timeout 60 node dist-test/scripts/gpu-wgmma-rate.js --out "$out/wgmma-rate.json" 2>&1 | tee "$out/wgmma-rate.txt"
  ;;
41)
  timeout 120 node dist-test/scripts/gpu-fused-small.js >"$out/small.txt" 2>&1
  echo "small rc=$?"; cat "$out/small.txt"
  pipeline_tests 240
  for shape in flash-ep8:1,2,4,8,16,32,64,128,256 flash:1,8,64,256,512,1024; do
    timeout 150 node dist/cli/main.js bench --impl fused --configs --shape "${shape%%:*}" --shared 0 \
      --tokens "${shape#*:}" --iters 20 --rounds 2 --out "$out/configs-${shape%%:*}.json" 2>&1 \
      | grep -vE "^[├┌└]" | grep -E "fused|T=" | cut -c1-150
  done
  ;;
42)
  export FUSED_SMALL_BLOCK_MS=16,32
  sanitizer memcheck
  torch_gemm "torch-grouped-gemm.json"
  GEMM_TILES=plan GEMM_CODES=quantized,uniform-bytes gemm_tiles gemm-codes
  sanitizer racecheck
  sanitizer synccheck
  ;;
43) sweep flash-ep8 0; sweep flash-ep8 1 ;;
44)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 100 >"$out/smi.csv" 2>&1 &
  smi=$!
  timeout 200 node dist/cli/main.js bench --impl fused --configs --shape flash-ep8 --shared 0 --tokens 2048,4096 \
    --iters 20 --rounds 4 --out "$out/rounds-flash-ep8.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "fused|T=" | cut -c1-150
  kill $smi
  echo "smi lines $(wc -l <"$out/smi.csv")"; head -3 "$out/smi.csv"
  ;;
45)
  gpu_tests 300 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  sweep flash 0; sweep flash 1; sweep pro 0; sweep pro 1
  ;;
46)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 >"$out/smi.csv" 2>&1 &
  smi=$!
  for round in 1 2; do
    echo "torch $round start $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
    torch_gemm "torch-grouped-gemm-$round.json"
    echo "torch $round end $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
    echo "ours $round start $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
    GEMM_TILES=plan gemm_tiles "gemm-$round" 120
    echo "ours $round end $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
  done
  kill $smi
  cat "$out/phases.txt"
  ;;
47)
  metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
  timeout 60 ncu --clock-control none --metrics $metrics --csv \
    python3 bench/peers/torch_moe.py --grouped-gemm-only --m-per-group 4096 --iters 20 >"$out/ncu-torch.csv" 2>"$out/ncu-torch.err"
  echo "torch rc=$? $(wc -l <"$out/ncu-torch.csv") lines"
  GEMM_TILES=plan timeout 60 ncu --clock-control none -k megamoe_fp8_grouped_gemm --metrics $metrics --csv \
    node dist-test/scripts/gpu-gemm-bench.js >"$out/ncu-ours.csv" 2>"$out/ncu-ours.err"
  echo "ours rc=$? $(wc -l <"$out/ncu-ours.csv") lines"
  ;;
48)
  gpu_tests 200 test-grouped-gemm.txt dist-test/test/gpu/grouped-gemm.test.js
  passed test-grouped-gemm.txt || { grep -A14 "✖" "$out/test-grouped-gemm.txt" | head -80; exit 1; }
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json"
    GEMM_TILES=m128n256,m128n256x2 gemm_tiles "gemm-$round" 150
  done
  metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
  timeout 60 ncu --clock-control none --metrics $metrics --csv \
    python3 bench/peers/torch_moe.py --grouped-gemm-only --m-per-group 4096 --iters 20 >"$out/ncu-torch.csv" 2>"$out/ncu-torch.err"
  echo "torch rc=$? $(wc -l <"$out/ncu-torch.csv") lines"
  GEMM_TILES=m128n256,m128n256x2 GEMM_M=4096 timeout 90 ncu --clock-control none -k megamoe_fp8_grouped_gemm \
    --metrics $metrics --csv node dist-test/scripts/gpu-gemm-bench.js >"$out/ncu-ours.csv" 2>"$out/ncu-ours.err"
  echo "ours rc=$? $(wc -l <"$out/ncu-ours.csv") lines"
  for tool in memcheck racecheck synccheck; do
    MEGAMOE_GEMM_TILES=m128n256x2 MEGAMOE_GEMM_CASE=tiny timeout 120 compute-sanitizer --tool $tool --print-limit 20 \
      node --test --test-reporter=spec dist-test/test/gpu/grouped-gemm.test.js >"$out/sanitizer-$tool.txt" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^ℹ (pass|fail)|Error" "$out/sanitizer-$tool.txt" | head -8
  done
  ;;
49)
  for round in 1 2; do
    for v in ${AB_VARIANTS:-- GEMM_CLUSTER_ARRIVE_SCOPE_CLUSTER=1 GEMM_DIAG_CLUSTER_NO_MULTICAST=1}; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256,m128n256x2 GEMM_M=512,4096 gemm_tiles "gemm-$tag-$round" 120
    done
  done
  for tile in m128n256 m128n256x2; do
    GEMM_TILES=$tile GEMM_M=4096 timeout 120 ncu --clock-control none -k megamoe_fp8_grouped_gemm --launch-skip 30 \
      --launch-count 1 --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum" \
      node dist-test/scripts/gpu-gemm-bench.js >"$out/ncu-stalls-$tile.txt" 2>&1
    echo "ncu $tile rc=$?"; grep -E "stalled|gmma|Duration|lts__t_bytes|L2 Cache Throughput|Mem.*Busy" "$out/ncu-stalls-$tile.txt" | sort -k3 -g -r | head -16
  done
  ;;
50)
  variants=${AB_VARIANTS:-- GEMM_EPILOGUE_TMA=1}
  for v in $variants; do
    tag=${v//[^A-Za-z0-9]/_}
    MEGAMOE_JIT_DEFINES=${v#-} gpu_tests 200 "test-grouped-gemm-$tag.txt" dist-test/test/gpu/grouped-gemm.test.js
  done
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in $variants GEMM_DIAG_SKIP_EPILOGUE=1; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=${GEMM_TILES:-m128n256} GEMM_M=512,4096 gemm_tiles "gemm-$tag-$round" 120
    done
  done
  ;;
51)
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - GEMM_STAGGER_NS=2000 GEMM_STAGGER_NS=8000 GEMM_STAGGER_NS=24000 GEMM_STAGGER_NS=8000,GEMM_EPILOGUE_TMA=1 GEMM_DIAG_SKIP_EPILOGUE=1; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=plan GEMM_M=512,4096 gemm_tiles "gemm-$tag-$round" 120
    done
  done
  ;;
52)
  gpu_tests 240 test-grouped-gemm.txt dist-test/test/gpu/grouped-gemm.test.js
  passed test-grouped-gemm.txt || { grep -A14 "✖" "$out/test-grouped-gemm.txt" | head -60; exit 1; }
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    GEMM_TILES=plan GEMM_EPILOGUE=staged,tma gemm_tiles "gemm-$round" 150
  done
  ;;
54)
  gpu_tests 240 test-expert-parallel.txt dist-test/test/gpu/expert-parallel.test.js dist-test/test/gpu/weightgen.test.js
  for args in "--shape flash --tokens 8 --ranks 8" "--shape tiny --tokens 37 --ranks 4"; do
    timeout 240 node dist/cli/main.js check $args --backend cuda 2>&1 | grep -vE "^[├┌└]|ETA" | tee -a "$out/check-ranks.txt"
  done
  ;;
55)
  MEGAMOE_JIT_DEFINES=GEMM_A_FROM_REGISTERS=1 gpu_tests 200 test-grouped-gemm-a-registers.txt \
    dist-test/test/gpu/grouped-gemm.test.js
  passed test-grouped-gemm-a-registers.txt || { grep -A14 "✖" "$out/test-grouped-gemm-a-registers.txt" | head -60; exit 1; }
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - GEMM_A_FROM_REGISTERS=1; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256,m64n256 GEMM_M=${GEMM_M:-64,512,4096} gemm_tiles "gemm-$tag-$round" 150
    done
  done
  ;;
56)
  variants="GEMM_WG_SCHEDULE=1 GEMM_WG_SCHEDULE=2 GEMM_WG_SCHEDULE=2,GEMM_A_FROM_REGISTERS=1"
  for v in $variants; do
    tag=${v//[^A-Za-z0-9]/_}
    MEGAMOE_JIT_DEFINES=$v gpu_tests 200 "test-grouped-gemm-$tag.txt" dist-test/test/gpu/grouped-gemm.test.js
  done
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - $variants; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256,m128n128 GEMM_M=${GEMM_M:-64,512,4096} gemm_tiles "gemm-$tag-$round" 150
    done
  done
  ;;
57)
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - GEMM_WG_SCHEDULE=2 GEMM_WG_SCHEDULE=2,GEMM_DIAG_FIXED_TILES=1 GEMM_WG_SCHEDULE=2,GEMM_DIAG_FIXED_TILES=2 \
      GEMM_WG_SCHEDULE=2,GEMM_DIAG_FIXED_TILES=3 GEMM_WG_SCHEDULE=2,GEMM_DIAG_SKIP_EPILOGUE=1 \
      GEMM_WG_SCHEDULE=2,GEMM_DIAG_FIXED_TILES=3,GEMM_DIAG_SKIP_EPILOGUE=1; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256 GEMM_M=${GEMM_M:-512,4096} gemm_tiles "gemm-$tag-$round" 150
    done
  done
  ;;
58)
  MEGAMOE_JIT_DEFINES=GEMM_WG_SCHEDULE=2,GEMM_STORE_STREAMING=1 gpu_tests 200 test-grouped-gemm-streaming.txt \
    dist-test/test/gpu/grouped-gemm.test.js
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - GEMM_WG_SCHEDULE=2 GEMM_WG_SCHEDULE=2,GEMM_DIAG_SKIP_EPILOGUE=2 GEMM_WG_SCHEDULE=2,GEMM_DIAG_SKIP_EPILOGUE=1 \
      GEMM_WG_SCHEDULE=2,GEMM_STORE_STREAMING=1; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256 GEMM_M=${GEMM_M:-512,4096} gemm_tiles "gemm-$tag-$round" 150
    done
  done
  ;;
59)
  for lag in 1 3; do
    MEGAMOE_JIT_DEFINES=GEMM_WG_SCHEDULE=3,GEMM_WG_LAG=$lag gpu_tests 200 "test-grouped-gemm-lag$lag.txt" \
      dist-test/test/gpu/grouped-gemm.test.js
  done
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - GEMM_WG_SCHEDULE=2 GEMM_WG_SCHEDULE=3,GEMM_WG_LAG=1 GEMM_WG_SCHEDULE=3,GEMM_WG_LAG=2 \
      GEMM_WG_SCHEDULE=3,GEMM_WG_LAG=3; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256,m128n128 GEMM_M=${GEMM_M:-512,4096} gemm_tiles "gemm-$tag-$round" 150
    done
  done
  ;;
60)
  gpu_tests 300 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json" 8
    for v in - GEMM_WG_TURNS=0; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=plan gemm_tiles "gemm-$tag-$round" 150
    done
  done
  cli_rows torch-grouped-gemm-2.json
  ;;
61)
  for f in diag/*.cubin; do [ -f "$f" ] && cuobjdump -sass "$f" >"$out/$(basename "$f" .cubin).sass" 2>&1; done
  round=0
  for order in "- GEMM_WG_TURNS=0" "GEMM_WG_TURNS=0 -" "- GEMM_WG_TURNS=0"; do
    round=$((round + 1))
    for v in $order; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=m128n256 GEMM_M=${GEMM_M:-512,2048} gemm_tiles "gemm-$tag-$round" 150
    done
  done
  torch_gemm torch-grouped-gemm.json 8
  ;;
62) gemm_sanitizers 150 ;;
63)
  for round in 1 2 3 4; do
    torch_gemm "torch-grouped-gemm-$round.json"
    GEMM_TILES=plan GEMM_M=512,4096 gemm_tiles "gemm-$round" 120
  done
  ;;
64)
  MEGAMOE_JIT_DEFINES=GEMM_PANEL_M=8 gpu_tests 200 test-grouped-gemm-panel8.txt dist-test/test/gpu/grouped-gemm.test.js
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json"
    for v in - GEMM_PANEL_M=8 GEMM_PANEL_M=16; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=plan GEMM_M=2048,4096 gemm_tiles "gemm-$tag-$round" 120
    done
  done
  ;;
65)
  gpu_tests 240 test-grouped-gemm-unfused.txt dist-test/test/gpu/grouped-gemm.test.js dist-test/test/gpu/unfused.test.js
  round=0
  for order in "- GEMM_DEFERRED_EPILOGUE=0 GEMM_DIAG_SKIP_EPILOGUE=1" "GEMM_DEFERRED_EPILOGUE=0 - GEMM_DIAG_SKIP_EPILOGUE=1" \
    "- GEMM_DEFERRED_EPILOGUE=0" "GEMM_DEFERRED_EPILOGUE=0 -"; do
    round=$((round + 1))
    torch_gemm "torch-grouped-gemm-$round.json"
    for v in $order; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=plan GEMM_M=${GEMM_M:-64,512,4096} gemm_tiles "gemm-$tag-$round" 120
    done
  done
  for v in - GEMM_DEFERRED_EPILOGUE=0; do
    tag=${v//[^A-Za-z0-9]/_}
    MEGAMOE_JIT_DEFINES=${v#-} timeout 150 node dist/cli/main.js bench --impl unfused --shape flash --shared 0 \
      --tokens 2048,8192 --iters 20 --rounds 2 --out "$out/layers-flash-shared0-unfused-$tag.json" 2>&1 \
      | grep -vE "^[├┌└]" | grep -E "unfused|floor" | cut -c1-150
  done
  ;;
66)
  metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
  for m in 512 4096; do
    timeout 90 ncu --clock-control none --metrics $metrics --csv python3 bench/peers/torch_moe.py --grouped-gemm-only \
      --m-per-group $m --iters 20 >"$out/ncu-torch-m$m.csv" 2>"$out/ncu-torch-m$m.err"
    echo "torch M=$m rc=$? $(wc -l <"$out/ncu-torch-m$m.csv") lines"
    for v in - GEMM_DEFERRED_EPILOGUE=0; do
      tag=${v//[^A-Za-z0-9]/_}
      MEGAMOE_JIT_DEFINES=${v#-} GEMM_TILES=plan GEMM_M=$m timeout 90 ncu --clock-control none -k megamoe_fp8_grouped_gemm \
        --metrics $metrics --csv node dist-test/scripts/gpu-gemm-bench.js >"$out/ncu-ours-$tag-m$m.csv" 2>"$out/ncu-ours-$tag-m$m.err"
      echo "ours $v M=$m rc=$? $(wc -l <"$out/ncu-ours-$tag-m$m.csv") lines"
    done
  done
  ;;
67)
  for round in 1 2 3; do
    torch_gemm "torch-grouped-gemm-$round.json"
    GEMM_MAX_CTAS=${GEMM_MAX_CTAS:--,124,116} GEMM_TILES=plan GEMM_M=512,4096 gemm_tiles "gemm-ctas-$round" 150
  done
  ;;
68)
  gpu_tests 300 test-gpu-all.txt $(find dist-test/test/gpu -name '*.test.js' | sort)
  gemm_sanitizers 100
  torch_gemm torch-grouped-gemm.json
  cli_rows torch-grouped-gemm.json
  ;;
72)
  warm=${WARMUP_MS:-1500} iters=${ITERS:-100}
  impls=${SUSTAINED_IMPLS:-"torch ours"}
  if [ -d mc/dist-test ] && [ -z "${SUSTAINED_IMPLS:-}" ]; then
    impls="torch ours mc"
    gpu_tests 200 test-grouped-gemm-mc.txt mc/dist-test/test/gpu/grouped-gemm.test.js
  fi
  clock_log; smi=$!
  for round in $(seq 1 "${ROUNDS:-3}"); do
    set -- $impls
    for _ in $(seq 2 "$round"); do set -- "${@:2}" "$1"; done  # round r starts r - 1 places later
    for impl in "$@"; do
      case $impl in
      torch) timeout 150 python3 bench/peers/torch_moe.py --grouped-gemm-only --m-per-group 512,4096 --iters $iters \
        --warmup-ms "$warm" --fp8-tflops 1500 --read-tbps 4.3 --copy-tbps 4.0 ${TORCH_ARGS:-} \
        --out "$out/sustained-torch-$round.json" 2>&1 | grep "M/group" ;;
      ours*) tag=${impl//[^A-Za-z0-9]/_}  # ours or ours:DEFINES (MEGAMOE_JIT_DEFINES)
        MEGAMOE_JIT_DEFINES=${impl#ours} MEGAMOE_JIT_DEFINES=${MEGAMOE_JIT_DEFINES#:} GEMM_TILES=plan GEMM_M=512,4096 \
        GEMM_WARMUP_MS=$warm GEMM_ITERS=$iters timeout 150 node dist-test/scripts/gpu-gemm-bench.js \
        "$out/sustained-$tag-$round.json" 2>&1 | sed "s/^/$tag /" ;;
      mc) GEMM_TILES=plan GEMM_M=512,4096 GEMM_WARMUP_MS=$warm GEMM_ITERS=$iters timeout 150 \
        node mc/dist-test/scripts/gpu-gemm-bench.js "$out/sustained-mc-$round.json" 2>&1 | sed "s/^/mc /" ;;
      esac
    done
  done
  kill $smi
  python3 scripts/clock-windows.py "$out/smi.csv" $iters "$out"/sustained-*.json | tee "$out/clock-windows.txt"
  ;;
73)
  PART=53 bash "$0"
  clock_log; smi=$!
  for mode in burst sustained; do
    extra=""; [ $mode = sustained ] && extra="--warmup-ms 1000 --iters 100"
    echo "$mode torch start $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
    timeout 240 python3 bench/peers/torch_moe.py --grouped-gemm-only --blockwise $extra \
      --out "$out/torch-grouped-gemm-$mode.json" 2>&1 | grep "M/group"
    echo "$mode ours start $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
    timeout 150 node dist/cli/main.js bench --impl grouped-gemm $extra --peer "$out/torch-grouped-gemm-$mode.json" \
      --out "$out/grouped-gemm-$mode.json" 2>&1 | grep -vE "^[├┌└]" | cut -c1-200
    echo "$mode end $(date +%H:%M:%S.%N)" >>"$out/phases.txt"
  done
  kill $smi
  ;;
69) gpu_tests 240 test-grouped-gemm-unfused.txt dist-test/test/gpu/grouped-gemm.test.js dist-test/test/gpu/unfused.test.js ;;
71)
  for round in 1 2; do
    torch_gemm "torch-grouped-gemm-$round.json"
    GEMM_CODES=gaussian,quantized GEMM_TILES=plan GEMM_M=512,4096 gemm_tiles "gemm-codes-$round" 100
  done
  ;;
53) gpu_tests 240 test-expert-parallel.txt dist-test/test/gpu/expert-parallel.test.js; grep -E "rank [0-9]" "$out/test-expert-parallel.txt" | head -60 ;;
37)
  for round in 1 2; do
    timeout 60 node dist-test/scripts/gpu-wgmma-rate.js --out "$out/wgmma-rate-$round.json" 2>&1 | tee "$out/wgmma-rate-$round.txt"
  done
  ;;
34)
  for case in "fused megamoe_fused 1" "unfused megamoe_fp8_grouped_gemm 1"; do
    set -- $case
    timeout 200 ncu --clock-control none -k "$2" --launch-count "$3" --section SourceCounters \
      --section WarpStateStats --import-source no -o "$out/ncu-src-$1" \
      node dist/cli/main.js bench --impl "$1" --shape flash-ep8 --shared 0 --tokens 4096 --iters 20 >"$out/ncu-src-$1.log" 2>&1
    echo "ncu $1 rc=$?"; tail -3 "$out/ncu-src-$1.log"
    ncu -i "$out/ncu-src-$1.ncu-rep" --page source --csv --print-source sass >"$out/ncu-src-$1-sass.csv" 2>"$out/ncu-src-$1-sass.err"
    echo "source page rc=$? $(wc -l <"$out/ncu-src-$1-sass.csv") lines"; head -c 600 "$out/ncu-src-$1-sass.err"
    ncu -i "$out/ncu-src-$1.ncu-rep" --page details >"$out/ncu-src-$1-details.txt" 2>&1
    grep -iE "stall|warp cycles|issued" "$out/ncu-src-$1-details.txt" | head -20
  done
  ;;
28) sweep flash 0 ;;
29)  # a version's check: tests, timeline, both flash shapes at the T that moved
  pipeline_tests 240
  fused_trace 45 1,8192
  grep -E "forward|placed|firstTask|l1EndLast|mathDone|end " "$out/trace.txt"
  for shape in flash-ep8 flash; do
    tokens=1,8,64,512,4096; [ "$shape" = flash ] && tokens=1,128,256,2048
    timeout 150 node dist/cli/main.js bench --impl fused,unfused --shape $shape --shared 0 --tokens $tokens \
      --iters 20 --rounds 2 --out "$out/layers-$shape-shared0.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "graph|floor" | cut -c1-120
  done
  ;;
26)  # a version's check over the whole T range, and the router's time
  pipeline_tests 120
  fused_trace 45 1,8192
  grep -E "forward|placed|firstTask|l1EndLast|mathDone|end " "$out/trace.txt"
  timeout 150 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 --tokens 1,8,64,512,4096,8192 \
    --iters 20 --rounds 2 --out "$out/layers-flash-ep8-shared0.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "graph|floor" | cut -c1-120
  timeout 120 node dist-test/scripts/gpu-gate-bench.js --out "$out/gate.json" 2>&1 | tee "$out/gate.txt"
  ;;
23)  # a version's check (tests, timeline, short sweep in rounds), then where the fused kernel's warps stall
  pipeline_tests 120
  fused_trace 45 1,64
  grep -E "forward|l1EndLast|l2ReadyFirst|l2EndFirst|mathDone|end " "$out/trace.txt"
  timeout 120 node dist/cli/main.js bench --impl fused,unfused --shape flash-ep8 --shared 0 --tokens 1,8,64,512,4096 \
    --iters 20 --rounds 2 --out "$out/layers-flash-ep8-shared0.json" 2>&1 | grep -vE "^[├┌└]" | grep -E "graph|floor" | cut -c1-120
  timeout 150 ncu --clock-control none -k megamoe_fused --launch-count 1 --section WarpStateStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor.*pct_of_peak_sustained_active" \
    node dist/cli/main.js bench --impl fused --shape flash-ep8 --shared 0 --tokens 4096 --iters 20 >"$out/ncu-stalls-T4096.txt" 2>&1
  echo "ncu rc=$?"; grep -E "stalled|tensor" "$out/ncu-stalls-T4096.txt" | sort -k3 -g -r | head -30
  ;;
21)  # the weight-stream probe (does the weights' layout or the busy SMs' count bound decode?), then PART=20
  timeout 60 node dist-test/scripts/gpu-weight-stream.js --out "$out/weight-stream.json" 2>&1 | tee "$out/weight-stream.txt"
  PART=20 bash "$0"
  ;;
esac
