/** `megamoe info`: the package, the CUDA driver and device, and the ceilings measured by our kernels. */

import path from "node:path";
import pc from "picocolors";
import { EXPERT_FORMATS, type ExpertFormat, PRESETS, presetNames } from "../config/config.js";
import {
  compilerProblem,
  cudaAvailability,
  deviceSummary,
  jitCacheDir,
  jitEnvProblems,
  type LocateResult,
  locateLibnvrtc,
  locateNvcc,
  openDevice,
  outputFileProblem,
} from "../cuda/index.js";
import { DeviceMoEWeights } from "../kernels/device-weights.js";
import { measureCeilings } from "../kernels/probe/probe.js";
import { formatBytes } from "./run.js";

export interface InfoOptions {
  json?: boolean;
  measure?: boolean;
}

/** A compiler's path when it can be used, else why not ("not found …" or "… not usable: …"). */
function compilerStatus(
  name: "nvrtc" | "nvcc",
  located: LocateResult,
): { path: string | null; problem?: string } {
  if (!located.ok) return { path: null, problem: located.reason };
  const problem = compilerProblem(name);
  if (problem === undefined) return { path: located.path };
  return { path: null, problem: `not usable: ${problem}` };
}

/** Device bytes of one layer of each preset (DeviceMoEWeights.bytesFor), by routed experts' format. */
export function presetLayerBytes(): Record<string, Record<ExpertFormat, number>> {
  return Object.fromEntries(
    presetNames().map((name) => [
      name,
      Object.fromEntries(
        EXPERT_FORMATS.map((f) => [f, DeviceMoEWeights.bytesFor({ ...PRESETS[name]!, expertFormat: f })]),
      ) as Record<ExpertFormat, number>,
    ]),
  );
}

export async function runInfo(opts: InfoOptions): Promise<void> {
  const cuda = cudaAvailability();
  // Found is not usable: a named file is loaded (NVRTC) or run (nvcc) before it is listed.
  const nvrtc = compilerStatus("nvrtc", locateLibnvrtc());
  const nvcc = compilerStatus("nvcc", locateNvcc());
  const cacheDir = path.resolve(jitCacheDir());
  const cacheProblem = outputFileProblem(path.join(cacheDir, "jit", "entry.cubin"));
  const jitEnv = jitEnvProblems();
  const info: Record<string, unknown> = {
    package: "megamoe 0.1.0",
    node: process.version,
    platform: `${process.platform}-${process.arch}`,
    cuda: cuda.ok
      ? { library: cuda.libraryPath, driverVersion: cuda.driverVersion, devices: cuda.deviceCount }
      : null,
    cudaUnavailable: cuda.ok ? undefined : cuda.reason,
    nvrtc: nvrtc.path,
    nvrtcUnavailable: nvrtc.problem,
    nvcc: nvcc.path,
    nvccUnavailable: nvcc.problem,
    jitCache: cacheDir,
    jitCacheUnusable: cacheProblem,
    jitEnvUnusable: jitEnv.length > 0 ? jitEnv : undefined,
    layerWeightBytes: presetLayerBytes(),
  };
  if (cuda.ok) {
    const device = openDevice(0);
    info.device = deviceSummary(device);
    if (opts.measure !== false) info.ceilings = measureCeilings(device);
  }
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(info, null, 2)}\n`);
    return;
  }
  const line = (k: string, v: unknown) => process.stdout.write(`  ${pc.dim(k.padEnd(14))} ${String(v)}\n`);
  process.stdout.write(`${pc.bold("megamoe info")}\n`);
  line("package", info.package);
  line("node", `${info.node} (${info.platform})`);
  line("nvrtc", nvrtc.path ?? pc.yellow(nvrtc.problem ?? ""));
  line("nvcc", nvcc.path ?? pc.yellow(nvcc.problem ?? ""));
  if (jitEnv.length > 0) line("jit env", pc.yellow(`not usable: ${jitEnv.join("; ")}`));
  line(
    "jit cache",
    cacheProblem === undefined
      ? cacheDir
      : pc.yellow(`${cacheDir}: not usable (${cacheProblem}); kernels compile each run`),
  );
  line("layer weights", "on a GPU, per layer, with fp8 / fp4 (MXFP4) routed experts (shared expert fp8):");
  for (const [name, b] of Object.entries(info.layerWeightBytes as ReturnType<typeof presetLayerBytes>)) {
    line(`  ${name}`, `${formatBytes(b.fp8)} / ${formatBytes(b.fp4)}`);
  }
  if (!cuda.ok) {
    line("cuda", pc.yellow(`unavailable: ${cuda.reason}`));
    line("backend", "cpu (the reference)");
    return;
  }
  line("driver", `${cuda.driverVersion} (${cuda.libraryPath})`);
  const d = info.device as Record<string, number | string>;
  line(
    "device",
    `${d.name}, ${d.arch}, ${d.sms} SMs, ${(Number(d.memoryBytes) / 2 ** 30).toFixed(1)} GiB, L2 ${(Number(d.l2Bytes) / 2 ** 20).toFixed(0)} MiB, ${(Number(d.clockKHz) / 1000).toFixed(0)} MHz`,
  );
  const c = info.ceilings as ReturnType<typeof measureCeilings> | undefined;
  if (c !== undefined) {
    line(
      "read",
      `${c.readTbps.toFixed(2)} TB/s (bytes read only, ${(c.readBytes / 2 ** 30).toFixed(1)} GiB read kernel; the layer and GEMM floors)`,
    );
    line(
      "copy",
      `${c.copyTbps.toFixed(2)} TB/s (read + write, ${(c.copyBytes / 2 ** 30).toFixed(1)} GiB copy kernel)`,
    );
    line("launch", `${c.launchUs.toFixed(2)} µs host time per launch from Node`);
    line("empty kernel", `${c.emptyKernelUs.toFixed(2)} µs GPU time, back to back in a graph`);
  }
}
