/**
 * `megamoe bench --impl ep` as the command line meets it: its options checked before a GPU is looked
 * for (--ranks 2 … 8 dividing the shape's experts, tokens a host-planned rank can receive, the options
 * of other impls refused), --ranks refused elsewhere, and without a GPU the no-GPU message in the CLI's
 * style. Each row spawns the CLI with NO_COLOR=1: the exit code and one line, never a stack trace.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { cudaAvailability } from "../../src/cuda/index.js";
import { runCli } from "../helpers/cli.js";

const noGpu = !cudaAvailability().ok;

const rows: { args: string[]; code: number; message: RegExp; when?: boolean }[] = [
  {
    args: ["bench", "--impl", "ep", "--ranks", "3"],
    code: 1,
    message: /^error: --ranks 3: must divide the 256 routed experts of flash\n$/,
  },
  {
    args: ["bench", "--impl", "ep", "--ranks", "2,4,16"],
    code: 1,
    message:
      /^error: --ranks 16: must be in 2 … 8 \(the fused kernel's EP build; one rank is --impl fused\)\n$/,
  },
  { args: ["bench", "--impl", "ep", "--ranks", "1"], code: 1, message: /--ranks 1: must be in 2 … 8/ },
  {
    args: ["bench", "--impl", "ep", "--ranks", "0"],
    code: 1,
    message: /expected a comma-separated list of positive integers, got "0"/,
  },
  {
    args: ["bench", "--impl", "ep", "--ranks", "2,,4"],
    code: 1,
    message: /expected a comma-separated list of positive integers, got "2,,4"/,
  },
  {
    args: ["bench", "--impl", "ep", "--shape", "tiny", "--ranks", "3"],
    code: 1,
    message: /--ranks 3: must divide the 8 routed experts of tiny/,
  },
  { args: ["bench", "--impl", "ep", "--shape", "huge"], code: 1, message: /unknown shape "huge"/ },
  {
    args: ["bench", "--impl", "ep", "--tokens", "1,16384"],
    code: 1,
    message:
      /--tokens 16384: with 8 ranks a host-planned rank may receive 8 × 16384 = 131072 rows, more than a layer's 65536/,
  },
  {
    args: ["bench", "--impl", "ep", "--tokens", "70000"],
    code: 1,
    message: /--tokens 70000: the layer takes at most 65536 tokens/,
  },
  {
    args: ["bench", "--ranks", "2"],
    code: 1,
    message: /^error: --ranks applies to --impl ep, not fused,unfused\n$/,
  },
  {
    args: ["bench", "--gpus"],
    code: 1,
    message: /^error: --gpus applies to --impl ep, not fused,unfused\n$/,
  },
  {
    args: ["bench", "--impl", "step", "--ranks", "2"],
    code: 1,
    message: /--ranks applies to --impl ep, not step/,
  },
  {
    args: ["bench", "--impl", "ep", "--experts", "fp6"],
    code: 1,
    message: /--experts/,
  },
  {
    args: ["bench", "--impl", "ep", "--configs"],
    code: 1,
    message: /--configs applies to --impl fused or fused,unfused, not ep/,
  },
  {
    args: ["bench", "--impl", "ep", "--plot", "x.svg"],
    code: 1,
    message: /--plot draws the layer's time against tokens/,
  },
  {
    args: ["bench", "--impl", "ep", "--peer", "package.json"],
    code: 1,
    message: /--peer applies to the layer and kernel benchmarks, not ep/,
  },
  {
    args: ["bench", "--impl", "ep", "--iters", "20", "--rounds", "21"],
    code: 1,
    message: /--rounds \(21\) must not exceed --iters \(20\)/,
  },
  {
    args: ["bench", "--impl", "quant", "--rounds", "2"],
    code: 1,
    message: /--rounds applies to --impl fused, unfused, fused,unfused or ep, not quant/,
  },
  {
    args: ["bench", "--impl", "ep"],
    code: 1,
    message:
      /^error: bench --impl ep needs a CUDA GPU \(its ranks are virtual ranks on GPU 0\): [^\n]{1,160}\n$/,
    when: noGpu,
  },
  {
    // The issue's sweep passes every check: only the GPU is missing.
    args: [
      "bench",
      "--impl",
      "ep",
      "--ranks",
      "2,4,8",
      "--shape",
      "flash",
      "--tokens",
      "1,8,64,512,4096,8192",
      "--rounds",
      "3",
      "--fp8-tflops",
      "1200",
    ],
    code: 1,
    message: /^error: bench --impl ep needs a CUDA GPU/,
    when: noGpu,
  },
  {
    args: ["bench", "--impl", "ep", "--verbose"],
    code: 1,
    message: /bench --impl ep needs a CUDA GPU .*looked in: /,
    when: noGpu,
  },
  { args: ["bench", "--help"], code: 0, message: /--ranks <list>\s+ep: virtual ranks on the one GPU/ },
];

describe("bench --impl ep: usage errors before the GPU, the no-GPU message", { concurrency: 2 }, () => {
  for (const r of rows) {
    it(r.args.join(" "), { skip: r.when === false }, async () => {
      const out = await runCli(r.args);
      assert.equal(out.code, r.code, `exit code; stderr: ${out.stderr}`);
      assert.doesNotMatch(out.stderr, /\n\s+at /, "a stack trace");
      assert.match(r.code === 0 ? out.stdout : out.stderr, r.message);
    });
  }
});
