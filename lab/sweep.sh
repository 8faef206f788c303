#!/usr/bin/env bash
# A layer sweep on the GPU host: shapes x shared expert x token counts, our pipelines beside the torch
# peer (lab/peers/torch_moe.py) measured in the same call. Replaces the sweep PARTs of the old
# scripts/gpu-next.sh (2-4, 27, 28, 31, 33, 43, 45) and scripts/gpu-sweeps.sh / gpu-final.sh.
usage() {
  cat <<HELP
usage: lab/sweep.sh [options]
  --shape LIST      presets, comma-separated (default flash-ep8)
  --shared 0|1|both shared expert off, on, or both (default both)
  --tokens LIST     token counts (default 1,2,4,...,8192)
  --impl LIST       our implementations (default fused,unfused), or step: the decode step (bench --impl step,
                    --layers blocks of norm, gate and fused layer in one graph, shared expert on; no peer,
                    plot or --shared)
  --layers N        step: MoE blocks in the step (default 8)
  --experts LIST    routed experts' formats, comma-separated (fp8, fp4; default the shape's): bench
                    --experts, one sweep each, the format in the file names
  --configs         also time every block M of the fused kernel (bench --configs)
  --rounds N        split our timed runs into N interleaved rounds (bench --rounds; default 2)
  --alternate       with two or more --experts formats: N rounds that each time every format once (bench
                    --rounds 1 per format and round, files …-FORMAT-rR.json, no plot), so the formats see
                    the same clock drift; not with --baseline or step
  --iters N         timed runs per case (default 20)
  --no-peer         leave the torch peer out
  --peer-file FILE  use a peer measured in an earlier call instead of measuring it again
  --timeout S       seconds for each of our sweeps (default 200)
  --baseline LIST   also time other builds of megamoe, comma-separated folders (each holds its package.json,
                    dist, src/include and src/kernels, e.g. an earlier commit's or a branch's): rounds
                    alternate them and this build, one round each, so all see the same clock drift; the
                    files are named by "baseline" (one folder) or each folder's name, and "this"
$LAB_COMMON_HELP
Writes, per shape and shared setting: torch-SHAPE-sharedS.json (the peer), layers-SHAPE-sharedS.json and
.svg (our rows beside the peer's; with --define, the file names carry the defines); step: step-SHAPE.json.
HELP
}
source "$(dirname "$0")/lib.sh"
shapes=flash-ep8 shared=both tokens=1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 impl=fused,unfused
configs="" rounds=2 iters=20 peer=1 peer_file="" seconds=200 baselines=() experts="" layers=8 alternate=0
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --shape) shapes=$2; shift 2 ;;
  --shared) shared=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --impl) impl=$2; shift 2 ;;
  --experts) experts=$2; shift 2 ;;
  --configs) configs=--configs; shift ;;
  --rounds) rounds=$2; shift 2 ;;
  --alternate) alternate=1; shift ;;
  --layers) layers=$2; shift 2 ;;
  --iters) iters=$2; shift 2 ;;
  --no-peer) peer=0; shift ;;
  --peer-file) peer_file=$2; shift 2 ;;
  --timeout) seconds=$2; shift 2 ;;
  --baseline)
    IFS=, read -ra dirs <<<"$2"
    for d in "${dirs[@]}"; do
      abs=$(cd "$d" && pwd) || lab_die "--baseline: no folder $d"
      label=baseline
      ((${#dirs[@]} > 1)) && label=$(basename "$abs")
      [[ " ${baselines[*]} " == *" $label="* ]] && lab_die "--baseline: two folders named $label"
      baselines+=("$label=$abs")
    done
    shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
case $shared in both) shared="1 0" ;; 0 | 1) ;; *) lab_die "--shared 0, 1 or both" ;; esac
# The step always runs the shared expert and has no peer, plot or rounds of its own (bench --impl step).
step=0
if [[ $impl == step ]]; then
  step=1 shared=1 peer=0
  [[ -z $configs ]] || lab_die "--configs times the fused kernel's block Ms, not the step"
elif [[ ,$impl, == *,step,* ]]; then
  lab_die "--impl step runs alone (the step is not a layer pipeline)"
fi
[[ -z $peer_file ]] || peer_file=$(cd "$(dirname "$peer_file")" && pwd)/$(basename "$peer_file")
formats=${experts//,/ }
if ((alternate)); then
  read -ra format_list <<<"$formats"
  ((${#format_list[@]} >= 2)) || lab_die "--alternate needs two or more --experts formats"
  ((${#baselines[@]} == 0 && !step)) || lab_die "--alternate times formats, not --baseline builds or the step"
fi
# One sweep per experts' format ("shape": the shape's own, no --experts, no suffix in the names); with
# --alternate one per format and round, the formats taking turns.
format_case() {  # format: the sweep's file name stem and its bench arguments
  name=$shape-shared$s prefix=layers case_args=(--shared "$s")
  ((step)) && name=$shape prefix=step case_args=(--layers "$layers")
  experts_args=()
  [[ $1 == shape ]] || { name=$name-$1; experts_args=(--experts "$1"); }
}
sweep_format() {  # format [round]
  local round=${2:-}
  format_case "$1"
  if [[ -n $round ]]; then
    echo "== $name round $round"
    out_args=(--out "$OUT_DIR/$prefix-$name-r$round$LAB_TAG.json" --rounds 1)
  else
    out_args=(--out "$OUT_DIR/$prefix-$name$LAB_TAG.json")
    ((step)) || out_args+=(--rounds "$rounds" --plot "$OUT_DIR/$prefix-$name$LAB_TAG.svg")
  fi
  timeout "$seconds" node dist/cli/main.js bench --force --impl "$impl" $configs --shape "$shape" "${case_args[@]}" \
    "${experts_args[@]}" --tokens "$tokens" --iters "$iters" "${peer_args[@]}" "${out_args[@]}" 2>&1 | lab_table
  ((PIPESTATUS[0] == 0)) || rc=1
}
lab_setup
rc=0
for shape in ${shapes//,/ }; do
  for s in $shared; do
    peer_args=()
    if [[ -n $peer_file ]]; then
      peer_args=(--peer "$peer_file")
    elif ((peer)); then
      timeout 150 python3 "$LAB_ROOT/$PEER" --shape "$shape" --shared "$s" --tokens "$tokens" --iters "$iters" \
        --out "$OUT_DIR/torch-$shape-shared$s.json" 2>&1 | tail -1
      [[ -f $OUT_DIR/torch-$shape-shared$s.json ]] && peer_args=(--peer "$OUT_DIR/torch-$shape-shared$s.json")
    fi
    if ((alternate)); then
      for ((r = 1; r <= rounds; r++)); do
        for fmt in $formats; do sweep_format "$fmt" "$r"; done
      done
      continue
    fi
    for fmt in ${formats:-shape}; do
      if ((${#baselines[@]} == 0)); then
        sweep_format "$fmt"
        continue
      fi
      format_case "$fmt"
      for ((r = 1; r <= rounds; r++)); do
        for entry in "${baselines[@]}" "this=$PWD"; do
          build=${entry%%=*} dir=${entry#*=}
          echo "== $name round $r: $build ($dir)"
          # Removed, not --force: a baseline's build may predate the flag.
          rm -f "$OUT_DIR/$prefix-$name-$build-r$r$LAB_TAG.json"
          (cd "$dir" && timeout "$seconds" node dist/cli/main.js bench --impl "$impl" $configs --shape "$shape" \
            "${case_args[@]}" "${experts_args[@]}" --tokens "$tokens" --iters "$iters" "${peer_args[@]}" \
            --out "$OUT_DIR/$prefix-$name-$build-r$r$LAB_TAG.json") 2>&1 | lab_table
          ((PIPESTATUS[0] == 0)) || rc=1
        done
      done
    done
  done
done
lab_finish $rc
