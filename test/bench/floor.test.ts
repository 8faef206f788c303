import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { groupedGemmFloorUs } from "../../src/bench/grouped-gemm.js";
import { DEFAULT_READ_TBPS, expertWeightBytes, layerFloor, routingFootprint } from "../../src/bench/layer.js";
import { groupedGemmFloorLine, unfusedFloorLine } from "../../src/cli/bench.js";
import { resolveConfig } from "../../src/config/config.js";
import { READ_BYTES_PER_S } from "../../src/cuda/hardware.js";
import { randomRouting } from "../../src/reference/router.js";

/** k distinct ids per token cycling through every expert: token t gets (k·t + j) mod E, j < k. */
function cyclingIds(tokens: number, k: number, experts: number): Int32Array {
  return Int32Array.from({ length: tokens * k }, (_, i) => i % experts);
}

const close = (a: number, b: number) => assert.ok(Math.abs(a - b) <= 1e-9 * Math.abs(b), `${a} ≉ ${b}`);

describe("layer floor: hand-computed bytes and FLOPs", () => {
  // tiny: E=8 H=256 IH=128 top-2, one shared expert of 128. One expert: W1 256×256 + W2 256×128 = 98304
  // FP8 bytes, 4 + 2 blocks of 128×128 with an fp32 scale each = 24 bytes.
  const tiny = resolveConfig("tiny");

  it("one tiny expert is 98 328 bytes", () => {
    assert.equal(expertWeightBytes(256, 128), 98_328);
  });

  it("tiny, T=1, experts 3 and 5", () => {
    const ids = Int32Array.from([3, 5]);
    const f = layerFloor(tiny, 1, { ids }, true, 4, 1500);
    assert.equal(f.expertsTouched, 2);
    assert.equal(f.routedRows, 2);
    // 2 routed experts + the shared one + 256 bf16 in + 256 bf16 out.
    assert.equal(f.bytes, 3 * 98_328 + 1024);
    assert.equal(f.bytes, 296_008);
    // 2·(2 rows·(256·256 + 128·256)) + 2·(1 token·(256·256 + 128·256)).
    assert.equal(f.flops, 589_824);
    close(f.floorUs, 296_008 / 4e12 / 1e-6); // 0.074002 µs: memory-bound
    assert.equal(f.bound, "memory");
    const off = layerFloor(tiny, 1, { ids }, false, 4, 1500);
    assert.equal(off.bytes, 2 * 98_328 + 1024);
    assert.equal(off.flops, 393_216);
  });

  it("tiny, T=8192, every expert touched: compute-bound", () => {
    const ids = cyclingIds(8192, 2, 8);
    const f = layerFloor(tiny, 8192, { ids }, true, 4, 1500);
    assert.equal(f.expertsTouched, 8);
    assert.equal(f.routedRows, 16_384);
    assert.equal(f.bytes, 9 * 98_328 + 2 * 8192 * 256 * 2);
    assert.equal(f.bytes, 9_273_560);
    assert.equal(f.flops, 4_831_838_208); // 2·16384·98304 + 2·8192·98304
    assert.equal(f.bound, "compute");
    close(f.floorUs, 3.221225472); // 4.83e9 / 1.5e15 s
  });

  // flash: E=256 H=4096 IH=2048 top-6, shared 2048. One expert: 3·2048·4096 = 25 165 824 FP8 bytes,
  // 1536 blocks of 128×128 → 6144 bytes of scales.
  const flash = resolveConfig("flash");

  it("one flash expert is 25 171 968 bytes", () => {
    assert.equal(expertWeightBytes(4096, 2048), 25_171_968);
  });

  it("flash, T=1, experts 0…5: memory-bound at 44 µs on 4 TB/s", () => {
    const ids = Int32Array.from([0, 1, 2, 3, 4, 5]);
    const f = layerFloor(flash, 1, { ids }, true, 4, 1500);
    assert.equal(f.expertsTouched, 6);
    assert.equal(f.bytes, 176_220_160); // 7 experts + 16 384 bytes of bf16 in and out
    assert.equal(f.flops, 352_321_536); // 2·(6 routed rows + 1 shared row)·25 165 824
    close(f.floorUs, 44.05504);
    assert.equal(f.bound, "memory");
  });

  it("flash, T=8192, all 256 experts: compute-bound at 1924 µs on 1500 TFLOP/s", () => {
    const ids = Int32Array.from({ length: 8192 * 6 }, (_, i) => (7 * i) % 256); // 6 consecutive are distinct
    const f = layerFloor(flash, 8192, { ids }, true, 4, 1500);
    assert.equal(f.expertsTouched, 256);
    assert.equal(f.routedRows, 49_152);
    assert.equal(f.bytes, 6_603_413_504); // 257 experts + 134 217 728 bytes of activations
    assert.equal(f.flops, 2_886_218_022_912); // 2·(49152 + 8192)·25 165 824
    close(f.floorUs, 1924.145348608);
    assert.equal(f.bound, "compute");
    // The FP8 rate the torch peer measured moves the compute floor with it.
    close(layerFloor(flash, 8192, { ids }, true, 4, 1312).floorUs, (2_886_218_022_912 / 1312e12) * 1e6);
  });

  it("masked slots (−1) and ids outside [0, E) are not routed", () => {
    const ids = Int32Array.from([3, -1, 8, 3]);
    assert.deepEqual(routingFootprint(tiny, 2, { ids }), { expertsTouched: 1, routedRows: 2 });
    const f = layerFloor(tiny, 2, { ids }, false, 4, 1500);
    assert.equal(f.bytes, 98_328 + 2 * 2 * 256 * 2);
    assert.equal(f.flops, 2 * 2 * 98_304);
  });

  it("rejects a short routing and non-positive rates", () => {
    assert.throws(() => layerFloor(tiny, 2, { ids: Int32Array.from([1, 2, 3]) }, true, 4), /fewer than/);
    assert.throws(() => layerFloor(tiny, 1, { ids: Int32Array.from([1, 2]) }, true, 0), /positive/);
  });
});

describe("floors use the read-stream ceiling", () => {
  const flash = resolveConfig("flash");

  it("the layer's default bandwidth is the H200 read stream, 4.3 TB/s", () => {
    assert.equal(DEFAULT_READ_TBPS, 4.3);
    const ids = Int32Array.from([0, 1, 2, 3, 4, 5]);
    const f = layerFloor(flash, 1, { ids }, true);
    close(f.floorUs, (176_220_160 / 4.3e12) * 1e6); // 40.98 µs
    assert.equal(f.bound, "memory");
  });

  it("stays under what the unfused layer measured on flash, which the copy floor did not", () => {
    // bench/results/2026-12-03-h200-sweep2-flash-shared1.svg, seed 1, CUDA graph: T=64 in 1193.0 µs,
    // T=512 in 1619.0 µs. At 3.96 TB/s (copy) those are 106% and 101% of the floor.
    for (const [tokens, us] of [
      [64, 1193.0],
      [512, 1619.0],
    ] as const) {
      const routing = randomRouting(1, tokens, flash);
      const copyFloor = layerFloor(flash, tokens, routing, true, 3.96).floorUs;
      const readFloor = layerFloor(flash, tokens, routing, true).floorUs;
      assert.ok(
        copyFloor > us,
        `T=${tokens}: the copy floor ${copyFloor} µs is no longer above the measured ${us} µs`,
      );
      assert.ok(readFloor < us, `T=${tokens}: the read floor ${readFloor} µs is above the measured ${us} µs`);
    }
  });

  it("the grouped GEMM's floor: bytes at 4.3 TB/s or FLOPs at 1.5 PFLOP/s", () => {
    assert.equal(READ_BYTES_PER_S, 4.3e12);
    close(groupedGemmFloorUs(4.3e9, 0), 1000);
    close(groupedGemmFloorUs(4.3e9, 3e12), 2000); // compute-bound: 3 TFLOP at 1.5 PFLOP/s
  });

  it("the printed floor lines name the read stream", () => {
    assert.equal(
      unfusedFloorLine(4.312, { tflops: 1500, source: "default" }),
      "floor = max(bytes / 4.31 TB/s read stream (probe_read), FLOPs / 1500 TFLOP/s FP8 (default))",
    );
    assert.equal(
      groupedGemmFloorLine(),
      "floor = max(bytes / 4.30 TB/s read stream, FLOPs / 1500 TFLOP/s FP8) (the kernel's own model)",
    );
  });
});

describe("floor with FP4 experts", () => {
  it("counts nibbles and one UE8M0 byte per 32 elements for routed experts; the shared stays FP8", () => {
    // 3 · 2048 · 4096 = 25 165 824 elements: 12 582 912 nibble bytes + 786 432 scale bytes.
    assert.equal(expertWeightBytes(4096, 2048, "fp4"), 13_369_344);
    const fp4 = resolveConfig("flash", { expertFormat: "fp4" });
    const ids = Int32Array.from([0, 1, 2, 3, 4, 5]);
    const f = layerFloor(fp4, 1, { ids }, true, 4, 1500);
    assert.equal(f.bytes, 6 * 13_369_344 + 25_171_968 + 16_384);
    assert.equal(f.flops, 352_321_536);
  });
});
