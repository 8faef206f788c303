/**
 * lab/soak's logic on the CPU backend (the GPU run is the lead's, on the H200): a handful of forwards
 * pass every check, a faulty engine's failures are counted and replayable, and the GPU plan only draws
 * shapes both pipelines accept.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import {
  CpuEngine,
  caseRouting,
  DEFAULT_SOAK,
  drawPlan,
  formatSummary,
  parseSoakArgs,
  runSoak,
  type ShapeRunner,
  type SoakEngine,
  type SoakOptions,
  SoakTrip,
} from "../../lab/soak.js";
import { validateConfig } from "../../src/config/config.js";
import { fusedLayerProblem } from "../../src/kernels/megamoe/megamoe.js";

const cpu = (o: Partial<SoakOptions> = {}): SoakOptions => ({
  ...DEFAULT_SOAK,
  backend: "cpu",
  forwards: 12,
  shapes: 2,
  seed: 11,
  ...o,
});

/** The CPU engine with a fault injected into every run after the first of a case's pipeline. */
class FaultyEngine implements SoakEngine {
  readonly impls = ["a", "b"];
  readonly description = "faulty";
  readonly fatalErrors = false;
  private readonly inner = new CpuEngine();
  constructor(private readonly fault: "repeat" | "cross" | "nan" | "watchdog" | "leak") {}
  private leaked = 0;
  memory() {
    return { driverFreeBytes: 1000 - this.leaked, allocatedBytes: this.leaked };
  }
  open(shape: Parameters<SoakEngine["open"]>[0]): ShapeRunner {
    const r = this.inner.open(shape);
    let runs = 0;
    return {
      load: (k, routing) => {
        runs = 0;
        r.load(k, routing);
      },
      run: (impl, k, poison) => {
        const out = r.run(impl, k, poison).slice();
        runs++;
        if (this.fault === "repeat" && impl === "a" && !poison) out[0] ^= 1;
        if (this.fault === "cross" && impl === "b") out[out.length - 1] ^= 1;
        if (this.fault === "nan" && impl === "b" && runs === 4) out[1] = 0x7fc0;
        if (this.fault === "watchdog" && impl === "b") throw new SoakTrip("watchdog", "trapped");
        if (this.fault === "leak") this.leaked += 64; // every forward keeps 64 bytes
        return out;
      },
      unload: () => r.unload(),
      dispose: () => r.dispose(),
    };
  }
}

describe("lab/soak", () => {
  test("a few CPU forwards pass every check", () => {
    const s = runSoak(cpu(), new CpuEngine());
    assert.equal(s.ok, true, formatSummary(s));
    assert.equal(s.shapes.run, 2);
    assert.equal(s.forwards.run, s.forwards.planned);
    assert.ok(s.forwards.run >= 12);
    assert.equal(s.checks.repeat.checked, s.cases);
    assert.equal(s.checks.finite.checked, s.forwards.run);
    assert.equal(s.checks.cross.checked, 0);
    assert.equal(s.checks.memory.checked, false);
    assert.match(formatSummary(s), /soak PASSED/);
  });

  for (const fault of ["repeat", "cross", "nan"] as const) {
    test(`a ${fault} fault is counted and replayable`, () => {
      const s = runSoak(cpu(), new FaultyEngine(fault));
      assert.equal(s.ok, false);
      const check = fault === "nan" ? "finite" : fault;
      assert.ok(s.checks[check].failed > 0, JSON.stringify(s.checks));
      const f = s.failures[0]!;
      assert.equal(f.check, check);
      assert.match(f.replay, new RegExp(`--seed 11 .*--only ${f.shape}:${f.case}$`));
      // The replay runs that case alone and fails the same way.
      const only = runSoak(cpu({ only: { shape: f.shape, case: f.case } }), new FaultyEngine(fault));
      assert.equal(only.cases, 1);
      assert.equal(only.failures[0]?.detail, f.detail);
    });
  }

  test("a watchdog trip is counted and, on a fatal engine, stops the run", () => {
    const s = runSoak(cpu(), new FaultyEngine("watchdog"));
    assert.equal(s.ok, false);
    assert.equal(s.checks.watchdog.trips, 1);
    assert.match(s.stoppedEarly ?? "", /unusable/);
    assert.equal(s.checks.memory.after, null);
  });

  test("memory that does not come back is a leak", () => {
    const s = runSoak(cpu(), new FaultyEngine("leak"));
    assert.equal(s.checks.memory.checked, true);
    assert.equal(s.checks.memory.ok, false);
    // Only the soak pass's forwards count: the opening pass's happen before the first reading.
    assert.equal(s.checks.memory.allocatedLeakBytes, 64 * s.forwards.run);
    assert.equal(s.checks.memory.driverLeakBytes, 64 * s.forwards.run);
    assert.equal(s.ok, false);
    assert.match(formatSummary(s), /LEAK/);
  });

  test("the GPU plan draws shapes both pipelines run, with T = 1 and maxTokens", () => {
    const plan = drawPlan({ ...DEFAULT_SOAK, seed: 5 });
    assert.equal(plan.length, DEFAULT_SOAK.shapes);
    const cases = plan.reduce((n, s) => n + s.cases.length, 0);
    assert.ok(cases * 4 >= DEFAULT_SOAK.forwards);
    for (const s of plan) {
      validateConfig(s.config);
      assert.equal(fusedLayerProblem(s.config), null);
      assert.equal(s.config.hidden % 256, 0);
      assert.equal(s.config.intermediate % 128, 0);
      assert.equal(s.cases[0]!.tokens, 1);
      assert.equal(s.cases[1]!.tokens, s.config.maxTokens);
      for (const k of s.cases.slice(0, 6)) {
        const r = caseRouting(s.config, k, "cuda");
        assert.equal(r.ids.length, k.tokens * s.config.topK);
        if (k.skew === "all-masked") assert.ok(r.ids.every((id) => id < 0 || id >= s.config.numExperts));
      }
    }
    const skews = new Set(plan.flatMap((s) => s.cases.map((k) => k.skew)));
    assert.deepEqual([...skews].sort(), ["all-masked", "empty", "hot", "uniform"]);
    assert.deepEqual(drawPlan({ ...DEFAULT_SOAK, seed: 5 }), plan, "the plan is a function of the seed");
  });

  test("arguments", () => {
    assert.equal(parseSoakArgs(["--help"]), "help");
    const p = parseSoakArgs(["--backend", "cpu", "--forwards", "8", "--only", "3:4", "--out", "x/s.json"]);
    assert.ok(p !== "help");
    assert.equal(p.options.forwards, 8);
    assert.deepEqual(p.options.only, { shape: 3, case: 4 });
    assert.equal(p.out, "x/s.json");
    assert.throws(() => parseSoakArgs(["--backend", "rocm"]), /cuda or cpu/);
    assert.throws(() => parseSoakArgs(["--forwards", "0"]), /≥ 1/);
    assert.throws(() => parseSoakArgs(["--only", "x"]), /SHAPE/);
  });
});
