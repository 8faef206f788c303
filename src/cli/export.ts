/**
 * `megamoe export`: a layer's fused forward for another runtime (docs/export.md): the cubins of every
 * kernel it launches for T = 1 … --max-tokens and the manifest that says how. No GPU needed.
 */
import pc from "picocolors";
import { MAX_TOKENS_LIMIT, type MoEConfig } from "../config/config.js";
import { defaultArch } from "../cuda/jit.js";
import { compileLayerExport, writeLayerExport } from "../export/export.js";
import { checkpointLayer } from "./checkpoint.js";
import { checkCheckpointExperts, checkShapeWithCheckpoint, shapeConfig } from "./run.js";
import { parseIntegerIn, UsageError } from "./usage.js";

export interface ExportOptions {
  out: string;
  shape: string;
  shapeGiven?: boolean;
  checkpoint?: string;
  layer?: string;
  experts?: string;
  maxTokens?: string;
  shared: boolean;
  sms: string;
  weightScales?: string;
  force?: boolean;
  json?: boolean;
}

/** The device SM counts a Hopper part has at most (H100 PCIe 114, SXM and H200 132). */
const MAX_SMS = 132;

export async function runExport(opts: ExportOptions): Promise<void> {
  checkShapeWithCheckpoint(opts);
  if (opts.layer !== undefined && opts.checkpoint === undefined)
    throw new UsageError("--layer needs --checkpoint");
  const scales = opts.weightScales ?? (opts.checkpoint === undefined ? "fp32" : "ue8m0");
  if (scales !== "fp32" && scales !== "ue8m0") {
    throw new UsageError(`--weight-scales ${scales}: expected fp32 or ue8m0`);
  }
  const smCount = parseIntegerIn("--sms", opts.sms, 1, MAX_SMS);
  const requested =
    opts.maxTokens === undefined
      ? undefined
      : parseIntegerIn("--max-tokens", opts.maxTokens, 1, MAX_TOKENS_LIMIT);
  let config: MoEConfig;
  if (opts.checkpoint !== undefined) {
    config = checkpointLayer(opts.checkpoint, opts.layer, requested ?? 8192).config;
    checkCheckpointExperts(opts.experts, config);
  } else config = shapeConfig(opts.shape, requested ?? 8192, opts.experts);
  const maxTokens = requested ?? config.maxTokens;

  const started = performance.now();
  const exp = await compileLayerExport(config, {
    maxTokens,
    shared: opts.shared,
    smCount,
    weightScales: scales,
    arch: defaultArch(),
    producer: "megamoe 0.1.0",
    onProgress: (done, total, id) => {
      if (!opts.json) process.stderr.write(`compiled ${id} (${done}/${total})\n`);
    },
  });
  writeLayerExport(opts.out, exp, opts.force === true);
  const m = exp.manifest;
  const summary = {
    out: opts.out,
    layer: m.layer,
    kernels: m.kernels.length,
    ranges: m.forward.length,
    weightBytes: m.buffers.filter((b) => b.lifetime === "weights").reduce((a, b) => a + b.bytes, 0),
    workspaceBytes: m.buffers.filter((b) => b.lifetime === "workspace").reduce((a, b) => a + b.bytes, 0),
    seconds: (performance.now() - started) / 1000,
  };
  if (opts.json) {
    console.log(JSON.stringify(summary, null, 2));
    return;
  }
  const gib = (b: number) => `${(b / 2 ** 30).toFixed(2)} GiB`;
  console.log(
    `${pc.bold("export")} ${opts.out}: layer ${m.layer.name} (${m.layer.expertFormat} experts, shared ${m.layer.sharedIntermediate > 0 ? "on" : "off"}), ` +
      `T = 1 … ${maxTokens} in ${m.forward.length} ranges, ${m.kernels.length} kernels for ${smCount} SMs; ` +
      `weights ${gib(summary.weightBytes)}, workspace ${gib(summary.workspaceBytes)}; ${summary.seconds.toFixed(1)} s`,
  );
}
