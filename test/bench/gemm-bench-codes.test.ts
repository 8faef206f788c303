/**
 * The grouped-GEMM benchmark's operand codes (src/bench/grouped-gemm.ts: randomCodes): what each
 * distribution promises, checked on the CPU.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { randomCodes } from "../../src/bench/grouped-gemm.js";
import { decodeE4m3, FP8_E4M3_MAX } from "../../src/numerics/fp8.js";

const isNaNCode = (code: number) => (code & 0x7f) === 0x7f;

/** Largest |value| over rows [r0, r0 + rows) and columns [c0, c0 + 128) of a [*, k] code matrix. */
function blockAmax(codes: Uint8Array, k: number, r0: number, rows: number, c0: number): number {
  let amax = 0;
  for (let r = r0; r < r0 + rows; r++) {
    for (let c = c0; c < c0 + 128; c++) amax = Math.max(amax, Math.abs(decodeE4m3(codes[r * k + c]!)));
  }
  return amax;
}

describe("grouped-GEMM benchmark codes", () => {
  test("gaussian: every weight block (128 × 128) and every activation block (1 × 128) reaches ±448, mostly well below", () => {
    const k = 384;
    for (const blockRows of [128, 1] as const) {
      const rows = 256;
      const codes = randomCodes(rows * k, 7, "gaussian", k, blockRows);
      assert.ok(!codes.some(isNaNCode), "no NaN codes");
      for (let r0 = 0; r0 < rows; r0 += blockRows) {
        for (let c0 = 0; c0 < k; c0 += 128) {
          assert.equal(
            blockAmax(codes, k, r0, blockRows, c0),
            FP8_E4M3_MAX,
            `block (${r0}, ${c0}) of ${blockRows}-row blocks`,
          );
        }
      }
      // Gaussian mass sits near zero: well over half of the codes below a quarter of the maximum for the
      // 16384-value blocks (amax ≈ 4σ), a third or more for the 128-value ones (amax ≈ 2.6σ).
      const small =
        Array.from(codes).filter((c) => Math.abs(decodeE4m3(c)) < FP8_E4M3_MAX / 4).length / codes.length;
      assert.ok(
        small > (blockRows === 128 ? 0.55 : 0.3),
        `share below 112: ${small.toFixed(3)} (${blockRows}-row blocks)`,
      );
    }
  });

  test("quantized: uniform over the e4m3 range, so a quarter of the codes lie below a quarter of the maximum", () => {
    const codes = randomCodes(1 << 16, 11, "quantized", 256, 1);
    assert.ok(!codes.some(isNaNCode));
    const small =
      Array.from(codes).filter((c) => Math.abs(decodeE4m3(c)) < FP8_E4M3_MAX / 4).length / codes.length;
    assert.ok(Math.abs(small - 0.25) < 0.02, `share below 112: ${small.toFixed(3)}`);
  });

  test("gaussian needs whole rows of 128-wide blocks", () => {
    assert.throws(() => randomCodes(300, 1, "gaussian", 256, 1), /not whole rows of 256/);
    assert.throws(() => randomCodes(200, 1, "gaussian", 100, 1), /128-wide blocks/);
  });

  test("the same seed gives the same codes, another seed others", () => {
    for (const codes of ["quantized", "gaussian", "uniform-bytes"] as const) {
      const a = randomCodes(128 * 256, 3, codes, 256, 128);
      assert.deepEqual(a, randomCodes(128 * 256, 3, codes, 256, 128), codes);
      assert.notDeepEqual(a, randomCodes(128 * 256, 4, codes, 256, 128), codes);
    }
  });
});
