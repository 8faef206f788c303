/**
 * The fused kernel's EP build, host side (src/parallel/fused-ep.ts): the symmetric buffer's layout
 * against the CPU model's (test/helpers/ep-protocol.ts protocolLayout), the EP operand bytes the
 * kernel reads (megamoe_ep.cuh EpOperands), the watchdog record's decoding, and the CI variants.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { PRESETS } from "../../src/config/config.js";
import {
  epVariants,
  FUSED_BLOCK_MS,
  fusedDefines,
  fusedEpDefines,
} from "../../src/kernels/megamoe/megamoe.variants.js";
import {
  decodeFusedEpStatus,
  describeFusedEpGiveUp,
  encodeFusedEpOperands,
  FUSED_EP_REGIONS,
  fusedEpLayout,
  fusedEpOperandsBytes,
  fusedEpTraffic,
} from "../../src/parallel/fused-ep.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { protocolLayout, runProtocol } from "../helpers/ep-protocol.js";

describe("fusedEpLayout", () => {
  for (const [ranks, E, k, H, T] of [
    [2, 8, 2, 256, 5],
    [4, 8, 2, 256, 33],
    [8, 8, 6, 512, 7],
    [8, 256, 6, 4096, 8192],
  ] as const) {
    test(`R ${ranks}, E ${E}, k ${k}, H ${H}, T ${T}: the model's regions, in kernel order`, () => {
      const l = fusedEpLayout({ ranks, numExperts: E, topK: k, hidden: H, maxTokens: T });
      const model = protocolLayout({
        ranks,
        numExperts: E,
        topK: k,
        hidden: H,
        maxTokens: T,
        blockM: 16,
        chunkTokens: l.chunkTokens,
      });
      assert.equal(l.localTopK, model.localTopK);
      assert.equal(l.descriptorWords, model.descriptorWords);
      assert.equal(l.maxChunks, model.maxChunks);
      assert.equal(l.poolRows, model.poolRows);
      // Every region the peers touch has the model's size (the model's header holds 2 of the 4 words).
      for (const name of FUSED_EP_REGIONS) {
        if (name === "header") continue;
        assert.equal(l.regions[name].bytes, model.regions[name].bytes, name);
      }
      let end = 0;
      for (const name of FUSED_EP_REGIONS) {
        const r = l.regions[name];
        assert.equal(r.offset % 16, 0, `${name} is 16-byte aligned (the kernel's vector loads)`);
        assert.ok(r.offset >= end, `${name} does not overlap the region before it`);
        end = r.offset + r.bytes;
      }
      assert.ok(l.bytes >= end);
      assert.equal(l.workspace.chunkCount, l.maxChunks * E);
      assert.equal(l.workspace.poolSource, 2 * l.poolRows);
    });
  }

  test("rejects shapes the kernel cannot run", () => {
    const ok = { ranks: 2, numExperts: 8, topK: 2, hidden: 256, maxTokens: 4 };
    assert.throws(() => fusedEpLayout({ ...ok, ranks: 1 }), /ranks/);
    assert.throws(() => fusedEpLayout({ ...ok, ranks: 16, numExperts: 16 }), /ranks/);
    assert.throws(() => fusedEpLayout({ ...ok, ranks: 3, numExperts: 8 }), /cannot be split/);
    assert.throws(() => fusedEpLayout({ ...ok, hidden: 384 }), /multiple of 256/);
    assert.throws(() => fusedEpLayout({ ...ok, maxTokens: 0 }), /maxTokens/);
  });
});

describe("encodeFusedEpOperands", () => {
  test("peers, region offsets, pointers, rank and maxTokens in EpOperands order", () => {
    const l = fusedEpLayout({ ranks: 4, numExperts: 8, topK: 2, hidden: 256, maxTokens: 9 });
    const peers = [0x1000n, 0x2000n, 0x3000n, 0x4000n];
    const bytes = encodeFusedEpOperands(l, 2, {
      peers,
      counters: 11n,
      chunkCount: 12n,
      chunkRows: 13n,
      expect: 14n,
      poolSource: 15n,
      hostStatus: 16n,
    });
    assert.equal(bytes.length, fusedEpOperandsBytes(4));
    assert.equal(fusedEpOperandsBytes(4), 8 * (4 + 11 + 6) + 8); // the kernel's static_assert
    const v = new DataView(bytes.buffer);
    const u64 = (i: number) => v.getBigUint64(8 * i, true);
    assert.deepEqual([0, 1, 2, 3].map(u64), peers);
    FUSED_EP_REGIONS.forEach((name, i) => {
      assert.equal(u64(4 + i), BigInt(l.regions[name].offset), name);
    });
    assert.deepEqual([15, 16, 17, 18, 19, 20].map(u64), [11n, 12n, 13n, 14n, 15n, 16n]);
    assert.equal(v.getInt32(8 * 21, true), 2);
    assert.equal(v.getInt32(8 * 21 + 4, true), 9);
    assert.throws(() => encodeFusedEpOperands(l, 4, { ...zeros(), peers }), /rank/);
    assert.throws(() => encodeFusedEpOperands(l, 0, { ...zeros(), peers: peers.slice(1) }), /3 peers/);
  });
});

function zeros() {
  return { counters: 0n, chunkCount: 0n, chunkRows: 0n, expect: 0n, poolSource: 0n, hostStatus: 0n };
}

describe("the EP watchdog record", () => {
  test("decodes the blame and names the dead rank as the model does", () => {
    assert.equal(decodeFusedEpStatus(new Int32Array(8)), null);
    const g = decodeFusedEpStatus(Int32Array.from([16, 3, 0b0100, 0b1110, 2, 0b1010, 0, 0]));
    assert.deepEqual(g, {
      what: "publication",
      cta: 3,
      blamed: [2],
      missing: [1, 2, 3],
      epoch: 2,
      gaveUp: [1, 3],
    });
    assert.equal(
      describeFusedEpGiveUp(0, g!),
      "rank 0: gave up waiting for the counts and row descriptors of epoch 2 from ranks 1, 2, 3: " +
        "rank 2 dead or not in step (ranks 1, 3 gave up waiting on it)",
    );
    const r = decodeFusedEpStatus(Int32Array.from([17, 0, 0b10, 0b10, 5, 0, 0, 0]))!;
    assert.equal(
      describeFusedEpGiveUp(3, r),
      "rank 3: gave up waiting for its tokens' expert results of epoch 5 from rank 1: rank 1 dead or not in step",
    );
    assert.throws(() => decodeFusedEpStatus(Int32Array.from([3, 0, 0, 0, 0, 0])), /unknown/);
  });
});

describe("EP variants", () => {
  test("the one-rank defines with the rank's local experts and EP_RANKS", () => {
    const tiny = PRESETS.tiny!;
    const d = fusedEpDefines(tiny, 4, 32);
    assert.deepEqual(d, { ...fusedDefines({ ...tiny, ranks: 4 }, 32), EP_RANKS: 4 });
    assert.equal((d as Record<string, number>).NUM_EXPERTS, 2);
    assert.throws(() => fusedEpDefines(tiny, 3, 32), /8 experts on 3 ranks/);
    assert.throws(() => fusedEpDefines(tiny, 1, 32), /ranks/);
    // tiny at 2, 4 and 8 ranks and flash at 8 with FP8 experts, flash at 8 with FP4: every block M;
    // flash at 8 with FP4 expanded: 128.
    assert.equal(epVariants.length, 5 * FUSED_BLOCK_MS.length + 1);
    assert.equal(epVariants.filter((v) => v.defines.B_FP4 === 1).length, FUSED_BLOCK_MS.length + 1);
    assert.deepEqual(
      epVariants.filter((v) => v.defines.FP4_EXPAND === 1).map((v) => v.defines.BLOCK_M),
      [128],
    );
    assert.equal(fusedEpDefines({ ...PRESETS.flash!, expertFormat: "fp4" }, 8, 128, true).FP4_EXPAND, 1);
    assert.ok(epVariants.every((v) => v.noSpill && (v.defines.EP_RANKS as number) >= 2));
  });
});

describe("fusedEpTraffic", () => {
  test("the CPU model's bytes across ranks, from the routing alone", () => {
    const config = { ...PRESETS.tiny!, numExperts: 16, topK: 4, maxTokens: 16 };
    const weights = new GeneratedWeights(config, 5);
    for (const ranks of [2, 4, 8]) {
      const inputs = Array.from({ length: ranks }, (_, s) => {
        const t = [5, 0, 9, 1, 7, 2, 11, 4][s]!;
        const r = randomRouting(100 * ranks + s, t, config, { maskedTokens: t > 2 ? [1] : [] });
        return { x: generateActivations(s, t, config.hidden), tokens: t, ...r };
      });
      const layout = fusedEpLayout({ ranks, numExperts: 16, topK: 4, hidden: config.hidden, maxTokens: 16 });
      const { rows, results, descriptors } = runProtocol(weights, [inputs], { seed: ranks }).traffic[0]!;
      assert.deepEqual(
        fusedEpTraffic(
          layout,
          inputs.map((i) => i.ids),
        ),
        { rows, results, descriptors },
        `${ranks} ranks`,
      );
      assert.ok(rows > 0 && results > 0);
    }
  });
});
