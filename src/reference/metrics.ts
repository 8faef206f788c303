/** Error figures used by every correctness check, and the output summary of a run. */

type Numeric = ArrayLike<number>;

/** ‖a − b‖ / ‖b‖ (b is the reference); 0 when both are zero. NaN anywhere gives NaN. */
export function relativeError(a: Numeric, b: Numeric): number {
  if (a.length !== b.length) throw new Error(`length mismatch: ${a.length} vs ${b.length}`);
  let num = 0;
  let den = 0;
  for (let i = 0; i < a.length; i++) {
    const d = a[i] - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  if (den === 0) return num === 0 ? 0 : Number.POSITIVE_INFINITY;
  return Math.sqrt(num / den);
}

/** DeepGEMM's similarity metric: 1 − 2Σxy / Σ(x² + y²); 0 for identical inputs. */
export function calcDiff(a: Numeric, b: Numeric): number {
  if (a.length !== b.length) throw new Error(`length mismatch: ${a.length} vs ${b.length}`);
  let xy = 0;
  let sq = 0;
  for (let i = 0; i < a.length; i++) {
    xy += a[i] * b[i];
    sq += a[i] * a[i] + b[i] * b[i];
  }
  if (sq === 0) return 0;
  return 1 - (2 * xy) / sq;
}

/** FNV-1a over the raw bytes, as 8 hex digits: equal outputs give equal checksums. */
export function checksum(bytes: ArrayBufferView): string {
  const u8 = new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let h = 0x811c9dc5;
  for (let i = 0; i < u8.length; i++) h = Math.imul(h ^ u8[i], 0x01000193);
  return (h >>> 0).toString(16).padStart(8, "0");
}

export function l2Norm(a: Numeric): number {
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i] * a[i];
  return Math.sqrt(s);
}
