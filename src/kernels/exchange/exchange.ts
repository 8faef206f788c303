/**
 * Launchers of expert parallelism's two data-movement kernels (parallel.cu): the dispatch's row gather
 * and the combine's sum over ranks. They take raw device pointers: their callers place rows at offsets
 * inside other ranks' buffers, which may live on peer GPUs (the launching device must have peer access
 * to them: `Device.enablePeerAccess`). Grid-stride kernels, 256 threads, at most 8 blocks per SM.
 */
import {
  compileKernel,
  type Device,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceOnce,
  type Stream,
} from "../../cuda/index.js";

export const EXCHANGE_SOURCE = "exchange/exchange.cu";
const THREADS = 256;
const VECTOR_BYTES = 16;

interface ParallelKernels {
  gather: Kernel;
  combine: Kernel;
  gatherArgs: KernelArgs;
  combineArgs: KernelArgs;
}

const kernels = perDeviceOnce<ParallelKernels>();

function kernelsFor(device: Device): ParallelKernels {
  return kernels(device, () => {
    const compiled = compileKernel({ source: EXCHANGE_SOURCE });
    return {
      gather: loadKernel(device, compiled, "megamoe_gather_rows"),
      combine: loadKernel(device, compiled, "megamoe_combine_ranks"),
      gatherArgs: new KernelArgs(5),
      combineArgs: new KernelArgs(7),
    };
  });
}

function gridFor(device: Device, vectors: number): number {
  return Math.max(1, Math.min(Math.ceil(vectors / THREADS), device.smCount * 8));
}

function checkRowBytes(rowBytes: number): void {
  if (!Number.isInteger(rowBytes) || rowBytes < VECTOR_BYTES || rowBytes % VECTOR_BYTES !== 0) {
    throw new RangeError(`rows must be a positive multiple of ${VECTOR_BYTES} bytes, got ${rowBytes}`);
  }
}

/**
 * Queues dst[r] = src[index[r]] for r < rows (rows of `rowBytes` bytes; `index` int32 [rows] on the
 * device) on `device`. `dst` may be a peer GPU's memory.
 */
export function gatherRowsOnDevice(
  device: Device,
  src: bigint,
  index: bigint,
  dst: bigint,
  rows: number,
  rowBytes: number,
  stream: Stream | null,
): void {
  checkRowBytes(rowBytes);
  if (rows === 0) return;
  const k = kernelsFor(device);
  const vecs = rowBytes / VECTOR_BYTES;
  k.gatherArgs.ptr(0, src).ptr(1, index).ptr(2, dst).i32(3, rows).i32(4, vecs);
  k.gather.launch(gridFor(device, rows * vecs), THREADS, 0, stream, k.gatherArgs);
}

/** Operands of the combine; every pointer on the launching device or a peer it can access. */
export interface CombineRanksArgs {
  /** bf16 [tokens, hidden] written. */
  out: bigint;
  /** bf16 [tokens, hidden]: the shared expert's output, or null for none. */
  shared: bigint | null;
  /** uint64 [ranks] on the device: rank d's bf16 [rows, hidden] results. */
  partials: bigint;
  /** int32 [ranks, tokens] on the device: the row of partials[d] holding token t, or −1. */
  slot: bigint;
  ranks: number;
  tokens: number;
  hidden: number;
}

/**
 * Queues out[t] = bf16(f32(shared[t]) + Σ_d f32(partials[d][slot[d, t]])), the sum in fp32 in rank
 * order: bit for bit the CPU's `combineRankOutputs`.
 */
export function combineRanksOnDevice(device: Device, a: CombineRanksArgs, stream: Stream | null): void {
  checkRowBytes(a.hidden * 2);
  if (a.tokens === 0) return;
  const k = kernelsFor(device);
  const vecs = (a.hidden * 2) / VECTOR_BYTES;
  k.combineArgs
    .ptr(0, a.shared ?? 0n)
    .ptr(1, a.partials)
    .ptr(2, a.slot)
    .ptr(3, a.out)
    .i32(4, a.ranks)
    .i32(5, a.tokens)
    .i32(6, vecs);
  k.combine.launch(gridFor(device, a.tokens * vecs), THREADS, 0, stream, k.combineArgs);
}
