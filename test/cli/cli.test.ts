import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";
import { cliArgs, runCliSync } from "../helpers/cli.js";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
console.log(`cli tests run ${path.relative(root, cliArgs.at(-1)!)}`);

function megamoe(...args: string[]) {
  return runCliSync(args);
}

describe("megamoe CLI", () => {
  it("run prints a deterministic JSON summary", () => {
    const a = megamoe("run", "--shape", "tiny", "--tokens", "5", "--seed", "3", "--json");
    assert.equal(a.code, 0, a.stderr);
    const s = JSON.parse(a.stdout);
    assert.equal(s.shape, "tiny");
    assert.equal(s.tokens, 5);
    assert.match(s.checksum, /^[0-9a-f]{8}$/);
    assert.ok(s.norm > 0);
    const b = megamoe("run", "--shape", "tiny", "--tokens", "5", "--seed", "3", "--json");
    assert.equal(JSON.parse(b.stdout).checksum, s.checksum);
    const c = megamoe("run", "--shape", "tiny", "--tokens", "5", "--seed", "4", "--json");
    assert.notEqual(JSON.parse(c.stdout).checksum, s.checksum);
  });

  it("run and check on the CPU give the same figures on one thread as on three (--threads)", () => {
    const cpu = (command: string, threads: string) =>
      megamoe(
        command,
        "--shape",
        "tiny",
        "--tokens",
        "7",
        "--backend",
        "cpu",
        "--threads",
        threads,
        "--json",
      );
    const one = cpu("run", "1");
    const three = cpu("run", "3");
    assert.equal(one.code, 0, one.stderr);
    assert.equal(three.code, 0, three.stderr);
    assert.equal(JSON.parse(three.stdout).checksum, JSON.parse(one.stdout).checksum);
    const checks = [cpu("check", "1"), cpu("check", "3")].map((r) => {
      assert.equal(r.code, 0, r.stderr);
      return JSON.parse(r.stdout).comparisons;
    });
    assert.deepEqual(checks[1], checks[0]);
  });

  it("run from saved weights gives the same output as generated weights", () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-cli-"));
    try {
      const file = path.join(dir, "w.safetensors");
      const saved = megamoe("run", "--tokens", "4", "--seed", "9", "--save-weights", file, "--json");
      assert.equal(saved.code, 0, saved.stderr);
      const loaded = megamoe("run", "--tokens", "4", "--seed", "9", "--weights", file, "--json");
      const generated = megamoe("run", "--tokens", "4", "--seed", "9", "--json");
      assert.equal(JSON.parse(loaded.stdout).checksum, JSON.parse(generated.stdout).checksum);
      assert.equal(JSON.parse(saved.stdout).checksum, JSON.parse(generated.stdout).checksum);
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  it("run names a bad --pipeline, and one given to the CPU backend", () => {
    const bad = megamoe("run", "--tokens", "2", "--pipeline", "nope");
    assert.notEqual(bad.code, 0);
    assert.match(bad.stderr, /--pipeline nope: expected fused or unfused/);
    const cpu = megamoe("run", "--tokens", "2", "--backend", "cpu", "--pipeline", "fused");
    assert.notEqual(cpu.code, 0);
    assert.match(cpu.stderr, /the pipeline applies to the "cuda" backend/);
  });

  it("check reports the FP8 error against the FP64 ideal, with its bounds and a verdict", () => {
    const r = megamoe("check", "--tokens", "8", "--backend", "cpu", "--json");
    assert.equal(r.code, 0, r.stderr);
    const result = JSON.parse(r.stdout);
    const [c] = result.comparisons;
    assert.equal(c.comparison, "reference(fp8) vs ideal(fp64)");
    assert.ok(c.relError > 0 && c.relError < 0.1, String(c.relError));
    assert.ok(c.calcDiff > 0 && c.calcDiff < 5e-3, String(c.calcDiff));
    assert.deepEqual(c.bounds, { relError: 0.1, calcDiff: 5e-3 });
    assert.equal(c.pass, true);
    assert.deepEqual(c.failures, []);
    assert.equal(result.pass, true);
    assert.equal(result.notChecked, "the GPU layer was not checked (--backend cpu)");
    const text = megamoe("check", "--tokens", "8", "--backend", "cpu");
    assert.equal(text.code, 0, text.stderr);
    assert.match(
      text.stdout,
      /reference\(fp8\) vs ideal\(fp64\)\s+\S+\s+≤ 1\.00e-1\s+\S+\s+≤ 5\.00e-3\s+pass/,
    );
    assert.match(text.stdout, /^pass: 1 of 1 comparisons within their bounds$/m);
    assert.match(text.stdout, /note: the GPU layer was not checked \(--backend cpu\)/);
  });

  it("run --ranks splits the layer and reports the rows each rank received and sent", () => {
    const r = megamoe("run", "--tokens", "10", "--ranks", "4", "--backend", "cpu", "--json");
    assert.equal(r.code, 0, r.stderr);
    const s = JSON.parse(r.stdout);
    assert.equal(s.ranks, 4);
    assert.equal(s.rowsReceived.length, 4);
    // Each token reaches 1 to top-k ranks; what a rank does not keep it sends.
    const received = s.rowsReceived.reduce((a: number, b: number) => a + b, 0);
    assert.ok(received >= 10 && received <= 10 * s.topK, String(received));
    assert.ok(s.rowsSent.reduce((a: number, b: number) => a + b, 0) <= received);
    assert.match(s.checksum, /^[0-9a-f]{8}$/);
  });

  it("check --ranks adds the expert-parallel layer against the one-device reference", () => {
    const r = megamoe("check", "--tokens", "11", "--ranks", "4", "--backend", "cpu", "--json");
    assert.equal(r.code, 0, r.stderr);
    const result = JSON.parse(r.stdout);
    assert.equal(result.ranks, 4);
    const ep = result.comparisons.find(
      (c: { comparison: string }) => c.comparison === "4 ranks (cpu) vs reference(fp8)",
    );
    assert.ok(ep, JSON.stringify(result.comparisons));
    assert.ok(ep.relError > 0 && ep.relError < 1e-2 && ep.calcDiff < 1e-4, JSON.stringify(ep));
    // judged by the bound of an output with the reference's numerics (11 tokens: not "few")
    assert.ok(ep.pass && ep.bounds.relError >= 1e-2 && ep.bounds.calcDiff >= 1e-4, JSON.stringify(ep));
    const uneven = megamoe("check", "--ranks", "3", "--backend", "cpu");
    assert.notEqual(uneven.code, 0);
    assert.match(uneven.stderr, /8 experts cannot be split evenly among 3 ranks/);
  });

  it("run --experts fp4 runs the layer with MXFP4 experts on the CPU and says so", () => {
    const fp4 = megamoe(
      "run",
      "--tokens",
      "5",
      "--seed",
      "3",
      "--backend",
      "cpu",
      "--experts",
      "fp4",
      "--json",
    );
    assert.equal(fp4.code, 0, fp4.stderr);
    const s = JSON.parse(fp4.stdout);
    assert.equal(s.expertFormat, "fp4");
    assert.match(s.checksum, /^[0-9a-f]{8}$/);
    const fp8 = JSON.parse(
      megamoe("run", "--tokens", "5", "--seed", "3", "--backend", "cpu", "--experts", "fp8", "--json").stdout,
    );
    const plain = JSON.parse(
      megamoe("run", "--tokens", "5", "--seed", "3", "--backend", "cpu", "--json").stdout,
    );
    assert.equal(fp8.expertFormat, "fp8");
    assert.equal(fp8.checksum, plain.checksum);
    assert.notEqual(s.checksum, fp8.checksum);
    // FP4 experts take about half FP8's device bytes (codes halve; scales grow from 1/4096 to 1/32).
    assert.ok(
      s.deviceWeightBytes < 0.6 * fp8.deviceWeightBytes,
      `${s.deviceWeightBytes} vs ${fp8.deviceWeightBytes}`,
    );
    const text = megamoe("run", "--tokens", "5", "--backend", "cpu", "--experts", "fp4");
    assert.equal(text.code, 0, text.stderr);
    assert.match(text.stdout, /weights\s+fp4 routed experts \(MXFP4\), shared fp8; [\d.]+ kB on a GPU/);
  });

  it("check --experts fp4 compares the FP4 layer's reference with its FP64 ideal", () => {
    const r = megamoe("check", "--tokens", "6", "--backend", "cpu", "--experts", "fp4", "--json");
    assert.equal(r.code, 0, r.stderr);
    const out = JSON.parse(r.stdout);
    assert.equal(out.expertFormat, "fp4");
    const [c] = out.comparisons;
    assert.ok(c.relError > 0 && c.relError < 0.2, String(c.relError));
  });

  it("info runs without a GPU and says why there is none", () => {
    const r = megamoe("info", "--json");
    assert.equal(r.code, 0, r.stderr);
    const info = JSON.parse(r.stdout);
    assert.equal(typeof info.node, "string");
    // A flash layer on a GPU: ~6.4 GB with FP8 experts, ~3.4 GB with FP4.
    const flash = info.layerWeightBytes.flash;
    assert.ok(flash.fp8 > 6.4e9 && flash.fp8 < 6.5e9, String(flash.fp8));
    assert.ok(flash.fp4 > 3.4e9 && flash.fp4 < 3.5e9, String(flash.fp4));
    if (info.cuda === null) assert.ok(info.cudaUnavailable.length > 0);
  });

  it("bad arguments fail with a clear message and exit code 1", () => {
    const cases: [string[], RegExp][] = [
      [["run", "--shape", "huge"], /unknown shape "huge"/],
      [["run", "--tokens", "0"], /tokens must be a positive integer/],
      [["run", "--tokens", "abc"], /tokens must be a positive integer/],
      [["run", "--routing", "magic"], /--routing must be/],
      [["run", "--backend", "tpu"], /--backend tpu: expected auto, cpu or cuda/],
      [["run", "--shared", "2"], /must be 0 or 1/],
      [["run", "--weights", "/nonexistent/w.safetensors"], /w\.safetensors/],
      [["bench", "--impl", "quant", "--rounds", "2"], /--rounds applies to --impl fused/],
      [
        ["bench", "--impl", "fused", "--iters", "20", "--rounds", "21"],
        /--rounds \(21\) must not exceed --iters \(20\)/,
      ],
      [["bench", "--impl", "fused", "--rounds", "0"], /rounds must be a positive integer/],
      [
        ["bench", "--impl", "grouped-gemm", "--codes", "pink"],
        /--codes must be one of quantized, gaussian, uniform-bytes, got "pink"/,
      ],
      [
        ["bench", "--impl", "fused", "--codes", "gaussian"],
        /--codes applies to --impl grouped-gemm, not fused/,
      ],
      [
        ["bench", "--impl", "fused", "--warmup-ms", "500"],
        /--warmup-ms applies to --impl grouped-gemm, not fused/,
      ],
      [["bench", "--impl", "grouped-gemm", "--warmup-ms", "-3"], /warmup-ms.*must be a positive number/],
      [["run", "--experts", "fp16"], /--experts fp16: expected fp4 or fp8/],
      [["check", "--experts", "FP4"], /--experts FP4: expected fp4 or fp8/],
      [["bench", "--impl", "fused", "--experts", "mxfp4"], /--experts mxfp4: expected fp4 or fp8/],
      [
        ["bench", "--impl", "quant", "--experts", "fp4"],
        /--experts applies to --impl fused, unfused, fused,unfused, step or ep, not quant/,
      ],
    ];
    for (const [args, message] of cases) {
      const r = megamoe(...args);
      assert.notEqual(r.code, 0, args.join(" "));
      assert.match(r.stderr, message, args.join(" "));
    }
  });
});
