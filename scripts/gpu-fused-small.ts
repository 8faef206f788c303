/**
 * On the GPU host, for compute-sanitizer: the fused kernel on the tiny shape, T = 7 and 300, every block
 * M, on 4 CTAs, each output compared bit for bit with the unfused pipeline's. Exits 1 on a difference.
 *   compute-sanitizer --tool memcheck  node dist-test/scripts/gpu-fused-small.js
 *   compute-sanitizer --tool racecheck node dist-test/scripts/gpu-fused-small.js   (and synccheck)
 */

import { forwardOperands } from "../src/bench/layer.js";
import { resolveConfig } from "../src/config/config.js";
import { openDevice } from "../src/cuda/index.js";
import { FUSED_BLOCK_MS, type FusedBlockM } from "../src/kernels/megamoe/megamoe.variants.js";
import { FusedPipeline } from "../src/pipeline/fused.js";
import { UnfusedPipeline } from "../src/pipeline/unfused.js";
import { randomRouting } from "../src/reference/router.js";
import { DeviceMoEWeights } from "../src/weights/device.js";
import { GeneratedWeights } from "../src/weights/generate.js";

const device = openDevice(0);
const config = resolveConfig("tiny");
const weights = DeviceMoEWeights.upload(
  device,
  new GeneratedWeights(config, 5, { cachedExperts: config.numExperts }),
);
const fused = new FusedPipeline(device, weights, 512);
const unfused = new UnfusedPipeline(device, weights, 512);
// FUSED_SMALL_BLOCK_MS (a comma list) narrows the block Ms, e.g. to keep a sanitizer run short.
const blockMs =
  process.env.FUSED_SMALL_BLOCK_MS?.split(",").map((m) => Number(m) as FusedBlockM) ?? FUSED_BLOCK_MS;
let failures = 0;
for (const tokens of [7, 300]) {
  const operands = forwardOperands(device, config, tokens, randomRouting(6, tokens, config), 7);
  const { out } = operands;
  const f = { ...operands, tokens, shared: true };
  unfused.forward(f, null);
  const want = out.toHost() as Uint16Array;
  for (const blockM of blockMs) {
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
  operands.dispose();
}
fused.dispose();
unfused.dispose();
weights.dispose();
process.exit(failures === 0 ? 0 : 1);
