import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  ConfigError,
  expertFormatOf,
  isValidatedConfig,
  type MoEConfig,
  PRESETS,
  presetNames,
  resolveConfig,
  sharedIntermediate,
  validateConfig,
} from "../../src/config/config.js";

describe("config presets", () => {
  it("are all valid and have the documented shapes", () => {
    for (const name of presetNames()) validateConfig(PRESETS[name]);
    const flash = resolveConfig("flash");
    assert.deepEqual(
      [flash.numExperts, flash.hidden, flash.intermediate, flash.topK, flash.numShared],
      [256, 4096, 2048, 6, 1],
    );
    const pro = resolveConfig("pro");
    assert.deepEqual(
      [pro.numExperts, pro.hidden, pro.intermediate, pro.topK, pro.numShared],
      [384, 7168, 3072, 6, 1],
    );
    const ep8 = resolveConfig("flash-ep8");
    assert.deepEqual([ep8.numExperts, ep8.hidden, ep8.intermediate, ep8.topK], [32, 4096, 2048, 6]);
    assert.equal(sharedIntermediate(flash), 2048);
  });

  it("accept overrides, validated", () => {
    assert.equal(resolveConfig("flash", { ranks: 8 }).ranks, 8);
    assert.equal(
      resolveConfig("tiny", { router: { scoring: "softmax" } as MoEConfig["router"] }).router.scoring,
      "softmax",
    );
    assert.throws(() => resolveConfig("flash", { ranks: 3 }), /multiple of ranks/);
  });

  it("reject an unknown preset naming the valid ones", () => {
    assert.throws(() => resolveConfig("huge"), /unknown shape "huge".*tiny, flash, pro, flash-ep8/);
  });
});

describe("config validation", () => {
  const base = resolveConfig("tiny");
  const cases: [string, Partial<MoEConfig>, RegExp][] = [
    ["H not a multiple of 128", { hidden: 300 }, /hidden must be a multiple of 128/],
    ["IH not a multiple of 128", { intermediate: 200 }, /intermediate must be a multiple of 128/],
    ["H too small", { hidden: 64 }, /hidden must be an integer in/],
    ["top-k > E", { topK: 9 }, /topK \(9\) must not exceed numExperts \(8\)/],
    ["top-k zero", { topK: 0 }, /topK must be an integer/],
    ["fractional experts", { numExperts: 7.5 }, /numExperts must be an integer/],
    ["negative shared", { numShared: -1 }, /numShared/],
    ["E not divisible by ranks", { ranks: 3 }, /multiple of ranks/],
    ["bad clamp", { swigluClamp: -1 }, /swigluClamp/],
    ["NaN clamp", { swigluClamp: Number.NaN }, /swigluClamp/],
    ["bad scale format", { scaleFormat: "fp16" as never }, /scaleFormat/],
    ["bad expert format", { expertFormat: "fp6" as never }, /expertFormat/],
    ["zero max tokens", { maxTokens: 0 }, /maxTokens/],
    ["too many max tokens", { maxTokens: 1e6 }, /maxTokens/],
  ];
  for (const [what, override, message] of cases) {
    it(`rejects ${what}`, () => {
      assert.throws(
        () => validateConfig({ ...base, ...override }),
        (e: Error) => e instanceof ConfigError && message.test(e.message),
      );
    });
  }

  it("rejects bad router settings", () => {
    const r = base.router;
    const bad: [Partial<MoEConfig["router"]>, RegExp][] = [
      [{ scoring: "relu" as never }, /router.scoring/],
      [{ nGroup: 3 }, /multiple of router.nGroup/],
      [{ nGroup: 4, topkGroup: 5 }, /router.topkGroup/],
      [{ nGroup: 8, topkGroup: 1 }, /cannot hold topK/],
      [{ routedScalingFactor: 0 }, /routedScalingFactor/],
    ];
    for (const [override, message] of bad) {
      assert.throws(() => validateConfig({ ...base, router: { ...r, ...override } }), message);
    }
  });
});

describe("validated configs", () => {
  it("come back as they are, while a spread copy is checked again", () => {
    const tiny = resolveConfig("tiny");
    assert.ok(isValidatedConfig(tiny) && Object.isFrozen(tiny) && Object.isFrozen(tiny.router));
    assert.equal(validateConfig(tiny), tiny);
    const copy = { ...tiny, hidden: 300 };
    assert.equal(isValidatedConfig(copy), false);
    assert.throws(() => validateConfig(copy), /hidden must be a multiple of 128/);
    for (const name of presetNames()) assert.ok(isValidatedConfig(PRESETS[name]));
  });

  it("name an unknown field and the nearest known one", () => {
    const tiny = resolveConfig("tiny");
    assert.throws(
      () => validateConfig({ ...tiny, numExpert: 8 } as MoEConfig),
      (e: Error) => e instanceof ConfigError && /numExpert \(did you mean numExperts\?\)/.test(e.message),
    );
    assert.throws(
      () => validateConfig({ ...tiny, zzzzzz: 1 } as MoEConfig),
      /unknown config field zzzzzz; known:/,
    );
  });
});

describe("expertFormat", () => {
  it("defaults to fp8 and accepts fp4", () => {
    assert.equal(expertFormatOf(resolveConfig("flash")), "fp8");
    const fp4 = resolveConfig("flash", { expertFormat: "fp4" });
    assert.equal(expertFormatOf(fp4), "fp4");
  });
});
