#!/usr/bin/env bash
# The expert-parallel benchmark (issues 24, 25) on the GPU host: R virtual ranks of one layer on one GPU
# (--gpus: rank r on GPU r), the in-kernel path (FusedExpertParallel) beside the host-planned one
# (ExpertParallelMoE), µs per forward,
# the floors and the bytes across ranks (megamoe bench --impl ep, src/bench/ep.ts). One bench call per
# rank count: a failed in-kernel forward loses its CUDA context, and the other counts still run.
usage() {
  cat <<HELP
usage: lab/ep.sh [options]
  --shape NAME      preset whose routed experts the ranks split (default flash: E = 256)
  --ranks LIST      virtual rank counts, each 2..8 dividing E, one bench call each (default 2,4,8)
  --gpus            one rank per GPU (each rank count at most the GPU count) instead of all on GPU 0
  --experts FMT     the routed experts' format, fp8 or fp4 (default the shape's)
  --tokens LIST     tokens per rank (default 1,8,64,512,4096,8192)
  --shared 0|1      shared expert off or on (default 1)
  --rounds N        interleaved rounds of the two paths (bench --rounds; default 3)
  --iters N         timed forwards per path and case (default 30)
  --timeout S       seconds for each bench call (default 540)
$LAB_COMMON_HELP
Writes, per rank count R: ep-SHAPE[-FMT]-sharedS-rR[-gpus].json (with --define, the file names carry the defines).
HELP
}
source "$(dirname "$0")/lib.sh"
shape=flash ranks=2,4,8 tokens=1,8,64,512,4096,8192 shared=1 rounds=3 iters=30 seconds=540 gpus="" experts=""
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --shape) shape=$2; shift 2 ;;
  --ranks) ranks=$2; shift 2 ;;
  --gpus) gpus=--gpus; shift ;;
  --experts) experts=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --shared) shared=$2; shift 2 ;;
  --rounds) rounds=$2; shift 2 ;;
  --iters) iters=$2; shift 2 ;;
  --timeout) seconds=$2; shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
case $shared in 0 | 1) ;; *) lab_die "--shared 0 or 1" ;; esac
lab_setup
rc=0
for r in ${ranks//,/ }; do
  name=ep-$shape${experts:+-$experts}-shared$shared-r$r${gpus:+-gpus}
  echo "== $name"
  timeout "$seconds" node dist/cli/main.js bench --force --impl ep --shape "$shape" --ranks "$r" $gpus ${experts:+--experts "$experts"} --shared "$shared" \
    --tokens "$tokens" --iters "$iters" --rounds "$rounds" --out "$OUT_DIR/$name$LAB_TAG.json" 2>&1 | lab_table
  ((PIPESTATUS[0] == 0)) || rc=1
done
lab_finish $rc
