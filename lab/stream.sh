#!/usr/bin/env bash
# The decode weight stream with no math (lab/stream.ts, probe_tma_stream): CTAs each streaming one
# weight tile through a TMA stage ring, FP8's 128-byte row pieces beside packed FP4's 64-byte ones,
# row-major beside K-block-major (by tensor maps of one or two rows per TMA row, or plain bulk copies),
# over ring depths and grids; the read ceiling beside them.
usage() {
  cat <<HELP
usage: lab/stream.sh [options]
  --ctas LIST       CTAs, one tile each (default 96,132: the busy SMs at flash-ep8 T = 1, all)
  --tile-rows LIST  rows per tile (default 256: an L1 tile)
  --box-rows LIST   rows per TMA box (default 128)
  --k-blocks LIST   128-deep K blocks per row (default 32: H = 4096)
  --pieces LIST     bytes of a row per K block, 128 (FP8) and/or 64 (FP4) (default 128,64)
  --layouts LIST    row-major, kblock-major (a box contiguous, through the layer's tensor map),
                    kblock-wide (the same boxes through a map of two rows per TMA row, unswizzled) and/or
                    kblock-bulk (the same boxes as plain bulk copies) (default all four)
  --stages LIST     ring depths (default 4,8)
  --rounds N        repeat the grid N times (default 2)
$LAB_COMMON_HELP
Writes stream.json (and the printed rows on stdout).
HELP
}
source "$(dirname "$0")/lib.sh"
opts=()
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --ctas | --tile-rows | --box-rows | --k-blocks | --pieces | --layouts | --stages | --rounds)
    [[ -n ${2:-} ]] || lab_die "$1 needs a value"; opts+=("$1" "$2"); shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
lab_setup
rc=0
timeout 500 node dist-test/lab/stream.js "${opts[@]}" --out "$OUT_DIR/stream$LAB_TAG.json" || rc=1
lab_finish $rc
