/**
 * The device weight generator (src/kernels/weightgen, src/kernels/device-weights.ts) against the CPU generator
 * (src/weights/generate.ts), bit for bit: FP8 codes and fp32 scales of routed and shared experts on
 * tiny (every expert), flash-ep8 and flash (first, middle, last expert and the shared one) and pro (first
 * and last), the gate weight and bias, and activations. Outputs are poisoned with 0xFF before the
 * compared generation, so an element the kernels never write is caught. Also times a flash layer.
 *
 * FP4 (MXFP4) routed experts the same way (`generateMxfp4`: packed nibbles and UE8M0 bytes): single
 * matrices in both scale layouts, then whole layers (tiny, flash-ep8, flash with expertFormat "fp4")
 * whose scales are in the FP4 grouped GEMM's layout (compared with `fp4GemmScaleWords` of the CPU bytes),
 * upload against generate, an expert-parallel rank's share, and the device bytes of a flash layer.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { expertFormatOf, type MoEConfig, PRESETS, sharedIntermediate } from "../../src/config/config.js";
import { DeviceTensor } from "../../src/cuda/index.js";
import {
  type DeviceExpertPair,
  type DeviceFp4ExpertPair,
  DeviceMoEWeights,
  generateActivationsOnDevice,
} from "../../src/kernels/device-weights.js";
import { fp4ReferenceWordsOnDevice } from "../../src/kernels/fp4/fp4_convert.js";
import { fp4GemmScaleWords } from "../../src/kernels/gemm/fp4_grouped_gemm.js";
import { generateMxfp4OnDevice } from "../../src/kernels/weightgen/weightgen.js";
import { countFp4ToFp8Inexact, fp4BlockScales, mxfp4DeviceLayout } from "../../src/numerics/fp4.js";
import { RankWeights } from "../../src/parallel/expert-parallel.js";
import {
  GeneratedWeights,
  generateActivations,
  generateExpert,
  generateGate,
  generateMxfp4,
  generateSharedExpert,
} from "../../src/weights/generate.js";
import {
  type BlockQuantized,
  type Fp4ExpertWeights,
  type Mxfp4Matrix,
  requireFp8Expert,
} from "../../src/weights/types.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("weightgen");

const device = testDevice;

function bytesOf(a: ArrayBufferView): Buffer {
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength);
}

/** Asserts equal bytes; on a mismatch names the first differing element as (row, col) of a [·, cols] array. */
function assertSameBits(
  what: string,
  got: Uint8Array | Uint16Array | Float32Array,
  want: typeof got,
  cols: number,
) {
  assert.equal(got.length, want.length, `${what}: length`);
  if (bytesOf(got).equals(bytesOf(want))) return;
  const g = new Uint32Array(got.length);
  const w = new Uint32Array(want.length);
  const bitsOf = (a: typeof got, out: Uint32Array) => {
    if (a instanceof Float32Array) out.set(new Uint32Array(a.buffer, a.byteOffset, a.length));
    else out.set(a);
  };
  bitsOf(got, g);
  bitsOf(want, w);
  let first = -1;
  let count = 0;
  for (let i = 0; i < g.length; i++) {
    if (g[i] !== w[i]) {
      if (first < 0) first = i;
      count++;
    }
  }
  const hex = (x: number) => `0x${x.toString(16)}`;
  assert.fail(
    `${what}: ${count} of ${g.length} elements differ; first at [${Math.floor(first / cols)}, ${first % cols}]: ` +
      `device ${hex(g[first]!)}, CPU ${hex(w[first]!)} (seed ${seed})`,
  );
}

/** Matrix `index` of a [count, rows, cols] pair tensor and its scales, on the host. */
function downloadMatrix(q: DeviceTensor, scales: DeviceTensor, index: number) {
  const [, rows, cols] = q.shape as [number, number, number];
  const [, brows, bcols] = scales.shape as [number, number, number];
  return {
    q: q.view([rows, cols], index * rows * cols).toHost() as Uint8Array,
    scales: scales.view([brows, bcols], index * brows * bcols).toHost() as Float32Array,
  };
}

function compareMatrix(
  what: string,
  pair: DeviceExpertPair,
  which: "w1" | "w2",
  index: number,
  cpu: BlockQuantized,
) {
  const dev = downloadMatrix(pair[which], which === "w1" ? pair.w1Scales : pair.w2Scales, index);
  assertSameBits(`${what} codes`, dev.q, cpu.q, cpu.cols);
  assertSameBits(`${what} scales`, dev.scales, cpu.scales, cpu.cols / 128);
}

/**
 * Scale strips of rows [firstRow, firstRow + rows) of a GEMM-layout scale tensor [kBlocks, totalRows·4]:
 * [kBlocks, rows·4], what fp4GemmScaleWords gives for those rows alone.
 */
function downloadScaleStrips(scales: DeviceTensor, firstRow: number, rows: number): Uint8Array {
  const [kBlocks, width] = scales.shape as [number, number];
  const out = new Uint8Array(kBlocks * rows * 4);
  for (let kb = 0; kb < kBlocks; kb++) {
    out.set(scales.view([rows * 4], kb * width + firstRow * 4).toHost() as Uint8Array, kb * rows * 4);
  }
  return out;
}

/**
 * Rows [firstRow, firstRow + rows) of a packed tensor in the device layout ([K/128, totalRows, 64]):
 * [K/128, rows, 64], the device layout of those rows alone.
 */
function downloadPackedStrips(packed: DeviceTensor, firstRow: number, rows: number, k: number): Uint8Array {
  const totalRows = packed.numel / (k / 2);
  const out = new Uint8Array((rows * k) / 2);
  for (let kb = 0; kb < k / 128; kb++) {
    out.set(
      packed.view([rows * 64], (kb * totalRows + firstRow) * 64).toHost() as Uint8Array,
      kb * rows * 64,
    );
  }
  return out;
}

function compareMxfp4Matrix(
  what: string,
  pair: DeviceFp4ExpertPair,
  which: "w1" | "w2",
  index: number,
  cpu: Mxfp4Matrix,
) {
  const { rows, cols } = cpu;
  const packed = downloadPackedStrips(pair[which], index * rows, rows, cols);
  assertSameBits(`${what} packed codes (device layout)`, packed, mxfp4DeviceLayout(cpu.packed, cols), 64);
  const scales = downloadScaleStrips(which === "w1" ? pair.w1Scales : pair.w2Scales, index * rows, rows);
  assertSameBits(`${what} scale words`, scales, fp4GemmScaleWords(cpu.scales, rows, cols), rows * 4);
  const want = fp4BlockScales(cpu);
  const blockScales = which === "w1" ? pair.w1BlockScales : pair.w2BlockScales;
  const got = blockScales.view([want.length], index * want.length).toHost() as Float32Array;
  assertSameBits(`${what} block scales`, got, want, cols / 128);
}

function compareExpert(config: MoEConfig, w: DeviceMoEWeights, e: number): void {
  const made = generateExpert(config, seed, e);
  if (made.format === "fp4") {
    assert.ok(w.routedFp4 !== null, `${config.name} has FP4 experts on the device`);
    compareMxfp4Matrix(`${config.name} fp4 expert ${e} W1`, w.routedFp4, "w1", e, made.w1);
    compareMxfp4Matrix(`${config.name} fp4 expert ${e} W2`, w.routedFp4, "w2", e, made.w2);
    return;
  }
  const cpu = requireFp8Expert(made, "weightgen test");
  compareMatrix(`${config.name} expert ${e} W1`, w.routed, "w1", e, cpu.w1);
  compareMatrix(`${config.name} expert ${e} W2`, w.routed, "w2", e, cpu.w2);
}

function compareShared(config: MoEConfig, w: DeviceMoEWeights): void {
  const cpu = generateSharedExpert(config, seed);
  assert.ok(cpu !== null && w.shared !== null, `${config.name} has a shared expert`);
  compareMatrix(`${config.name} shared W1`, w.shared, "w1", 0, cpu.w1);
  compareMatrix(`${config.name} shared W2`, w.shared, "w2", 0, cpu.w2);
}

function compareGate(config: MoEConfig, w: DeviceMoEWeights): void {
  const cpu = generateGate(config, seed);
  assertSameBits(
    `${config.name} gate weight`,
    w.gateWeight.toHost() as Uint16Array,
    cpu.weight,
    config.hidden,
  );
  if (cpu.bias === null) {
    assert.equal(w.gateBias, null);
  } else {
    assert.ok(w.gateBias !== null);
    assertSameBits(
      `${config.name} gate bias`,
      w.gateBias.toHost() as Float32Array,
      cpu.bias,
      config.numExperts,
    );
  }
}

function allTensors(w: DeviceMoEWeights): DeviceTensor[] {
  const pairs = [w.routedFp4 ?? w.routed, ...(w.shared === null ? [] : [w.shared])];
  const out: DeviceTensor[] = pairs.flatMap((p) => [p.w1, p.w1Scales, p.w2, p.w2Scales]);
  if (w.routedFp4 !== null) out.push(w.routedFp4.w1BlockScales, w.routedFp4.w2BlockScales);
  out.push(w.gateWeight);
  if (w.gateBias !== null) out.push(w.gateBias);
  return out;
}

/** The layer generated for `seed` into memory poisoned with 0xFF (an unwritten byte cannot pass). */
function generatePoisoned(config: MoEConfig): DeviceMoEWeights {
  const d = device();
  const w = DeviceMoEWeights.generate(d, config, seed + 1);
  try {
    for (const t of allTensors(w)) t.fill(0xff);
    w.regenerate(seed);
    d.synchronize();
  } catch (e) {
    w.dispose();
    throw e;
  }
  return w;
}

describeGpu("device weight generator on a GPU", () => {
  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
    console.log(`device: ${device().describe()}`);
  });

  test("tiny: every expert, the shared expert and the gate bit for bit; upload gives the same bytes", () => {
    const config = PRESETS.tiny!;
    const w = generatePoisoned(config);
    const up = DeviceMoEWeights.upload(device(), new GeneratedWeights(config, seed));
    try {
      for (let e = 0; e < config.numExperts; e++) compareExpert(config, w, e);
      compareShared(config, w);
      compareGate(config, w);
      const gen = allTensors(w);
      const upl = allTensors(up);
      assert.equal(gen.length, upl.length);
      for (let i = 0; i < gen.length; i++) {
        assert.deepEqual(upl[i]!.shape, gen[i]!.shape);
        assert.ok(bytesOf(upl[i]!.toHost()).equals(bytesOf(gen[i]!.toHost())), `upload tensor ${i} differs`);
      }
    } finally {
      w.dispose();
      up.dispose();
    }
  });

  test("an expert-parallel rank's share (tiny, 4 ranks): generated on the device as uploaded from the CPU", () => {
    const global = new GeneratedWeights(PRESETS.tiny!, seed);
    for (let rank = 0; rank < 4; rank++) {
      const share = new RankWeights(global, rank, 4, 16);
      assert.deepEqual(share.generated, { seed, firstExpert: 2 * rank });
      const made = DeviceMoEWeights.generate(
        device(),
        share.config,
        seed,
        null,
        share.generated!.firstExpert,
      );
      const up = DeviceMoEWeights.upload(device(), {
        config: share.config,
        expert: (e) => share.expert(e),
        shared: () => share.shared(),
        gate: () => share.gate(),
      });
      try {
        const a = allTensors(made);
        const b = allTensors(up);
        assert.equal(a.length, b.length);
        for (let i = 0; i < a.length; i++) {
          assert.ok(
            bytesOf(a[i]!.toHost()).equals(bytesOf(b[i]!.toHost())),
            `rank ${rank}: tensor ${i} differs`,
          );
        }
      } finally {
        made.dispose();
        up.dispose();
      }
    }
  });

  const sampled: [string, (e: number) => number[], boolean][] = [
    ["flash-ep8", (e) => [0, e >> 1, e - 1], true],
    ["flash", (e) => [0, (e >> 1) + 1, e - 1], true],
    ["pro", (e) => [0, e - 1], false],
  ];
  for (const [name, experts, withShared] of sampled) {
    test(`${name}: sampled experts${withShared ? ", the shared expert" : ""} and the gate bit for bit`, () => {
      const config = PRESETS[name]!;
      const w = generatePoisoned(config);
      try {
        for (const e of experts(config.numExperts)) compareExpert(config, w, e);
        if (withShared) compareShared(config, w);
        compareGate(config, w);
      } finally {
        w.dispose();
      }
    });
  }

  test("activations bit for bit (T = 1, 7, 129; H = 256, 4096, 7168)", () => {
    const d = device();
    for (const hidden of [256, 4096, 7168]) {
      for (const tokens of [1, 7, 129]) {
        const x = generateActivationsOnDevice(d, seed, tokens, hidden);
        try {
          x.fill(0xff);
          generateActivationsOnDevice(d, seed, tokens, hidden, x);
          const want = generateActivations(seed, tokens, hidden);
          assertSameBits(`activations T=${tokens} H=${hidden}`, x.toHost() as Uint16Array, want, hidden);
        } finally {
          x.dispose();
        }
      }
    }
  });

  test("a flash layer generates in well under a second", () => {
    const d = device();
    const config = PRESETS.flash!;
    let t0 = performance.now();
    const w = DeviceMoEWeights.generate(d, config, seed);
    const firstMs = performance.now() - t0;
    try {
      t0 = performance.now();
      w.regenerate(seed + 7);
      d.synchronize();
      const ms = performance.now() - t0;
      const gb = DeviceMoEWeights.bytesFor(config) / 1e9;
      console.log(
        `flash layer (${gb.toFixed(2)} GB, ${config.numExperts} experts + shared of ${sharedIntermediate(config)}): ` +
          `${ms.toFixed(1)} ms (${(gb / (ms / 1e3)).toFixed(0)} GB/s); first generate incl. alloc and JIT ${firstMs.toFixed(0)} ms`,
      );
      assert.ok(ms < 1000, `flash layer generation took ${ms.toFixed(0)} ms`);
    } finally {
      w.dispose();
    }
  });

  test("a layer larger than the device fails before allocating, saying how much it needs", () => {
    const huge: MoEConfig = { ...PRESETS.pro!, name: "huge", numExperts: 4096 };
    const before = device().allocatedBytes;
    assert.throws(
      () => DeviceMoEWeights.generate(device(), huge, seed),
      /huge layer needs [\d.]+ GiB on the device/,
    );
    assert.equal(device().allocatedBytes, before);
  });

  test("the FP8 routed pair is refused for a layer with FP4 experts, naming routedFp4", () => {
    const w = DeviceMoEWeights.generate(device(), fp4Config("tiny"), seed);
    try {
      assert.equal(w.expertFormat, "fp4");
      assert.throws(() => w.routed, /FP4 \(MXFP4\) routed experts: they need the FP4 kernels \(routedFp4\)/);
    } finally {
      w.dispose();
    }
  });
});

/** A preset with FP4 routed experts. */
function fp4Config(name: string): MoEConfig {
  return { ...PRESETS[name]!, expertFormat: "fp4" };
}

describeGpu("device weight generator on a GPU: FP4 (MXFP4) experts", () => {
  // Small shapes with several 128-blocks each way, then flash's and pro's expert matrices.
  const matrices: [number, number][] = [
    [128, 128],
    [256, 384],
    [384, 256],
    [4096, 4096], // flash W1 [2I, H]
    [4096, 2048], // flash W2 [H, I]
    [6144, 7168], // pro W1
  ];
  for (const [rows, cols] of matrices) {
    test(`one ${rows}×${cols} matrix bit for bit, plain and GEMM scale layouts`, () => {
      const d = device();
      const spec = { name: "experts.5.w1", rows, cols, fanIn: cols };
      const cpu = generateMxfp4(seed, spec.name, rows, cols, cols);
      // Plain layout at a nonzero offset of larger buffers: the bytes around must stay poisoned.
      const packed = DeviceTensor.empty(d, "uint8", [(rows * cols) / 2 + 32]);
      const plain = DeviceTensor.empty(d, "uint8", [(rows * cols) / 32 + 8]);
      // GEMM layout: the matrix is rows [rows, 2·rows) of a 3·rows-row stack.
      const gemm = DeviceTensor.empty(d, "uint8", [cols / 128, 3 * rows * 4]);
      try {
        for (const t of [packed, plain, gemm]) t.fill(0xff);
        generateMxfp4OnDevice(d, seed, spec, packed, 16, plain, { kind: "rows", offset: 4 }, null);
        d.synchronize();
        const p = packed.toHost() as Uint8Array;
        assertSameBits(
          `${rows}×${cols} packed`,
          p.subarray(16, 16 + cpu.packed.length),
          cpu.packed,
          cols / 2,
        );
        assert.ok(
          p.subarray(0, 16).every((b) => b === 0xff) &&
            p.subarray(16 + cpu.packed.length).every((b) => b === 0xff),
        );
        const s = plain.toHost() as Uint8Array;
        assertSameBits(`${rows}×${cols} scales`, s.subarray(4, 4 + cpu.scales.length), cpu.scales, cols / 32);
        assert.ok(
          s.subarray(0, 4).every((b) => b === 0xff) &&
            s.subarray(4 + cpu.scales.length).every((b) => b === 0xff),
        );

        packed.fill(0xff);
        generateMxfp4OnDevice(
          d,
          seed,
          spec,
          packed,
          0,
          gemm,
          { kind: "gemm", totalRows: 3 * rows, firstRow: rows },
          null,
        );
        d.synchronize();
        assertSameBits(
          `${rows}×${cols} packed (GEMM run)`,
          (packed.toHost() as Uint8Array).subarray(0, cpu.packed.length),
          cpu.packed,
          cols / 2,
        );
        // The generator writes the UE8M0 bytes in the GEMM's order; the load-time pass makes them words.
        fp4ReferenceWordsOnDevice(d, gemm, rows, rows, rows, null);
        d.synchronize();
        const want = fp4GemmScaleWords(cpu.scales, rows, cols);
        assertSameBits(
          `${rows}×${cols} GEMM scale words`,
          downloadScaleStrips(gemm, rows, rows),
          want,
          rows * 4,
        );
        for (const other of [0, 2 * rows]) {
          assert.ok(
            downloadScaleStrips(gemm, other, rows).every((b) => b === 0xff),
            `rows ${other}.. untouched`,
          );
        }
      } finally {
        packed.dispose();
        plain.dispose();
        gemm.dispose();
      }
    });
  }

  test("tiny: every expert, the FP8 shared expert and the gate bit for bit; upload gives the same bytes", () => {
    const config = fp4Config("tiny");
    const w = generatePoisoned(config);
    const up = DeviceMoEWeights.upload(device(), new GeneratedWeights(config, seed));
    try {
      assert.equal(expertFormatOf(w.config), "fp4");
      assert.ok(w.routedFp4 !== null && up.routedFp4 !== null);
      for (let e = 0; e < config.numExperts; e++) compareExpert(config, w, e);
      compareShared(config, w);
      compareGate(config, w);
      const gen = allTensors(w);
      const upl = allTensors(up);
      assert.equal(gen.length, upl.length);
      for (let i = 0; i < gen.length; i++) {
        assert.deepEqual(upl[i]!.shape, gen[i]!.shape);
        assert.ok(bytesOf(upl[i]!.toHost()).equals(bytesOf(gen[i]!.toHost())), `upload tensor ${i} differs`);
      }
    } finally {
      w.dispose();
      up.dispose();
    }
  });

  test("upload stages scales in chunks: 40 experts (a chunk of 32 and one of 8) equal generate", () => {
    const config: MoEConfig = { ...fp4Config("tiny"), name: "tiny-40", numExperts: 40, topK: 2 };
    const made = DeviceMoEWeights.generate(device(), config, seed);
    const up = DeviceMoEWeights.upload(device(), new GeneratedWeights(config, seed));
    try {
      const a = allTensors(made);
      const b = allTensors(up);
      for (let i = 0; i < a.length; i++) {
        assert.ok(bytesOf(a[i]!.toHost()).equals(bytesOf(b[i]!.toHost())), `tensor ${i} differs`);
      }
      // The upload counts the elements e4m3 cannot hold: none of the generator's.
      assert.equal(made.fp4Exactness, null);
      const { hidden: H, intermediate: I } = config;
      assert.deepEqual(up.fp4Exactness, { elements: 40 * 3 * I * H, inexact: 0 });
    } finally {
      made.dispose();
      up.dispose();
    }
  });

  test("upload counts FP4 elements whose e4m3 form is not exact (a K block spanning 30 bytes)", () => {
    const config = fp4Config("tiny");
    const g = new GeneratedWeights(config, seed);
    const wide = g.expert(3) as Fp4ExpertWeights;
    const scales = Uint8Array.from(wide.w1.scales);
    scales.set([150, 120, 150, 150], 0); // row 0, K block 0: one group 30 below the others
    const w1 = { ...wide.w1, scales };
    const source = Object.create(g) as GeneratedWeights;
    source.expert = (e: number) => (e === 3 ? { ...wide, w1 } : g.expert(e));
    const up = DeviceMoEWeights.upload(device(), source);
    try {
      const want = countFp4ToFp8Inexact(w1);
      assert.ok(want > 0);
      assert.equal(up.fp4Exactness?.inexact, want);
    } finally {
      up.dispose();
    }
  });

  test("an expert-parallel rank's share (tiny fp4, 4 ranks): generated on the device as uploaded", () => {
    const global = new GeneratedWeights(fp4Config("tiny"), seed);
    for (let rank = 0; rank < 4; rank++) {
      const share = new RankWeights(global, rank, 4, 16);
      const made = DeviceMoEWeights.generate(
        device(),
        share.config,
        seed,
        null,
        share.generated!.firstExpert,
      );
      const up = DeviceMoEWeights.upload(device(), {
        config: share.config,
        expert: (e) => share.expert(e),
        shared: () => share.shared(),
        gate: () => share.gate(),
      });
      try {
        const a = allTensors(made);
        const b = allTensors(up);
        assert.equal(a.length, b.length);
        for (let i = 0; i < a.length; i++) {
          assert.ok(
            bytesOf(a[i]!.toHost()).equals(bytesOf(b[i]!.toHost())),
            `rank ${rank}: tensor ${i} differs`,
          );
        }
      } finally {
        made.dispose();
        up.dispose();
      }
    }
  });

  for (const [name, experts] of [
    ["flash-ep8", (e: number) => [0, e >> 1, e - 1]],
    ["flash", (e: number) => [0, (e >> 1) + 1, e - 1]],
  ] as const) {
    test(`${name} fp4: sampled experts, the shared expert and the gate bit for bit`, () => {
      const config = fp4Config(name);
      const w = generatePoisoned(config);
      try {
        for (const e of experts(config.numExperts)) compareExpert(config, w, e);
        compareShared(config, w);
        compareGate(config, w);
      } finally {
        w.dispose();
      }
    });
  }

  test("a flash layer with FP4 experts holds about half the bytes of FP8 and generates fast", () => {
    const d = device();
    const config = fp4Config("flash");
    const before = d.allocatedBytes;
    let t0 = performance.now();
    const w = DeviceMoEWeights.generate(d, config, seed);
    const firstMs = performance.now() - t0;
    try {
      const tensorBytes = allTensors(w).reduce((a, t) => a + t.bytes, 0);
      assert.equal(w.bytes, tensorBytes);
      assert.equal(d.allocatedBytes - before, w.bytes);
      const fp8 = DeviceMoEWeights.bytesFor(PRESETS.flash!);
      assert.ok(w.bytes > 3.3e9 && w.bytes < 3.5e9 && fp8 > 6.4e9 && fp8 < 6.5e9, `${w.bytes} vs ${fp8}`);
      t0 = performance.now();
      w.regenerate(seed + 7);
      d.synchronize();
      const ms = performance.now() - t0;
      console.log(
        `flash fp4 layer (${(w.bytes / 1e9).toFixed(2)} GB; fp8: ${(fp8 / 1e9).toFixed(2)} GB): ${ms.toFixed(1)} ms; ` +
          `first generate incl. alloc and JIT ${firstMs.toFixed(0)} ms`,
      );
      assert.ok(ms < 1000, `flash fp4 layer generation took ${ms.toFixed(0)} ms`);
    } finally {
      w.dispose();
    }
  });
});
