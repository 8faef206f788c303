/**
 * The figures of the target GPU (H200, sm_90a) that plans, floors and benchmarks assume when they do not
 * measure them. One place, so the tile cost model, the layer floor and the CLI's floor lines agree.
 * No imports: pure constants, usable on a machine without CUDA.
 */

/** Streaming multiprocessors of an H200: the persistent grids' default size. */
export const H200_SMS = 132;

/** Dense FP8 tensor-core rate of an H200 (FLOP/s). */
export const FP8_PEAK_FLOPS = 1.5e15;

/**
 * Read-stream bandwidth of an H200 (bytes/s): 4.34 TB/s measured by torch (`probe_read` measures ours).
 * A GEMM's bytes are nearly all weight and activation reads, so floors send all bytes at this rate.
 */
export const READ_BYTES_PER_S = 4.3e12;

/** Bandwidth one SM can draw from memory with its TMA pipeline (bytes/s; a guess that caps small grids). */
export const SM_READ_BYTES_PER_S = 1.2e11;

/** Dynamic shared memory a block may opt into on sm_90 (227 KB). */
export const SM90_SHARED_OPTIN_BYTES = 232_448;
