/** A tiny DeepSeek-V4-layout checkpoint for tests: hash and score routed layers, FP4 and FP8 experts. */
import type { MoEConfig } from "../../src/config/config.js";
import {
  type SaveCheckpointOptions,
  type SaveLayer,
  saveCheckpoint,
} from "../../src/weights/checkpoint-save.js";
import { RandomV4Weights } from "../../src/weights/random-v4.js";

export const VOCAB = 40;

/** V4's MoE (sqrtsoftplus, scaling 1.5, clamp 10, UE8M0 activations) at a tiny size. */
export function tinyV4(overrides: Partial<MoEConfig> = {}, hash = false): MoEConfig {
  return {
    name: "tiny-v4",
    numExperts: 8,
    hidden: 256,
    intermediate: 128,
    topK: 2,
    numShared: 1,
    ranks: 1,
    swigluClamp: 10,
    scaleFormat: "ue8m0",
    router: {
      scoring: "sqrtsoftplus",
      nGroup: 1,
      topkGroup: 1,
      correctionBias: !hash,
      renormalize: true,
      routedScalingFactor: 1.5,
      ...(hash ? { hashRouted: true } : {}),
    },
    maxTokens: 64,
    ...overrides,
  };
}

/**
 * Layers 0 (hash, FP8), 1 (hash, FP4), 2 (score, FP4), 3 (score, FP8) and mtp.0 (score, FP4), each from
 * its own seed; with a small shard budget one layer's tensors span shards. Unrelated tensors come first.
 */
export function tinyV4Layers(seed: number): SaveLayer[] {
  const fp4 = { expertFormat: "fp4" as const };
  const w = (c: MoEConfig, s: number) => new RandomV4Weights(c, seed + s, { vocab: VOCAB });
  return [
    { block: "layers.0", source: w(tinyV4({}, true), 0) },
    { block: "layers.1", source: w(tinyV4(fp4, true), 1) },
    { block: "layers.2", source: w(tinyV4(fp4), 2) },
    { block: "layers.3", source: w(tinyV4(), 3) },
    { block: "mtp.0", source: w(tinyV4(fp4), 4) },
  ];
}

export function writeTinyV4(dir: string, seed: number, opts: SaveCheckpointOptions = {}): SaveLayer[] {
  const layers = tinyV4Layers(seed);
  saveCheckpoint(dir, layers, {
    shardBytes: 600_000,
    extraTensors: [
      { name: "embed.weight", dtype: "BF16", shape: [VOCAB, 256], data: new Uint16Array(VOCAB * 256) },
      {
        name: "layers.0.attn_norm.weight",
        dtype: "BF16",
        shape: [256],
        data: new Uint16Array(256).fill(0x3f80),
      },
      {
        name: "layers.2.attn.wq_a.weight",
        dtype: "F8_E4M3",
        shape: [128, 256],
        data: new Uint8Array(128 * 256),
      },
    ],
    ...opts,
  });
  return layers;
}
