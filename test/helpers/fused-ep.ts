/**
 * What the in-kernel EP GPU tests share (test/gpu/fused-ep.test.ts, fused-ep-gpus.test.ts and its rank
 * processes, fused-ep-peer.ts): the shape, and the count of bf16 values two outputs differ in.
 */
import { type MoEConfig, PRESETS } from "../../src/config/config.js";

/** Tokens a rank brings at most. */
export const EP_GPU_MAX_TOKENS = 16;
/** 16 experts of top-4: 8 ranks hold 2 each (min(k, E/R) = 2 slots a rank). */
export const EP_GPU_CONFIG: MoEConfig = {
  ...PRESETS.tiny!,
  numExperts: 16,
  topK: 4,
  maxTokens: EP_GPU_MAX_TOKENS,
};

/** Values that differ between two outputs, a length mismatch counting the longer one whole. */
export function differing(a: Uint16Array, b: Uint16Array): number {
  let n = a.length === b.length ? 0 : Math.max(a.length, b.length);
  for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) n++;
  return n;
}
