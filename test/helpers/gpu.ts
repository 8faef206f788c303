/**
 * What every GPU test file shares: skip with the reason when no GPU is usable, or fail instead when
 * MEGAMOE_REQUIRE_GPU=1 (the GPU host's `npm run test:gpu`), and the device opened once.
 */
import { cudaAvailability, type Device, openDevice } from "../../src/cuda/index.js";

export const availability = cudaAvailability();
export const requireGpu = process.env.MEGAMOE_REQUIRE_GPU === "1";
/** `false`, or the reason to skip, for node:test's `{ skip }`. */
export const gpuSkip: false | string =
  availability.ok || requireGpu ? false : `no usable GPU: ${availability.reason}`;

let cachedDevice: Device | undefined;
/** Device 0, opened on first use. */
export function testDevice(): Device {
  cachedDevice ??= openDevice(0);
  return cachedDevice;
}
