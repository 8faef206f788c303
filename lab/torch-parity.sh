#!/usr/bin/env bash
# Node = PyTorch on the GPU host: for each layer, lab/torch-parity.ts exports it, writes its weights in
# the engine layouts and runs Node's fused forward on random cases; lab/torch_parity.py adopts the same
# weights with megamoe_torch (python/) and compares every output's bits, eager and from a CUDA graph, and
# the output against a float64 layer; then many calls leave the device memory as it was.
usage() {
  cat <<HELP
usage: lab/torch-parity.sh [options]
  --layers LIST   shape:experts:shared[:max-tokens], comma-separated (default: tiny, both formats,
                  shared expert on and off, every block M and FP4's expand variant; flash-ep8 FP8 and FP4)
  --tokens LIST   token counts per layer (default 1,7,64,129,1000 and the layer's maximum)
  --calls N       eager calls for the memory check (default 10000)
$LAB_COMMON_HELP
Writes parity-SHAPE-FMT-sharedS.json (the verdict) and .txt (the lines printed).
HELP
}
source "$(dirname "$0")/lib.sh"
layers=tiny:fp8:1:1024,tiny:fp8:0:1024,tiny:fp4:1:2048,tiny:fp4:0:2048,flash-ep8:fp8:0:4096,flash-ep8:fp4:1:4096
tokens="" calls=10000
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --layers) layers=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --calls) calls=$2; shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
lab_setup
rc=0
IFS=, read -ra layer_list <<<"$layers"
for layer in "${layer_list[@]}"; do
  IFS=: read -r shape fmt shared max <<<"$layer"
  max=${max:-1024}
  list=${tokens:-1,7,64,129,1000,$max}
  name=parity-$shape-$fmt-shared$shared
  work=$(mktemp -d)
  echo "== $name (T = $list)"
  if node dist-test/lab/torch-parity.js --shape "$shape" --experts "$fmt" --shared "$shared" \
    --tokens "$list" --max-tokens "$max" --out "$work" &&
    python3 lab/torch_parity.py "$work" --calls "$calls" --json "$OUT_DIR/$name.json" | tee "$OUT_DIR/$name.txt"; then
    :
  else
    rc=1
  fi
  rm -rf "$work"
done
lab_finish "$rc"
