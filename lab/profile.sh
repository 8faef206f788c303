#!/usr/bin/env bash
# Nsight Compute on one kernel and case on the GPU host, clocks left alone (--clock-control none).
# Replaces the ncu PARTs of the old scripts/gpu-next.sh (22, 23, 34, 47, 49, 66).
usage() {
  cat <<HELP
usage: lab/profile.sh [options]
  --kernel K        fused (megamoe_fused, through bench --impl fused), unfused-gemm (the unfused pipeline's
                    grouped GEMMs, bench --impl unfused), gemm (lab/gemm-tiles.js, the plan's or --tiles'
                    tile), torch-gemm (the peer's torch._scaled_grouped_mm), step (the norm, the gate's
                    kernels and the fused kernel of a one-block decode step, bench --impl step, shared
                    expert on) (default fused)
  --shape NAME      fused, unfused-gemm, step: preset (default flash-ep8, shared expert off but in step)
  --tokens N        fused, unfused-gemm, step: token count (default 4096)
  --experts FMT     fused, unfused-gemm, step: the routed experts' format, fp8 or fp4 (default the shape's)
  --m N             gemm, torch-gemm: rows per group (default 4096)
  --tiles SPEC      gemm: as lab/gemm.sh's (default plan)
  --what W          summary: speed of light, workload, warp state, scheduler, launch, tensor-pipe and
                    memory rates (default); stalls: each stall reason per issue; sass: per-instruction
                    stall samples as CSV (SourceCounters); clock: duration and SM clock of every launch, CSV;
                    times: every launch's duration, CSV, and per kernel and grid the launches and median /
                    min / max µs (lab/kernel-times.ts; ncu flushes caches before each kernel)
  --launch-skip N   launches to skip before the profiled one (default 0)
  --launch-count N  launches to profile (default 1; clock, times: every launch)
$LAB_COMMON_HELP
Writes ncu-KERNEL-WHAT.txt (or .csv; sass: also the .ncu-rep; times: .csv and .txt) and the command's log
ncu-KERNEL-WHAT.log.
HELP
}
source "$(dirname "$0")/lib.sh"
kernel=fused shape=flash-ep8 tokens=4096 experts=() m=4096 tiles=plan what=summary skip=0 count=""
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --kernel) kernel=$2; shift 2 ;;
  --shape) shape=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --experts) experts=(--experts "$2"); tag_experts=-$2; shift 2 ;;
  --m) m=$2; shift 2 ;;
  --tiles) tiles=$2; shift 2 ;;
  --what) what=$2; shift 2 ;;
  --launch-skip) skip=$2; shift 2 ;;
  --launch-count) count=$2; shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
lab_setup
case $kernel in
fused) filter=(-k megamoe_fused); cmd=(node dist/cli/main.js bench --impl fused --shape "$shape" --shared 0 --tokens "$tokens" "${experts[@]}" --iters 20) ;;
unfused-gemm) filter=(-k megamoe_fp8_grouped_gemm); cmd=(node dist/cli/main.js bench --impl unfused --shape "$shape" --shared 0 --tokens "$tokens" "${experts[@]}" --iters 20) ;;
gemm) filter=(-k megamoe_fp8_grouped_gemm); cmd=(node dist-test/lab/gemm-tiles.js --tiles "$tiles" --m "$m") ;;
torch-gemm) filter=(); cmd=(python3 "$LAB_ROOT/$PEER" --grouped-gemm-only --m-per-group "$m" --iters 20) ;;
step) filter=(-k "regex:megamoe_(rmsnorm|gate|fused|quantize)"); cmd=(node dist/cli/main.js bench --impl step --shape "$shape" --tokens "$tokens" "${experts[@]}" --layers 1 --iters 20) ;;
*) lab_die "--kernel fused, unfused-gemm, gemm, torch-gemm or step" ;;
esac
launches=(--launch-skip "$skip")
[[ ($what == clock || $what == times) && -z $count ]] || launches+=(--launch-count "${count:-1}")
base=$OUT_DIR/ncu-$kernel${tag_experts:-}$LAB_TAG-$what
case $what in
summary)
  timeout 300 ncu --clock-control none "${filter[@]}" "${launches[@]}" --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section LaunchStats --metrics \
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,dram__bytes_read.sum.per_second \
    "${cmd[@]}" >"$base.txt" 2>&1
  rc=$?
  grep -E "gmma|Duration|Throughput|Busy|lts__t_bytes|dram__bytes|Stall|Issued Warp|No Eligible|Registers" "$base.txt" | head -40 ;;
stalls)
  timeout 300 ncu --clock-control none "${filter[@]}" "${launches[@]}" --section WarpStateStats \
    --section SchedulerStats --metrics \
    "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum" \
    "${cmd[@]}" >"$base.txt" 2>&1
  rc=$?
  grep -E "stalled|gmma|Duration" "$base.txt" | sort -k3 -g -r | head -30 ;;
sass)
  timeout 300 ncu --clock-control none "${filter[@]}" "${launches[@]}" --section SourceCounters \
    --section WarpStateStats --import-source no -o "$base" "${cmd[@]}" >"$base.log" 2>&1
  rc=$?
  ncu -i "$base.ncu-rep" --page source --csv --print-source sass >"$base.csv" 2>>"$base.log" || rc=1
  echo "ncu rc=$rc, $(wc -l <"$base.csv") SASS lines in $base.csv" ;;
clock)
  timeout 300 ncu --clock-control none "${filter[@]}" "${launches[@]}" --csv \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second "${cmd[@]}" >"$base.csv" 2>"$base.log"
  rc=$?
  echo "ncu rc=$rc, $(wc -l <"$base.csv") lines in $base.csv" ;;
times)
  timeout 300 ncu --clock-control none "${filter[@]}" "${launches[@]}" --csv --metrics gpu__time_duration.sum \
    "${cmd[@]}" >"$base.csv" 2>"$base.log"
  rc=$?
  node dist-test/lab/kernel-times.js "$base.csv" | tee "$base.txt" || rc=1 ;;
*) lab_die "--what summary, stalls, sass, clock or times" ;;
esac
lab_finish $rc
