/**
 * On the GPU host: the router (MegaGate, both logits paths) timed alone, graph replays with the L2
 * flushed, for each preset at decode and prefill batch sizes, so the default path's threshold
 * (GATE_EXACT_MAX_MACS) rests on measurement. Prints a table and writes JSON to --out.
 *   node dist-test/scripts/gpu-gate-bench.js --out gate.json
 */
import { resolveConfig } from "../src/config/config.js";
import { DeviceTensor, deviceSummary, openDevice, timeKernel, writeResults } from "../src/cuda/index.js";
import {
  defaultGateLogits,
  type GateLogits,
  planGate,
  reserveGateWorkspace,
  routeOnDevice,
} from "../src/kernels/gate/gate.js";
import { f32ToBf16Bits } from "../src/numerics/bf16.js";

const outIndex = process.argv.indexOf("--out");
const out = outIndex > 0 ? process.argv[outIndex + 1] : undefined;
const device = openDevice(0);
const TOKENS = [1, 8, 32, 128, 256, 1024, 8192];
const rows: Record<string, unknown>[] = [];
let state = 0x9e3779b9;
const random = () => {
  state = (Math.imul(state ^ (state >>> 15), 0x2c1b3c6d) + 0x6d2b79f5) >>> 0;
  return state / 2 ** 32;
};
for (const shape of ["flash-ep8", "flash", "pro"]) {
  const c = resolveConfig(shape);
  const { hidden: H, numExperts: E, topK } = c;
  const maxT = TOKENS[TOKENS.length - 1]!;
  const xHost = new Uint16Array(maxT * H).map(() => f32ToBf16Bits(random() * 2 - 1));
  const wHost = new Uint16Array(E * H).map(() => f32ToBf16Bits((random() * 2 - 1) * (2 / Math.sqrt(H))));
  const weight = DeviceTensor.fromHost(device, "bf16", [E, H], wHost);
  const bias = c.router.correctionBias
    ? DeviceTensor.fromHost(device, "fp32", [E], new Float32Array(E))
    : null;
  for (const tokens of TOKENS) {
    const x = DeviceTensor.fromHost(device, "bf16", [tokens, H], xHost.subarray(0, tokens * H));
    const ids = DeviceTensor.empty(device, "int32", [tokens, topK]);
    const weights = DeviceTensor.empty(device, "fp32", [tokens, topK]);
    const line: string[] = [];
    for (const logits of ["fast", "exact"] as GateLogits[]) {
      reserveGateWorkspace(device, planGate(tokens, H, E, device.smCount, logits).workspaceBytes);
      const t = timeKernel(
        device,
        (s) => routeOnDevice(device, x, { weight, bias }, c, { ids, weights }, s, { logits }),
        {
          warmup: 3,
          iters: 20,
          graph: true,
        },
      );
      rows.push({
        shape,
        tokens,
        logits,
        us: t.usMedian,
        default: defaultGateLogits(tokens, H, E, c.router.scoring) === logits,
      });
      line.push(`${logits} ${t.usMedian.toFixed(1).padStart(7)} µs`);
    }
    console.log(
      `${shape.padEnd(10)} T=${String(tokens).padStart(5)}: ${line.join("  ")}  (default ${defaultGateLogits(tokens, H, E, c.router.scoring)})`,
    );
    for (const t of [x, ids, weights]) t.dispose();
  }
  weight.dispose();
  bias?.dispose();
}
if (out) {
  writeResults(out, {
    device: deviceSummary(device),
    command: `node dist-test/scripts/gpu-gate-bench.js --out ${out}`,
    rows,
  });
}
