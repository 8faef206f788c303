/**
 * Lab helper (lab/gemm.sh runs it on the GPU host from dist-test): the grouped GEMM on the flash expert
 * shapes (32 groups, L1 N = K = 4096, L2 N = 4096 K = 2048), every case alternating its code
 * distributions and grid caps so that drifts hit all alike. Each row records when its timed runs ended
 * (wall_end_s), for lab/clock-windows.py.
 *   node dist-test/lab/gemm-tiles.js [--tiles plan|all|T,T] [--m 64,512,4096] [--codes quantized,...]
 *     [--ctas -,124] [--warmup-ms 0] [--iters 20] [--out results.json]
 * --tiles: "plan" (the default) times the plan's pick only, "all" the plan's pick and every tile, a
 * comma list the plan's pick and those. --ctas: grid caps ("-": none).
 */
import { parseArgs } from "node:util";
import {
  benchmarkGroupedGemm,
  type GemmBenchCodes,
  type GroupedGemmBenchCase,
} from "../src/bench/grouped-gemm.js";
import { deviceSummary, openDevice, writeResults } from "../src/cuda/index.js";
import { GEMM_TILE_NAMES, type GemmTileName } from "../src/kernels/gemm/fp8_grouped_gemm.variants.js";

const { values: args } = parseArgs({
  options: {
    tiles: { type: "string", default: "plan" },
    m: { type: "string", default: "64,512,4096" },
    codes: { type: "string", default: "quantized" },
    ctas: { type: "string", default: "-" },
    "warmup-ms": { type: "string", default: "0" },
    iters: { type: "string", default: "20" },
    out: { type: "string" },
  },
});
const device = openDevice(0);
const tiles = ((): GemmTileName[] => {
  if (args.tiles === "all") return GEMM_TILE_NAMES;
  if (args.tiles === "plan") return [];
  const names = args.tiles.split(",") as GemmTileName[];
  const unknown = names.filter((name) => !GEMM_TILE_NAMES.includes(name));
  if (unknown.length > 0)
    throw new Error(`--tiles: unknown tile ${unknown.join(", ")} (${GEMM_TILE_NAMES.join(", ")})`);
  return names;
})();
const mPerGroup = args.m.split(",").map(Number);
const codesList = args.codes.split(",") as GemmBenchCodes[];
const ctasList = args.ctas.split(",").map((v) => (v === "-" ? undefined : Number(v)));
const warmupMs = Number(args["warmup-ms"]);
const iters = Number(args.iters);
const shapes = [
  { name: "flash-L1", n: 4096, k: 4096 },
  { name: "flash-L2", n: 4096, k: 2048 },
];
const rows = [];
for (const s of shapes) {
  for (const m of mPerGroup) {
    const base = { config: s.name, groups: 32, mPerGroup: m, n: s.n, k: s.k };
    const cases: GroupedGemmBenchCase[] = [base, ...tiles.map((tile) => ({ ...base, tile }))];
    for (const c of cases) {
      for (const maxCtas of ctasList) {
        for (const codes of codesList) {
          const grid = maxCtas === undefined ? "" : ` ${maxCtas} CTAs`;
          try {
            const [row] = benchmarkGroupedGemm(device, [{ ...c, codes, maxCtas }], {
              warmup: 5,
              warmupMs,
              iters,
            });
            const picked = c.tile === undefined ? "plan" : "forced";
            // When the timed runs ended (Unix seconds), to match the row with a clock log.
            rows.push({ ...row, choice: picked, wall_end_s: Date.now() / 1000 });
            console.log(
              `${s.name} M/group=${m} ${picked.padEnd(6)} ${String(row.tile).padEnd(9)} ${codes.padEnd(13)}${grid} ${row.us_median.toFixed(1).padStart(8)} µs  floor ${row.floor_us.toFixed(1).padStart(7)}  ${row.tflops.toFixed(0).padStart(5)} TFLOP/s`,
            );
          } catch (e) {
            console.log(
              `${s.name} M/group=${m} ${c.tile ?? "plan"} ${codes}${grid}: FAILED ${(e as Error).message.split("\n")[0]}`,
            );
          }
        }
      }
    }
  }
}
if (args.out !== undefined) {
  // The recipe's results file, written anew on each run of the recipe (as bench --force).
  writeResults(
    args.out,
    {
      device: deviceSummary(device),
      command: `node dist-test/lab/gemm-tiles.js ${process.argv.slice(2).join(" ")}`,
      rows,
    },
    { overwrite: true },
  );
}
