/**
 * Specializations of fp8_grouped_gemm.cu, and the pure facts about them that the launcher and the CI
 * compile check share: the tile menu, the shared-memory layout formula (mirrors the kernel's), the
 * pipeline depth that fits, and the -D defines. No CUDA here, so `scripts/compile-kernels.ts` can
 * import it on a machine without a GPU.
 */
import { PRESETS, QUANT_BLOCK } from "../../config/config.js";
import {
  alignUp,
  aScaleStageBytes,
  type KernelDefines,
  type KernelVariant,
  SM90_SHARED_OPTIN_BYTES,
  STAGING_PITCH_WIDE,
  stagingAreaBytes,
} from "../variants.js";

/** Names of the tile shapes the launcher may pick (or a benchmark may force). */
export type GemmTileName = "m128n128" | "m128n256" | "m64n256" | "m64n128";

/** One tile shape: BLOCK_M × BLOCK_N per CTA, split among 1 or 2 math warpgroups. */
export interface GemmTile {
  name: GemmTileName;
  blockM: 64 | 128;
  blockN: 64 | 128 | 256;
  mathWarpgroups: 1 | 2;
}

/**
 * The menu. m128n128: large groups, each math warpgroup owns 64 rows (DeepGEMM's shape). m128n256: the
 * same with a wider B tile (two n128 wgmma chunks per warpgroup, needs setmaxnreg's 232 registers).
 * m64n256: small groups (decode), the two warpgroups share 64 rows and split the 256 columns.
 * m64n128: one math warpgroup, no register hand-over: the most tiles for small problems, and the
 * simplest path when a faster one must be diagnosed.
 */
export const GEMM_TILES: Readonly<Record<GemmTileName, GemmTile>> = {
  m128n128: { name: "m128n128", blockM: 128, blockN: 128, mathWarpgroups: 2 },
  m128n256: { name: "m128n256", blockM: 128, blockN: 256, mathWarpgroups: 2 },
  m64n256: { name: "m64n256", blockM: 64, blockN: 256, mathWarpgroups: 2 },
  m64n128: { name: "m64n128", blockM: 64, blockN: 128, mathWarpgroups: 1 },
};

export const GEMM_TILE_NAMES = Object.keys(GEMM_TILES) as GemmTileName[];

/** How the weights (B) arrive: FP8 with 128 × 128 block scales, or FP4 (MXFP4) converted on the device. */
export type GemmWeightFormat = "fp8" | "fp4";

/**
 * Tiles with FP4 weights: a stage also holds the packed B rows and their scales, so the 256-wide tiles
 * fit only 3 stages (m128n256 also spilled, with a scale per column, at the 224 registers the math
 * warpgroups keep beside the converters). m128n128 (4 stages) and m64n128 (6) remain.
 */
export const FP4_GEMM_TILE_NAMES: readonly GemmTileName[] = ["m128n128", "m64n128"];

/** The tiles a weight format can use. */
export function gemmTileNames(format: GemmWeightFormat = "fp8"): readonly GemmTileName[] {
  return format === "fp4" ? FP4_GEMM_TILE_NAMES : GEMM_TILE_NAMES;
}

/** K per pipeline stage (one scale block). */
export const GEMM_BLOCK_K = 128;
/** Largest group count the kernel's shared group table supports. */
export const GEMM_MAX_GROUPS = 1024;
export const GEMM_MIN_STAGES = 2;
export const GEMM_MAX_STAGES = 10;

/** Threads per CTA: the math warpgroups plus one producer warpgroup. */
export function gemmThreads(tile: GemmTile): number {
  return 128 * (tile.mathWarpgroups + 1);
}

/**
 * Dynamic shared memory of one CTA, byte for byte the kernel's layout: per stage an A tile, a B tile and
 * BLOCK_M activation scales (128-aligned); two buffers of the tile's weight scales; full/empty barriers;
 * the group table (8 bytes per group) and tile prefix (4 · (G + 1)); each math warp's epilogue staging
 * area; 1024 bytes to align the base.
 * The kernel checks %dynamic_smem_size against its own figure and reports a mismatch in its status.
 */
export function gemmSharedBytes(
  tile: GemmTile,
  stages: number,
  k: number,
  groups: number,
  format: GemmWeightFormat = "fp8",
): number {
  const kBlocks = k / GEMM_BLOCK_K;
  const swRows = Math.ceil(tile.blockN / QUANT_BLOCK);
  const aTile = tile.blockM * GEMM_BLOCK_K;
  const bTile = tile.blockN * GEMM_BLOCK_K;
  const saStride = aScaleStageBytes(tile.blockM);
  const fp4 = format === "fp4";
  // FP4: per stage the packed B rows and their u32 reference words.
  const fp4Stage = fp4 ? (tile.blockN * GEMM_BLOCK_K) / 2 + tile.blockN * 4 : 0;
  // The packed rows start at a 1024-byte boundary (their 64-byte swizzle).
  const offPacked = stages * (aTile + bTile + saStride);
  const offSw = (fp4 ? alignUp(offPacked, 1024) : offPacked) + stages * fp4Stage;
  // The block weight scales: two buffers (alternating per tile) per math warpgroup.
  const swBytes = 2 * tile.mathWarpgroups * swRows * kBlocks * 4;
  const offFull = alignUp(offSw + swBytes, 8);
  // full and empty barriers, and FP4's `loaded` ones.
  const offGroups = offFull + (fp4 ? 24 : 16) * stages;
  const offStaging = alignUp(offGroups + 8 * groups + 4 * (groups + 1), 16);
  // One staging area per math warp, sized for the wider (fp32) pitch.
  const bytes = offStaging + 4 * tile.mathWarpgroups * stagingAreaBytes(STAGING_PITCH_WIDE);
  return bytes + 1024;
}

/** The deepest pipeline (up to GEMM_MAX_STAGES) that fits `budget` bytes; 0 when not even 2 stages fit. */
export function gemmMaxStages(
  tile: GemmTile,
  k: number,
  groups: number,
  budget = SM90_SHARED_OPTIN_BYTES,
  format: GemmWeightFormat = "fp8",
): number {
  for (let stages = GEMM_MAX_STAGES; stages >= GEMM_MIN_STAGES; stages--) {
    if (gemmSharedBytes(tile, stages, k, groups, format) <= budget) return stages;
  }
  return 0;
}

/** One specialization: a tile with its stage count, for a problem's N, K, group count and output type. */
export interface GemmSpecialization {
  tile: GemmTile;
  stages: number;
  n: number;
  k: number;
  groups: number;
  outBf16: boolean;
  /** Default "fp8". */
  format?: GemmWeightFormat;
}

/** The -D macros of fp8_grouped_gemm.cu for one specialization. */
export function gemmDefines(s: GemmSpecialization): KernelDefines {
  return {
    BLOCK_M: s.tile.blockM,
    BLOCK_N: s.tile.blockN,
    BLOCK_K: GEMM_BLOCK_K,
    NUM_STAGES: s.stages,
    NUM_MATH_WARPGROUPS: s.tile.mathWarpgroups,
    N: s.n,
    K: s.k,
    NUM_GROUPS: s.groups,
    OUT_BF16: s.outBf16 ? 1 : 0,
    // Only FP4 builds name it, so FP8 specializations keep their defines (and JIT cache keys).
    ...(s.format === "fp4" ? { B_FP4: 1 } : {}),
  };
}

/** The (N, K) pairs of a preset's two expert GEMMs: L1 = [2·I, H], L2 = [H, I]. */
export function presetGemmShapes(hidden: number, intermediate: number): { n: number; k: number }[] {
  return [
    { n: 2 * intermediate, k: hidden },
    { n: hidden, k: intermediate },
  ];
}

/**
 * Every specialization the launcher can ask for on the presets: each preset's two GEMM shapes, with
 * its routed expert count and with 1 group (the shared expert), each tile of the menu at the deepest
 * pipeline that fits 227 KB, fp32 and bf16 output; and with FP4 weights, the same for the routed experts
 * (the shared expert stays FP8) on the FP4 tiles.
 */
export const variants: readonly KernelVariant[] = (() => {
  const seen = new Set<string>();
  const out: KernelVariant[] = [];
  for (const preset of Object.values(PRESETS)) {
    for (const { n, k } of presetGemmShapes(preset.hidden, preset.intermediate)) {
      for (const groups of [preset.numExperts / preset.ranks, 1]) {
        for (const tile of Object.values(GEMM_TILES)) {
          if (n % tile.blockN !== 0) continue;
          const stages = gemmMaxStages(tile, k, groups);
          for (const outBf16 of [false, true]) {
            const defines = gemmDefines({ tile, stages, n, k, groups, outBf16 });
            const key = JSON.stringify(defines);
            if (seen.has(key)) continue;
            seen.add(key);
            out.push({ defines, noSpill: true });
          }
        }
      }
      const groups = preset.numExperts / preset.ranks;
      for (const name of FP4_GEMM_TILE_NAMES) {
        const tile = GEMM_TILES[name];
        if (n % tile.blockN !== 0) continue;
        const stages = gemmMaxStages(tile, k, groups, SM90_SHARED_OPTIN_BYTES, "fp4");
        for (const outBf16 of [false, true]) {
          const defines = gemmDefines({ tile, stages, n, k, groups, outBf16, format: "fp4" });
          const key = JSON.stringify(defines);
          if (seen.has(key)) continue;
          seen.add(key);
          out.push({ defines, noSpill: true });
        }
      }
    }
  }
  return out;
})();
