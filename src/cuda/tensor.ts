/**
 * Dense, contiguous device tensors: a device allocation with a dtype and a shape.
 *
 * Shape/dtype/host-array checks are pure functions (testable without a GPU). A tensor must be released
 * with `dispose()`; one that is garbage-collected without it triggers a one-line warning naming its
 * dtype, shape and allocation site. Its memory is then deliberately leaked, not freed: a CUDA graph or
 * queued kernel may still use the address, and freeing under it would corrupt silently.
 */

import { type Device, disposeSymbol, type Stream } from "./driver.js";

/** Element types a tensor may hold. fp8 and bf16 are raw bits on the host. */
export type DType = "fp8_e4m3" | "bf16" | "fp32" | "int32" | "int64" | "uint8";

/** Every dtype, in a stable order. */
export const DTYPES: readonly DType[] = ["fp8_e4m3", "bf16", "fp32", "int32", "int64", "uint8"];

/** Bytes per element. */
export const DTYPE_BYTES: Readonly<Record<DType, number>> = {
  fp8_e4m3: 1,
  bf16: 2,
  fp32: 4,
  int32: 4,
  int64: 8,
  uint8: 1,
};

/** The host typed array holding a dtype's values (fp8 as bytes, bf16 as 16-bit bit patterns). */
export interface HostArrayOf {
  fp8_e4m3: Uint8Array;
  bf16: Uint16Array;
  fp32: Float32Array;
  int32: Int32Array;
  int64: BigInt64Array;
  uint8: Uint8Array;
}
/** Host array type for dtype `D`. */
export type HostArray<D extends DType> = HostArrayOf[D];

const HOST_ARRAY_CTORS = {
  fp8_e4m3: Uint8Array,
  bf16: Uint16Array,
  fp32: Float32Array,
  int32: Int32Array,
  int64: BigInt64Array,
  uint8: Uint8Array,
} as const;

/** Whether a string is a known dtype. */
export function isDType(x: string): x is DType {
  return (DTYPES as readonly string[]).includes(x);
}

/** Validate a shape (non-negative safe integers) and return its element count. */
export function elementCount(shape: readonly number[]): number {
  let n = 1;
  for (let i = 0; i < shape.length; i++) {
    const d = shape[i]!;
    if (!Number.isSafeInteger(d) || d < 0) {
      throw new RangeError(`shape [${shape.join(", ")}]: dimension ${i} is ${d}, not a non-negative integer`);
    }
    n *= d;
  }
  if (!Number.isSafeInteger(n)) throw new RangeError(`shape [${shape.join(", ")}] has too many elements`);
  return n;
}

/** Row-major strides (in elements) of a contiguous tensor. */
export function contiguousStrides(shape: readonly number[]): number[] {
  const strides = new Array<number>(shape.length);
  let s = 1;
  for (let i = shape.length - 1; i >= 0; i--) {
    strides[i] = s;
    s *= shape[i]!;
  }
  return strides;
}

/** Total bytes of a contiguous tensor. */
export function tensorBytes(dtype: DType, shape: readonly number[]): number {
  if (!isDType(dtype)) throw new TypeError(`unknown dtype "${dtype}" (expected one of ${DTYPES.join(", ")})`);
  return elementCount(shape) * DTYPE_BYTES[dtype];
}

/** "bf16[4, 128]" */
export function describeTensor(dtype: DType, shape: readonly number[]): string {
  return `${dtype}[${shape.join(", ")}]`;
}

/** A tensor's dtype and shape (a DeviceTensor, or a plain description for checks that need no GPU). */
export interface TensorLike {
  dtype: DType;
  shape: readonly number[];
}

export function sameShape(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

type OneOrMany<T> = T | readonly T[];

/**
 * The operand check every launcher makes: throws unless `t` has one of `dtypes` and one of `shapes`,
 * naming the caller and the operand ("where: what must be fp32[4, 8] or bf16[4, 8], got …").
 */
export function expectTensor(
  where: string,
  what: string,
  t: TensorLike,
  dtypes: OneOrMany<DType>,
  shapes: OneOrMany<readonly number[]>,
): void {
  const dtypeList: readonly DType[] = typeof dtypes === "string" ? [dtypes] : dtypes;
  const shapeList = (
    shapes.length > 0 && Array.isArray(shapes[0]) ? shapes : [shapes]
  ) as readonly (readonly number[])[];
  if (dtypeList.includes(t.dtype) && shapeList.some((shape) => sameShape(t.shape, shape))) return;
  const want = dtypeList.flatMap((d) => shapeList.map((shape) => describeTensor(d, shape))).join(" or ");
  throw new Error(`${where}: ${what} must be ${want}, got ${describeTensor(t.dtype, t.shape)}`);
}

/** Throws unless `t` lives on `device`. */
export function expectOnDevice(where: string, what: string, t: { device: Device }, device: Device): void {
  if (t.device !== device) {
    throw new Error(`${where}: ${what} lives on device ${t.device.ordinal}, not on device ${device.ordinal}`);
  }
}

/** Both checks: `t` is `dtype` with exactly `shape`, on `device` (the message names where and what). */
export function expectOperand(
  where: string,
  what: string,
  t: TensorLike & { device: Device },
  dtype: DType,
  shape: readonly number[],
  device: Device,
): void {
  expectTensor(where, what, t, dtype, shape);
  expectOnDevice(where, what, t, device);
}

/**
 * Check that `data` is the typed array `dtype` uses on the host and holds exactly the shape's element
 * count; throws a TypeError / RangeError saying what was expected.
 */
export function checkHostArray<D extends DType>(
  dtype: D,
  shape: readonly number[],
  data: unknown,
): asserts data is HostArray<D> {
  if (!isDType(dtype)) throw new TypeError(`unknown dtype "${dtype}" (expected one of ${DTYPES.join(", ")})`);
  const ctor = HOST_ARRAY_CTORS[dtype];
  const n = elementCount(shape);
  if (!(data instanceof ctor)) {
    const got = ArrayBuffer.isView(data) ? data.constructor.name : data === null ? "null" : typeof data;
    throw new TypeError(`${describeTensor(dtype, shape)} needs a ${ctor.name} on the host, got ${got}`);
  }
  if (data.length !== n) {
    throw new RangeError(
      `${describeTensor(dtype, shape)} has ${n} elements but the ${ctor.name} has ${data.length}`,
    );
  }
}

/** A new zeroed host array for `dtype` with `count` elements. */
export function allocHostArray<D extends DType>(dtype: D, count: number): HostArray<D> {
  return new HOST_ARRAY_CTORS[dtype](count) as HostArray<D>;
}

interface LeakRecord {
  description: string;
  bytes: number;
  /** First caller frame outside this file, e.g. "file:///x/test.ts:12:5". */
  site: string | undefined;
}

let leakWarnings = 0;
const leakRegistry = new FinalizationRegistry<LeakRecord>((record) => {
  leakWarnings++;
  process.stderr.write(
    `megamoe: warning: DeviceTensor ${record.description} (${record.bytes} bytes) was garbage-collected without dispose(); its device memory stays allocated${record.site ? `; allocated at ${record.site}` : ""}\n`,
  );
});

/**
 * Where the caller allocating a tensor is: the first stack frame outside this file. The stack is
 * formatted right away (about 5 µs): an unformatted captured stack would keep the frames' receivers,
 * the tensor among them, alive, and the tensor could then never be collected and reported.
 */
function allocationSite(): string | undefined {
  const savedLimit = Error.stackTraceLimit;
  Error.stackTraceLimit = 8;
  const holder: { stack?: string } = {};
  Error.captureStackTrace(holder);
  Error.stackTraceLimit = savedLimit;
  const stack = holder.stack;
  if (!stack) return undefined;
  for (const line of stack.split("\n").slice(1)) {
    const frame = line.trim().replace(/^at /, "");
    if (!frame.includes("/cuda/tensor.")) return frame;
  }
  return undefined;
}

/** Number of leak warnings printed so far (for tests). */
export function tensorLeakWarnings(): number {
  return leakWarnings;
}

/** A contiguous device tensor. Create with {@link DeviceTensor.empty} or {@link DeviceTensor.fromHost}; release with `dispose()`. */
export class DeviceTensor<D extends DType = DType> {
  readonly device: Device;
  readonly dtype: D;
  readonly shape: readonly number[];
  readonly numel: number;
  readonly bytes: number;
  private address: bigint;
  private disposed = false;
  /** For a view: the tensor whose memory it reads (a view owns nothing). */
  private readonly base: DeviceTensor | null;

  private constructor(
    device: Device,
    dtype: D,
    shape: readonly number[],
    view?: { base: DeviceTensor; address: bigint },
  ) {
    this.bytes = tensorBytes(dtype, shape); // checks the dtype and the shape
    this.numel = this.bytes / DTYPE_BYTES[dtype];
    this.device = device;
    this.dtype = dtype;
    this.shape = Object.freeze([...shape]);
    this.base = view?.base ?? null;
    if (view !== undefined) {
      this.address = view.address;
      return;
    }
    this.address = device.alloc(this.bytes);
    const record = { description: describeTensor(dtype, shape), bytes: this.bytes, site: allocationSite() };
    leakRegistry.register(this, record, this);
  }

  /**
   * A tensor of `shape` over this one's memory from element `offset` on (buffers sized for a maximum
   * are used at the batch's size). It owns nothing: disposing it is a no-op, and it is unusable once
   * the tensor it views is disposed.
   */
  view(shape: readonly number[], offset = 0): DeviceTensor<D> {
    const count = elementCount(shape);
    if (!Number.isInteger(offset) || offset < 0 || offset + count > this.numel) {
      throw new RangeError(
        `view ${describeTensor(this.dtype, shape)} at element ${offset} does not fit in ${describeTensor(this.dtype, this.shape)}`,
      );
    }
    const root = this.base ?? this;
    const address = this.ptr + BigInt(offset * DTYPE_BYTES[this.dtype]);
    return new DeviceTensor(this.device, this.dtype, shape, { base: root, address });
  }

  /** Uninitialized tensor (use `fill` to poison it when a test must catch unwritten elements). */
  static empty<D extends DType>(device: Device, dtype: D, shape: readonly number[]): DeviceTensor<D> {
    return new DeviceTensor(device, dtype, shape);
  }

  /** Tensor holding a copy of `data` (whose typed-array kind and length must match dtype and shape). */
  static fromHost<D extends DType>(
    device: Device,
    dtype: D,
    shape: readonly number[],
    data: HostArray<D>,
  ): DeviceTensor<D> {
    checkHostArray(dtype, shape, data);
    const t = new DeviceTensor(device, dtype, shape);
    try {
      t.copyFromHost(data);
    } catch (e) {
      t.dispose();
      throw e;
    }
    return t;
  }

  /** Device address of element 0. Throws after dispose. */
  get ptr(): bigint {
    if (this.disposed || this.base?.isDisposed)
      throw new Error(`DeviceTensor ${describeTensor(this.dtype, this.shape)} used after dispose()`);
    return this.address;
  }

  /** Whether `dispose()` was called. */
  get isDisposed(): boolean {
    return this.disposed;
  }

  /** Overwrite the whole tensor from the host (synchronous without a stream). */
  copyFromHost(data: HostArray<D>, stream?: Stream | null): void {
    const ptr = this.ptr;
    checkHostArray(this.dtype, this.shape, data);
    if (this.bytes > 0) this.device.copyHtoD(ptr, data, this.bytes, stream);
  }

  /** Copy to a new host array (synchronous; waits for work queued before it on blocking streams). */
  toHost(): HostArray<D> {
    const ptr = this.ptr;
    const out = allocHostArray(this.dtype, this.numel);
    if (this.bytes > 0) this.device.copyDtoH(out, ptr, this.bytes);
    return out;
  }

  /** Set every byte to `byte` (e.g. 0xff to poison fp8/bf16 outputs with NaNs). */
  fill(byte: number, stream?: Stream | null): void {
    const ptr = this.ptr;
    if (!Number.isInteger(byte) || byte < 0 || byte > 255)
      throw new RangeError(`fill: ${byte} is not a byte`);
    if (this.bytes > 0) this.device.memsetD8(ptr, byte, this.bytes, stream);
  }

  /** Free the device memory. Idempotent. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    if (this.base !== null) return;
    leakRegistry.unregister(this);
    this.device.free(this.address);
    this.address = 0n;
  }

  [disposeSymbol](): void {
    this.dispose();
  }

  toString(): string {
    return `DeviceTensor ${describeTensor(this.dtype, this.shape)}${this.disposed ? " (disposed)" : ""}`;
  }
}
