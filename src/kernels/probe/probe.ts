/**
 * The machine's ceilings, measured by the project's own kernels: the read-stream bandwidth (the floor
 * of a kernel that streams weights, i.e. of the layer and the grouped GEMM), the device-copy bandwidth
 * (the floor of a kernel that writes about as much as it reads, e.g. the quantization) and the host cost
 * of one launch from Node (the floor of a small layer run launch by launch); for diagnosis, the TMA weight
 * stream of decode and the tensor cores' rate in the mainloops' wgmma shapes.
 */
import {
  compileKernel,
  DEFAULT_MAX_DYNAMIC_SHARED_BYTES,
  type Device,
  encodeTensorMapTiled,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceOnce,
  type Stream,
  TensorMapDataType,
  TensorMapL2Promotion,
  TensorMapSwizzle,
  timeKernel,
} from "../../cuda/index.js";
import { encodeFp4RowsMap, encodeFp8RowsMap } from "../tensor-maps.js";

export interface Ceilings {
  /** Read stream, bytes read per second (nothing written), in TB/s. */
  readTbps: number;
  readBytes: number;
  /** Device copy, bytes read plus bytes written per second, in TB/s. */
  copyTbps: number;
  copyBytes: number;
  /** Host time of one `cuLaunchKernel` of an empty kernel from Node, in µs (median of batches). */
  launchUs: number;
  /** GPU time of one empty kernel in a back-to-back stream, in µs. */
  emptyKernelUs: number;
}

interface ProbeKernels {
  empty: Kernel;
  copy: Kernel;
  read: Kernel;
  tmaStream: Kernel;
  wgmmaN128: Kernel;
  wgmmaN256: Kernel;
}

const probeKernelMemo = perDeviceOnce<ProbeKernels>();

/** The probe kernels on `device`, compiled (or read from the JIT cache) once. */
function probeKernels(device: Device): ProbeKernels {
  return probeKernelMemo(device, () => {
    const compiled = compileKernel({ source: "probe/probe.cu" });
    return {
      empty: loadKernel(device, compiled, "probe_empty"),
      copy: loadKernel(device, compiled, "probe_copy"),
      read: loadKernel(device, compiled, "probe_read"),
      tmaStream: loadKernel(device, compiled, "probe_tma_stream"),
      wgmmaN128: loadKernel(device, compiled, "probe_wgmma_n128"),
      wgmmaN256: loadKernel(device, compiled, "probe_wgmma_n256"),
    };
  });
}

/** The probes' buffer: `bytes`, capped at a quarter of the device's memory, a multiple of 16. */
function probeBytes(device: Device, bytes: number): number {
  return Math.min(bytes, Math.floor(device.totalMemoryBytes / 4 / 16) * 16);
}

/**
 * Read-stream bandwidth over `bytes` (default 2 GiB, capped at a quarter of the device's memory): bytes
 * read per second by `probe_read` (16-byte L1-bypassing loads, 8 in flight per thread, grid 2 × SMs ×
 * 512 threads, nothing written). Timed as the copy is: median of 20 runs after 3 warm-ups, no L2 flush
 * (the buffer is 34× the H200's L2).
 */
export function measureReadCeiling(device: Device, bytes = 2 ** 31): { tbps: number; bytes: number } {
  const size = probeBytes(device, bytes);
  const probe = readStream(device, size);
  try {
    const t = timeKernel(device, probe.queue, { warmup: 3, iters: 20, l2Flush: false });
    return { tbps: size / (t.usMedian * 1e-6) / 1e12, bytes: size };
  } finally {
    probe.dispose();
  }
}

/** `probe_read` over a buffer of `size` bytes (a multiple of 16), nothing written, queued on demand. */
function readStream(device: Device, size: number): { queue(stream: Stream): void; dispose(): void } {
  const { read } = probeKernels(device);
  const grid = device.smCount * 2;
  const src = device.alloc(size);
  let sink = 0n;
  const free = () => {
    device.free(src);
    if (sink !== 0n) device.free(sink);
  };
  try {
    sink = device.alloc(grid * 4);
    device.memsetD32(src, 0x3c003c00, size / 4, device.nullStream);
    device.memsetD32(sink, 0, grid, device.nullStream);
  } catch (e) {
    free();
    throw e;
  }
  // write_sink = 0: the kernel only reads (see probe.cu).
  const args = new KernelArgs(4)
    .ptr(0, src)
    .u64(1, BigInt(size / 16))
    .ptr(2, sink)
    .i32(3, 0);
  return {
    queue: (stream) => read.launch(grid, 512, 0, stream, args),
    dispose: free,
  };
}

/**
 * An L2 flush by reads, for `timeKernel`'s `rotate` (with `l2Flush: false`): `probe_read` over a buffer of
 * twice the L2 size, nothing written, leaves the L2 holding clean lines, where the default flush (a
 * memset) leaves dirty ones that the timed kernel's loads must first write back. Lab diagnosis: how much
 * of a short run is that write-back.
 */
export function readFlush(device: Device): { queue(stream: Stream): void; dispose(): void } {
  return readStream(device, Math.ceil((2 * device.l2CacheBytes) / 16) * 16);
}

/** Queues an empty kernel of this launch shape: what a launch costs before its first instruction. */
export function emptyLaunch(
  device: Device,
  grid: number,
  threads: number,
  sharedBytes: number,
): (s: Stream) => void {
  const { empty } = probeKernels(device);
  if (sharedBytes > DEFAULT_MAX_DYNAMIC_SHARED_BYTES) empty.setMaxDynamicSharedMemory(sharedBytes);
  const args = new KernelArgs(0);
  return (stream) => empty.launch(grid, threads, sharedBytes, stream, args);
}

/** Copy bandwidth over `bytes` (default 2 GiB, capped at a quarter of the device's memory). */
export function measureCopyCeiling(device: Device, bytes = 2 ** 31): { tbps: number; bytes: number } {
  const size = probeBytes(device, bytes);
  const { copy } = probeKernels(device);
  const src = device.alloc(size);
  const dst = device.alloc(size);
  try {
    device.memsetD32(src, 0x3c003c00, size / 4, device.nullStream);
    const vectors = size / 16;
    const args = new KernelArgs(3).ptr(0, src).ptr(1, dst).u64(2, BigInt(vectors));
    const grid = device.smCount * 4;
    const t = timeKernel(device, (s) => copy.launch(grid, 512, 0, s, args), {
      warmup: 3,
      iters: 20,
      l2Flush: false,
    });
    return { tbps: (2 * size) / (t.usMedian * 1e-6) / 1e12, bytes: size };
  } finally {
    device.free(src);
    device.free(dst);
  }
}

/**
 * How weights lie in memory for `measureWeightStream`, and how a box is loaded: row-major or
 * K-block-major through a tensor map of the layer's rows; K-block-major through a map of rows twice as
 * wide, unswizzled ("kblock-wide": what a layout stored already swizzled would load, two rows a TMA
 * row); or K-block-major as plain bulk copies ("kblock-bulk").
 */
export type WeightLayout = "row-major" | "kblock-major" | "kblock-wide" | "kblock-bulk";
/** The probe's `layout` argument per layout. */
const LAYOUT_CODES: Record<WeightLayout, number> = {
  "row-major": 0,
  "kblock-major": 1,
  "kblock-bulk": 2,
  "kblock-wide": 3,
};
/** Every layout `measureWeightStream` takes. */
export const WEIGHT_LAYOUTS = Object.keys(LAYOUT_CODES) as readonly WeightLayout[];

export interface WeightStreamOptions {
  /** CTAs, one tile each (the layer at decode: one L1 tile per busy SM). */
  ctas: number;
  /** Rows per tile (a stage holds tileRows × pieceBytes). */
  tileRows: number;
  /** Rows per TMA box (at most 256). */
  boxRows: number;
  /** 128-deep K blocks per tile row (K / 128). */
  kBlocks: number;
  layout: WeightLayout;
  stages: number;
  /**
   * Bytes of a row per K block: 128 (FP8, the 128-byte swizzle; the default) or 64 (packed FP4, the
   * 64-byte swizzle), the boxes the fused kernel loads for either format.
   */
  pieceBytes?: 64 | 128;
}

/** Dynamic shared memory of a weight-stream launch: the ring, alignment slack and its barriers. */
export function weightStreamSharedBytes(
  o: Pick<WeightStreamOptions, "tileRows" | "stages" | "pieceBytes">,
): number {
  return o.stages * o.tileRows * (o.pieceBytes ?? 128) + 1024 + 16 * o.stages;
}

/**
 * Bytes per second with which `options.ctas` CTAs stream one weight tile each through a TMA stage ring
 * and no math (`probe_tma_stream`): the rate the layer's producer can reach at decode, for either weight
 * layout. Timed with the L2 flushed (each tile is read once per run), median of 20 runs.
 */
export function measureWeightStream(
  device: Device,
  options: WeightStreamOptions,
): { tbps: number; us: number } {
  const { ctas, tileRows, boxRows, kBlocks, layout, stages } = options;
  const piece = options.pieceBytes ?? 128;
  if (tileRows % boxRows !== 0 || boxRows > 256)
    throw new RangeError("weight stream: boxRows must divide tileRows and be ≤ 256");
  if (piece !== 64 && piece !== 128) throw new RangeError("weight stream: pieceBytes must be 64 or 128");
  const { tmaStream } = probeKernels(device);
  const rows = ctas * tileRows;
  const bytes = rows * kBlocks * piece;
  const shared = weightStreamSharedBytes(options);
  tmaStream.setMaxDynamicSharedMemory(shared);
  const src = device.alloc(bytes);
  const stalled = device.alloc(4);
  try {
    device.memsetD32(src, 0x3c003c00, bytes / 4, device.nullStream);
    device.memsetD32(stalled, 0, 1, device.nullStream);
    const args = new KernelArgs(10, { tensorMaps: [0] });
    const rowMajor = layout === "row-major";
    // The layer's operand map (FP8 rows or packed FP4 rows, either encoder taking K = 128 per K block);
    // K-block-major is the same map over rows of one K block.
    const encode = piece === 128 ? encodeFp8RowsMap : encodeFp4RowsMap;
    if (rowMajor) encode(args.tensorMap(0), src, kBlocks * 128, rows, boxRows);
    else if (layout === "kblock-wide") {
      encodeTensorMapTiled(args.tensorMap(0), {
        dataType: TensorMapDataType.UINT8,
        globalAddress: src,
        globalDims: [2 * piece, (rows * kBlocks) / 2],
        globalStridesBytes: [2 * piece],
        boxDims: [2 * piece, boxRows / 2],
        swizzle: TensorMapSwizzle.NONE,
        l2Promotion: TensorMapL2Promotion.B256,
      });
    } else encode(args.tensorMap(0), src, 128, rows * kBlocks, boxRows);
    args
      .i32(1, tileRows)
      .i32(2, boxRows)
      .i32(3, rows)
      .i32(4, kBlocks)
      .i32(5, LAYOUT_CODES[layout])
      .i32(6, stages)
      .i32(7, piece);
    args.ptr(8, stalled).ptr(9, src);
    const t = timeKernel(device, (s) => tmaStream.launch(ctas, 64, shared, s, args), {
      warmup: 3,
      iters: 20,
    });
    const flag = new Int32Array(1);
    device.copyDtoH(flag, stalled, 4);
    if (flag[0] !== 0) throw new Error(`weight stream: ${flag[0]} waits stalled (a wedged ring)`);
    return { tbps: bytes / (t.usMedian * 1e-6) / 1e12, us: t.usMedian };
  } finally {
    device.free(src);
    device.free(stalled);
  }
}

export interface WgmmaRateOptions {
  /** wgmma N: 128 (the mainloops' chunks) or 256. */
  n: 128 | 256;
  /** Math warpgroups per CTA (1 to 3), one CTA per SM. */
  warpgroups: 1 | 2 | 3;
  /** n-wide chunks per 128-deep K block, each waited for (the mainloops: 2 of n128). */
  chunks: number;
  /** Promote each chunk into a second accumulator (n = 128 only: n = 256 has no registers for it). */
  promote: boolean;
  /** K blocks per warpgroup. */
  kBlocks: number;
}

/**
 * FP8 FLOP/s of the tensor cores in a mainloop's shape with no memory traffic (`probe_wgmma_n128/256`):
 * the ceiling a mainloop built that way can reach. Median of 10 runs, one CTA per SM.
 */
export function measureWgmmaRate(device: Device, options: WgmmaRateOptions): { tflops: number; us: number } {
  const { n, warpgroups, chunks, promote, kBlocks } = options;
  if (n === 256 && promote) throw new RangeError("wgmma rate: no promotion at n = 256");
  const kernels = probeKernels(device);
  const kernel = n === 128 ? kernels.wgmmaN128 : kernels.wgmmaN256;
  const shared = 56 * 1024 + 1024; // three warpgroups' A tiles, one B tile, alignment
  kernel.setMaxDynamicSharedMemory(shared);
  const args = new KernelArgs(n === 128 ? 4 : 3).i32(0, kBlocks).i32(1, chunks);
  if (n === 128) args.i32(2, promote ? 1 : 0).ptr(3, 0n);
  else args.ptr(2, 0n);
  const ctas = device.smCount;
  const t = timeKernel(device, (s) => kernel.launch(ctas, 128 * warpgroups, shared, s, args), {
    warmup: 2,
    iters: 10,
    l2Flush: false,
  });
  const flops = ctas * warpgroups * kBlocks * chunks * 2 * 64 * n * 128;
  return { tflops: flops / (t.usMedian * 1e-6) / 1e12, us: t.usMedian };
}

/** Host cost per launch (Node → driver) and GPU time per empty kernel. */
export function measureLaunchOverhead(
  device: Device,
  launches = 2000,
): { launchUs: number; emptyKernelUs: number } {
  const { empty } = probeKernels(device);
  const args = new KernelArgs(0);
  const stream = device.createStream();
  try {
    const batches: number[] = [];
    for (let b = 0; b < 5; b++) {
      stream.synchronize();
      const t0 = performance.now();
      for (let i = 0; i < launches; i++) empty.launch(1, 32, 0, stream, args);
      batches.push(((performance.now() - t0) * 1000) / launches);
    }
    stream.synchronize();
    batches.sort((a, b) => a - b);
    const gpu = timeKernel(
      device,
      (s) => {
        for (let i = 0; i < 100; i++) empty.launch(1, 32, 0, s, args);
      },
      { warmup: 2, iters: 10, graph: true, l2Flush: false, stream },
    );
    return { launchUs: batches[2], emptyKernelUs: gpu.usMedian / 100 };
  } finally {
    stream.destroy();
  }
}

export function measureCeilings(device: Device): Ceilings {
  const read = measureReadCeiling(device);
  const copy = measureCopyCeiling(device);
  const launch = measureLaunchOverhead(device);
  return {
    readTbps: read.tbps,
    readBytes: read.bytes,
    copyTbps: copy.tbps,
    copyBytes: copy.bytes,
    ...launch,
  };
}
