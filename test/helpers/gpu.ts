/**
 * What every GPU test file shares: skip with the reason when no GPU is usable, or fail instead when
 * MEGAMOE_REQUIRE_GPU=1 (the GPU host's `npm run test:gpu`), and the device opened once.
 */
import { describe, test } from "node:test";
import {
  cudaAvailability,
  type Device,
  DeviceTensor,
  type DType,
  type HostArray,
  openDevice,
} from "../../src/cuda/index.js";

export const availability = cudaAvailability();
export const requireGpu = process.env.MEGAMOE_REQUIRE_GPU === "1";

/**
 * The reason's first clause ("libcuda not found (libcuda.so.1)"): the folders searched follow it, too
 * long to repeat for every skipped suite. `megamoe info` and MEGAMOE_REQUIRE_GPU=1 give it in full.
 */
export function shortReason(reason: string): string {
  const first = reason.split(/; |\n/)[0]!.trim();
  return first.length <= 120 ? first : `${first.slice(0, 117)}...`;
}

/** `false`, or the reason to skip, for node:test's `{ skip }`. */
export const gpuSkip: false | string =
  availability.ok || requireGpu ? false : `no usable GPU: ${shortReason(availability.reason)}`;

/**
 * A suite of GPU tests. Without a GPU it is one skipped test named after the suite, so it prints one
 * line with the reason and counts in node:test's "skipped" (a skipped `describe` counts nowhere).
 */
export function describeGpu(name: string, fn: () => void): void {
  if (gpuSkip === false) describe(name, fn);
  else test(name, { skip: gpuSkip }, () => {});
}

let cachedDevice: Device | undefined;
/** Device 0, opened on first use. */
export function testDevice(): Device {
  cachedDevice ??= openDevice(0);
  return cachedDevice;
}

/** Owns the test device's tensors a run makes (optionally poisoned); `dispose()` frees them all. */
export class TestTensors {
  private readonly all: DeviceTensor[] = [];
  empty<D extends DType>(dtype: D, shape: number[], poison?: number): DeviceTensor<D> {
    const t = DeviceTensor.empty(testDevice(), dtype, shape);
    this.all.push(t);
    if (poison !== undefined) t.fill(poison);
    return t;
  }
  from<D extends DType>(dtype: D, shape: number[], data: HostArray<D>): DeviceTensor<D> {
    const t = DeviceTensor.fromHost(testDevice(), dtype, shape, data);
    this.all.push(t);
    return t;
  }
  dispose(): void {
    for (const t of this.all) t.dispose();
  }
}
