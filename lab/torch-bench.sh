#!/usr/bin/env bash
# The fused layer from PyTorch beside Node, in one call on the GPU host: `megamoe export`, then rounds
# that alternate Node's benchmark (`megamoe bench --impl fused`: CUDA-graph replays, L2 flushed before
# each) and megamoe_torch's (python -m megamoe_torch.bench: the same, plus an eager call's host time)
# on the same layer shape.
usage() {
  cat <<HELP
usage: lab/torch-bench.sh [options]
  --shape NAME      preset (default flash-ep8)
  --experts LIST    fp8 and/or fp4, comma-separated (default fp8,fp4)
  --shared 0|1      the shared expert (default 0)
  --tokens LIST     token counts (default 1,8,64,512,4096)
  --rounds N        Node and PyTorch alternate N times (default 2)
$LAB_COMMON_HELP
Writes node-SHAPE-FMT-sharedS-rR.json and torch-SHAPE-FMT-sharedS-rR.json (and .txt).
HELP
}
source "$(dirname "$0")/lib.sh"
shape=flash-ep8 experts=fp8,fp4 shared=0 tokens=1,8,64,512,4096 rounds=2
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --shape) shape=$2; shift 2 ;;
  --experts) experts=$2; shift 2 ;;
  --shared) shared=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --rounds) rounds=$2; shift 2 ;;
  *) lab_common_option "$@"; ((SHIFT)) || lab_die "unknown option $1 (--help)"; shift "$SHIFT" ;;
  esac
done
lab_setup
rc=0
max=$(tr , '\n' <<<"$tokens" | sort -n | tail -1)
IFS=, read -ra formats <<<"$experts"
for fmt in "${formats[@]}"; do
  exp=$(mktemp -d)/export
  node dist/cli/main.js export --shape "$shape" --experts "$fmt" --shared "$shared" --max-tokens "$max" \
    --out "$exp" || { rc=1; continue; }
  for r in $(seq 1 "$rounds"); do
    tag=$shape-$fmt-shared$shared-r$r
    node dist/cli/main.js bench --impl fused --shape "$shape" --experts "$fmt" --shared "$shared" \
      --tokens "$tokens" --out "$OUT_DIR/node-$tag.json" --force >"$OUT_DIR/node-$tag.txt" 2>&1 || rc=1
    # Node's CUDA-graph figures by T, for the PyTorch table's column beside its own.
    python3 -c 'import json,sys; rows=json.load(open(sys.argv[1]))["rows"]
print(json.dumps({str(r["tokens"]): r["us_median"] for r in rows if r["impl"] == "fused" and r.get("graph")}))' \
      "$OUT_DIR/node-$tag.json" >"$OUT_DIR/node-$tag.graph.json" || rc=1
    PYTHONPATH=python python3 -m megamoe_torch.bench --export "$exp" --tokens "$tokens" \
      --node-json "$OUT_DIR/node-$tag.graph.json" --json "$OUT_DIR/torch-$tag.json" | tee "$OUT_DIR/torch-$tag.txt" || rc=1
  done
done
lab_finish "$rc"
