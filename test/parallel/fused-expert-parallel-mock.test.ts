/**
 * FusedExpertParallel's host side against the CPU stand-in for libcuda (test/fixtures/cuda/mock_libcuda.c):
 * the heap it builds (R virtual ranks on one device, or one rank per device), the epoch written into
 * each header, each rank's kernel built for the EP layout, every launch on its rank's stream with
 * ⌊SMs / ranks per device⌋ CTAs, a skipped rank's launch left out, the watchdog records decoded into
 * an error naming the dead rank, the input checks, and teardown in order (also after a failure part-way
 * through construction). The kernels are stand-in images seeded into a private JIT cache: nothing
 * computes here (test/gpu/fused-ep.test.ts checks the numbers). Skipped without a C compiler, the CUDA
 * headers or a CUDA compiler to key the cache by.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { before, describe, test } from "node:test";
import koffi from "koffi";
import { type MoEConfig, PRESETS } from "../../src/config/config.js";
import { type Device, DeviceTensor, openDevice } from "../../src/cuda/index.js";
import { encodeCacheEntry, kernelCacheEntry } from "../../src/cuda/jit.js";
import { FUSED_KERNEL, FUSED_KERNEL_SOURCE } from "../../src/kernels/megamoe/megamoe.js";
import { FUSED_BLOCK_MS, fusedEpDefines } from "../../src/kernels/megamoe/megamoe.variants.js";
import { QUANT_KERNEL_NAME, QUANT_KERNEL_SOURCE } from "../../src/kernels/quant/quant.js";
import { quantDefines } from "../../src/kernels/quant/quant.variants.js";
import { InputError } from "../../src/layer.js";
import { fusedEpLayout } from "../../src/parallel/fused-ep.js";
import {
  FusedExpertParallel,
  FusedExpertParallelError,
  type FusedRankDeviceInput,
} from "../../src/parallel/fused-expert-parallel.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import type { MoEWeightSource } from "../../src/weights/types.js";
import { bindMock, fakeCubin, type MockControl, mockWithJitCache } from "../cuda/mock-cuda.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("fused expert parallel on the mock driver");
const config: MoEConfig = { ...PRESETS.tiny!, maxTokens: 16 };
const MOCK_SMS = 132; // the mock's SM count (cuDeviceGetAttribute)

const { mock, skip, cacheDir } = mockWithJitCache();

/** Stand-in images for every kernel these tests reach, under the keys compileKernel computes. */
function seedCache(ranks: number): void {
  const entries: [string, string][] = FUSED_BLOCK_MS.map((m) => [
    kernelCacheEntry({ source: FUSED_KERNEL_SOURCE, defines: fusedEpDefines(config, ranks, m) }),
    FUSED_KERNEL,
  ]);
  entries.push([
    kernelCacheEntry({
      source: QUANT_KERNEL_SOURCE,
      defines: quantDefines(config.hidden, config.scaleFormat),
    }),
    QUANT_KERNEL_NAME,
  ]);
  for (const [file, name] of entries) {
    fs.mkdirSync(path.dirname(file), { recursive: true });
    fs.writeFileSync(file, encodeCacheEntry(fakeCubin([name])));
  }
}

/** The generated weights without their seed, so they are uploaded (the mock runs no weight kernels). */
function uploaded(w: GeneratedWeights): MoEWeightSource {
  return { config: w.config, expert: (e) => w.expert(e), shared: () => w.shared(), gate: () => w.gate() };
}

describe("FusedExpertParallel against the mock libcuda", { skip }, () => {
  let m: MockControl;
  let dev: Device[];
  const weights = new GeneratedWeights(config, seed);
  before(() => {
    if (skip !== false || !mock.ok) return;
    process.env.MEGAMOE_LIBCUDA = mock.library;
    process.env.MOCK_CUDA_DEVICES = "4";
    process.env.MEGAMOE_CACHE_DIR = cacheDir;
    m = bindMock(mock.library);
    dev = [0, 1, 2, 3].map((i) => openDevice(i));
    for (const ranks of [2, 4, 8]) seedCache(ranks);
  });

  /** The tensors deviceInputs made (its operands are views of them), freed by freeInputs. */
  const made: DeviceTensor[] = [];
  const freeInputs = () => {
    for (const t of made.splice(0)) t.dispose();
  };

  /** Each rank's device operands for `tokens[s]` tokens (random routing). */
  function deviceInputs(ep: FusedExpertParallel, tokens: number[]): FusedRankDeviceInput[] {
    const { hidden: H, topK: k } = config;
    return tokens.map((t, s) => {
      const d = ep.devices[s]!;
      const n = Math.max(t, 1); // the mock allocates nothing of 0 bytes: a [0, ·] view of one row
      const r = randomRouting(seed + s, n, config);
      const x = DeviceTensor.fromHost(d, "bf16", [n, H], generateActivations(seed + s, n, H));
      const ids = DeviceTensor.fromHost(d, "int32", [n, k], r.ids);
      const w = DeviceTensor.fromHost(d, "fp32", [n, k], r.weights);
      const out = DeviceTensor.empty(d, "bf16", [n, H]);
      made.push(x, ids, w, out);
      return {
        x: x.view([t, H]),
        ids: ids.view([t, k]),
        weights: w.view([t, k]),
        out: out.view([t, H]),
        tokens: t,
      };
    });
  }

  test("virtual ranks: the heap, the epochs, one stream and ⌊SMs / R⌋ CTAs per rank, teardown in order", () => {
    for (const ranks of [2, 4, 8]) {
      m.vmmReset();
      m.start();
      const ep = new FusedExpertParallel(uploaded(weights), { ranks, devices: dev[1]!, maxTokens: 8 });
      const layout = fusedEpLayout({
        ranks,
        numExperts: config.numExperts,
        topK: config.topK,
        hidden: config.hidden,
        maxTokens: 8,
      });
      assert.deepEqual(ep.layout, layout);
      assert.equal(ep.heap.ranks, ranks);
      assert.ok(ep.heap.stride >= layout.bytes);
      const vmm = m.vmmTrace();
      assert.equal(vmm.filter((l) => l.startsWith("create")).length, ranks, "one allocation per rank");
      assert.ok(vmm.filter((l) => l.startsWith("create")).every((l) => / dev=1 /.test(l)));
      for (let r = 0; r < ranks; r++) {
        const header = new Uint32Array(4);
        dev[1]!.copyDtoH(header, ep.heap.address(r));
        assert.deepEqual([...header], [1, 0, 0, 0], `rank ${r}'s header: epoch 1`);
        const rest = new Uint8Array(layout.regions.combine.offset - 16);
        dev[1]!.copyDtoH(rest, ep.heap.address(r) + 16n);
        assert.ok(
          rest.every((b) => b === 0),
          `rank ${r}'s buffer zeroed`,
        );
      }
      ep.kernels.forEach((k, r) => {
        assert.equal(k.ctas, Math.floor(MOCK_SMS / ranks), `rank ${r}'s CTAs`);
        assert.equal(k.poolRows, layout.poolRows);
        assert.equal(k.config.numExperts, config.numExperts);
        assert.equal(k.config.ranks, ranks);
        assert.equal(k.ep?.rank, r);
        assert.deepEqual(k.ep?.peers, [...ep.heap.addressTable()]);
      });
      const streams = new Set(ep.streams.map((s) => s.handle));
      assert.equal(streams.size, ranks, "a stream per rank");

      const tokens = Array.from({ length: ranks }, (_, s) => (s === 1 ? 0 : 1 + ((s * 3) % 8)));
      const inputs = deviceInputs(ep, tokens);
      m.stop();
      m.start();
      ep.forwardDevice(inputs);
      ep.forwardDevice(inputs, { shared: false }); // back to back: queued, no host sync
      const launches = m.read().filter((l) => l.startsWith("launch megamoe_fused"));
      assert.equal(launches.length, 2 * ranks);
      launches.forEach((l, i) => {
        const s = i % ranks;
        const stream = `0x${ep.streams[s]!.handle.toString(16)}`;
        assert.match(l, new RegExp(`grid=${Math.floor(MOCK_SMS / ranks)} block=384 .* stream=${stream}$`), l);
      });
      ep.synchronize();

      // Teardown: each rank's staging, stream, kernel and weights, then its status words; the heap last.
      m.stop();
      m.start();
      const heapBase = ep.heap.base;
      m.vmmReset();
      ep.dispose();
      const events = m.read();
      const order = events.map((l) => l.split(" ")[0]);
      const destroys = order.flatMap((o, i) => (o === "stream-destroy" ? [i] : []));
      const hostFrees = order.flatMap((o, i) => (o === "host-free" ? [i] : []));
      assert.equal(destroys.length, ranks);
      assert.equal(hostFrees.length, ranks);
      for (let r = 0; r < ranks; r++) {
        assert.ok(destroys[r]! < hostFrees[r]!, "a rank's stream goes before its status words");
        if (r > 0) assert.ok(hostFrees[r - 1]! < destroys[r]!, "one rank after another");
      }
      const vmmAfter = m.vmmTrace();
      assert.equal(vmmAfter.filter((l) => l.startsWith("unmap")).length, ranks);
      assert.ok(vmmAfter.at(-1)!.startsWith(`free 0x${heapBase.toString(16)}`), "the reservation last");
      m.stop();
      ep.dispose(); // idempotent
      assert.throws(() => ep.forwardDevice(inputs), /after dispose/);
      freeInputs();
    }
  });

  test("one rank per device: the heap spans the devices; each kernel gets every SM", () => {
    const ep = new FusedExpertParallel(uploaded(weights), { ranks: 4, devices: [0, 1, 2, 3], maxTokens: 4 });
    try {
      assert.deepEqual(
        ep.devices.map((d) => d.ordinal),
        [0, 1, 2, 3],
      );
      assert.deepEqual(
        ep.kernels.map((k) => k.ctas),
        [MOCK_SMS, MOCK_SMS, MOCK_SMS, MOCK_SMS],
      );
      assert.deepEqual(
        [0, 1, 2, 3].map((r) => ep.heap.deviceOf(r)),
        dev,
      );
    } finally {
      ep.dispose();
    }
  });

  test("a skipped rank is left out, and every rank's record names it", () => {
    const ep = new FusedExpertParallel(uploaded(weights), { ranks: 4, devices: dev[0]!, maxTokens: 8 });
    const inputs = deviceInputs(ep, [3, 5, 1, 2]);
    try {
      m.start();
      ep.forwardDevice(inputs, { skipRank: 2 });
      const launched = m.read().filter((l) => l.startsWith("launch megamoe_fused"));
      const streamOf = (s: number) => `stream=0x${ep.streams[s]!.handle.toString(16)}`;
      assert.deepEqual(
        launched.map((l) => [0, 1, 2, 3].find((s) => l.endsWith(streamOf(s)))),
        [0, 1, 3],
      );
      m.stop();
      // What the kernel's ep_give_up leaves in the pinned words of ranks 0, 1 and 3 when rank 2 never
      // publishes: code 16 (publication), the CTA, blamed {2}, missing, epoch 1, ranks that gave up.
      ep.statusWords(0).set([16, 0, 0b0100, 0b0100, 1, 0]);
      ep.statusWords(1).set([16, 5, 0b0100, 0b0100, 1, 0]);
      ep.statusWords(3).set([16, 2, 0b0100, 0b0101, 1, 0b0001]);
      m.failSyncs(719); // CUDA_ERROR_LAUNCH_FAILED: the trap's lost context
      let err: unknown;
      try {
        ep.synchronize();
      } catch (e) {
        err = e;
      }
      m.failSyncs(0);
      assert.ok(err instanceof FusedExpertParallelError, String(err));
      assert.deepEqual([...err.records.keys()], [0, 1, 3]);
      for (const r of [0, 1, 3]) {
        assert.match(
          err.message,
          new RegExp(`rank ${r}: gave up waiting for the counts and row descriptors of epoch 1`),
        );
      }
      assert.equal(err.message.match(/rank 2 dead or not in step/g)?.length, 3);
      assert.match(err.message, /rank 0 gave up waiting on it/);
      // A failure without records says so and keeps the CUDA error.
      for (const r of [0, 1, 3]) ep.statusWords(r).fill(0);
      m.failSyncs(719);
      assert.throws(() => ep.synchronize(), /no rank recorded a wait on its peers .*rank 0: /);
      m.failSyncs(0);
    } finally {
      m.failSyncs(0);
      ep.dispose();
      freeInputs();
    }
  });

  test("bad inputs: clear errors before anything is queued", () => {
    const src = uploaded(weights);
    assert.throws(
      () => new FusedExpertParallel(src, { ranks: 0 }),
      /ranks must be an integer in \[2, 8\], got number 0/,
    );
    assert.throws(() => new FusedExpertParallel(src, { ranks: 1 }), /one rank: MoELayer/);
    assert.throws(
      () => new FusedExpertParallel(src, { ranks: 3 }),
      /8 experts cannot be split evenly among 3/,
    );
    assert.throws(() => new FusedExpertParallel(src, { ranks: 2, maxTokens: 0 }), /maxTokens/);
    assert.throws(
      () => new FusedExpertParallel(src, { ranks: 2, blockM: 48 as never }),
      /blockM must be "auto" or one of 16, 32, 64, 128, got number 48/,
    );
    assert.throws(
      () => new FusedExpertParallel(src, { ranks: 2, fp4Expand: "yes" as never }),
      /fp4Expand must be "auto", true or false, got the string "yes"/,
    );
    assert.throws(() => new FusedExpertParallel(src, { ranks: 2, devices: [0] }), /1 GPUs for 2 ranks/);
    assert.throws(() => new FusedExpertParallel(src, { ranks: 2, bogus: 1 } as never), InputError);
    const ep = new FusedExpertParallel(src, { ranks: 2, devices: dev[0]!, maxTokens: 4 });
    try {
      const H = config.hidden;
      const k = config.topK;
      const x = new Uint16Array(2 * H);
      const r = randomRouting(seed, 2, config);
      const ok = { x, tokens: 2, ids: r.ids, weights: r.weights };
      const none = { x: new Uint16Array(0), tokens: 0, ids: new Int32Array(0), weights: new Float32Array(0) };
      assert.throws(() => ep.forward([ok]), /one input per rank \(2\)/);
      assert.throws(
        () =>
          ep.forward([
            ok,
            {
              x: new Uint16Array(5 * H),
              tokens: 5,
              ids: new Int32Array(5 * k),
              weights: new Float32Array(5 * k),
            },
          ]),
        /rank 1: too many tokens: 5 > maxTokens 4/,
      );
      const twice = Int32Array.from(r.ids);
      twice[1] = twice[0]!;
      assert.throws(() => ep.forward([none, { ...ok, ids: twice }]), /rank 1: .*already chosen/);
      assert.throws(() => ep.forward([{ ...ok, ids: new Int32Array(3) }, none]), /rank 0: .*ids/);
      const d = deviceInputs(ep, [2, 1]);
      assert.throws(
        () => ep.forwardDevice([d[0]!, { ...d[1]!, out: d[0]!.out }]),
        /rank 1: .*out must be bf16\[1, 256\]/,
      );
      assert.throws(
        () => ep.forwardDevice([d[0]!, { ...d[1]!, ids: d[1]!.weights }]),
        /rank 1: .*ids must be int32/,
      );
      assert.throws(
        () => ep.forwardDevice(d, { skipRank: 2 }),
        /skipRank must be a rank of this process \(0, 1\), got number 2/,
      );
      freeInputs();
    } finally {
      ep.dispose();
    }
    assert.throws(() => ep.forward([]), /used after dispose/);
  });

  test("one rank per process (join): each drives its own rank with every SM, through a joined heap", async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fused-ep-join-"));
    const socketPath = path.join(dir, "ep.sock");
    const joins = [2, 3].map((d, rank) =>
      FusedExpertParallel.join(uploaded(weights), {
        rank,
        ranks: 2,
        device: dev[d]!,
        socketPath,
        maxTokens: 8,
      }),
    );
    const eps = await Promise.all(joins);
    try {
      eps.forEach((ep, rank) => {
        assert.equal(ep.rank, rank);
        assert.deepEqual(ep.localRanks, [rank]);
        assert.equal(ep.heap.rank, rank);
        assert.equal(ep.kernels.length, 1);
        const k = ep.kernels[0]!;
        assert.equal(k.ctas, MOCK_SMS, "the rank's launch takes every SM of its GPU");
        assert.equal(k.ep?.rank, rank);
        assert.deepEqual(k.ep?.peers, [...ep.heap.addressTable()]);
        const header = new Uint32Array(4);
        dev[2 + rank]!.copyDtoH(header, ep.heap.address(rank));
        assert.deepEqual([...header], [1, 0, 0, 0], `rank ${rank}'s header: epoch 1`);
        assert.throws(() => ep.statusWords(1 - rank), /rank \d is not driven by this process/);
      });
      const inputs = deviceInputs(eps[1]!, [3]);
      assert.throws(
        () => eps[1]!.forwardDevice([...inputs, ...inputs]),
        /expected one input \(this process's rank 1\)/,
      );
      m.start();
      eps[1]!.forwardDevice(inputs);
      const launches = m.read().filter((l) => l.startsWith("launch megamoe_fused"));
      m.stop();
      assert.equal(launches.length, 1);
      assert.match(launches[0]!, new RegExp(`grid=${MOCK_SMS} block=384 `));
      eps[1]!.synchronize();
    } finally {
      freeInputs();
      for (const ep of eps) ep.dispose();
      fs.rmSync(dir, { recursive: true, force: true });
    }
    await assert.rejects(
      FusedExpertParallel.join(uploaded(weights), {
        rank: 2,
        ranks: 2,
        socketPath: path.join(dir, "x.sock"),
      }),
      /rank must be an integer in \[0, ranks\), got rank number 2 of number 2/,
    );
    await assert.rejects(
      FusedExpertParallel.join(uploaded(weights), {
        rank: 0,
        ranks: 3,
        socketPath: path.join(dir, "x.sock"),
      }),
      /cannot be split evenly among 3 ranks/,
    );
  });

  test("a failure part-way through construction releases what was made, in order", () => {
    const lib = koffi.load((mock as { library: string }).library);
    const failStream = lib.func("void mock_fail_stream_create(int nth)");
    const start = dev[0]!.allocatedBytes;
    m.vmmReset();
    m.start();
    failStream(3); // rank 2's stream: ranks 0 and 1 are complete, rank 2 has its status, weights, kernel
    assert.throws(
      () => new FusedExpertParallel(uploaded(weights), { ranks: 4, devices: dev[0]!, maxTokens: 4 }),
      /cuStreamCreate/,
    );
    failStream(0);
    const events = m.read();
    m.stop();
    const count = (kind: string) => events.filter((l) => l.split(" ")[0] === kind).length;
    assert.equal(count("free"), count("alloc"), "every device allocation freed");
    assert.equal(count("host-alloc"), 3, "status words of ranks 0, 1, 2");
    assert.equal(count("host-free"), 3);
    assert.equal(count("stream-create"), 2);
    assert.equal(count("stream-destroy"), 2);
    const order = events.map((l) => l.split(" ")[0]);
    const firstDestroy = order.indexOf("stream-destroy");
    assert.ok(order.indexOf("host-free") < firstDestroy, "rank 2's half undone before ranks 1 and 0");
    assert.equal(dev[0]!.allocatedBytes, start);
    const vmm = m.vmmTrace();
    assert.equal(vmm.filter((l) => l.startsWith("unmap")).length, 4);
    assert.ok(vmm.at(-1)!.startsWith("free "), "the reservation last");
  });
});
