import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  fillHash32,
  fillUniform,
  hash32,
  streamKey,
  tensorKey,
  uniformSym,
} from "../../src/numerics/counter-rng.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("counter-rng tests");

const f32Bits = (x: number) => new Uint32Array(new Float32Array([x]).buffer)[0];

describe("tensorKey", () => {
  it("is FNV-1a of the UTF-8 name", () => {
    assert.equal(tensorKey(""), 0x811c9dc5);
    assert.equal(tensorKey("a"), 0xe40c292c);
    assert.equal(tensorKey("foobar"), 0xbf9cf968);
    assert.notEqual(tensorKey("experts.0.w1"), tensorKey("experts.0.w2"));
  });
});

describe("hash32 and uniformSym", () => {
  // Pinned values, checked against an independent C++ implementation of docs/weights.md: a change here
  // changes every generated weight and breaks bit-exactness with the CUDA generator.
  it("match the known-answer vectors", () => {
    const key = tensorKey("experts.0.w1");
    assert.equal(key, 0x105fa81a);
    const vectors: [number, number, number, number][] = [
      [0, 0, 0xc266c25e, 0x3c29fcd2],
      [0, 4294967295, 0x7a782c06, 0xba628852],
      [1, 1, 0xf020439b, 0x3c8f8574],
      [123456789, 1000, 0xbc76f514, 0x3c1aca21],
    ];
    for (const [s, i, h, scaledBits] of vectors) {
      assert.equal(hash32(s, key, i), h, `hash32(${s}, key, ${i})`);
      const out = new Float32Array(1);
      fillUniform(out, s, key, i, Math.fround(0.02));
      assert.equal(f32Bits(out[0]), scaledBits, `fillUniform(${s}, key, ${i}, 0.02)`);
    }
  });

  it("is deterministic and depends on seed, key and index", () => {
    const key = tensorKey("t");
    for (let i = 0; i < 100; i++) {
      const index = (seed * 7919 + i * 104729) % 2 ** 32;
      assert.equal(hash32(seed, key, index), hash32(seed, key, index));
      assert.equal(uniformSym(seed, key, index), uniformSym(seed, key, index));
    }
    const differ = (f: (i: number) => [number, number]) => {
      let same = 0;
      for (let i = 0; i < 1000; i++) {
        const [a, b] = f(i);
        if (a === b) same++;
      }
      return same;
    };
    assert.ok(differ((i) => [hash32(seed, key, i), hash32(seed + 1, key, i)]) <= 1);
    assert.ok(differ((i) => [hash32(seed, key, i), hash32(seed, tensorKey("u"), i)]) <= 1);
    assert.ok(differ((i) => [hash32(seed, key, i), hash32(seed, key, i + 1)]) <= 1);
    assert.notEqual(streamKey(seed, key), streamKey(seed + 1, key));
  });

  it("gives exact fp32 values in [-1, 1) with mean 0 and variance 1/3", () => {
    const key = tensorKey("stats");
    const n = 200_000;
    let sum = 0;
    let sumSq = 0;
    for (let i = 0; i < n; i++) {
      const u = uniformSym(seed, key, i);
      assert.ok(u >= -1 && u < 1);
      if (i < 1000) assert.equal(Math.fround(u), u);
      sum += u;
      sumSq += u * u;
    }
    const mean = sum / n;
    const variance = sumSq / n - mean * mean;
    assert.ok(Math.abs(mean) < 0.01, `mean ${mean}`);
    assert.ok(Math.abs(variance - 1 / 3) < 0.01, `variance ${variance}`);
  });

  it("has every output bit near 50% ones over consecutive indices", () => {
    const key = tensorKey("bits");
    const n = 20_000;
    const ones = new Array<number>(32).fill(0);
    for (let i = 0; i < n; i++) {
      const h = hash32(seed, key, i);
      for (let b = 0; b < 32; b++) ones[b] += (h >>> b) & 1;
    }
    for (let b = 0; b < 32; b++) assert.ok(Math.abs(ones[b] / n - 0.5) < 0.03, `bit ${b}: ${ones[b] / n}`);
  });
});

describe("fillUniform and fillHash32", () => {
  it("equal the per-element functions, at any start and offset", () => {
    const key = tensorKey("fill");
    const scale = Math.fround(0.0371);
    const start = (seed % 1_000_000) * 3;
    const out = new Float32Array(1000).fill(7);
    fillUniform(out, seed, key, start, scale, 100, 800);
    const hashes = new Uint32Array(1000);
    fillHash32(hashes, seed, key, start, 100, 800);
    for (let i = 0; i < 1000; i++) {
      if (i < 100 || i >= 900) {
        assert.equal(out[i], 7);
        assert.equal(hashes[i], 0);
        continue;
      }
      assert.equal(out[i], Math.fround(uniformSym(seed, key, start + i - 100) * scale));
      assert.equal(hashes[i], hash32(seed, key, start + i - 100));
    }
  });

  it("wraps the Weyl counter correctly up to index 2^32 − 1", () => {
    const key = tensorKey("wrap");
    const out = new Float32Array(16);
    fillUniform(out, seed, key, 2 ** 32 - 16, 1);
    for (let i = 0; i < 16; i++) assert.equal(out[i], uniformSym(seed, key, 2 ** 32 - 16 + i));
    assert.throws(() => fillUniform(out, seed, key, 2 ** 32 - 15, 1), RangeError);
    assert.throws(() => fillUniform(out, seed, key, 0, 1, 10, 7), RangeError);
  });
});
