/** Opening a GPU: its primary context, properties, device memory and copies, and what it creates. */

import { check, cu, outI32, outU64, requireCuda } from "./driver-api.js";
import { DeviceAttribute } from "./driver-constants.js";
import { type HostMemory, hostBytes, hostPointer, PinnedBuffer } from "./host-memory.js";
import { Module } from "./launch.js";
import { Event, Stream } from "./stream.js";

export let currentContext = 0n;
const openDevices = new Map<number, Device>();

/**
 * Open GPU `ordinal` (retain its primary context and make it current). Returns the same object for the
 * same ordinal; properties are read once here.
 * @throws Error with the availability reason when CUDA cannot be used
 */
export function openDevice(ordinal = 0): Device {
  const existing = openDevices.get(ordinal);
  if (existing) {
    existing.makeCurrent();
    return existing;
  }
  requireCuda();
  const device = new Device(ordinal);
  openDevices.set(ordinal, device);
  return device;
}

/** One GPU with its primary context. Create through {@link openDevice}. */
export class Device {
  readonly ordinal: number;
  /** The `CUdevice` handle. */
  readonly handle: number;
  /** The primary `CUcontext`. */
  readonly context: bigint;
  readonly name: string;
  readonly smCount: number;
  readonly computeCapability: { major: number; minor: number };
  /** Total device memory in bytes. */
  readonly totalMemoryBytes: number;
  readonly l2CacheBytes: number;
  /** Largest dynamic shared memory one block may opt into (bytes). */
  readonly maxSharedMemoryPerBlockOptin: number;
  readonly maxSharedMemoryPerSm: number;
  /** SM clock in kHz (as reported by CU_DEVICE_ATTRIBUTE_CLOCK_RATE). */
  readonly clockRateKHz: number;
  readonly memoryClockRateKHz: number;
  readonly memoryBusWidthBits: number;
  /** Driver version as an integer, e.g. 13000. */
  readonly driverVersion: number;
  /** The legacy default stream (handle 0). */
  readonly nullStream: Stream;
  private readonly allocations = new Map<bigint, number>();
  private allocatedTotal = 0;
  private released = false;

  /** @internal use {@link openDevice} */
  constructor(ordinal: number) {
    this.ordinal = ordinal;
    check("cuDeviceGet", cu.cuDeviceGet(outI32, ordinal), `ordinal ${ordinal}`);
    this.handle = outI32[0]!;
    check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(outU64, this.handle));
    this.context = outU64[0]!;
    this.makeCurrent();
    const nameBytes = new Uint8Array(256);
    check("cuDeviceGetName", cu.cuDeviceGetName(nameBytes, nameBytes.length, this.handle));
    const end = nameBytes.indexOf(0);
    this.name = new TextDecoder().decode(nameBytes.subarray(0, end < 0 ? nameBytes.length : end));
    check("cuDeviceTotalMem_v2", cu.cuDeviceTotalMem(outU64, this.handle));
    this.totalMemoryBytes = Number(outU64[0]);
    this.smCount = this.attribute(DeviceAttribute.MULTIPROCESSOR_COUNT);
    this.computeCapability = {
      major: this.attribute(DeviceAttribute.COMPUTE_CAPABILITY_MAJOR),
      minor: this.attribute(DeviceAttribute.COMPUTE_CAPABILITY_MINOR),
    };
    this.l2CacheBytes = this.attribute(DeviceAttribute.L2_CACHE_SIZE);
    this.maxSharedMemoryPerBlockOptin = this.attribute(DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    this.maxSharedMemoryPerSm = this.attribute(DeviceAttribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    this.clockRateKHz = this.attribute(DeviceAttribute.CLOCK_RATE);
    this.memoryClockRateKHz = this.attribute(DeviceAttribute.MEMORY_CLOCK_RATE);
    this.memoryBusWidthBits = this.attribute(DeviceAttribute.GLOBAL_MEMORY_BUS_WIDTH);
    check("cuDriverGetVersion", cu.cuDriverGetVersion(outI32));
    this.driverVersion = outI32[0]!;
    this.nullStream = new Stream(this, 0n);
  }

  /** e.g. "sm_90" (add the "a" suffix yourself for arch-specific features). */
  get smArch(): string {
    return `sm_${this.computeCapability.major}${this.computeCapability.minor}`;
  }

  /** Bytes currently allocated through {@link alloc} and not freed. */
  get allocatedBytes(): number {
    return this.allocatedTotal;
  }

  /**
   * Free and total memory of the device as the driver reports them (cuMemGetInfo): everything any
   * process or the driver holds, modules and local memory included, unlike {@link allocatedBytes}.
   */
  memoryInfo(): { freeBytes: number; totalBytes: number } {
    this.makeCurrent();
    const free = new BigUint64Array(1);
    const total = new BigUint64Array(1);
    check("cuMemGetInfo_v2", cu.cuMemGetInfo(free, total));
    return { freeBytes: Number(free[0]), totalBytes: Number(total[0]) };
  }

  /** Read any `CUdevice_attribute` (see {@link DeviceAttribute}). */
  attribute(attr: number): number {
    check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(outI32, attr, this.handle), `attribute ${attr}`);
    return outI32[0]!;
  }

  /** Make this device's context current on the calling thread (cheap when it already is). */
  makeCurrent(): void {
    if (currentContext === this.context) return;
    if (this.released) throw new Error(`device ${this.ordinal} was closed`);
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(this.context));
    currentContext = this.context;
  }

  /** Wait for all work on this device. */
  synchronize(): void {
    this.makeCurrent();
    check("cuCtxSynchronize", cu.cuCtxSynchronize());
  }

  /** Allocate `bytes` of device memory (uninitialized). Zero bytes gives the null pointer. */
  alloc(bytes: number): bigint {
    if (!Number.isSafeInteger(bytes) || bytes < 0) throw new RangeError(`alloc: bad byte count ${bytes}`);
    if (bytes === 0) return 0n;
    this.makeCurrent();
    check(
      "cuMemAlloc_v2",
      cu.cuMemAlloc(outU64, bytes),
      `${bytes} bytes; ${this.allocatedTotal} already allocated`,
    );
    const ptr = outU64[0]!;
    this.allocations.set(ptr, bytes);
    this.allocatedTotal += bytes;
    return ptr;
  }

  /** Free memory from {@link alloc}. Freeing 0n is a no-op. */
  free(ptr: bigint): void {
    if (ptr === 0n) return;
    const bytes = this.allocations.get(ptr);
    if (bytes === undefined)
      throw new Error(`free: 0x${ptr.toString(16)} was not allocated by device ${this.ordinal}`);
    this.makeCurrent();
    check("cuMemFree_v2", cu.cuMemFree(ptr));
    this.allocations.delete(ptr);
    this.allocatedTotal -= bytes;
  }

  /** Allocate page-locked host memory (fast, truly asynchronous copies). */
  allocPinned(bytes: number): PinnedBuffer {
    if (!Number.isSafeInteger(bytes) || bytes <= 0)
      throw new RangeError(`allocPinned: bad byte count ${bytes}`);
    this.makeCurrent();
    check("cuMemHostAlloc", cu.cuMemHostAlloc(outU64, bytes, 0), `${bytes} bytes`);
    return new PinnedBuffer(outU64[0]!, bytes);
  }

  /**
   * Copy host → device. Without a stream the copy is synchronous; with one it is queued on it (then the
   * host memory must stay alive and unchanged until the stream reaches the copy).
   */
  copyHtoD(dst: bigint, src: HostMemory, bytes = hostBytes(src), stream?: Stream | null): void {
    if (stream) {
      check("cuMemcpyHtoDAsync_v2", cu.cuMemcpyHtoDAsync(dst, hostPointer(src), bytes, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemcpyHtoD_v2", cu.cuMemcpyHtoD(dst, hostPointer(src), bytes));
    }
  }

  /** Copy device → host; synchronous without a stream, queued with one (wait on the stream before reading). */
  copyDtoH(dst: HostMemory, src: bigint, bytes = hostBytes(dst), stream?: Stream | null): void {
    if (stream) {
      check("cuMemcpyDtoHAsync_v2", cu.cuMemcpyDtoHAsync(hostPointer(dst), src, bytes, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemcpyDtoH_v2", cu.cuMemcpyDtoH(hostPointer(dst), src, bytes));
    }
  }

  /** Copy device → device. */
  copyDtoD(dst: bigint, src: bigint, bytes: number, stream?: Stream | null): void {
    if (stream) {
      check("cuMemcpyDtoDAsync_v2", cu.cuMemcpyDtoDAsync(dst, src, bytes, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemcpyDtoD_v2", cu.cuMemcpyDtoD(dst, src, bytes));
    }
  }

  /** Set `count` bytes at `ptr` to `value` (0..255). */
  memsetD8(ptr: bigint, value: number, count: number, stream?: Stream | null): void {
    if (stream) {
      check("cuMemsetD8Async", cu.cuMemsetD8Async(ptr, value, count, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemsetD8_v2", cu.cuMemsetD8(ptr, value, count));
    }
  }

  /** Set `count` 32-bit words at `ptr` (4-byte aligned) to `value`. */
  memsetD32(ptr: bigint, value: number, count: number, stream?: Stream | null): void {
    if (stream) {
      check("cuMemsetD32Async", cu.cuMemsetD32Async(ptr, value >>> 0, count, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemsetD32_v2", cu.cuMemsetD32(ptr, value >>> 0, count));
    }
  }

  /** A new (blocking) stream. */
  createStream(): Stream {
    this.makeCurrent();
    check("cuStreamCreate", cu.cuStreamCreate(outU64, 0));
    return new Stream(this, outU64[0]!);
  }

  /** A new event; `timing: false` makes a lighter event that cannot be timed. */
  createEvent(options: { timing?: boolean; blockingSync?: boolean } = {}): Event {
    this.makeCurrent();
    const flags = (options.blockingSync ? 1 : 0) | (options.timing === false ? 2 : 0);
    check("cuEventCreate", cu.cuEventCreate(outU64, flags));
    return new Event(this, outU64[0]!);
  }

  /** Load a cubin (ELF image) into this context. */
  loadModule(image: Uint8Array): Module {
    this.makeCurrent();
    check("cuModuleLoadData", cu.cuModuleLoadData(outU64, image), `${image.byteLength}-byte image`);
    return new Module(this, outU64[0]!);
  }

  /** Whether this device can map `peer`'s memory directly. */
  canAccessPeer(peer: Device): boolean {
    check("cuDeviceCanAccessPeer", cu.cuDeviceCanAccessPeer(outI32, this.handle, peer.handle));
    return outI32[0] !== 0;
  }

  /** Let kernels on this device access `peer`'s memory. Enabling twice is not an error. */
  enablePeerAccess(peer: Device): void {
    this.makeCurrent();
    const code = cu.cuCtxEnablePeerAccess(peer.context, 0);
    if (code !== 704 /* CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED */) {
      check("cuCtxEnablePeerAccess", code, `device ${this.ordinal} → ${peer.ordinal}`);
    }
  }

  /** Release the primary context; the object is unusable afterwards. */
  close(): void {
    if (this.released) return;
    check("cuDevicePrimaryCtxRelease_v2", cu.cuDevicePrimaryCtxRelease(this.handle));
    this.released = true;
    if (currentContext === this.context) currentContext = 0n;
    openDevices.delete(this.ordinal);
  }

  /** A short description, e.g. "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, L2 60 MiB)". */
  describe(): string {
    const gib = (this.totalMemoryBytes / 2 ** 30).toFixed(1);
    const l2 = (this.l2CacheBytes / 2 ** 20).toFixed(0);
    return `${this.name} (${this.smArch}, ${this.smCount} SMs, ${gib} GiB, L2 ${l2} MiB)`;
  }
}
