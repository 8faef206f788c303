/**
 * The device weight generator (src/kernels/weightgen, src/weights/device.ts) against the CPU generator
 * (src/weights/generate.ts), bit for bit: FP8 codes and fp32 scales of routed and shared experts on
 * tiny (every expert), flash-ep8 and flash (first, middle, last expert and the shared one) and pro (first
 * and last), the gate weight and bias, and activations. Outputs are poisoned with 0xFF before the
 * compared generation, so an element the kernels never write is caught. Also times a flash layer.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { type MoEConfig, PRESETS, sharedIntermediate } from "../../src/config/config.js";
import type { DeviceTensor } from "../../src/cuda/index.js";
import { RankWeights } from "../../src/parallel/expert-parallel.js";
import {
  type DeviceExpertPair,
  DeviceMoEWeights,
  generateActivationsOnDevice,
} from "../../src/weights/device.js";
import {
  GeneratedWeights,
  generateActivations,
  generateExpert,
  generateGate,
  generateSharedExpert,
} from "../../src/weights/generate.js";
import { type BlockQuantized, requireFp8Expert } from "../../src/weights/types.js";
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

function compareExpert(config: MoEConfig, w: DeviceMoEWeights, e: number): void {
  const cpu = requireFp8Expert(generateExpert(config, seed, e), "weightgen test");
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
  const pairs = [w.routed, ...(w.shared === null ? [] : [w.shared])];
  const out: DeviceTensor[] = pairs.flatMap((p) => [p.w1, p.w1Scales, p.w2, p.w2Scales]);
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
});
