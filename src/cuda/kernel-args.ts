/**
 * Kernel arguments for `cuLaunchKernel`, built once per launch site and mutated in place.
 *
 * `cuLaunchKernel` takes `void** kernelParams`: an array whose i-th entry is the address of the i-th
 * argument's value. Here every argument value lives in one host buffer (8-byte slots for scalars and
 * pointers, 128-byte slots aligned to 128 for `CUtensorMap`s, optional larger slots for by-value
 * structs) and `params` holds the slot addresses. Setting an argument writes into its slot; nothing is
 * allocated per launch.
 *
 * Both buffers are created with `new ArrayBuffer`, whose memory V8 keeps off the JS heap and never
 * moves, so the addresses taken once stay valid for the object's life. (A small typed array created
 * with a length may start on the JS heap, where the GC can move it.)
 */

import { hostAddress } from "./ffi.js";

/** Bytes of a `CUtensorMap` (CU_TENSOR_MAP_NUM_QWORDS = 16 quadwords). */
export const TENSOR_MAP_BYTES = 128;
/**
 * Alignment of a `CUtensorMap`: `cuTensorMapEncodeTiled` documents 64 bytes, but CUDA 13's cuda.h
 * declares the type `alignas(128)`; 128 satisfies both.
 */
export const TENSOR_MAP_ALIGN = 128;
/** Bytes of a scalar / pointer slot. */
export const SCALAR_SLOT_BYTES = 8;

const KIND_SCALAR = 0;
const KIND_TENSOR_MAP = 1;
const KIND_STRUCT = 2;

/** Which slots are not plain 8-byte scalars. */
export interface KernelArgsLayout {
  /** Argument indices that are `const __grid_constant__ CUtensorMap` (128 bytes, 128-aligned). */
  tensorMaps?: readonly number[];
  /** Argument index → size in bytes of a struct passed by value (16-byte aligned slot). */
  structs?: Readonly<Record<number, number>>;
}

/**
 * A block of native-stable host memory with an aligned start. Returns the view and its address.
 * @param bytes size of the usable region
 * @param align power-of-two alignment of the region's first byte
 */
export function alignedHostBytes(bytes: number, align: number): { view: Uint8Array; address: bigint } {
  if (!Number.isInteger(align) || align <= 0 || (align & (align - 1)) !== 0) {
    throw new RangeError(`alignment must be a power of two, got ${align}`);
  }
  const buffer = new ArrayBuffer(bytes + align);
  const base = hostAddress(new Uint8Array(buffer, 0, 1));
  const pad = Number((BigInt(align) - (base % BigInt(align))) % BigInt(align));
  return { view: new Uint8Array(buffer, pad, bytes), address: base + BigInt(pad) };
}

/** A 128-byte, 128-byte-aligned host buffer for one `CUtensorMap` (e.g. for `encodeTensorMapTiled`). */
export function allocTensorMapBytes(): Uint8Array {
  return alignedHostBytes(TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN).view;
}

function roundUp(x: number, to: number): number {
  return Math.ceil(x / to) * to;
}

/**
 * Argument block for one kernel signature. Create once, set values with the typed setters (each returns
 * `this`), pass to `Kernel.launch`. Setters check the index and the value's range (cheap) so a wrong
 * slot or an overflowing integer throws instead of launching garbage.
 *
 * @example
 * const args = new KernelArgs(4, { tensorMaps: [0] });
 * encodeTensorMapTiled(args.tensorMap(0), {...});
 * args.ptr(1, out.ptr).i32(2, rows).f32(3, 0.5);
 */
export class KernelArgs {
  /** Number of kernel arguments. */
  readonly count: number;
  /** The `void*[count]` array of slot addresses given to the driver. */
  readonly params: BigUint64Array;
  /** Address of `params` (what `cuLaunchKernel` receives as `kernelParams`). */
  readonly paramsAddress: bigint;
  private readonly data: DataView;
  private readonly offsets: Int32Array;
  private readonly sizes: Int32Array;
  private readonly kinds: Uint8Array;
  private readonly slotViews: Uint8Array[];

  /**
   * @param count number of kernel parameters, in declaration order
   * @param layout which indices are tensor maps or by-value structs; all others are 8-byte slots
   */
  constructor(count: number, layout: KernelArgsLayout = {}) {
    if (!Number.isInteger(count) || count < 0)
      throw new RangeError(`KernelArgs: bad argument count ${count}`);
    this.count = count;
    this.kinds = new Uint8Array(count);
    this.sizes = new Int32Array(count);
    this.offsets = new Int32Array(count);
    for (const i of layout.tensorMaps ?? []) {
      this.checkLayoutIndex(i, "tensorMaps");
      this.kinds[i] = KIND_TENSOR_MAP;
    }
    for (const [key, size] of Object.entries(layout.structs ?? {})) {
      const i = Number(key);
      this.checkLayoutIndex(i, "structs");
      if (this.kinds[i] !== KIND_SCALAR) throw new RangeError(`KernelArgs: argument ${i} declared twice`);
      if (!Number.isInteger(size) || size <= 0)
        throw new RangeError(`KernelArgs: struct ${i} has bad size ${size}`);
      this.kinds[i] = KIND_STRUCT;
    }
    // Offsets relative to an aligned start: tensor maps on TENSOR_MAP_ALIGN, structs on 16, scalars on 8.
    let end = 0;
    for (let i = 0; i < count; i++) {
      const kind = this.kinds[i];
      const size =
        kind === KIND_TENSOR_MAP
          ? TENSOR_MAP_BYTES
          : kind === KIND_STRUCT
            ? roundUp(layout.structs![i]!, 8)
            : SCALAR_SLOT_BYTES;
      const align =
        kind === KIND_TENSOR_MAP ? TENSOR_MAP_ALIGN : kind === KIND_STRUCT ? 16 : SCALAR_SLOT_BYTES;
      end = roundUp(end, align);
      this.offsets[i] = end;
      this.sizes[i] = size;
      end += size;
    }
    const block = alignedHostBytes(Math.max(end, SCALAR_SLOT_BYTES), TENSOR_MAP_ALIGN);
    this.data = new DataView(block.view.buffer, block.view.byteOffset, block.view.byteLength);
    this.slotViews = [];
    const paramsBuffer = new ArrayBuffer(Math.max(count, 1) * 8);
    this.params = new BigUint64Array(paramsBuffer, 0, count);
    for (let i = 0; i < count; i++) {
      this.params[i] = block.address + BigInt(this.offsets[i]!);
      this.slotViews.push(
        new Uint8Array(block.view.buffer, block.view.byteOffset + this.offsets[i]!, this.sizes[i]!),
      );
    }
    this.paramsAddress = hostAddress(new Uint8Array(paramsBuffer, 0, 1));
  }

  private checkLayoutIndex(i: number, what: string): void {
    if (!Number.isInteger(i) || i < 0 || i >= this.count) {
      throw new RangeError(`KernelArgs: ${what} index ${i} is outside 0..${this.count - 1}`);
    }
  }

  private scalarOffset(i: number): number {
    if (this.kinds[i] !== KIND_SCALAR || i >= this.count) {
      throw new RangeError(`KernelArgs: argument ${i} is not a scalar slot (count ${this.count})`);
    }
    return this.offsets[i]!;
  }

  /** Set argument `i` to a device pointer (or any 64-bit address). */
  ptr(i: number, value: bigint): this {
    this.data.setBigUint64(this.scalarOffset(i), value, true);
    return this;
  }

  /** Set argument `i` to a signed 32-bit integer. */
  i32(i: number, value: number): this {
    if ((value | 0) !== value) throw new RangeError(`KernelArgs.i32(${i}): ${value} is not a 32-bit integer`);
    this.data.setInt32(this.scalarOffset(i), value, true);
    return this;
  }

  /** Set argument `i` to an unsigned 32-bit integer. */
  u32(i: number, value: number): this {
    if (value >>> 0 !== value)
      throw new RangeError(`KernelArgs.u32(${i}): ${value} is not an unsigned 32-bit integer`);
    this.data.setUint32(this.scalarOffset(i), value, true);
    return this;
  }

  /** Set argument `i` to a 32-bit float (rounded from the JS double). */
  f32(i: number, value: number): this {
    this.data.setFloat32(this.scalarOffset(i), value, true);
    return this;
  }

  /** Set argument `i` to an unsigned 64-bit integer. */
  u64(i: number, value: bigint): this {
    if (value < 0n || value > 0xffff_ffff_ffff_ffffn) {
      throw new RangeError(`KernelArgs.u64(${i}): ${value} is out of range`);
    }
    this.data.setBigUint64(this.scalarOffset(i), value, true);
    return this;
  }

  /** Set argument `i` to a signed 64-bit integer. */
  i64(i: number, value: bigint): this {
    if (value < -(2n ** 63n) || value >= 2n ** 63n)
      throw new RangeError(`KernelArgs.i64(${i}): ${value} is out of range`);
    this.data.setBigInt64(this.scalarOffset(i), value, true);
    return this;
  }

  /** The 128-byte, 128-aligned slot of tensor-map argument `i`, to be filled by `encodeTensorMapTiled`. */
  tensorMap(i: number): Uint8Array {
    if (this.kinds[i] !== KIND_TENSOR_MAP || i >= this.count) {
      throw new RangeError(`KernelArgs: argument ${i} was not declared as a tensor map`);
    }
    return this.slotViews[i]!;
  }

  /** Copy an already encoded 128-byte tensor map into slot `i`. */
  setTensorMap(i: number, map: Uint8Array): this {
    if (map.byteLength !== TENSOR_MAP_BYTES) {
      throw new RangeError(
        `KernelArgs.setTensorMap(${i}): a tensor map is ${TENSOR_MAP_BYTES} bytes, got ${map.byteLength}`,
      );
    }
    this.tensorMap(i).set(map);
    return this;
  }

  /** Copy the bytes of a by-value struct into slot `i` (declared in `layout.structs`). */
  struct(i: number, bytes: Uint8Array): this {
    if (this.kinds[i] !== KIND_STRUCT || i >= this.count) {
      throw new RangeError(`KernelArgs: argument ${i} was not declared as a struct`);
    }
    const slot = this.slotViews[i]!;
    if (bytes.byteLength > slot.byteLength) {
      throw new RangeError(
        `KernelArgs.struct(${i}): ${bytes.byteLength} bytes exceed the slot's ${slot.byteLength}`,
      );
    }
    slot.set(bytes);
    return this;
  }

  /** The bytes of slot `i` (a live view; for tests and debugging). */
  slotBytes(i: number): Uint8Array {
    if (!Number.isInteger(i) || i < 0 || i >= this.count)
      throw new RangeError(`KernelArgs: no argument ${i}`);
    return this.slotViews[i]!;
  }
}
