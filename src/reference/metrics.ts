/** Error figures used by every correctness check, and the output summary of a run. */
import { describeValue } from "../config/config.js";

type Numeric = ArrayLike<number>;

/** TypeError unless a and b are arrays (or typed arrays) of numbers; RangeError unless their lengths match. */
function checkPair(what: string, a: unknown, b: unknown): void {
  for (const [name, v] of [
    ["a", a],
    ["b", b],
  ] as const) {
    if (!(Array.isArray(v) || (ArrayBuffer.isView(v) && !(v instanceof DataView)))) {
      throw new TypeError(
        `${what}: ${name} must be an array or typed array of numbers, got ${describeValue(v)}`,
      );
    }
  }
  const la = (a as Numeric).length;
  const lb = (b as Numeric).length;
  if (la !== lb) throw new RangeError(`${what}: length mismatch: ${la} vs ${lb}`);
}

/**
 * ‖a − b‖ / ‖b‖ (b is the reference); 0 when both are zero. NaN anywhere gives NaN (a metric reports
 * what it sees: a NaN output must show as NaN, not as an error of the metric).
 */
export function relativeError(a: Numeric, b: Numeric): number {
  checkPair("relativeError", a, b);
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

/** DeepGEMM's similarity metric: 1 − 2Σxy / Σ(x² + y²); 0 for identical inputs; NaN anywhere gives NaN. */
export function calcDiff(a: Numeric, b: Numeric): number {
  checkPair("calcDiff", a, b);
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
  if (!ArrayBuffer.isView(bytes))
    throw new TypeError(`checksum: bytes must be a typed array, got ${describeValue(bytes)}`);
  const u8 = new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let h = 0x811c9dc5;
  for (let i = 0; i < u8.length; i++) h = Math.imul(h ^ u8[i], 0x01000193);
  return (h >>> 0).toString(16).padStart(8, "0");
}

export function l2Norm(a: Numeric): number {
  checkPair("l2Norm", a, a);
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i] * a[i];
  return Math.sqrt(s);
}
