/**
 * The activation quantization kernel (src/kernels/quant) against the CPU reference `quantizeActivations`,
 * bit for bit (codes and scales), on random and adversarial bf16 rows, plus the device e4m3 encoder
 * against the CPU encoder on NaN, ±inf, ties and subnormals. Outputs are poisoned with 0xFF before every
 * run so an element the kernel never writes is caught; raw launches also check guard bands around the
 * outputs for writes past the end.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 * The launch-heuristic tests at the top run everywhere.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { QUANT_BLOCK, SCALE_FORMATS, type ScaleFormat } from "../../src/config/config.js";
import { H200_SMS } from "../../src/cuda/hardware.js";
import { compileKernel, DeviceTensor, KernelArgs, loadKernel } from "../../src/cuda/index.js";
import {
  allocQuantOutputs,
  QUANT_KERNEL_NAME,
  QUANT_KERNEL_SOURCE,
  quantBytes,
  quantFloor,
  quantizeOnDevice,
  quantLaunchConfig,
  residentBlocksPerSm,
} from "../../src/kernels/quant/quant.js";
import { quantDefines } from "../../src/kernels/quant/quant.variants.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { encodeE4m3 } from "../../src/numerics/fp8.js";
import { quantizeActivations } from "../../src/numerics/quant.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("quant");

const random = rng(seed);

const HIDDENS = [256, 4096, 7168];
const TOKENS = [1, 7, 129, 1000, 8192];

// ---------------------------------------------------------------------------------------------------
// Launch heuristics (no GPU needed)

describe("quant launch heuristics", () => {
  test("every warp-step of every shape is reachable and blocks are whole warps", () => {
    for (const hidden of [128, ...HIDDENS, 65536]) {
      for (const tokens of [1, 2, 7, 129, 1000, 8192, 65536]) {
        const c = quantLaunchConfig(tokens, hidden, H200_SMS, 44);
        assert.equal(c.groups, (tokens * hidden) / QUANT_BLOCK);
        assert.ok(c.threads % 32 === 0 && c.threads >= 32 && c.threads <= 256, `threads ${c.threads}`);
        assert.ok(c.blocks >= 1, `blocks ${c.blocks}`);
        // The grid-stride loop covers any grid; the grid never exceeds what can be resident at once.
        assert.ok(c.blocks <= H200_SMS * residentBlocksPerSm(c.threads, 44));
        assert.ok(c.blocks <= Math.ceil(Math.ceil(c.groups / 8) / (c.threads / 32)), "no idle blocks");
      }
    }
  });

  test("small problems spread over SMs, large ones fill the resident grid", () => {
    assert.deepEqual(quantLaunchConfig(1, 256, H200_SMS, 44), { groups: 2, threads: 32, blocks: 1 });
    const big = quantLaunchConfig(8192, 7168, H200_SMS, 44);
    assert.equal(big.threads, 256);
    assert.equal(big.blocks, H200_SMS * 5); // 44 registers: 5 blocks of 256 threads per SM
  });

  test("occupancy estimate", () => {
    assert.equal(residentBlocksPerSm(256, 32), 8);
    assert.equal(residentBlocksPerSm(256, 64), 4);
    assert.equal(residentBlocksPerSm(32, 16), 32); // the 32-blocks-per-SM limit binds
  });

  test("bytes model and floor", () => {
    assert.equal(quantBytes(8192, 7168), 3 * 8192 * 7168 + 4 * 8192 * 56);
    const f = quantFloor(8192, 7168, 4.25);
    assert.equal(f.bytes, 177995776);
    assert.ok(Math.abs(f.floorUs - 177995776 / 4.25e6) < 1e-9);
    assert.throws(() => quantFloor(1, 128, 0), /positive/);
  });
});

// ---------------------------------------------------------------------------------------------------
// Inputs

/** Random finite bf16 activations; each 128-group gets its own magnitude (2^-30 .. 2^30). */
function randomActivations(tokens: number, hidden: number): Uint16Array {
  const x = new Uint16Array(tokens * hidden);
  for (let g = 0; g < x.length / QUANT_BLOCK; g++) {
    const magnitude = 2 ** Math.floor(random() * 61 - 30);
    for (let j = 0; j < QUANT_BLOCK; j++)
      x[g * QUANT_BLOCK + j] = f32ToBf16Bits((random() * 2 - 1) * magnitude);
  }
  return x;
}

const bf16 = (v: number): number => f32ToBf16Bits(v);
const bf16ToNumber = (bits: number): number => bf16BitsToF32(bits);

/**
 * Adversarial rows, one pattern per row, each repeated over the row's groups with variations:
 * equal values, the ±448 saturation edge, huge outliers, amax near the 1e-10 floor, bf16 subnormals,
 * zeros of both signs, exact and inexact powers of two (the UE8M0 round-up).
 */
function specialRows(hidden: number): { x: Uint16Array; names: string[] } {
  const groups = hidden / QUANT_BLOCK;
  const rows: { name: string; group: (g: number, out: Uint16Array) => void }[] = [
    { name: "all equal", group: (g, o) => o.fill(bf16((1 + random()) * 2 ** (g % 9))) },
    { name: "all equal negative", group: (g, o) => o.fill(bf16(-(1 + random()) * 2 ** -(g % 11))) },
    {
      // Values from 0.85·amax to amax, both signs: products land on 416..448 and the 432 tie.
      name: "saturation edge",
      group: (g, o) => {
        const amaxBits = bf16((1 + random()) * 2 ** ((g % 7) - 3));
        for (let j = 0; j < QUANT_BLOCK; j++) o[j] = (amaxBits - (j % 24)) | (j & 1 ? 0x8000 : 0);
        o[QUANT_BLOCK - 1] = amaxBits;
      },
    },
    {
      // amax = 1.0234375: 448 · fround(1/fround(a/448)) lands just above 448 (numerics.md).
      name: "product above 448",
      group: (g, o) => {
        for (let j = 0; j < QUANT_BLOCK; j++) o[j] = bf16((random() * 2 - 1) * 1.0234375);
        o[g % QUANT_BLOCK] = bf16(g % 2 ? -1.0234375 : 1.0234375);
      },
    },
    {
      // One huge value (0x7F7F is the largest bf16); the rest 2^0 .. 2^-24 below it, so they land on
      // e4m3 normals, subnormals and zero.
      name: "huge outlier",
      group: (g, o) => {
        const outlier = g % 3 === 0 ? 0x7f7f : bf16(g % 2 ? -1e30 : 3e4);
        const magnitude = Math.abs(bf16ToNumber(outlier));
        for (let j = 0; j < QUANT_BLOCK; j++) {
          o[j] = bf16((random() * 2 - 1) * magnitude * 2 ** -Math.floor(random() * 25));
        }
        o[(g * 37) % QUANT_BLOCK] = outlier;
      },
    },
    {
      // amax just below, at and just above the 1e-10 floor.
      name: "amax near 1e-10",
      group: (g, o) => {
        const amax = 1e-10 * [0.5, 0.99, 1, 1.01, 2][g % 5]!;
        for (let j = 0; j < QUANT_BLOCK; j++) o[j] = bf16((random() * 2 - 1) * amax);
        o[0] = bf16(amax);
      },
    },
    {
      name: "bf16 subnormals",
      group: (_g, o) => {
        for (let j = 0; j < QUANT_BLOCK; j++) o[j] = (1 + Math.floor(random() * 0x7f)) | (j & 1 ? 0x8000 : 0);
      },
    },
    {
      // Negative zeros among values, and whole groups of ±0 (amax 0 → the floor).
      name: "negative zero",
      group: (g, o) => {
        for (let j = 0; j < QUANT_BLOCK; j++) {
          o[j] = g % 3 === 0 ? (j & 1 ? 0x8000 : 0) : j % 4 === 0 ? 0x8000 : bf16((random() * 2 - 1) * 3);
        }
      },
    },
    {
      // amax = 448·2^k exactly (scale a power of two: no UE8M0 round-up) or one bf16 ulp above.
      name: "powers of two",
      group: (g, o) => {
        const amaxBits = bf16(448 * 2 ** ((g % 13) - 6)) + (g % 2);
        for (let j = 0; j < QUANT_BLOCK; j++) o[j] = bf16((random() * 2 - 1) * 448 * 2 ** ((g % 13) - 6));
        o[(g * 5) % QUANT_BLOCK] = amaxBits | (g % 4 === 1 ? 0x8000 : 0);
      },
    },
  ];
  const x = new Uint16Array(rows.length * hidden);
  for (let r = 0; r < rows.length; r++) {
    for (let g = 0; g < groups; g++) {
      const start = r * hidden + g * QUANT_BLOCK;
      rows[r]!.group(g, x.subarray(start, start + QUANT_BLOCK));
    }
  }
  return { x, names: rows.map((r) => r.name) };
}

// ---------------------------------------------------------------------------------------------------
// Comparison

function hex(v: number, digits: number): string {
  return `0x${v.toString(16).padStart(digits, "0")}`;
}

/** Asserts q and scales equal the CPU reference bit for bit; on a mismatch names the first one fully. */
function assertSameQuant(
  what: string,
  x: Uint16Array,
  hidden: number,
  expected: { q: Uint8Array; scales: Float32Array },
  got: { q: Uint8Array; scales: Float32Array },
  rowNames?: string[],
): void {
  const groups = hidden / QUANT_BLOCK;
  const where = (i: number): string => {
    const t = Math.floor(i / hidden);
    return `token ${t}${rowNames ? ` (${rowNames[t]})` : ""}, channel ${i % hidden}`;
  };
  const expBits = new Uint32Array(expected.scales.buffer, expected.scales.byteOffset, expected.scales.length);
  const gotBits = new Uint32Array(got.scales.buffer, got.scales.byteOffset, got.scales.length);
  if (Buffer.compare(Buffer.from(expBits.buffer), Buffer.from(gotBits.buffer)) !== 0) {
    let bad = 0;
    let first = -1;
    for (let g = 0; g < expBits.length; g++) {
      if (expBits[g] !== gotBits[g]) {
        if (first < 0) first = g;
        bad++;
      }
    }
    assert.fail(
      `${what}: ${bad} of ${expBits.length} scales differ; first at ${where(first * QUANT_BLOCK).replace(/channel \d+/, `group ${first % groups}`)}: ` +
        `expected ${expected.scales[first]} (${hex(expBits[first]!, 8)}), got ${got.scales[first]} (${hex(gotBits[first]!, 8)}) (seed ${seed})`,
    );
  }
  if (Buffer.compare(expected.q, got.q) !== 0) {
    let bad = 0;
    let first = -1;
    for (let i = 0; i < expected.q.length; i++) {
      if (expected.q[i] !== got.q[i]) {
        if (first < 0) first = i;
        bad++;
      }
    }
    const g = Math.floor(first / QUANT_BLOCK);
    assert.fail(
      `${what}: ${bad} of ${expected.q.length} codes differ; first at ${where(first)}: x = ${hex(x[first]!, 4)}, ` +
        `scale ${expected.scales[g]}, expected ${hex(expected.q[first]!, 2)}, got ${hex(got.q[first]!, 2)} (seed ${seed})`,
    );
  }
}

// ---------------------------------------------------------------------------------------------------
// GPU

const device = testDevice;

/** Runs the launcher on poisoned outputs and returns them on the host. */
function runOnDevice(x: Uint16Array, tokens: number, hidden: number, format: ScaleFormat) {
  const d = device();
  const input = DeviceTensor.fromHost(d, "bf16", [tokens, hidden], x);
  const out = allocQuantOutputs(d, tokens, hidden);
  try {
    out.q.fill(0xff);
    out.scales.fill(0xff); // 0xFFFFFFFF is a NaN, which no scale is
    quantizeOnDevice(d, input, out, format, null);
    return { q: out.q.toHost() as Uint8Array, scales: out.scales.toHost() as Float32Array };
  } finally {
    input.dispose();
    out.q.dispose();
    out.scales.dispose();
  }
}

describeGpu("activation quantization kernel on a GPU", () => {
  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
    console.log(`device: ${device().describe()}`);
  });

  test("device e4m3 encoder matches the CPU encoder (NaN, ±inf, ties, subnormals, both helpers)", () => {
    const d = device();
    // Every fp32 high half (sign, exponent, top 7 mantissa bits: all rounding positions of e4m3 and
    // every NaN/inf class) with low halves at and around the tie points plus random ones.
    const lows = [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0, 0];
    const bits = new Uint32Array(65536 * lows.length);
    for (let hi = 0; hi < 65536; hi++) {
      for (let k = 0; k < lows.length; k++) {
        const low = k >= 6 ? Math.floor(random() * 65536) : lows[k]!;
        bits[hi * lows.length + k] = ((hi << 16) | low) >>> 0;
      }
    }
    const values = new Float32Array(bits.buffer);
    const expected = new Uint8Array(values.length);
    for (let i = 0; i < values.length; i++) expected[i] = encodeE4m3(values[i]!);

    const compiled = compileKernel({ source: "quant/e4m3_probe.cu" });
    const kernel = loadKernel(d, compiled, "megamoe_e4m3_probe");
    const pairs = values.length / 2;
    const input = DeviceTensor.fromHost(d, "fp32", [values.length], values);
    const scalar = DeviceTensor.empty(d, "uint8", [values.length]);
    const packed = DeviceTensor.empty(d, "uint8", [values.length]); // pairs as little-endian u16
    try {
      scalar.fill(0xaa);
      packed.fill(0xaa);
      const args = new KernelArgs(4).ptr(0, input.ptr).ptr(1, scalar.ptr).ptr(2, packed.ptr).u32(3, pairs);
      kernel.launch(Math.ceil(pairs / 256), 256, 0, null, args);
      for (const [name, got] of [
        ["scalar", scalar.toHost() as Uint8Array],
        ["packed pair", packed.toHost() as Uint8Array],
      ] as const) {
        const i = expected.findIndex((e, j) => e !== got[j]);
        if (i >= 0) {
          assert.fail(
            `${name} encoder: fp32 ${hex(bits[i]!, 8)} (${values[i]}) → expected ${hex(expected[i]!, 2)}, got ${hex(got[i]!, 2)}`,
          );
        }
      }
    } finally {
      input.dispose();
      scalar.dispose();
      packed.dispose();
    }
  });

  for (const hidden of HIDDENS) {
    test(`random activations, H=${hidden}, T ∈ {${TOKENS.join(", ")}}, both formats`, () => {
      for (const tokens of TOKENS) {
        const x = randomActivations(tokens, hidden);
        for (const format of SCALE_FORMATS) {
          const expected = quantizeActivations(x, tokens, hidden, format);
          const got = runOnDevice(x, tokens, hidden, format);
          assertSameQuant(`T=${tokens} H=${hidden} ${format}`, x, hidden, expected, got);
        }
      }
    });

    test(`special rows, H=${hidden}, both formats`, () => {
      const { x, names } = specialRows(hidden);
      const tokens = names.length;
      for (const format of SCALE_FORMATS) {
        const expected = quantizeActivations(x, tokens, hidden, format);
        const got = runOnDevice(x, tokens, hidden, format);
        assertSameQuant(`special rows H=${hidden} ${format}`, x, hidden, expected, got, names);
      }
    });
  }

  test("raw launches write exactly their outputs (guard bands) and any grid covers the work", () => {
    const d = device();
    const guardBytes = 4096;
    const cases = [
      { tokens: 1, hidden: 256, grid: undefined },
      { tokens: 7, hidden: 7168, grid: undefined },
      { tokens: 129, hidden: 4096, grid: undefined },
      { tokens: 1000, hidden: 4096, grid: { blocks: 3, threads: 96 } }, // many grid-stride steps per warp
      { tokens: 333, hidden: 256, grid: { blocks: 1, threads: 32 } },
    ];
    for (const { tokens, hidden, grid } of cases) {
      for (const format of SCALE_FORMATS) {
        const x = randomActivations(tokens, hidden);
        const expected = quantizeActivations(x, tokens, hidden, format);
        const groups = (tokens * hidden) / QUANT_BLOCK;
        const input = DeviceTensor.fromHost(d, "bf16", [tokens, hidden], x);
        const q = DeviceTensor.empty(d, "uint8", [tokens * hidden + 2 * guardBytes]);
        const scales = DeviceTensor.empty(d, "uint8", [4 * groups + 2 * guardBytes]);
        try {
          q.fill(0xff);
          scales.fill(0xff);
          const kernel = loadKernel(
            d,
            compileKernel({ source: QUANT_KERNEL_SOURCE, defines: quantDefines(hidden, format) }),
            QUANT_KERNEL_NAME,
          );
          const launch = grid ?? quantLaunchConfig(tokens, hidden, d.smCount, kernel.numRegisters);
          const args = new KernelArgs(4)
            .ptr(0, input.ptr)
            .ptr(1, q.ptr + BigInt(guardBytes))
            .ptr(2, scales.ptr + BigInt(guardBytes))
            .u32(3, tokens);
          kernel.launch(launch.blocks, launch.threads, 0, null, args);
          const qAll = q.toHost() as Uint8Array;
          const sAll = scales.toHost() as Uint8Array;
          const what = `raw T=${tokens} H=${hidden} ${format} grid ${launch.blocks}×${launch.threads}`;
          for (const [name, buf, inner] of [
            ["q", qAll, tokens * hidden],
            ["scales", sAll, 4 * groups],
          ] as const) {
            const before = buf.subarray(0, guardBytes).findIndex((b) => b !== 0xff);
            const after = buf.subarray(guardBytes + inner).findIndex((b) => b !== 0xff);
            assert.equal(
              before,
              -1,
              `${what}: ${name} written ${guardBytes - before} bytes before its start`,
            );
            assert.equal(after, -1, `${what}: ${name} written ${after} bytes past its end`);
          }
          const gotScales = new Float32Array(sAll.slice(guardBytes, guardBytes + 4 * groups).buffer);
          const gotQ = qAll.slice(guardBytes, guardBytes + tokens * hidden);
          assertSameQuant(what, x, hidden, expected, { q: gotQ, scales: gotScales });
        } finally {
          input.dispose();
          q.dispose();
          scales.dispose();
        }
      }
    }
  });

  test("shape, dtype and device errors are clear", () => {
    const d = device();
    const x = DeviceTensor.fromHost(d, "bf16", [2, 256], randomActivations(2, 256));
    const good = allocQuantOutputs(d, 2, 256);
    const wrongQ = DeviceTensor.empty(d, "uint8", [2, 256]);
    const wrongScales = DeviceTensor.empty(d, "fp32", [2, 3]);
    const oddHidden = DeviceTensor.empty(d, "bf16", [2, 200]);
    try {
      assert.throws(
        () => quantizeOnDevice(d, x, { q: wrongQ, scales: good.scales }, "fp32", null),
        /out.q must be fp8_e4m3\[2, 256\]/,
      );
      assert.throws(
        () => quantizeOnDevice(d, x, { q: good.q, scales: wrongScales }, "fp32", null),
        /out.scales must be fp32\[2, 2\]/,
      );
      assert.throws(
        () => quantizeOnDevice(d, oddHidden, good, "fp32", null),
        /hidden must be a positive multiple of 128/,
      );
      assert.throws(() => quantizeOnDevice(d, good.scales, good, "fp32", null), /x must be bf16/);
      assert.throws(() => quantizeOnDevice(d, x, good, "e8m0" as ScaleFormat, null), /scale format/);
    } finally {
      for (const t of [x, good.q, good.scales, wrongQ, wrongScales, oddHidden]) t.dispose();
    }
  });

  test("zero tokens launch nothing", () => {
    const d = device();
    const x = DeviceTensor.empty(d, "bf16", [0, 4096]);
    const out = allocQuantOutputs(d, 0, 4096);
    try {
      quantizeOnDevice(d, x, out, "ue8m0", null);
    } finally {
      x.dispose();
      out.q.dispose();
      out.scales.dispose();
    }
  });
});
