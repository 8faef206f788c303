/** Loaded cubins and their kernels: attributes, launches (plain and with a thread-block cluster). */

import { currentContext, type Device } from "./device.js";
import { check, cu, disposeSymbol, outI32, outU64 } from "./driver-api.js";
import {
  DEFAULT_MAX_DYNAMIC_SHARED_BYTES,
  FunctionAttribute,
  LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
  LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
  LAUNCH_CONFIG_LAYOUT,
} from "./driver-constants.js";
import { alignedHostBytes, type KernelArgs } from "./kernel-args.js";
import type { Stream } from "./stream.js";

/** Grid / block / cluster dimensions: a number means (n, 1, 1). */
export type Dim3 = number | readonly [number, number, number];

function dimX(d: Dim3): number {
  return typeof d === "number" ? d : d[0];
}
function dimY(d: Dim3): number {
  return typeof d === "number" ? 1 : d[1];
}
function dimZ(d: Dim3): number {
  return typeof d === "number" ? 1 : d[2];
}

/** A loaded cubin. */
export class Module {
  readonly device: Device;
  readonly handle: bigint;
  private unloaded = false;

  /** @internal use `device.loadModule()` */
  constructor(device: Device, handle: bigint) {
    this.device = device;
    this.handle = handle;
  }

  /** The kernel named `name` (its symbol name: use `extern "C"` kernels to avoid C++ mangling). */
  getFunction(name: string): Kernel {
    this.device.makeCurrent();
    check("cuModuleGetFunction", cu.cuModuleGetFunction(outU64, this.handle, name), `kernel "${name}"`);
    return new Kernel(this, name, outU64[0]!);
  }

  unload(): void {
    if (this.unloaded) return;
    this.device.makeCurrent();
    check("cuModuleUnload", cu.cuModuleUnload(this.handle));
    this.unloaded = true;
  }

  [disposeSymbol](): void {
    this.unload();
  }
}

/** One kernel of a loaded module, launchable with {@link KernelArgs}. */
let kernelLaunchCount = 0;

/**
 * Kernel launches queued by this process so far (every `Kernel.launch`, captured ones included): the
 * difference over a piece of work is how many launches it costs.
 */
export function kernelLaunches(): number {
  return kernelLaunchCount;
}

export class Kernel {
  readonly module: Module;
  readonly device: Device;
  readonly name: string;
  /** The `CUfunction`. */
  readonly handle: bigint;
  private maxDynamicShared = DEFAULT_MAX_DYNAMIC_SHARED_BYTES;
  /** Preallocated `CUlaunchConfig` + one `CUlaunchAttribute`: `launchEx`'s cluster, `launchAfterPrevious`'s. */
  private exConfig: DataView | undefined;
  private exConfigAddress = 0n;
  private pdlConfig: DataView | undefined;
  private pdlConfigAddress = 0n;

  /** @internal use `module.getFunction()` */
  constructor(module: Module, name: string, handle: bigint) {
    this.module = module;
    this.device = module.device;
    this.name = name;
    this.handle = handle;
  }

  /** Read a `CUfunction_attribute` (see {@link FunctionAttribute}). */
  getAttribute(attr: number): number {
    check(
      "cuFuncGetAttribute",
      cu.cuFuncGetAttribute(outI32, attr, this.handle),
      `${this.name}, attribute ${attr}`,
    );
    return outI32[0]!;
  }

  /** Set a `CUfunction_attribute`. */
  setAttribute(attr: number, value: number): this {
    check(
      "cuFuncSetAttribute",
      cu.cuFuncSetAttribute(this.handle, attr, value),
      `${this.name}, attribute ${attr} = ${value}`,
    );
    if (attr === FunctionAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES) this.maxDynamicShared = value;
    return this;
  }

  /** Allow launches with up to `bytes` of dynamic shared memory (needed above 48 KiB). */
  setMaxDynamicSharedMemory(bytes: number): this {
    if (bytes > this.device.maxSharedMemoryPerBlockOptin) {
      throw new RangeError(
        `${this.name}: ${bytes} bytes of dynamic shared memory exceed the device's ${this.device.maxSharedMemoryPerBlockOptin}`,
      );
    }
    return this.setAttribute(FunctionAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
  }

  /** Registers per thread, as compiled. */
  get numRegisters(): number {
    return this.getAttribute(FunctionAttribute.NUM_REGS);
  }

  private checkShared(sharedBytes: number): void {
    if (sharedBytes > this.maxDynamicShared) {
      throw new RangeError(
        `${this.name}: launch asks ${sharedBytes} bytes of dynamic shared memory but the limit set is ${this.maxDynamicShared}; call setMaxDynamicSharedMemory first`,
      );
    }
  }

  /** Launch on `stream` (null: the legacy default stream). Synchronous to queue, no per-call allocation. */
  launch(grid: Dim3, block: Dim3, sharedBytes: number, stream: Stream | null, args: KernelArgs): void {
    if (sharedBytes > DEFAULT_MAX_DYNAMIC_SHARED_BYTES) this.checkShared(sharedBytes);
    if (currentContext !== this.device.context) this.device.makeCurrent();
    const code = cu.cuLaunchKernel(
      this.handle,
      dimX(grid),
      dimY(grid),
      dimZ(grid),
      dimX(block),
      dimY(block),
      dimZ(block),
      sharedBytes,
      stream === null ? 0n : stream.handle,
      args.paramsAddress,
      null,
    );
    if (code !== 0) check("cuLaunchKernel", code, this.launchDetail(grid, block, sharedBytes));
    kernelLaunchCount += 1;
  }

  /**
   * Launch with a thread-block cluster of `cluster` blocks (grid dims must be multiples of it), through
   * `cuLaunchKernelEx` and CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION.
   */
  launchEx(
    grid: Dim3,
    block: Dim3,
    sharedBytes: number,
    stream: Stream | null,
    args: KernelArgs,
    cluster: Dim3,
  ): void {
    if (this.exConfig === undefined) {
      const made = this.createExConfig(LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
      this.exConfig = made.view;
      this.exConfigAddress = made.address;
    }
    const c = this.exConfig;
    const attr = LAUNCH_CONFIG_LAYOUT.size + 8; // the attribute follows the config (see createExConfig)
    c.setUint32(attr + LAUNCH_CONFIG_LAYOUT.attributeValue, dimX(cluster), true);
    c.setUint32(attr + LAUNCH_CONFIG_LAYOUT.attributeValue + 4, dimY(cluster), true);
    c.setUint32(attr + LAUNCH_CONFIG_LAYOUT.attributeValue + 8, dimZ(cluster), true);
    this.launchConfigured(
      c,
      this.exConfigAddress,
      grid,
      block,
      sharedBytes,
      stream,
      args,
      () => `, cluster ${dimX(cluster)}x${dimY(cluster)}x${dimZ(cluster)}`,
    );
  }

  /**
   * Launch with programmatic stream serialization (`cuLaunchKernelEx`,
   * CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the kernel may start while the previous kernel
   * on the stream is still finishing, so its launch and prologue overlap that kernel's tail. The kernel
   * must execute `griddepcontrol.wait` before it touches memory that kernel (or anything before it) wrote
   * or reads; launched after anything but a kernel it runs as a plain launch.
   */
  launchAfterPrevious(
    grid: Dim3,
    block: Dim3,
    sharedBytes: number,
    stream: Stream | null,
    args: KernelArgs,
  ): void {
    if (this.pdlConfig === undefined) {
      const made = this.createExConfig(LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
      made.view.setInt32(LAUNCH_CONFIG_LAYOUT.size + 8 + LAUNCH_CONFIG_LAYOUT.attributeValue, 1, true);
      this.pdlConfig = made.view;
      this.pdlConfigAddress = made.address;
    }
    this.launchConfigured(
      this.pdlConfig,
      this.pdlConfigAddress,
      grid,
      block,
      sharedBytes,
      stream,
      args,
      () => ", programmatic stream serialization",
    );
  }

  private launchConfigured(
    c: DataView,
    address: bigint,
    grid: Dim3,
    block: Dim3,
    sharedBytes: number,
    stream: Stream | null,
    args: KernelArgs,
    detail: () => string,
  ): void {
    if (sharedBytes > DEFAULT_MAX_DYNAMIC_SHARED_BYTES) this.checkShared(sharedBytes);
    if (currentContext !== this.device.context) this.device.makeCurrent();
    const L = LAUNCH_CONFIG_LAYOUT;
    c.setUint32(L.gridDimX, dimX(grid), true);
    c.setUint32(L.gridDimX + 4, dimY(grid), true);
    c.setUint32(L.gridDimX + 8, dimZ(grid), true);
    c.setUint32(L.blockDimX, dimX(block), true);
    c.setUint32(L.blockDimX + 4, dimY(block), true);
    c.setUint32(L.blockDimX + 8, dimZ(block), true);
    c.setUint32(L.sharedMemBytes, sharedBytes, true);
    c.setBigUint64(L.hStream, stream === null ? 0n : stream.handle, true);
    const code = cu.cuLaunchKernelEx(address, this.handle, args.paramsAddress, null);
    if (code !== 0)
      check("cuLaunchKernelEx", code, `${this.launchDetail(grid, block, sharedBytes)}${detail()}`);
    kernelLaunchCount += 1;
  }

  /** A `CUlaunchConfig` with one attribute of this id after it (64-bit aligned), at a fixed host address. */
  private createExConfig(attributeId: number): { view: DataView; address: bigint } {
    const L = LAUNCH_CONFIG_LAYOUT;
    const attrOffset = L.size + 8;
    const block = alignedHostBytes(attrOffset + L.attributeSize, 16);
    const view = new DataView(block.view.buffer, block.view.byteOffset, block.view.byteLength);
    view.setBigUint64(L.attrs, block.address + BigInt(attrOffset), true);
    view.setUint32(L.numAttrs, 1, true);
    view.setUint32(attrOffset, attributeId, true);
    return { view, address: block.address };
  }

  private launchDetail(grid: Dim3, block: Dim3, sharedBytes: number): string {
    return `kernel ${this.name}, grid ${dimX(grid)}x${dimY(grid)}x${dimZ(grid)}, block ${dimX(block)}x${dimY(block)}x${dimZ(block)}, ${sharedBytes} B shared`;
  }
}
