#!/usr/bin/env bash
# lab/check: a version's correctness check on the GPU host. Every GPU test file (npm run test:gpu), then
# compute-sanitizer memcheck, racecheck and synccheck on small runs of the fused kernel (every block M),
# expert parallelism inside it (virtual ranks), the grouped GEMM, the gate and the norm kernels. One results file per tool under the output folder,
# and a summary line per tool.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
  cat <<'HELP'
lab/check.sh [options]: the GPU tests, then compute-sanitizer on small runs of every kernel family.

Phases (default: both; naming one runs only the named ones):
  --tests                 every GPU test file (dist-test/test/gpu/*.test.js, MEGAMOE_REQUIRE_GPU=1)
                          into OUT/tests.txt
  --sanitizers            compute-sanitizer with each tool on each target, into OUT/sanitizer-TOOL.txt

Options:
  --out DIR               results folder (default $OUT, else ./lab-out/check)
  --tools LIST            comma list of memcheck, racecheck, synccheck (default all three)
  --targets LIST          comma list of fused, ep, gemm, gate, norm (default all five)
  --block-ms LIST         the fused kernel's block Ms, one sanitizer run each (default 16,32,64,128)
  --experts LIST          the fused kernel's routed-expert formats, fp8 and/or fp4 (default fp8,fp4)
  --ep-ranks LIST         virtual rank counts of the ep target (2, 4, 8), one run each (default 2)
  --gemm-cases LIST       the grouped-GEMM test cases (substrings of their names, MEGAMOE_GEMM_CASE;
                          default "tiny,empty groups"), one sanitizer run each
  --tests-timeout S       seconds for the test phase (default 300)
  --run-timeout S         seconds for each sanitizer run (default 150)
  -h, --help              this text

Each sanitizer run is one process: `compute-sanitizer --tool TOOL node dist-test/lab/check-targets.js
TARGET` (fused, ep, gate, norm) or the grouped-GEMM test file narrowed to one case, with kernels compiled
-lineinfo (MEGAMOE_JIT_LINEINFO=1) so reports name source lines. A run's errors are its ERROR SUMMARY
(RACECHECK SUMMARY for racecheck); a timeout or a wrong output counts as a failed run.
Exit status: 0 when the tests pass and no tool found an error, 1 otherwise, 2 for a usage error.

Both phases together can pass the GPU host's 10 minutes: run `lab/check.sh --tests` and
`lab/check.sh --sanitizers` as two commands (or narrow with --tools).
HELP
}

out=${OUT:-lab-out/check}
tools=memcheck,racecheck,synccheck
targets=fused,ep,gemm,gate,norm
ep_ranks=2
block_ms=16,32,64,128
experts=fp8,fp4
gemm_cases="tiny,empty groups"
tests_timeout=300
run_timeout=150
do_tests=0 do_sanitizers=0
while (($#)); do
  case $1 in
  --tests) do_tests=1 ;;
  --sanitizers) do_sanitizers=1 ;;
  --out) out=$2; shift ;;
  --tools) tools=$2; shift ;;
  --targets) targets=$2; shift ;;
  --block-ms) block_ms=$2; shift ;;
  --experts) experts=$2; shift ;;
  --ep-ranks) ep_ranks=$2; shift ;;
  --gemm-cases) gemm_cases=$2; shift ;;
  --tests-timeout) tests_timeout=$2; shift ;;
  --run-timeout) run_timeout=$2; shift ;;
  -h | --help) usage; exit 0 ;;
  *) echo "lab/check.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
  shift
done
((do_tests || do_sanitizers)) || do_tests=1 do_sanitizers=1
for t in ${tools//,/ }; do
  [[ $t =~ ^(memcheck|racecheck|synccheck)$ ]] || { echo "lab/check.sh: unknown tool $t" >&2; exit 2; }
done
for t in ${targets//,/ }; do
  [[ $t =~ ^(fused|ep|gemm|gate|norm)$ ]] || { echo "lab/check.sh: unknown target $t" >&2; exit 2; }
done
for x in ${experts//,/ }; do
  [[ $x =~ ^(fp8|fp4)$ ]] || { echo "lab/check.sh: unknown expert format $x" >&2; exit 2; }
done

# The GPU host has no Node of its own: the bundle's (bash ../shared/gpu-host/bundle.sh) when present.
if ! command -v node >/dev/null && [[ -f .gpuhost/activate ]]; then
  source .gpuhost/activate
  export MEGAMOE_CACHE_DIR=${MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit}
fi
[[ -d dist-test/test/gpu ]] || { echo "lab/check.sh: no dist-test: run npx tsc -p tsconfig.json first" >&2; exit 2; }
mkdir -p "$out"
export MEGAMOE_REQUIRE_GPU=1
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
status=0
summary=()

if ((do_tests)); then
  mapfile -t files < <(find dist-test/test/gpu -name '*.test.js' | sort)
  timeout "$tests_timeout" node --test --test-reporter=spec "${files[@]}" >"$out/tests.txt" 2>&1
  rc=$?
  pass=$(grep -oP '^ℹ pass \K[0-9]+' "$out/tests.txt" | tail -1)
  fail=$(grep -oP '^ℹ fail \K[0-9]+' "$out/tests.txt" | tail -1)
  line="tests: ${pass:-?} passed, ${fail:-?} failed, rc=$rc$( ((rc == 124)) && echo ' (timed out)') ($out/tests.txt)"
  ((rc == 0)) || status=1
  summary+=("$line")
  echo "$line"
  grep -E "^✖" "$out/tests.txt" | head -10
fi

# run TOOL LABEL FILE CMD...: one sanitizer run appended to FILE; prints "LABEL ERRORS RC"
run() {
  local tool=$1 label=$2 file=$3
  shift 3
  local tmp
  tmp=$(mktemp)
  echo "===== $tool $label: $*" >>"$file"
  MEGAMOE_JIT_LINEINFO=1 timeout "$run_timeout" "$sanitizer" --tool "$tool" --print-limit 20 "$@" >"$tmp" 2>&1
  local rc=$?
  cat "$tmp" >>"$file"
  echo "===== $tool $label: rc=$rc" >>"$file"
  local errors
  if [[ $tool == racecheck ]]; then
    errors=$(grep -oP 'RACECHECK SUMMARY: .*\(\K[0-9]+(?= error)' "$tmp" | tail -1)
  else
    errors=$(grep -oP 'ERROR SUMMARY: \K[0-9]+' "$tmp" | tail -1)
  fi
  rm -f "$tmp"
  echo "  $tool $label: ${errors:-?} errors, rc=$rc" >&2
  echo "$label ${errors:-?} $rc"
}

if ((do_sanitizers)); then
  command -v "$sanitizer" >/dev/null || { echo "lab/check.sh: $sanitizer not found (COMPUTE_SANITIZER=path)" >&2; exit 2; }
  IFS=, read -ra gemm_list <<<"$gemm_cases"
  for tool in ${tools//,/ }; do
    file="$out/sanitizer-$tool.txt"
    : >"$file"
    total=0 bad_runs=() parts=()
    results=()
    for target in ${targets//,/ }; do
      case $target in
      fused) for x in ${experts//,/ }; do
        for m in ${block_ms//,/ }; do
          results+=("$(run "$tool" "fused-$x:$m" "$file" node dist-test/lab/check-targets.js fused "$m" "$x")")
        done
      done ;;
      ep) for x in ${experts//,/ }; do
        for r in ${ep_ranks//,/ }; do
          results+=("$(run "$tool" "ep-$x:$r" "$file" node dist-test/lab/check-targets.js ep "$r" "$x")")
          # FP4's expand variant runs only in 128-row tiles, which 16 tokens never pick.
          [[ $x == fp4 ]] && results+=("$(run "$tool" "ep-$x-expand:$r" "$file" node dist-test/lab/check-targets.js ep "$r" "$x" 64 expand)")
        done
      done ;;
      gemm) for c in "${gemm_list[@]}"; do
        results+=("$(MEGAMOE_GEMM_CASE=$c run "$tool" "gemm:${c// /-}" "$file" node --test dist-test/test/gpu/grouped-gemm.test.js)")
      done ;;
      gate | norm) results+=("$(run "$tool" "$target" "$file" node dist-test/lab/check-targets.js "$target")") ;;
      esac
    done
    for r in "${results[@]}"; do
      read -r label errors rc <<<"$r"
      parts+=("$label $errors")
      if [[ $errors =~ ^[0-9]+$ ]]; then total=$((total + errors)); fi
      if [[ $errors != 0 || $rc != 0 ]]; then bad_runs+=("$label(rc=$rc)"); fi
    done
    line="$tool: $total errors in ${#results[@]} runs"
    if ((${#bad_runs[@]})); then
      line+=", FAILED: ${bad_runs[*]}"
      status=1
    fi
    line+=" [${parts[*]}] ($file)"
    summary+=("$line")
  done
fi

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
