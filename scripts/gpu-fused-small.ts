/**
 * On the GPU host, for compute-sanitizer: the fused kernel on the tiny shape, T = 7 and 300, both block
 * Ms, on 4 CTAs, each output compared bit for bit with the unfused pipeline's. Exits 1 on a difference.
 *   compute-sanitizer --tool memcheck  node dist-test/scripts/gpu-fused-small.js
 *   compute-sanitizer --tool racecheck node dist-test/scripts/gpu-fused-small.js   (and synccheck)
 */
import { resolveConfig } from "../src/config/config.js";
import { DeviceTensor, openDevice } from "../src/cuda/index.js";
import { FusedPipeline } from "../src/pipeline/fused.js";
import { UnfusedPipeline } from "../src/pipeline/unfused.js";
import { randomRouting } from "../src/reference/router.js";
import { DeviceMoEWeights } from "../src/weights/device.js";
import { GeneratedWeights, generateActivations } from "../src/weights/generate.js";

const device = openDevice(0);
const config = resolveConfig("tiny");
const weights = DeviceMoEWeights.upload(
  device,
  new GeneratedWeights(config, 5, { cachedExperts: config.numExperts }),
);
const fused = new FusedPipeline(device, weights, 512);
const unfused = new UnfusedPipeline(device, weights, 512);
let failures = 0;
for (const tokens of [7, 300]) {
  const routing = randomRouting(6, tokens, config);
  const x = DeviceTensor.fromHost(
    device,
    "bf16",
    [tokens, config.hidden],
    generateActivations(7, tokens, config.hidden),
  );
  const ids = DeviceTensor.fromHost(device, "int32", [tokens, config.topK], routing.ids);
  const w = DeviceTensor.fromHost(device, "fp32", [tokens, config.topK], routing.weights);
  const out = DeviceTensor.empty(device, "bf16", [tokens, config.hidden]);
  const f = { x, ids, weights: w, out, tokens, shared: true };
  unfused.forward(f, null);
  const want = out.toHost() as Uint16Array;
  for (const blockM of [64, 128] as const) {
    fused.kernel.blockM = blockM;
    fused.kernel.ctas = 4;
    out.fill(0xff);
    fused.forward(f, null);
    fused.checkStatus();
    const got = out.toHost() as Uint16Array;
    const at = got.findIndex((v, i) => v !== want[i]);
    console.log(
      `tiny T=${tokens} BLOCK_M ${blockM}: ${at === -1 ? "equal to the unfused pipeline" : `differs at ${at}`}`,
    );
    if (at !== -1) failures += 1;
  }
  for (const t of [x, ids, w, out]) t.dispose();
}
fused.dispose();
unfused.dispose();
weights.dispose();
process.exit(failures === 0 ? 0 : 1);
