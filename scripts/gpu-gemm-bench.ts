/**
 * On the GPU host: every grouped-GEMM tile on the flash expert shapes (32 groups, M per group 64, 512,
 * 4096), so the plan's cost model can be checked against measurement. Writes results JSON to argv[2].
 * GEMM_CODES (default "quantized"): a comma list of operand code distributions to time each case with
 * (GemmBenchCodes), alternating per case so that drifts hit all alike. GEMM_TILES: "plan" times the
 * plan's pick only, a comma list of tile names the plan's pick and those (default: every tile). GEMM_M:
 * a comma list of M per group (default 64,512,4096). GEMM_MAX_CTAS: a comma list of grid caps ("-": none).
 * GEMM_WARMUP_MS (default 0) and GEMM_ITERS (default 20): untimed GPU time before each case's timed runs
 * (a second or so gives the clock a power-capped card sustains), and the timed runs. Each row records
 * when its timed runs ended (wall_end_s), for scripts/clock-windows.py.
 */
import { deviceSummary, openDevice, writeResults } from "../src/cuda/index.js";
import { GEMM_TILE_NAMES, type GemmTileName } from "../src/kernels/gemm/fp8_grouped_gemm.variants.js";
import {
  benchmarkGroupedGemm,
  type GemmBenchCodes,
  type GroupedGemmBenchCase,
} from "../src/kernels/gemm/grouped_gemm.js";

const device = openDevice(0);
const tiles = ((): GemmTileName[] => {
  const asked = process.env.GEMM_TILES;
  if (asked === undefined) return GEMM_TILE_NAMES;
  if (asked === "plan") return [];
  const names = asked.split(",") as GemmTileName[];
  const unknown = names.filter((name) => !GEMM_TILE_NAMES.includes(name));
  if (unknown.length > 0)
    throw new Error(`GEMM_TILES: unknown tile ${unknown.join(", ")} (${GEMM_TILE_NAMES.join(", ")})`);
  return names;
})();
const mPerGroup = (process.env.GEMM_M ?? "64,512,4096").split(",").map(Number);
const codesList = (process.env.GEMM_CODES ?? "quantized").split(",") as GemmBenchCodes[];
// GEMM_MAX_CTAS: a comma list of grid caps to time each case with ("-" for none, the default).
const ctasList = (process.env.GEMM_MAX_CTAS ?? "-")
  .split(",")
  .map((v) => (v === "-" ? undefined : Number(v)));
const warmupMs = Number(process.env.GEMM_WARMUP_MS ?? "0");
const iters = Number(process.env.GEMM_ITERS ?? "20");
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
if (process.argv[2]) {
  writeResults(process.argv[2], {
    device: deviceSummary(device),
    command: "node dist-test/scripts/gpu-gemm-bench.js",
    rows,
  });
}
