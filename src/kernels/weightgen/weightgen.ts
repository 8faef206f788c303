/**
 * Launchers of weightgen.cu: the seeded generator of src/weights/generate.ts run on the device, bit for
 * bit. The host computes each tensor's 32-bit hash stream with the CPU generator's own functions
 * (`streamKey(seed, tensorKey(name))`) and passes it as a kernel argument, so the names, keys and seed
 * handling cannot drift from the CPU; the kernels only hash indices.
 *
 * Every size is a runtime argument (one compiled image for every preset). Launches are asynchronous on
 * the given stream and allocate nothing.
 */

import { QUANT_BLOCK } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  type DeviceTensor,
  type DType,
  describeTensor,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceOnce,
  type Stream,
} from "../../cuda/index.js";
import { checkSeed, streamKey, tensorKey } from "../../numerics/counter-rng.js";
import {
  ACTIVATION_BASE,
  GATE_BIAS_SCALE,
  gateWeightScale,
  generatorNames,
  type MatrixSpec,
  matrixBaseScale,
} from "../../numerics/generator.js";

/** The kernel source, relative to src/kernels. */
export const WEIGHTGEN_KERNEL_SOURCE = "weightgen/weightgen.cu";

// Mirrors of weightgen.cu's block sizes.
const MATRIX_THREADS = 256;
const MXFP4_THREADS = 256;
const STREAM_THREADS = 256;
const ACTIVATIONS_PER_THREAD = 8;
/** Enough resident blocks to saturate any Hopper part; the stream kernels grid-stride past it. */
const MAX_STREAM_BLOCKS = 4096;
const INDEX_LIMIT = 2 ** 32;
/** The Weyl increment between consecutive elements' hashes (weightgen.cu: kGolden). */
const WEYL_STEP = 0x9e3779b9 | 0;

interface WeightgenKernels {
  matrix: Kernel;
  mxfp4: Kernel;
  uniform: Kernel;
  activations: Kernel;
  matrixArgs: KernelArgs;
  mxfp4Args: KernelArgs;
  uniformArgs: KernelArgs;
  activationArgs: KernelArgs;
}

const weightgenKernels = perDeviceOnce<WeightgenKernels>();

/** The four kernels on `device`, compiled (or read from the JIT cache) once, with reusable arguments. */
function kernelsFor(device: Device): WeightgenKernels {
  return weightgenKernels(device, () => {
    const compiled = compileKernel({ source: WEIGHTGEN_KERNEL_SOURCE });
    return {
      matrix: loadKernel(device, compiled, "megamoe_weightgen_matrix"),
      mxfp4: loadKernel(device, compiled, "megamoe_weightgen_mxfp4"),
      uniform: loadKernel(device, compiled, "megamoe_weightgen_uniform"),
      activations: loadKernel(device, compiled, "megamoe_weightgen_activations"),
      // cuLaunchKernel copies the argument values, so one set per kernel serves every launch.
      matrixArgs: new KernelArgs(7),
      mxfp4Args: new KernelArgs(8),
      uniformArgs: new KernelArgs(5),
      activationArgs: new KernelArgs(6),
    };
  });
}

/** The 32-bit stream every element hash of tensor `name` starts from (counter-rng.ts). */
export function tensorStream(seed: number, name: string): number {
  return streamKey(seed, tensorKey(name));
}

function checkMatrixShape(name: string, rows: number, cols: number): void {
  if (
    !Number.isInteger(rows) ||
    !Number.isInteger(cols) ||
    rows <= 0 ||
    cols <= 0 ||
    rows % QUANT_BLOCK !== 0 ||
    cols % QUANT_BLOCK !== 0
  ) {
    throw new RangeError(
      `${name}: rows and cols must be positive multiples of ${QUANT_BLOCK}, got ${rows}×${cols}`,
    );
  }
  if (rows * cols > INDEX_LIMIT)
    throw new RangeError(`${name}: ${rows}×${cols} elements exceed 2^32 hash indices`);
}

function checkTensor(
  what: string,
  t: DeviceTensor,
  dtype: DType,
  count: number,
  offset: number,
  device: Device,
): void {
  if (t.device !== device) {
    throw new Error(`${what} lives on device ${t.device.ordinal}, not on device ${device.ordinal}`);
  }
  if (t.dtype !== dtype) {
    throw new Error(`${what} must hold ${dtype}, got ${describeTensor(t.dtype, t.shape)}`);
  }
  if (!Number.isInteger(offset) || offset < 0 || offset + count > t.numel) {
    throw new RangeError(
      `${what}: elements [${offset}, ${offset + count}) do not fit in ${describeTensor(t.dtype, t.shape)}`,
    );
  }
}

/**
 * Queues the generation of matrix `spec` (what `generateBlockQuantized(seed, name, rows, cols, fanIn)`
 * makes on the CPU) into q (e4m3) from element `qOffset` on and its [rows/128, cols/128] fp32 scales
 * into `scales` from element `scalesOffset` on.
 */
export function generateMatrixOnDevice(
  device: Device,
  seed: number,
  spec: MatrixSpec,
  q: DeviceTensor,
  qOffset: number,
  scales: DeviceTensor,
  scalesOffset: number,
  stream: Stream | null,
): void {
  checkSeed(seed);
  const { name, rows, cols, fanIn } = spec;
  checkMatrixShape(name, rows, cols);
  const blocks = (rows / QUANT_BLOCK) * (cols / QUANT_BLOCK);
  checkTensor(`${name} codes`, q, "fp8_e4m3", rows * cols, qOffset, device);
  checkTensor(`${name} scales`, scales, "fp32", blocks, scalesOffset, device);
  const k = kernelsFor(device);
  k.matrixArgs
    .ptr(0, q.ptr + BigInt(qOffset))
    .ptr(1, scales.ptr + BigInt(4 * scalesOffset))
    .u32(2, tensorStream(seed, name))
    .u32(3, tensorStream(seed, generatorNames.blockExponent(name)))
    .u32(4, rows)
    .u32(5, cols)
    .f32(6, matrixBaseScale(fanIn));
  k.matrix.launch(blocks, MATRIX_THREADS, 0, stream, k.matrixArgs);
}

/**
 * Where the UE8M0 bytes of an MXFP4 matrix [rows, cols] go (both 4-byte aligned):
 * - "rows": the plain [rows, cols/32] bytes (row-major, as `generateMxfp4` returns them), from byte
 *   `offset` (a multiple of 4) of the tensor on;
 * - "gemm": in the FP4 kernels' order [cols/128, totalRows·4] (row n's four bytes of K block b at
 *   (b, 4n)), the matrix being rows firstRow..firstRow+rows−1 of it: `fp4ReferenceWordsOnDevice` then
 *   makes them the reference words the kernels read (what `fp4GemmScaleWords` gives on the host).
 */
export type Mxfp4ScaleLayout =
  | { kind: "rows"; offset: number }
  | { kind: "gemm"; totalRows: number; firstRow: number };

/**
 * Queues the generation of matrix `spec` in MXFP4, what `generateMxfp4(seed, name, rows, cols, fanIn)`
 * makes on the CPU: the packed e2m1 codes (rows·cols/2 bytes, element 2j in the low nibble of byte j)
 * into `packed` (uint8) from byte `packedOffset` (a multiple of 16) on, and the UE8M0 scale bytes into
 * `scales` (uint8) in `layout`.
 */
export function generateMxfp4OnDevice(
  device: Device,
  seed: number,
  spec: MatrixSpec,
  packed: DeviceTensor,
  packedOffset: number,
  scales: DeviceTensor,
  layout: Mxfp4ScaleLayout,
  stream: Stream | null,
): void {
  checkSeed(seed);
  const { name, rows, cols, fanIn } = spec;
  checkMatrixShape(name, rows, cols);
  if (!Number.isInteger(packedOffset) || packedOffset % 16 !== 0) {
    throw new RangeError(`${name}: packedOffset ${packedOffset} must be a multiple of 16 bytes`);
  }
  checkTensor(`${name} codes`, packed, "uint8", (rows * cols) / 2, packedOffset, device);
  const kBlocks = cols / QUANT_BLOCK;
  let firstWord: number;
  let kbStride: number;
  let rowStride: number;
  if (layout.kind === "rows") {
    if (!Number.isInteger(layout.offset) || layout.offset % 4 !== 0) {
      throw new RangeError(`${name}: scale offset ${layout.offset} must be a multiple of 4 bytes`);
    }
    checkTensor(`${name} scales`, scales, "uint8", (rows * cols) / 32, layout.offset, device);
    firstWord = layout.offset / 4;
    kbStride = 1;
    rowStride = kBlocks;
  } else if (layout.kind === "gemm") {
    const { totalRows, firstRow } = layout;
    if (
      !Number.isInteger(totalRows) ||
      !Number.isInteger(firstRow) ||
      firstRow < 0 ||
      firstRow + rows > totalRows
    ) {
      throw new RangeError(
        `${name}: rows ${firstRow}..${firstRow + rows - 1} do not fit the GEMM scales' ${totalRows} rows`,
      );
    }
    if (totalRows > 2 ** 30) throw new RangeError(`${name}: ${totalRows} GEMM rows exceed 2^30`);
    const want = kBlocks * totalRows * 4;
    if (scales.numel !== want) {
      throw new RangeError(
        `${name} scales: the GEMM layout [${kBlocks}, ${totalRows}·4] holds ${want} bytes, got ${describeTensor(scales.dtype, scales.shape)}`,
      );
    }
    checkTensor(`${name} scales`, scales, "uint8", want, 0, device);
    firstWord = firstRow;
    kbStride = totalRows;
    rowStride = 1;
  } else {
    throw new TypeError(`${name}: unknown scale layout ${JSON.stringify(layout)}`);
  }
  const k = kernelsFor(device);
  k.mxfp4Args
    .ptr(0, packed.ptr + BigInt(packedOffset))
    .ptr(1, scales.ptr + BigInt(4 * firstWord))
    .u32(2, tensorStream(seed, name))
    .u32(3, tensorStream(seed, generatorNames.blockExponent(name)))
    .u32(4, cols)
    .u32(5, kbStride)
    .u32(6, rowStride)
    .f32(7, matrixBaseScale(fanIn));
  // rows·cols/32 groups, a multiple of 512: every thread has one.
  k.mxfp4.launch((rows * cols) / 32 / MXFP4_THREADS, MXFP4_THREADS, 0, stream, k.mxfp4Args);
}

function streamBlocks(work: number): number {
  return Math.max(1, Math.min(MAX_STREAM_BLOCKS, Math.ceil(work / STREAM_THREADS)));
}

/**
 * Queues out[i] = fround(uniformSym(seed, key(name), i) · scale) for i < count, stored as bf16 (round
 * to nearest even) or fp32 by `out`'s dtype: `fillUniform` (plus `bf16FromF32Array`) on the device.
 */
export function generateUniformOnDevice(
  device: Device,
  seed: number,
  name: string,
  scale: number,
  out: DeviceTensor,
  count: number,
  stream: Stream | null,
  firstElement = 0,
): void {
  checkSeed(seed);
  if (!Number.isInteger(firstElement) || firstElement < 0 || firstElement + count > INDEX_LIMIT) {
    throw new RangeError(`${name}: elements ${firstElement}…+${count} exceed 2^32 hash indices`);
  }
  if (out.dtype !== "bf16" && out.dtype !== "fp32") {
    throw new Error(`${name}: output must be bf16 or fp32, got ${describeTensor(out.dtype, out.shape)}`);
  }
  if (!Number.isInteger(count) || count < 0 || count > INDEX_LIMIT - 1) {
    throw new RangeError(`${name}: count ${count} must be an integer in [0, 2^32)`);
  }
  checkTensor(name, out, out.dtype, count, 0, device);
  if (count === 0) return;
  const k = kernelsFor(device);
  k.uniformArgs
    .ptr(0, out.ptr)
    .u32(1, count)
    // Element i hashes stream + i · golden (mod 2^32): starting the stream firstElement steps on
    // makes out[i] the tensor's element firstElement + i.
    .u32(2, (tensorStream(seed, name) + Math.imul(firstElement, WEYL_STEP)) >>> 0)
    .f32(3, Math.fround(scale))
    .i32(4, out.dtype === "bf16" ? 1 : 0);
  k.uniform.launch(streamBlocks(count), STREAM_THREADS, 0, stream, k.uniformArgs);
}

/** The gate weight bf16 [E, H] of `generateGate` into `weight`. */
export function generateGateWeightOnDevice(
  device: Device,
  seed: number,
  experts: number,
  hidden: number,
  weight: DeviceTensor,
  stream: Stream | null,
  firstExpert = 0,
): void {
  if (weight.dtype !== "bf16") throw new Error(`gate weight must be bf16, got ${weight.dtype}`);
  const scale = gateWeightScale(hidden);
  const name = generatorNames.gateWeight;
  generateUniformOnDevice(device, seed, name, scale, weight, experts * hidden, stream, firstExpert * hidden);
}

/** The gate correction bias fp32 [E] of `generateGate` into `bias`. */
export function generateGateBiasOnDevice(
  device: Device,
  seed: number,
  experts: number,
  bias: DeviceTensor,
  stream: Stream | null,
  firstExpert = 0,
): void {
  if (bias.dtype !== "fp32") throw new Error(`gate bias must be fp32, got ${bias.dtype}`);
  const name = generatorNames.gateBias;
  generateUniformOnDevice(device, seed, name, GATE_BIAS_SCALE, bias, experts, stream, firstExpert);
}

/**
 * Queues `generateActivations(seed, tokens, hidden)` into out (bf16, at least tokens·hidden elements,
 * written from element 0). tokens·hidden must be below 2^32 (the CPU allows exactly 2^32, 16 GiB of
 * bf16, which no test needs).
 */
export function generateActivationsInto(
  device: Device,
  seed: number,
  tokens: number,
  hidden: number,
  out: DeviceTensor,
  stream: Stream | null,
): void {
  checkSeed(seed);
  if (!Number.isInteger(tokens) || tokens < 0)
    throw new RangeError(`tokens must be a non-negative integer, got ${tokens}`);
  if (!Number.isInteger(hidden) || hidden <= 0 || hidden % QUANT_BLOCK !== 0) {
    throw new RangeError(`hidden must be a positive multiple of ${QUANT_BLOCK}, got ${hidden}`);
  }
  if (tokens * hidden >= INDEX_LIMIT)
    throw new RangeError(`tokens·hidden = ${tokens * hidden} must be below 2^32`);
  checkTensor("activations", out, "bf16", tokens * hidden, 0, device);
  if (tokens === 0) return;
  const k = kernelsFor(device);
  k.activationArgs
    .ptr(0, out.ptr)
    .u32(1, tokens)
    .u32(2, hidden)
    .u32(3, tensorStream(seed, generatorNames.input))
    .u32(4, tensorStream(seed, generatorNames.inputTokenScale))
    .f32(5, ACTIVATION_BASE);
  const chunks = (tokens * hidden) / ACTIVATIONS_PER_THREAD;
  k.activations.launch(streamBlocks(chunks), STREAM_THREADS, 0, stream, k.activationArgs);
}
