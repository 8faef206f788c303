/** The shape test/gpu/fused-ep-gpus.test.ts and its rank processes (fused-ep-peer.ts) share. */
import { type MoEConfig, PRESETS } from "../../src/config/config.js";

/** Tokens a rank brings at most. */
export const EP_GPU_MAX_TOKENS = 16;
/** 16 experts of top-4: 8 ranks hold 2 each, as in test/gpu/fused-ep.test.ts. */
export const EP_GPU_CONFIG: MoEConfig = {
  ...PRESETS.tiny!,
  numExperts: 16,
  topK: 4,
  maxTokens: EP_GPU_MAX_TOKENS,
};
