/**
 * The command line as a new user meets it: every option of run, check, info, bench and plot given a
 * bad value, each row the argv, the exit code and a fragment of the message. A bad value exits 1 with
 * one line naming the value and what was expected, never a stack trace; the rows that exit 0 are
 * values the help documents as valid (edges included). Bench rows stop in its checks, before a GPU is
 * looked for, so they run the same on any machine.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import { cudaAvailability } from "../../src/cuda/index.js";
import { GeneratedWeights, resolveConfig, saveMoEWeights } from "../../src/index.js";
import { runCli } from "../helpers/cli.js";

const noGpu = !cudaAvailability().ok;

// Made at load time, so the rows (and the tests' names) hold the real paths.
const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-bad-inputs-"));
const write = (name: string, text: string) => {
  const file = path.join(dir, name);
  fs.writeFileSync(file, text);
  return file;
};
const files = {
  notJson: write("not.json", "not json"),
  noRows: write("empty.json", '{"rows": []}'),
  // JSON.parse reads 1e400 as Infinity, which JSON.stringify would print as null.
  hugeTime: write(
    "huge.json",
    '{"rows": [{"config": "tiny", "impl": "fused", "tokens": 1, "us_median": 1e400, "us_min": 1, "us_max": 1}]}',
  ),
  notSafetensors: write("weights.safetensors", "a text file, not safetensors\n"),
  plainFile: write("plain", "x"),
  fp4Weights: path.join(dir, "fp4.safetensors"),
};
saveMoEWeights(files.fp4Weights, new GeneratedWeights(resolveConfig("tiny", { expertFormat: "fp4" }), 1));
after(() => fs.rmSync(dir, { recursive: true, force: true }));

interface Row {
  args: () => string[];
  code: number;
  /** Matched against stderr for a failure, stdout + stderr for a success. */
  message: RegExp;
  env?: NodeJS.ProcessEnv;
  /** Only where this holds (e.g. a row about the machine having no GPU). */
  when?: boolean;
}

const row = (args: string[], code: number, message: RegExp, extra: Partial<Row> = {}): Row => ({
  args: () => args,
  code,
  message,
  ...extra,
});

const rows: Row[] = [
  // unknown commands, options and arguments
  row(["nope"], 1, /unknown command 'nope'/),
  row(["run", "--bogus"], 1, /unknown option '--bogus'/),
  row(["run", "extra"], 1, /too many arguments for 'run'/),
  row(["info", "--bogus"], 1, /unknown option '--bogus'/),
  row(["plot"], 1, /required option '--out <file>' not specified/),
  // run: shapes, tokens, seeds, choices
  row(["run", "--shape", "huge"], 1, /unknown shape "huge": expected one of tiny, flash, pro, flash-ep8/),
  row(["run", "--shape", ""], 1, /unknown shape ""/),
  row(
    ["run", "--tokens", "-1"],
    1,
    /argument '-1' is invalid\. tokens must be a positive integer, at most 65536/,
  ),
  row(["run", "--tokens", "1.5"], 1, /argument '1\.5' is invalid\. tokens must be a positive integer/),
  row(["run", "--tokens", "0x10"], 1, /argument '0x10' is invalid\. tokens must be a positive integer/),
  row(["run", "--tokens", "1e3"], 1, /argument '1e3' is invalid\. tokens must be a positive integer/),
  row(
    ["run", "--tokens", "65537"],
    1,
    /argument '65537' is invalid\. tokens must be a positive integer, at most 65536/,
  ),
  row(["run", "--tokens", "99999999999999999999"], 1, /tokens must be a positive integer, at most 65536/),
  row(["run", "--tokens", ""], 1, /argument '' is invalid/),
  row(
    ["run", "--seed", "-1"],
    1,
    /argument '-1' is invalid\. seed must be an integer in \[0, 4294967295\], got "-1"/,
  ),
  row(
    ["run", "--seed", "abc"],
    1,
    /argument 'abc' is invalid\. seed must be an integer in \[0, 4294967295\]/,
  ),
  row(
    ["run", "--seed", "1e30"],
    1,
    /argument '1e30' is invalid\. seed must be an integer in \[0, 4294967295\]/,
  ),
  row(
    ["run", "--seed", "4294967296"],
    1,
    /seed must be an integer in \[0, 4294967295\], got number 4294967296/,
  ),
  row(["run", "--shared", "yes"], 1, /argument 'yes' is invalid\. must be 0 or 1/),
  row(["run", "--ranks", "0"], 1, /ranks must be a positive integer/),
  row(["run", "--threads", "0"], 1, /threads must be a positive integer, at most 64/),
  row(["check", "--threads", "65"], 1, /threads must be a positive integer, at most 64/),
  row(["run", "--threads", "two"], 1, /threads must be a positive integer, at most 64/),
  row(["run", "--ranks", "3"], 1, /8 experts cannot be split evenly among 3 ranks/),
  row(["run", "--ranks", "1000000"], 1, /8 experts cannot be split evenly among 1000000 ranks/),
  row(["run", "--routing", "magic"], 1, /--routing must be "gate" or "random", got "magic"/),
  row(["run", "--backend", "tpu"], 1, /--backend tpu: expected auto, cpu or cuda/),
  row(["run", "--pipeline", "nope"], 1, /--pipeline nope: expected fused or unfused/),
  row(
    ["run", "--backend", "cpu", "--pipeline", "fused"],
    1,
    /--pipeline fused: the pipeline applies to the "cuda" backend/,
  ),
  row(["run", "--backend", "cuda"], 1, /^error: --backend cuda needs a CUDA GPU: [^\n]{1,160}\n$/, {
    when: noGpu,
  }),
  // run: files
  row(
    ["run", "--weights", "/nonexistent/w.safetensors"],
    1,
    /--weights \/nonexistent\/w\.safetensors: no such file/,
  ),
  { args: () => ["run", "--weights", dir], code: 1, message: /--weights \S+: is a folder, not a file/ },
  {
    args: () => ["run", "--weights", files.notSafetensors],
    code: 1,
    message: /weights\.safetensors: header length \d+ extends beyond the file .*not a safetensors file/,
  },
  {
    args: () => ["run", "--save-weights", dir],
    code: 1,
    message: /--save-weights \S+: cannot be written \(\S+ is a folder\)/,
  },
  {
    args: () => ["run", "--save-weights", path.join(files.plainFile, "w.safetensors")],
    code: 1,
    message: /--save-weights \S+: cannot be written \(\S+plain is not a folder\)/,
  },
  {
    args: () => ["run", "--weights", files.fp4Weights],
    code: 1,
    message:
      /fp4\.safetensors: its metadata says it holds a "tiny" layer \(E=8 H=256 I=128 shared=1 fp4 experts\), not the "tiny" layer asked for \(E=8 H=256 I=128 shared=1 fp8 experts\)/,
  },
  {
    args: () => ["run", "--checkpoint", files.fp4Weights, "--shape", "flash"],
    code: 1,
    message:
      /--checkpoint takes the place of --shape \(the layer's shape is the checkpoint's\): give one, not --shape flash/,
  },
  row(
    ["run", "--save-weights", "/proc/nope/w.safetensors"],
    1,
    /cannot be written \(\/proc\/nope\/w\.safetensors is under \/proc, a pseudo file system\)/,
  ),
  // check
  row(["check", "--tokens", "0"], 1, /tokens must be a positive integer/),
  row(["check", "--shape", "nope"], 1, /unknown shape "nope"/),
  row(["check", "--backend", "gpu"], 1, /--backend gpu: expected auto, cpu or cuda/),
  row(["check", "--pipeline", "x"], 1, /--pipeline x: expected fused or unfused/),
  row(
    ["check", "--backend", "cpu", "--pipeline", "unfused"],
    1,
    /the pipeline applies to the "cuda" backend/,
  ),
  row(["check", "--seed", "1.5"], 1, /argument '1\.5' is invalid/),
  row(["check", "--ranks", "5"], 1, /8 experts cannot be split evenly among 5 ranks/),
  {
    args: () => ["check", "--checkpoint", files.fp4Weights, "--shape", "tiny"],
    code: 1,
    message: /--checkpoint takes the place of --shape .*not --shape tiny/,
  },
  // bench: stopped by its checks before a GPU is looked for
  row(
    ["bench", "--impl", "nope"],
    1,
    /--impl must be one of fused, unfused, fused,unfused, step, quant, grouped-gemm, ep, got "nope"/,
  ),
  row(["bench", "--shape", "huge"], 1, /unknown shape "huge"/),
  row(
    ["bench", "--tokens", "0x10,1e3"],
    1,
    /expected a comma-separated list of positive integers, got "0x10,1e3"/,
  ),
  row(["bench", "--tokens", "1,,2"], 1, /expected a comma-separated list of positive integers, got "1,,2"/),
  row(["bench", "--tokens", "70000"], 1, /--tokens 70000: the layer takes at most 65536 tokens/),
  row(["bench", "--iters", "5"], 1, /--iters must be at least 20 \(medians of fewer runs are noise\), got 5/),
  row(["bench", "--seed", "-3"], 1, /argument '-3' is invalid/),
  row(["bench", "--format", "fp16", "--impl", "quant"], 1, /--format must be fp32 or ue8m0, got "fp16"/),
  row(["bench", "--format", "ue8m0"], 1, /--format applies to --impl quant, not fused,unfused/),
  row(["bench", "--hidden", "4096"], 1, /--hidden applies to --impl quant, not fused,unfused/),
  row(["bench", "--impl", "quant", "--hidden", "100"], 1, /--hidden 100: must be a multiple of 128/),
  row(["bench", "--impl", "fused", "--layers", "3"], 1, /--layers applies to --impl step, not fused/),
  row(
    ["bench", "--impl", "quant", "--shared", "0"],
    1,
    /--shared applies to --impl fused, unfused, fused,unfused or ep, not quant/,
  ),
  row(["bench", "--shared", "2"], 1, /argument '2' is invalid\. must be 0 or 1/),
  row(
    ["bench", "--impl", "unfused", "--configs"],
    1,
    /--configs applies to --impl fused or fused,unfused, not unfused/,
  ),
  row(
    ["bench", "--impl", "fused", "--no-graph"],
    1,
    /--graph \/ --no-graph applies to --impl unfused or fused,unfused, not fused/,
  ),
  row(
    ["bench", "--impl", "quant", "--fp8-tflops", "900"],
    1,
    /--fp8-tflops applies to --impl fused, unfused, fused,unfused or ep, not quant/,
  ),
  row(["bench", "--fp8-tflops", "inf"], 1, /argument 'inf' is invalid\. must be a positive number/),
  row(["bench", "--impl", "quant", "--plot", "x.svg"], 1, /--plot draws the layer's time against tokens/),
  row(
    ["bench", "--out", "/proc/nope/r.json"],
    1,
    /--out \/proc\/nope\/r\.json: cannot be written \(.*pseudo file system\)/,
  ),
  {
    args: () => ["bench", "--out", dir],
    code: 1,
    message: /--out \S+: cannot be written \(\S+ is a folder\)/,
  },
  {
    args: () => ["bench", "--plot", path.join(files.plainFile, "p.svg")],
    code: 1,
    message: /--plot \S+: cannot be written \(\S+plain is not a folder\)/,
  },
  row(["bench", "--peer", "/nonexistent/peer.json"], 1, /--peer \/nonexistent\/peer\.json: no such file/),
  {
    args: () => ["bench", "--checkpoint", files.fp4Weights, "--shape", "tiny"],
    code: 1,
    message: /--checkpoint takes the place of --shape .*not --shape tiny/,
  },
  {
    args: () => ["bench", "--peer", files.noRows, "--out", files.noRows],
    code: 1,
    message: /--out \S+empty\.json: the same file as --peer; give each its own file/,
  },
  {
    args: () => ["bench", "--out", path.join(dir, "r.json"), "--plot", path.join(dir, ".", "r.json")],
    code: 1,
    message: /--plot \S+r\.json: the same file as --out/,
  },
  { args: () => ["bench", "--peer", files.notJson], code: 1, message: /not\.json: not JSON/ },
  row(["bench"], 1, /^error: bench needs a CUDA GPU: [^\n]{1,160}\n$/, { when: noGpu }),
  row(["bench", "--verbose"], 1, /bench needs a CUDA GPU: .*looked in: /, { when: noGpu }),
  // plot
  {
    args: () => ["plot", "/nonexistent/r.json", "--out", path.join(dir, "p.svg")],
    code: 1,
    message: /plot \/nonexistent\/r\.json: no such file/,
  },
  {
    args: () => ["plot", dir, "--out", path.join(dir, "p.svg")],
    code: 1,
    message: /plot \S+: is a folder, not a file/,
  },
  {
    args: () => ["plot", files.notJson, "--out", path.join(dir, "p.svg")],
    code: 1,
    message: /not\.json: not JSON/,
  },
  {
    args: () => ["plot", files.noRows, "--out", path.join(dir, "p.svg")],
    code: 1,
    message: /plot: \S+empty\.json holds no rows/,
  },
  {
    args: () => ["plot", files.hugeTime, "--out", path.join(dir, "p.svg")],
    code: 1,
    message: /"us_median" must be a finite number, got number Infinity/,
  },
  {
    args: () => ["plot", files.noRows, "--out", "/proc/p.svg"],
    code: 1,
    message: /--out \/proc\/p\.svg: cannot be written/,
  },
  {
    args: () => ["plot", files.noRows, "--out", dir],
    code: 1,
    message: /--out \S+: cannot be written \(\S+ is a folder\)/,
  },
  {
    args: () => ["plot", files.noRows, "--out", files.noRows],
    code: 1,
    message:
      /--out \S+empty\.json: is the results file \S+empty\.json being plotted; write the SVG elsewhere/,
  },
  {
    args: () => ["plot", files.noRows, "--out", "x.svg", "--shared", "2"],
    code: 1,
    message: /argument '2' is invalid\. must be 0 or 1/,
  },
  // the environment: reported by info, never taken on trust
  row(
    ["info", "--json", "--no-measure"],
    0,
    /"nvrtcUnavailable": "not usable: libnvrtc at \/etc\/passwd failed to load/,
    {
      env: { MEGAMOE_LIBNVRTC: "/etc/passwd" },
    },
  ),
  row(
    ["info", "--json", "--no-measure"],
    0,
    /"nvccUnavailable": "not usable: nvcc at \/etc\/passwd does not run/,
    {
      env: { MEGAMOE_NVCC: "/etc/passwd" },
    },
  ),
  row(["info", "--no-measure"], 0, /jit cache\s+\/proc\/nope: not usable \(.*pseudo file system\)/, {
    env: { MEGAMOE_CACHE_DIR: "/proc/nope" },
  }),
  row(
    ["info", "--no-measure"],
    0,
    /nvrtc\s+nvrtc: MEGAMOE_LIBNVRTC=\/nonexistent\/libnvrtc\.so does not name an existing file|libnvrtc: MEGAMOE_LIBNVRTC=/,
    {
      env: { MEGAMOE_LIBNVRTC: "/nonexistent/libnvrtc.so" },
    },
  ),
  // help: defaults shown as the options are written, bench described as what it times
  row(["run", "--help"], 0, /--shared <0\|1>\s+include the shared expert \(default: 1\)/),
  row(
    ["bench", "--help"],
    0,
    /time the layer's GPU pipelines \(fused, unfused\), a\s+decode step or a kernel/,
  ),
  // accepted as documented: the edges of the valid ranges
  row(["run", "--seed", "0", "--tokens", "1", "--json"], 0, /"seed":0/),
  row(["run", "--seed", "4294967295", "--tokens", "2", "--json"], 0, /"seed":4294967295/),
  row(["run", "--shared", "0", "--tokens", "2", "--routing", "random", "--json"], 0, /"shared":false/),
  row(["run", "--tokens", "2"], 0, /(^|\n)megamoe: [^\n]{1,60}; running on the CPU[^\n]*\n/, {
    when: noGpu,
  }),
  row(["check", "--tokens", "3", "--shared", "0"], 0, /pass: 1 of 1 comparisons within their bounds/),
  row(
    ["run", "--tokens", "1", "--json", "--save-weights", path.join(dir, "new", "sub", "w.safetensors")],
    0,
    /"checksum"/,
  ),
];

describe("bad command-line values: each row exits with its code and says what was wrong", {
  concurrency: 2,
}, () => {
  const census = { tried: 0, errors: 0, accepted: 0 };
  after(() => {
    console.log(
      `  ${census.tried} tried: ${census.errors} clear errors, ${census.accepted} accepted as documented`,
    );
  });
  for (const [i, r] of rows.entries()) {
    it(`row ${i + 1}: ${r.args().join(" ")}${r.env ? ` ${JSON.stringify(r.env)}` : ""}`, {
      skip: r.when === false,
    }, async () => {
      const out = await runCli(r.args(), r.env);
      census.tried++;
      assert.equal(out.code, r.code, `exit code; stderr: ${out.stderr}`);
      assert.doesNotMatch(out.stderr, /\n\s+at /, "a stack trace");
      if (r.code === 0) {
        census.accepted++;
        assert.match(out.stdout + out.stderr, r.message);
      } else {
        census.errors++;
        assert.match(out.stderr, r.message);
        assert.match(
          out.stderr,
          /^(megamoe: [^\n]*; running on the CPU[^\n]*\n)?error: /,
          'one "error:" line',
        );
      }
    });
  }
});
