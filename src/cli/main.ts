#!/usr/bin/env node
/** The megamoe command line: run a layer, compare backends, show the machine. */
import { Command, InvalidArgumentError, Option } from "commander";
import pc from "picocolors";
import { MAX_TOKENS_LIMIT } from "../config/config.js";
import { parseSeed } from "../numerics/counter-rng.js";
import { MAX_THREADS } from "../reference/threads.js";
import { parseList, runBench } from "./bench.js";
import { CHECK_FAILED_EXIT_CODE, runCheck } from "./check.js";
import { runInspect } from "./checkpoint.js";
import { runExport } from "./export.js";
import { runInfo } from "./info.js";
import { runPlot } from "./plot.js";
import { runLayer } from "./run.js";
import { parseIntegerIn } from "./usage.js";

/** Decimal digits in [1, max]: "0x10", "1e3", "1.5" and "-1" are refused, as is a value past `max`. */
function positiveInt(name: string, max = Number.MAX_SAFE_INTEGER) {
  return (value: string): number => {
    try {
      return parseIntegerIn(name, value, 1, max);
    } catch {
      throw new InvalidArgumentError(
        max === Number.MAX_SAFE_INTEGER
          ? `${name} must be a positive integer`
          : `${name} must be a positive integer, at most ${max}`,
      );
    }
  };
}

/** --seed under the library's one seed rule (checkSeed), so the CLI and the API accept the same seeds. */
function seedArg(value: string): number {
  try {
    return parseSeed(value);
  } catch (e) {
    throw new InvalidArgumentError((e as Error).message);
  }
}

function positiveNumber(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n <= 0) throw new InvalidArgumentError("must be a positive number");
  return n;
}

function sharedFlag(value: string): boolean {
  if (value !== "0" && value !== "1") throw new InvalidArgumentError("must be 0 or 1");
  return value === "1";
}

/** `--shared <0|1>`, on by default; help shows the default as the flag is written ("1", not "true"). */
function sharedOption(): Option {
  return new Option("--shared <0|1>", "include the shared expert").argParser(sharedFlag).default(true, "1");
}

/**
 * `--threads <n>`: the CPU reference's worker threads, through MEGAMOE_CPU_THREADS (which the library
 * reads) so that every layer a command makes, the ranks' too, runs with it.
 */
function threadsOption(): Option {
  return new Option(
    "--threads <n>",
    `cpu: threads for the reference's experts, at most ${MAX_THREADS} (default: MEGAMOE_CPU_THREADS, else the cores)`,
  ).argParser(positiveInt("threads", MAX_THREADS));
}

function applyThreads(threads: number | undefined): void {
  if (threads !== undefined) process.env.MEGAMOE_CPU_THREADS = String(threads);
}

/** Whether --shape was written (not its default): with --checkpoint it would be ignored without a word. */
function shapeGiven(cmd: Command): boolean {
  return cmd.getOptionValueSource("shape") !== "default";
}

const program = new Command()
  .name("megamoe")
  .description(
    "DeepSeek-V4-class MoE layer, FP8 or FP4 (MXFP4) experts: fused Hopper kernels and an exact CPU reference",
  )
  .version("0.1.0");

const shapeHelp = "preset: tiny, flash, pro, flash-ep8";
const VERBOSE_HELP = "without a GPU, list every folder searched for the CUDA driver";

program
  .command("run")
  .description("run one MoE layer forward on random weights and inputs, print a summary")
  .option("--shape <name>", shapeHelp, "tiny")
  .option("--tokens <n>", "tokens in the batch", positiveInt("tokens", MAX_TOKENS_LIMIT), 16)
  .option("--backend <name>", "auto (the GPU when there is one), cuda or cpu", "auto")
  .option("--pipeline <name>", "cuda: fused (one kernel) or unfused (the baseline); default the layer's")
  .option("--seed <n>", "seed of weights, inputs and routing", seedArg, 1)
  .addOption(sharedOption())
  .option("--routing <kind>", "gate (the layer's router) or random", "gate")
  .option(
    "--experts <fmt>",
    "routed experts' format: fp8 or fp4 (MXFP4; shared expert stays fp8); default the shape's",
  )
  .option(
    "--checkpoint <dir>",
    "a DeepSeek-V4 checkpoint directory (or one .safetensors file) instead of --shape",
  )
  .option("--layer <L>", "with --checkpoint: the layer (a number, layers.L or mtp.0)")
  .option("--weights <file>", "load weights from a safetensors file instead of generating them")
  .option(
    "--save-weights <file>",
    "write the generated weights to a safetensors file first (an existing file needs --force)",
  )
  .option("--force", "overwrite an existing --save-weights file")
  .option(
    "--ranks <n>",
    "split the layer across n expert-parallel ranks (the batch dealt out among them)",
    positiveInt("ranks"),
    1,
  )
  .addOption(threadsOption())
  .option("--json", "print the summary as JSON")
  .option("--verbose", VERBOSE_HELP)
  .action(async ({ threads, ...opts }, cmd: Command) => {
    applyThreads(threads);
    await runLayer({ ...opts, shapeGiven: shapeGiven(cmd) });
  });

program
  .command("check")
  .description(
    `compare the FP8 reference, the FP64 ideal and the GPU layer: ‖Δ‖/‖ref‖ and calc_diff of each against its bound (the GPU tests'), a verdict, exit code ${CHECK_FAILED_EXIT_CODE} on a failure`,
  )
  .option("--backend <name>", "auto (add the GPU when there is one), cuda or cpu", "auto")
  .option("--pipeline <name>", "cuda: fused (one kernel) or unfused (the baseline); default the layer's")
  .option("--shape <name>", shapeHelp, "tiny")
  .option("--tokens <n>", "tokens in the batch", positiveInt("tokens", MAX_TOKENS_LIMIT), 16)
  .option("--seed <n>", "seed of weights, inputs and routing", seedArg, 1)
  .addOption(sharedOption())
  .option(
    "--checkpoint <dir>",
    "a DeepSeek-V4 checkpoint directory (or one .safetensors file) instead of --shape",
  )
  .option("--layer <L>", "with --checkpoint: the layer (a number, layers.L or mtp.0)")
  .option(
    "--experts <fmt>",
    "routed experts' format: fp8 or fp4 (MXFP4; shared expert stays fp8); default the shape's",
  )
  .option("--ranks <n>", "also check the layer split across n expert-parallel ranks", positiveInt("ranks"), 1)
  .addOption(threadsOption())
  .option("--json", "print the result as JSON")
  .option("--verbose", VERBOSE_HELP)
  .action(async ({ threads, ...opts }, cmd: Command) => {
    applyThreads(threads);
    await runCheck({ ...opts, shapeGiven: shapeGiven(cmd) });
  });

program
  .command("info")
  .description("show the package, the CUDA driver and device, and measured ceilings when a GPU is present")
  .option("--json", "print as JSON")
  .option("--no-measure", "skip measuring the read and copy bandwidths and the launch overhead")
  .action(async (opts) => {
    await runInfo(opts);
  });

program
  .command("bench")
  .description(
    "time the layer's GPU pipelines (fused, unfused), a decode step or a kernel (quant, grouped-gemm) over a sweep on the GPU, or its two expert-parallel paths on virtual ranks (ep): table, results JSON, plot",
  )
  .option(
    "--impl <name>",
    "fused,unfused (the layer's two GPU pipelines side by side), fused, unfused, step (a decode step of norm → gate → MoE blocks), quant (input quantization), grouped-gemm or ep (the in-kernel expert-parallel path beside the host-planned one, R virtual ranks on one GPU)",
    "fused,unfused",
  )
  .option("--shape <name>", `${shapeHelp} (default flash-ep8; ep: flash, split R ways)`)
  .addOption(
    new Option("--shared <0|1>", "fused/unfused/ep: include the shared expert (default 1)").argParser(
      sharedFlag,
    ),
  )
  .option(
    "--checkpoint <dir>",
    "a DeepSeek-V4 checkpoint directory (or one .safetensors file) instead of --shape (fused/unfused)",
  )
  .option("--layer <L>", "with --checkpoint: the layer (a number, layers.L or mtp.0)")
  .option(
    "--experts <fmt>",
    "fused/unfused/step/ep: routed experts' format, fp8 or fp4 (default the shape's)",
  )
  .option("--seed <n>", "seed of weights, inputs and routing", seedArg, 1)
  .option("--graph", "unfused: also time CUDA-graph replays (the default)")
  .option("--no-graph", "unfused: time eager launches only")
  .option("--configs", "fused: also time every block M, and how far the heuristic's pick is from the best")
  .option("--layers <n>", "step: MoE blocks in the decode step (default 8)", positiveInt("layers"))
  .option(
    "--ranks <list>",
    "ep: virtual ranks on the one GPU, each 2 … 8 and dividing the shape's experts (default 2,4,8)",
    parseList,
  )
  .option(
    "--gpus",
    "ep: one rank per GPU (rank r on GPU r; each --ranks at most the GPU count) instead of virtual ranks on GPU 0",
  )
  .option(
    "--tokens <list>",
    "token counts (default 1,2,4,…,8192; quant: 1,7,129,1024,4096,8192; grouped-gemm: M per group 64,512,4096; ep: per rank 1,8,64,512,4096,8192)",
    parseList,
  )
  .option("--iters <n>", "timed runs per case (median; at least 20)", positiveInt("iters"))
  .option(
    "--rounds <n>",
    "fused/unfused/ep: split the runs into n rounds that each time every row in turn (drifts then hit all alike; ep default 3)",
    positiveInt("rounds"),
  )
  .option(
    "--fp8-tflops <rate>",
    "FP8 rate for the floor (default: the peer's measurement, else 1500)",
    positiveNumber,
  )
  .option(
    "--peer <file>",
    "results JSON of a peer (lab/peers/torch_moe.py): its times beside ours, each series of its rows (e.g. --blockwise's) in columns of its own",
  )
  .option(
    "--plot <file>",
    "fused/unfused: write an SVG plot of time against tokens (ours, the peer, the floor)",
  )
  .option("--hidden <list>", "quant: hidden sizes, multiples of 128 (default 4096,7168)", parseList)
  .option("--format <fmt>", "quant: activation scale format, fp32 (the default) or ue8m0")
  .option(
    "--codes <kind>",
    "grouped-gemm: the operands' FP8 codes: quantized (uniform values, the default), gaussian (the torch peer's data in block format) or uniform-bytes",
  )
  .option(
    "--warmup-ms <ms>",
    "grouped-gemm: untimed GPU time before each case's timed runs (about 1000: the clock a power-capped card sustains)",
    positiveNumber,
  )
  .option("--out <file>", "write the results JSON here (bench/results/...); an existing file needs --force")
  .option("--force", "overwrite existing --out and --plot files")
  .option("--json", "print the rows as JSON")
  .option("--verbose", VERBOSE_HELP)
  .action(async (opts) => {
    await runBench(opts);
  });

program
  .command("export")
  .description(
    "write a layer's fused forward for another runtime (megamoe_torch, docs/export.md): the cubins of every kernel it launches for T = 1 … --max-tokens and the manifest; no GPU needed",
  )
  .requiredOption("--out <dir>", "the folder to write (an existing non-empty one needs --force)")
  .option("--shape <name>", shapeHelp, "flash")
  .option(
    "--checkpoint <dir>",
    "a DeepSeek-V4 checkpoint directory (or one .safetensors file) instead of --shape",
  )
  .option("--layer <L>", "with --checkpoint: the layer (a number, layers.L or mtp.0)")
  .option("--experts <fmt>", "routed experts' format: fp8 or fp4; default the shape's or checkpoint's")
  .option("--max-tokens <n>", "the largest T a forward takes (default: the shape's maxTokens)")
  .addOption(sharedOption())
  .option("--sms <n>", "SMs of the target GPU (H100 SXM and H200: 132)", "132")
  .option(
    "--weight-scales <fmt>",
    "how the caller's FP8 matrices carry their block scales: fp32 or ue8m0 (default: ue8m0 with --checkpoint, else fp32)",
  )
  .option("--force", "replace a non-empty --out folder")
  .option("--json", "print the summary as JSON")
  .action(async (opts, cmd: Command) => {
    await runExport({ ...opts, shapeGiven: shapeGiven(cmd) });
  });

program
  .command("inspect")
  .description(
    "summarize a DeepSeek-V4 checkpoint: MoE shape, expert format, layers, shards, bytes, first problems",
  )
  .argument(
    "<dir>",
    "checkpoint directory (config.json, model.safetensors.index.json, shards) or one .safetensors file",
  )
  .option("--json", "print the summary as JSON")
  .option(
    "--exactness",
    "also count each FP4 layer's routed elements that e4m3 does not hold exactly (reads every expert's scales)",
  )
  .option(
    "--deep",
    "also read every expert's codes and scales, the shared expert and the gate, with run's checks (reads the whole MoE)",
  )
  .action((dir: string, opts) => {
    runInspect(dir, opts);
  });

program
  .command("plot")
  .description("plot time against tokens from results files (ours and peers'), as SVG; no GPU needed")
  .argument("<files...>", "results JSON files")
  .requiredOption("--out <file>", "the SVG to write (an existing file needs --force)")
  .option("--force", "overwrite an existing --out file")
  .option("--shape <name>", "plot only rows of this config")
  .option("--shared <0|1>", "plot only rows with the shared expert on (1) or off (0)", sharedFlag)
  .option("--title <text>", "title (default: shape, shared expert, device)")
  .action((files: string[], opts) => {
    runPlot(files, opts);
  });

program.parseAsync(process.argv).catch((err: unknown) => {
  const e = err instanceof Error ? err : new Error(String(err));
  process.stderr.write(`${pc.red("error:")} ${e.message}\n`);
  if (process.env.MEGAMOE_DEBUG) process.stderr.write(`${e.stack ?? ""}\n`);
  process.exit(1);
});
