/**
 * Lab helper (lab/stream.sh runs it on the GPU host from dist-test): the decode weight stream with no
 * math (probe_tma_stream), each CTA streaming one weight tile through a TMA stage ring, for every
 * combination of the options, beside the device's read ceiling (probe_read). Answers what a layout or a
 * box shape would give the fused kernel's producer before the kernel changes: FP8's 128-byte row pieces
 * against packed FP4's 64-byte ones, row-major against K-block-major (a box contiguous in memory),
 * through the tensor map of the layer's rows, one of rows twice as wide, or as plain bulk copies.
 *   node dist-test/lab/stream.js [--ctas 96,132] [--tile-rows 256] [--box-rows 128] [--k-blocks 32]
 *     [--pieces 128,64] [--layouts row-major,kblock-major,kblock-wide,kblock-bulk] [--stages 4,8] [--rounds 2] [--out FILE]
 * Rounds repeat the whole grid in the same order, so clock drift shows as round-to-round spread.
 */
import { parseArgs } from "node:util";
import { SM90_SHARED_OPTIN_BYTES } from "../src/cuda/hardware.js";
import { deviceSummary, openDevice, writeResults } from "../src/cuda/index.js";
import {
  measureReadCeiling,
  measureWeightStream,
  WEIGHT_LAYOUTS,
  type WeightLayout,
  weightStreamSharedBytes,
} from "../src/kernels/probe/probe.js";

const { values: args } = parseArgs({
  options: {
    ctas: { type: "string", default: "96,132" },
    "tile-rows": { type: "string", default: "256" },
    "box-rows": { type: "string", default: "128" },
    "k-blocks": { type: "string", default: "32" },
    pieces: { type: "string", default: "128,64" },
    layouts: { type: "string", default: "row-major,kblock-major,kblock-wide,kblock-bulk" },
    stages: { type: "string", default: "4,8" },
    rounds: { type: "string", default: "2" },
    out: { type: "string" },
  },
});
const list = (name: string, text: string): number[] => {
  const v = text.split(",").map(Number);
  if (v.some((x) => !Number.isInteger(x) || x <= 0))
    throw new Error(`--${name}: positive integers, not ${text}`);
  return v;
};
const pieces = list("pieces", args.pieces);
if (pieces.some((p) => p !== 64 && p !== 128)) throw new Error(`--pieces: 64 or 128, not ${args.pieces}`);
const layouts = args.layouts.split(",") as WeightLayout[];
if (layouts.some((l) => !WEIGHT_LAYOUTS.includes(l)))
  throw new Error(`--layouts: ${WEIGHT_LAYOUTS.join(", ")}, not ${args.layouts}`);

const device = openDevice(0);
const read = measureReadCeiling(device);
console.log(`read ceiling ${read.tbps.toFixed(2)} TB/s`);
const rows: Record<string, unknown>[] = [{ probe: "read ceiling", bytes: read.bytes, tbps: read.tbps }];
for (let round = 1; round <= Number(args.rounds); round++) {
  for (const ctas of list("ctas", args.ctas))
    for (const tileRows of list("tile-rows", args["tile-rows"]))
      for (const boxRows of list("box-rows", args["box-rows"]))
        for (const kBlocks of list("k-blocks", args["k-blocks"]))
          for (const pieceBytes of pieces as (64 | 128)[])
            for (const layout of layouts)
              for (const stages of list("stages", args.stages)) {
                const o = { ctas, tileRows, boxRows, kBlocks, pieceBytes, layout, stages };
                if (weightStreamSharedBytes(o) > SM90_SHARED_OPTIN_BYTES) {
                  if (round === 1) console.log(`skipped (shared memory): ${JSON.stringify(o)}`);
                  continue;
                }
                const r = measureWeightStream(device, o);
                rows.push({
                  round,
                  ...o,
                  bytes: ctas * tileRows * kBlocks * pieceBytes,
                  us: r.us,
                  tbps: r.tbps,
                });
                console.log(
                  `r${round} ctas=${ctas} tile=${tileRows}×${kBlocks}×${pieceBytes} B box=${boxRows} ${layout} stages=${stages}: ` +
                    `${r.us.toFixed(1)} µs, ${r.tbps.toFixed(2)} TB/s`,
                );
              }
}
if (args.out !== undefined) {
  // The recipe's results file, written anew on each run of the recipe (as bench --force).
  writeResults(
    args.out,
    {
      device: deviceSummary(device),
      command: `node dist-test/lab/stream.js ${process.argv.slice(2).join(" ")}`,
      rows,
    },
    { overwrite: true },
  );
}
