/** The CI kernel check's reading of ptxas -v: per-entry figures and what fails the check. */
import assert from "node:assert/strict";
import { test } from "node:test";
import { parsePtxasReport, ptxasProblems } from "../../scripts/ptxas-report.js";

// Shaped like nvcc 13's output: the warning before the entry's lines, a non-inlined callee after it.
const LOG = `ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.DP in divergent path in the function 'gemm'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm' for 'sm_90a'
ptxas info    : Function properties for gemm
    16 bytes stack frame, 20 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 16 bytes cumulative stack size
ptxas info    : Function properties for _Z6reportPiiii
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'clean' for 'sm_90a'
ptxas info    : Function properties for clean
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 512 bytes smem
`;

test("each entry keeps its own figures; a callee's report does not overwrite them", () => {
  const [gemm, clean] = parsePtxasReport(LOG);
  assert.deepEqual(gemm, {
    name: "gemm",
    registers: 168,
    stackBytes: 16,
    spillStores: 20,
    spillLoads: 88,
    sharedBytes: 0,
    wgmmaSerialized: true,
  });
  assert.equal(clean?.registers, 40);
  assert.equal(clean?.sharedBytes, 512);
  assert.equal(clean?.wgmmaSerialized, false);
});

test("serialized wgmmas fail every variant; spills only the no-spill ones", () => {
  const functions = parsePtxasReport(LOG);
  assert.deepEqual(ptxasProblems(functions, false), ["gemm: ptxas serializes its wgmmas (C7518)"]);
  assert.deepEqual(ptxasProblems(functions, true), [
    "gemm: ptxas serializes its wgmmas (C7518)",
    "gemm spills (20/88 B)",
    "gemm uses a 16 B stack frame",
  ]);
  assert.deepEqual(ptxasProblems(functions.slice(1), true), []);
  assert.deepEqual(ptxasProblems([], false), ["no entry function in ptxas report"]);
});
