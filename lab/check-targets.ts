/**
 * The small runs lab/check.sh puts under compute-sanitizer, one target per process so a report names
 * what it covers:
 *
 *   fused BLOCK_M [fp8|fp4]  the fused kernel forced to one block M on the tiny shape (FP8 or FP4
 *                  routed experts, default FP8; FP4 at 128 also expanded), T = 7 and 300, on 4 CTAs
 *                  (more than one CTA, few enough that racecheck stays short), each output equal to
 *                  the unfused pipeline's bit for bit
 *   gate           the router (both logits paths) on tiny (E = 8, grouped sigmoid) and E = 64 softmax
 *   norm           RMSNorm with FP8 output, plain rows and the 4-stream pre-mix, H = 256, 384 and 4096
 *   ep RANKS [fp8|fp4] [BLOCK_M] [expand]  expert parallelism inside the fused kernel: RANKS virtual
 *                  ranks (one launch each, on its own stream) of tiny with 16 experts, uneven tokens, a
 *                  masked token and a hot expert, at BLOCK_M (default the heuristic's; "expand" forces
 *                  FP4's expand variant, BLOCK_M 64 or 128), each rank's output equal to the
 *                  host-planned layer's bit for bit
 *
 * (The grouped GEMM runs through its own test file's small cases: MEGAMOE_GEMM_CASE.) Each prints one
 * line per sub-case and exits 1 when an output is wrong, so a sanitizer run also says whether the
 * kernel still computed the right thing under instrumentation.
 *   node dist-test/lab/check-targets.js fused 64
 */
import { pathToFileURL } from "node:url";
import { forwardOperands } from "../src/bench/layer.js";
import { EXPERT_FORMATS, type ExpertFormat, type MoEConfig, resolveConfig } from "../src/config/config.js";
import { type Device, DeviceTensor, openDevice } from "../src/cuda/index.js";
import { DeviceMoEWeights } from "../src/kernels/device-weights.js";
import { routeOnDevice } from "../src/kernels/gate/gate.js";
import { FUSED_BLOCK_MS, type FusedBlockM } from "../src/kernels/megamoe/megamoe.variants.js";
import { rmsNormOnDevice } from "../src/kernels/norm/norm.js";
import { allocQuantOutputs } from "../src/kernels/quant/quant.js";
import { f32ToBf16Bits } from "../src/numerics/bf16.js";
import { ExpertParallelMoE, type RankInput } from "../src/parallel/expert-parallel.js";
import { FusedExpertParallel } from "../src/parallel/fused-expert-parallel.js";
import { FusedPipeline } from "../src/pipeline/fused.js";
import { UnfusedPipeline } from "../src/pipeline/unfused.js";
import { randomRouting } from "../src/reference/router.js";
import { GeneratedWeights, generateActivations, generateGate } from "../src/weights/generate.js";

export const CHECK_TARGETS = ["fused", "ep", "gate", "norm"] as const;
const TOKENS = [7, 300];

/** The fused kernel at one block M against the unfused pipeline; returns the failures. */
function fused(device: Device, blockM: FusedBlockM, expertFormat: ExpertFormat): number {
  const config = resolveConfig("tiny", { expertFormat });
  const weights = DeviceMoEWeights.upload(
    device,
    new GeneratedWeights(config, 5, { cachedExperts: config.numExperts }),
  );
  const f = new FusedPipeline(device, weights, 512);
  const u = new UnfusedPipeline(device, weights, 512);
  // FP4 128-row tiles also run expanded (every weight stage converted once per forward).
  const expands = expertFormat === "fp4" && blockM === 128 ? [false, true] : [false];
  let failures = 0;
  try {
    for (const tokens of TOKENS) {
      // Token 3 masked, expert 0 hot: empty and crowded experts in one launch.
      const routing = randomRouting(6, tokens, config, { maskedTokens: [3], hotExpert: 0 });
      const operands = forwardOperands(device, config, tokens, routing, 7);
      try {
        const args = { ...operands, tokens, shared: true };
        u.forward(args, null);
        u.checkStatus();
        const want = operands.out.toHost() as Uint16Array;
        for (const expand of expands) {
          f.kernel.blockM = blockM;
          f.kernel.ctas = 4;
          if (expertFormat === "fp4") f.kernel.fp4Expand = expand;
          operands.out.fill(0xff);
          f.fillScratch(0xff);
          f.forward(args, null);
          f.checkStatus();
          const got = operands.out.toHost() as Uint16Array;
          const at = got.findIndex((v, i) => v !== want[i]);
          console.log(
            `fused tiny ${expertFormat}${expand ? " expanded" : ""} T=${tokens} BLOCK_M ${blockM}: ${at === -1 ? "equal to the unfused pipeline" : `differs at ${at}`}`,
          );
          if (at !== -1) failures++;
        }
      } finally {
        operands.dispose();
      }
    }
  } finally {
    f.dispose();
    u.dispose();
    weights.dispose();
  }
  return failures;
}

/** R virtual ranks of the EP build against the host-planned layer on the same GPU; returns the failures. */
function ep(
  device: Device,
  ranks: number,
  expertFormat: ExpertFormat,
  blockM: "auto" | FusedBlockM,
  fp4Expand: boolean,
): number {
  // 16 experts of top-4, so that 8 ranks still hold 2 each.
  const config: MoEConfig = {
    ...resolveConfig("tiny", { expertFormat }),
    numExperts: 16,
    topK: 4,
    maxTokens: 16,
  };
  const weights = new GeneratedWeights(config, 11);
  const inputs: RankInput[] = Array.from({ length: ranks }, (_, s) => {
    const tokens = [5, 1, 9, 16, 3, 7, 2, 11][s]!;
    const routing = randomRouting(60 + s, tokens, config, {
      maskedTokens: tokens > 2 ? [1] : [],
      hotExpert: 6,
    });
    return { x: generateActivations(40 + s, tokens, config.hidden), tokens, ...routing };
  });
  const host = new ExpertParallelMoE(weights, { ranks, backend: "cuda", devices: device, pipeline: "fused" });
  const fused = new FusedExpertParallel(weights, {
    ranks,
    devices: device,
    maxTokens: 16,
    blockM,
    ...(fp4Expand ? { fp4Expand } : {}),
  });
  let failures = 0;
  try {
    const want = host.forward(inputs).out;
    const got = fused.forward(inputs).out;
    inputs.forEach((input, s) => {
      const at = got[s]!.findIndex((v, i) => v !== want[s]![i]);
      console.log(
        `ep tiny ${expertFormat}${fp4Expand ? " expanded" : ""} ${ranks} ranks, block M ${blockM}, rank ${s} T=${input.tokens}: ${at === -1 ? "equal to the host-planned layer" : `differs at ${at}`}`,
      );
      if (at !== -1) failures++;
    });
  } finally {
    fused.dispose();
    host.dispose();
  }
  return failures;
}

/** The router on two configs and both logits paths; checks ids are distinct experts or −1. */
function gate(device: Device): number {
  const configs: MoEConfig[] = [
    resolveConfig("tiny"),
    resolveConfig("tiny", {
      numExperts: 64,
      hidden: 512,
      topK: 6,
      router: { ...resolveConfig("tiny").router, scoring: "softmax", nGroup: 1, topkGroup: 1 },
    }),
  ];
  let failures = 0;
  for (const c of configs) {
    const g = generateGate(c, 9);
    const owned: DeviceTensor[] = [];
    const keep = <T extends DeviceTensor>(t: T) => {
      owned.push(t);
      return t;
    };
    try {
      const weight = keep(DeviceTensor.fromHost(device, "bf16", [c.numExperts, c.hidden], g.weight));
      const bias = g.bias ? keep(DeviceTensor.fromHost(device, "fp32", [c.numExperts], g.bias)) : null;
      for (const tokens of TOKENS) {
        const x = keep(
          DeviceTensor.fromHost(device, "bf16", [tokens, c.hidden], generateActivations(3, tokens, c.hidden)),
        );
        for (const logits of ["exact", "fast"] as const) {
          const ids = keep(DeviceTensor.empty(device, "int32", [tokens, c.topK]));
          const weights = keep(DeviceTensor.empty(device, "fp32", [tokens, c.topK]));
          const logitsOut = keep(DeviceTensor.empty(device, "fp32", [tokens, c.numExperts]));
          ids.fill(0x7f);
          routeOnDevice(device, x, { weight, bias }, c, { ids, weights, logits: logitsOut }, null, {
            logits,
          });
          device.synchronize();
          const got = ids.toHost() as Int32Array;
          let bad = -1;
          for (let t = 0; t < tokens && bad === -1; t++) {
            const row = Array.from(got.subarray(t * c.topK, (t + 1) * c.topK));
            const valid = row.every((e) => e >= 0 && e < c.numExperts) && new Set(row).size === row.length;
            if (!valid) bad = t;
          }
          console.log(
            `gate E=${c.numExperts} H=${c.hidden} ${c.router.scoring} T=${tokens} ${logits}: ${bad === -1 ? "ids valid" : `token ${bad} has bad ids`}`,
          );
          if (bad !== -1) failures++;
        }
      }
    } finally {
      for (const t of owned) t.dispose();
    }
  }
  return failures;
}

/** RMSNorm with bf16 and FP8 outputs; checks every output element was written and is finite. */
function norm(device: Device): number {
  let failures = 0;
  // 4096: the few-token kernel's full block of 8 warps (T = 7), beside the one-warp kernel (T = 300).
  for (const hidden of [256, 384, 4096]) {
    for (const tokens of TOKENS) {
      for (const streams of [0, 4]) {
        const owned: DeviceTensor[] = [];
        const keep = <T extends DeviceTensor>(t: T) => {
          owned.push(t);
          return t;
        };
        try {
          const weightBits = new Uint16Array(hidden).map((_, i) => f32ToBf16Bits(0.5 + (i % 7) / 8));
          const weight = keep(DeviceTensor.fromHost(device, "bf16", [hidden], weightBits));
          const rows = Math.max(1, streams) * tokens;
          const data = generateActivations(4, rows, hidden);
          const input =
            streams === 0
              ? { x: keep(DeviceTensor.fromHost(device, "bf16", [tokens, hidden], data)) }
              : {
                  streams: keep(DeviceTensor.fromHost(device, "bf16", [tokens, streams, hidden], data)),
                  mix: keep(
                    DeviceTensor.fromHost(
                      device,
                      "fp32",
                      [tokens, streams],
                      new Float32Array(tokens * streams).map((_, i) => 0.25 + (i % 3) / 4),
                    ),
                  ),
                };
          const y = keep(DeviceTensor.empty(device, "bf16", [tokens, hidden]));
          const q = allocQuantOutputs(device, tokens, hidden);
          keep(q.q);
          keep(q.scales);
          y.fill(0xff);
          q.scales.fill(0xff);
          rmsNormOnDevice(device, input, weight, 1e-6, { y, fp8: { ...q, format: "fp32" } }, null);
          device.synchronize();
          const yBits = y.toHost() as Uint16Array;
          const scales = q.scales.toHost() as Float32Array;
          const badY = yBits.findIndex((v) => (v & 0x7f80) === 0x7f80);
          const badScale = scales.findIndex((v) => !Number.isFinite(v));
          const ok = badY === -1 && badScale === -1;
          console.log(
            `norm H=${hidden} T=${tokens} ${streams === 0 ? "rows" : `${streams}-stream pre-mix`}: ${ok ? "outputs finite" : `non-finite y at ${badY}, scale at ${badScale}`}`,
          );
          if (!ok) failures++;
        } finally {
          for (const t of owned) t.dispose();
        }
      }
    }
  }
  return failures;
}

export const TARGETS_HELP = `node dist-test/lab/check-targets.js TARGET [ARG]: one small run for compute-sanitizer
  fused BLOCK_M [fp8|fp4]  the fused kernel at BLOCK_M (${FUSED_BLOCK_MS.join(", ")}) against the unfused
                  pipeline, with FP8 (default) or FP4 routed experts
  ep RANKS [fp8|fp4] [BLOCK_M] [expand]  RANKS (2, 4, 8) virtual ranks of the EP build against the
                  host-planned layer, at BLOCK_M (default the heuristic's); expand: FP4 expanded
  gate            the router, both logits paths
  norm            RMSNorm with FP8 output, plain rows and the pre-mix
Exit status 1 when an output is wrong, 2 for a usage error.`;

function main(argv: string[]): number {
  const [target, arg, format = "fp8", epBlockM = "auto", epExpand] = argv;
  if (target === undefined || target === "--help" || target === "-h") {
    console.log(TARGETS_HELP);
    return target === undefined ? 2 : 0;
  }
  const device = openDevice(0);
  let failures: number;
  if (target === "fused") {
    const blockM = Number(arg) as FusedBlockM;
    if (!FUSED_BLOCK_MS.includes(blockM)) {
      console.error(`fused needs a block M, one of ${FUSED_BLOCK_MS.join(", ")}; got ${arg}`);
      return 2;
    }
    if (!EXPERT_FORMATS.includes(format as ExpertFormat)) {
      console.error(`fused takes fp8 or fp4 experts; got ${format}`);
      return 2;
    }
    failures = fused(device, blockM, format as ExpertFormat);
  } else if (target === "ep") {
    const ranks = Number(arg);
    if (![2, 4, 8].includes(ranks)) {
      console.error(`ep needs 2, 4 or 8 ranks; got ${arg}`);
      return 2;
    }
    if (!EXPERT_FORMATS.includes(format as ExpertFormat)) {
      console.error(`ep takes fp8 or fp4 experts; got ${format}`);
      return 2;
    }
    const blockM = epBlockM === "auto" ? "auto" : (Number(epBlockM) as FusedBlockM);
    if (blockM !== "auto" && !FUSED_BLOCK_MS.includes(blockM)) {
      console.error(`ep takes a block M of ${FUSED_BLOCK_MS.join(", ")}; got ${epBlockM}`);
      return 2;
    }
    if (
      epExpand !== undefined &&
      (epExpand !== "expand" || format !== "fp4" || blockM === "auto" || blockM < 64)
    ) {
      console.error(
        `ep's last argument is "expand", with fp4 experts and a block M of 64 or 128; got ${argv.slice(1).join(" ")}`,
      );
      return 2;
    }
    failures = ep(device, ranks, format as ExpertFormat, blockM, epExpand === "expand");
  } else if (target === "gate") failures = gate(device);
  else if (target === "norm") failures = norm(device);
  else {
    console.error(`unknown target "${target}"\n${TARGETS_HELP}`);
    return 2;
  }
  console.log(`${target}${arg ? ` ${arg}` : ""}: ${failures === 0 ? "ok" : `${failures} wrong outputs`}`);
  return failures === 0 ? 0 : 1;
}

if (process.argv[1] !== undefined && import.meta.url === pathToFileURL(process.argv[1]).href) {
  process.exitCode = main(process.argv.slice(2));
}
