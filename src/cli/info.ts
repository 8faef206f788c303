/** `megamoe info`: the package, the CUDA driver and device, and the ceilings measured by our kernels. */
import pc from "picocolors";
import { EXPERT_FORMATS, type ExpertFormat, PRESETS, presetNames } from "../config/config.js";
import { cudaAvailability, deviceSummary, locateLibnvrtc, locateNvcc, openDevice } from "../cuda/index.js";
import { DeviceMoEWeights } from "../kernels/device-weights.js";
import { measureCeilings } from "../kernels/probe/probe.js";
import { formatBytes } from "./run.js";

export interface InfoOptions {
  json?: boolean;
  measure?: boolean;
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
  const nvrtc = locateLibnvrtc();
  const nvcc = locateNvcc();
  const info: Record<string, unknown> = {
    package: "megamoe 0.1.0",
    node: process.version,
    platform: `${process.platform}-${process.arch}`,
    cuda: cuda.ok
      ? { library: cuda.libraryPath, driverVersion: cuda.driverVersion, devices: cuda.deviceCount }
      : null,
    cudaUnavailable: cuda.ok ? undefined : cuda.reason,
    nvrtc: nvrtc.ok ? nvrtc.path : null,
    nvcc: nvcc.ok ? nvcc.path : null,
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
  line("nvrtc", info.nvrtc ?? pc.yellow("not found"));
  line("nvcc", info.nvcc ?? pc.yellow("not found"));
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
