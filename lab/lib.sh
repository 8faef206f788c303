# Sourced by the lab recipes (lab/*.sh): the GPU host's environment, the output folder, lab-only builds
# with extra kernel defines, and archiving. Not a recipe itself.
#
# The recipes run on the GPU host from the project's root after, here:
#   npm run build:lab && bash ../shared/gpu-host/bundle.sh
# with carry [".gpuhost", "dist", "dist-test"] (".fixtures" too for the large-shape GPU tests).

set -uo pipefail
if [[ -f .gpuhost/activate ]]; then source .gpuhost/activate; fi
export MEGAMOE_CACHE_DIR=${MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit} PYTHONUNBUFFERED=1 MEGAMOE_REQUIRE_GPU=1
# The commit results files record: the host's copy of the tree has no reliable git state, so build:lab
# writes the development machine's (with -dirty for uncommitted changes) beside the compiled tests.
if [[ -z ${MEGAMOE_COMMIT:-} && -f dist-test/COMMIT ]]; then export MEGAMOE_COMMIT=$(<dist-test/COMMIT); fi
LAB_ROOT=$(pwd)
OUT_DIR=${OUT:-/tmp/megamoe-out}
LAB_DEFINES=()
LAB_ARCHIVE=0
PEER=lab/peers/torch_moe.py

lab_die() { echo "${0##*/}: $*" >&2; exit 2; }

# Options every recipe takes; a recipe's own parser calls this for what it does not know. Sets SHIFT to
# how many arguments it used, 0 for an unknown option.
lab_common_option() {  # option [value]
  SHIFT=0
  case $1 in --out | --define) [[ -n ${2:-} ]] || lab_die "$1 needs a value" ;; esac
  case $1 in
  --out) OUT_DIR=$2; SHIFT=2 ;;
  --define) [[ $2 == *=* || $2 =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || lab_die "--define NAME[=VALUE], not $2"
    LAB_DEFINES+=("$2"); SHIFT=2 ;;
  --archive) LAB_ARCHIVE=1; SHIFT=1 ;;
  esac
}

LAB_COMMON_HELP="Common options:
  --out DIR             where results go (default \$OUT, else /tmp/megamoe-out)
  --define NAME[=VAL]   run on a lab-only build with this macro defined in every kernel source
                        (repeatable): a copy of package.json, dist, dist-test, src/include and
                        src/kernels under /tmp with '#define NAME VAL' put at the top of each .cu.
                        The product has no environment override for kernel macros; this is the only
                        way a recipe changes one, and the rows it writes say so in their file name.
  --archive             tar everything into DIR/all.tgz at the end (the device tool returns few files)"

# lab_setup: makes the output folder; with --define, builds the lab copy and cds into it, so that every
# node and python command after it runs that build (the JIT finds kernels from package.json's folder).
lab_setup() {
  if [[ $LAB_ARCHIVE == 1 ]]; then LAB_FINAL=$OUT_DIR; OUT_DIR=$(mktemp -d); fi
  mkdir -p "$OUT_DIR"
  OUT_DIR=$(cd "$OUT_DIR" && pwd)
  [[ -d dist && -d dist-test ]] || lab_die "no dist or dist-test: run npm run build:lab first"
  if ((${#LAB_DEFINES[@]} > 0)); then
    local tag dir
    tag=$(printf '%s\n' "${LAB_DEFINES[@]}" | tr -c 'A-Za-z0-9\n' '_' | paste -sd- -)
    dir=/tmp/megamoe-lab-$tag
    rm -rf "$dir" && mkdir -p "$dir/src"
    cp -r package.json dist dist-test "$dir/" && cp -r src/include src/kernels "$dir/src/"
    [[ -e node_modules ]] && ln -s "$LAB_ROOT/node_modules" "$dir/node_modules"
    [[ -d lab ]] && cp -r lab "$dir/"
    local header="" d
    for d in "${LAB_DEFINES[@]}"; do header+="#define ${d%%=*} $([[ $d == *=* ]] && echo "${d#*=}")"$'\n'; done
    find "$dir/src/kernels" -name '*.cu' | while read -r f; do
      { printf '// lab-only build (lab/lib.sh --define)\n%s' "$header"; cat "$f"; } >"$f.tmp" && mv "$f.tmp" "$f"
    done
    echo "lab build: $dir (${LAB_DEFINES[*]})"
    LAB_TAG="-$tag"
    cd "$dir" || exit 2
  else
    LAB_TAG=""
  fi
}

lab_finish() {  # rc
  if [[ $LAB_ARCHIVE == 1 ]]; then
    mkdir -p "$LAB_FINAL" && tar czf "$LAB_FINAL/all.tgz" -C "$OUT_DIR" . && rm -rf "$OUT_DIR"
    echo "archive: $LAB_FINAL/all.tgz"
  fi
  exit "${1:-0}"
}

# The SM clock, power and temperature every PERIOD ms into FILE in the background (the caller kills
# $LAB_SMI); lab/clock-windows.py reads it.
lab_clock_log() {  # file [period-ms]
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -lms "${2:-20}" >"$1" 2>&1 &
  LAB_SMI=$!
}

lab_table() { grep -vE "^[├┌└]" | cut -c1-170; }  # the CLI's table without its rules
