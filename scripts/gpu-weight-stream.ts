/**
 * On the GPU host: how fast TMA streams the layer's weight tiles at decode, by weight layout, CTA count,
 * box rows and ring depth (`probe_tma_stream`, no math). The question it answers: is the decode L1
 * phase's ~3.2 TB/s the row-major layout's (128 bytes out of rows 4 KB apart per box row) or the
 * number of busy SMs'? Prints one line per configuration and writes JSON to --out.
 *   node dist-test/scripts/gpu-weight-stream.js --out weight-stream.json
 */
import { deviceSummary, openDevice, writeResults } from "../src/cuda/index.js";
import { measureReadCeiling, measureWeightStream, type WeightLayout } from "../src/kernels/probe/probe.js";

const outIndex = process.argv.indexOf("--out");
const out = outIndex > 0 ? process.argv[outIndex + 1] : undefined;
const device = openDevice(0);
const read = measureReadCeiling(device);
console.log(`read stream ceiling: ${read.tbps.toFixed(2)} TB/s`);
const rows: Record<string, unknown>[] = [];
for (const layout of ["row-major", "kblock-major"] as WeightLayout[]) {
  for (const ctas of [96, 112, 132]) {
    for (const [tileRows, boxRows] of [
      [256, 128],
      [256, 256],
      [128, 128],
    ]) {
      for (const stages of [4, 6]) {
        const kBlocks = 32; // flash's K = H = 4096
        const m = measureWeightStream(device, { ctas, tileRows, boxRows, kBlocks, layout, stages });
        const row = { layout, ctas, tileRows, boxRows, stages, kBlocks, us: m.us, tbps: m.tbps };
        rows.push(row);
        console.log(
          `${layout.padEnd(12)} ctas ${String(ctas).padStart(3)} tile ${tileRows} box ${boxRows} stages ${stages}: ${m.us.toFixed(1).padStart(7)} µs ${m.tbps.toFixed(2)} TB/s (${((m.tbps / read.tbps) * 100).toFixed(0)}% of the read stream)`,
        );
      }
    }
  }
}
if (out) {
  writeResults(out, {
    device: { ...deviceSummary(device), read_tbps: read.tbps },
    command: `node dist-test/scripts/gpu-weight-stream.js --out ${out}`,
    rows,
  });
}
