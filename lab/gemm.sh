#!/usr/bin/env bash
# The grouped GEMM against its peer (torch._scaled_grouped_mm, lab/peers/torch_moe.py --grouped-gemm-only)
# on the flash expert shapes, in rounds that alternate who goes first, burst and/or sustained (warmed to the
# clock a power-capped card holds) while nvidia-smi logs the SM clock and power; then each row's clock and
# power in its timed window (lab/clock-windows.py). Replaces the GEMM PARTs of the old scripts/gpu-next.sh
# (35, 40, 46, 51-52, 55-61, 63-67, 71-73) and scripts/gpu-gemm.sh.
usage() {
  cat <<HELP
usage: lab/gemm.sh [options]
  --mode burst|sustained|both  burst: 20 timed runs after a few warm-up runs (the usual benchmark);
                    sustained: --warmup-ms 1500 of untimed runs, then 100 timed (default both)
  --m LIST          rows per group (default 64,512,4096)
  --tiles SPEC      ours: plan (the plan's pick; default), all (every tile), or a comma list of tiles
  --codes LIST      ours: operand codes quantized, gaussian (the peer's data), uniform-bytes (default quantized)
  --ctas LIST       ours: grid caps, "-" for none (default -)
  --rounds N        rounds per mode, each starting one place later in the order torch, ours (default 2)
  --iters N         timed runs per case (default: 20 burst, 100 sustained)
  --warmup-ms MS    sustained warm-up per case (default 1500)
  --blockwise       the peer also times PyTorch's block-scaled GEMM (its own series)
  --peer-args STR   more arguments to the peer, e.g. "--fp8-tflops 1500 --read-tbps 4.3 --copy-tbps 4.0"
                    (skips its measurement of the floor's rates, as the old sustained runs did)
  --no-peer         ours only
  --no-clock        no nvidia-smi log and no clock windows
$LAB_COMMON_HELP
Writes MODE-torch-R.json and MODE-ours-R.json per round, gemm-MODE-R.txt (ours, printed), smi.csv (the clock
log), phases.txt (when each run started) and clock-windows.txt (clock and power per row).
HELP
}
source "$(dirname "$0")/lib.sh"
modes="burst sustained" m=64,512,4096 tiles=plan codes=quantized ctas=- rounds=2 iters="" warm=1500
blockwise="" peer=1 clock=1 peer_args=""
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --mode) case $2 in both) modes="burst sustained" ;; burst | sustained) modes=$2 ;; *) lab_die "--mode burst, sustained or both" ;; esac
    shift 2 ;;
  --m) m=$2; shift 2 ;;
  --tiles) tiles=$2; shift 2 ;;
  --codes) codes=$2; shift 2 ;;
  --ctas) ctas=$2; shift 2 ;;
  --rounds) rounds=$2; shift 2 ;;
  --iters) iters=$2; shift 2 ;;
  --warmup-ms) warm=$2; shift 2 ;;
  --blockwise) blockwise=--blockwise; shift ;;
  --peer-args) peer_args=$2; shift 2 ;;
  --no-peer) peer=0; shift ;;
  --no-clock) clock=0; shift ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
lab_setup
((clock)) && lab_clock_log "$OUT_DIR/smi.csv" 20
mark() { echo "$* $(date +%H:%M:%S.%N)" >>"$OUT_DIR/phases.txt"; }
rc=0
for mode in $modes; do
  if [[ $mode == burst ]]; then n=${iters:-20} w=0; else n=${iters:-100} w=$warm; fi
  impls="ours"; ((peer)) && impls="torch ours"
  for round in $(seq 1 "$rounds"); do
    set -- $impls
    for _ in $(seq 2 "$round"); do set -- "${@:2}" "$1"; done  # round r starts r - 1 places later
    for impl in "$@"; do
      mark "$mode $impl $round start"
      if [[ $impl == torch ]]; then
        timeout 240 python3 "$LAB_ROOT/$PEER" --grouped-gemm-only $blockwise --m-per-group "$m" --iters "$n" \
          --warmup-ms "$w" $peer_args --out "$OUT_DIR/$mode-torch-$round.json" 2>&1 | grep "M/group"
      else
        timeout 200 node dist-test/lab/gemm-tiles.js --tiles "$tiles" --m "$m" --codes "$codes" --ctas "$ctas" \
          --warmup-ms "$w" --iters "$n" --out "$OUT_DIR/$mode-ours$LAB_TAG-$round.json" 2>&1 |
          tee "$OUT_DIR/gemm-$mode$LAB_TAG-$round.txt"
        ((PIPESTATUS[0] == 0)) || rc=1
      fi
    done
  done
  mark "$mode end"
done
if ((clock)); then
  kill "$LAB_SMI" 2>/dev/null
  for mode in $modes; do
    if [[ $mode == burst ]]; then n=${iters:-20}; else n=${iters:-100}; fi
    python3 "$LAB_ROOT/lab/clock-windows.py" "$OUT_DIR/smi.csv" "$n" "$OUT_DIR/$mode"-*.json
  done | tee "$OUT_DIR/clock-windows.txt"
fi
lab_finish $rc
