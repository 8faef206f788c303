/**
 * On the GPU host: the tensor cores' FP8 rate in the mainloops' wgmma shapes with no memory traffic
 * (`probe_wgmma_n128/256`): n128 vs n256 wgmmas, one or two warpgroups, with and without the per-block
 * promotion. The question it answers: can a mainloop of n128 chunks, waited for one at a time, reach the
 * ~1500 TFLOP/s that a dense FP8 GEMM reaches, or is ~70–78% its own ceiling? (Rates without promotion
 * are upper bounds: see probe.cu.)
 *   node dist-test/scripts/gpu-wgmma-rate.js --out wgmma-rate.json
 */
import { deviceSummary, openDevice, writeResults } from "../src/cuda/index.js";
import { measureWgmmaRate, type WgmmaRateOptions } from "../src/kernels/probe/probe.js";

const outIndex = process.argv.indexOf("--out");
const out = outIndex > 0 ? process.argv[outIndex + 1] : undefined;
const device = openDevice(0);
const cases: Omit<WgmmaRateOptions, "kBlocks">[] = [
  { n: 128, warpgroups: 2, chunks: 2, promote: true }, // the fused kernel's and the m128n256 GEMM's mainloop
  { n: 128, warpgroups: 2, chunks: 2, promote: false },
  { n: 128, warpgroups: 1, chunks: 2, promote: true },
  { n: 128, warpgroups: 1, chunks: 2, promote: false },
  // One n128 chunk per warpgroup and K block: do three warpgroups fill the promotions better than two?
  { n: 128, warpgroups: 3, chunks: 1, promote: true },
  { n: 128, warpgroups: 2, chunks: 1, promote: true },
  { n: 256, warpgroups: 2, chunks: 1, promote: false },
  { n: 256, warpgroups: 1, chunks: 1, promote: false },
];
const rows: Record<string, unknown>[] = [];
for (const c of cases) {
  const m = measureWgmmaRate(device, { ...c, kBlocks: 4096 });
  rows.push({ ...c, kBlocks: 4096, us: m.us, tflops: m.tflops });
  console.log(
    `n${c.n} × ${c.chunks} chunk(s), ${c.warpgroups} warpgroup(s), ${c.promote ? "promoted" : "no promotion"}: ${m.tflops.toFixed(0).padStart(5)} TFLOP/s (${m.us.toFixed(0)} µs)`,
  );
}
if (out) {
  writeResults(out, {
    device: deviceSummary(device),
    command: `node dist-test/scripts/gpu-wgmma-rate.js --out ${out}`,
    rows,
  });
}
