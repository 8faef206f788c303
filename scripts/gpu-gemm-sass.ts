/** Diagnosis on the GPU host: write the JIT's cubin of one grouped-GEMM plan to argv[2]. */
import fs from "node:fs";
import { compileKernel } from "../src/cuda/index.js";
import type { GemmTileName } from "../src/kernels/gemm/fp8_grouped_gemm.variants.js";
import { planGroupedGemm } from "../src/kernels/gemm/grouped_gemm.js";

const [, , out, tile, mTotal, n, k, groups] = process.argv;
const plan = planGroupedGemm(
  { mTotal: Number(mTotal), n: Number(n), k: Number(k), groups: Number(groups), outDtype: "fp32" },
  { tile: tile as GemmTileName },
);
const compiled = compileKernel({ source: "gemm/fp8_grouped_gemm.cu", defines: plan.defines });
fs.writeFileSync(out, compiled.cubin);
console.log(JSON.stringify(plan.defines));
