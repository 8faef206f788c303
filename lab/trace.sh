#!/usr/bin/env bash
# The fused kernel's per-CTA timeline on the GPU host (lab/trace.ts): for each token count, the untraced
# forward's median time (beside it: after an L2 flush by reads instead of writes, with no flush, and an
# empty kernel of its launch shape), then min / median / max over the CTAs of every phase the kernel
# records (dispatch, waits on dependencies and stages, epilogues, the combine). Replaces the timeline steps of the old
# scripts/gpu-next.sh (PARTs 1, 12-20, 23, 26, 29, 30, 39-40) and scripts/gpu-fused.sh's TRACE_T.
usage() {
  cat <<HELP
usage: lab/trace.sh [options]
  --shape LIST      presets, comma-separated (default flash-ep8)
  --tokens LIST     token counts (default 1,64,512,8192)
  --experts LIST    the routed experts' formats, fp8 and/or fp4, comma-separated (default the shape's)
  --shared 0|1      the shared expert off or on (default 1)
  --rounds N        repeat the whole timeline N times, one file each (default 1)
  --grep REGEX      print only the fields matching REGEX (the files keep all)
$LAB_COMMON_HELP
A/B of a kernel macro: run once plain and once with --define NAME=VALUE, into the same --out.
Writes trace-SHAPE[-FMT][-shared0][-DEFINES]-R.txt.
HELP
}
source "$(dirname "$0")/lib.sh"
shapes=flash-ep8 tokens=1,64,512,8192 rounds=1 pattern="" experts="" shared=1
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --shape) shapes=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --experts) experts=$2; shift 2 ;;
  --shared) shared=$2; shift 2 ;;
  --rounds) rounds=$2; shift 2 ;;
  --grep) pattern=$2; shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
[[ $shared == 0 || $shared == 1 ]] || lab_die "--shared is 0 or 1, not $shared"
lab_setup
rc=0
IFS=, read -ra shape_list <<<"$shapes"
IFS=, read -ra format_list <<<"${experts:--}"
for round in $(seq 1 "$rounds"); do
  for shape in "${shape_list[@]}"; do
    for format in "${format_list[@]}"; do
      fmt=${format#-}
      file=$OUT_DIR/trace-$shape${fmt:+-$fmt}$([[ $shared == 0 ]] && echo -shared0)$LAB_TAG-$round.txt
      timeout 150 node dist-test/lab/trace.js "$shape" "$tokens" "$format" "$shared" >"$file" 2>&1 || rc=1
      if [[ -n $pattern ]]; then grep -E "forward|$pattern" "$file"; else cat "$file"; fi
    done
  done
done
lab_finish $rc
