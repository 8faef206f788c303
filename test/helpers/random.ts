/**
 * Test randomness: one seed per run (fresh unless MEGAMOE_SEED pins it), printed so a failure can be
 * replayed, and mulberry32 streams drawn from it.
 */

/** The run's seed: MEGAMOE_SEED, else fresh; printed with the file's label. */
export function testSeed(label: string): number {
  const seed = Number(process.env.MEGAMOE_SEED ?? Date.now() % 2 ** 31);
  console.log(`${label}: seed ${seed} (MEGAMOE_SEED=${seed} replays it)`);
  return seed;
}

/** mulberry32: uniform 32-bit unsigned integers. Small and fast; good enough for test data. */
export function rngU32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (t ^ (t >>> 14)) >>> 0;
  };
}

/** mulberry32 as uniform floats in [0, 1). */
export function rng(seed: number): () => number {
  const next = rngU32(seed);
  return () => next() / 4294967296;
}
