/**
 * What the symmetric-heap GPU test and its peer process share: the fixture kernels
 * (test/fixtures/cuda/symmetric_kernels.cu), their pattern on the host, and the checks of every rank's
 * buffer through the heap's addresses, by copies and by the pull kernel.
 */
import path from "node:path";
import {
  type CompiledKernel,
  compileKernel,
  type Device,
  DeviceTensor,
  KernelArgs,
  loadKernel,
  packageRoot,
} from "../../src/cuda/index.js";
import type { SymmetricHeap } from "../../src/parallel/symmetric.js";

/** The kernels' pattern: the word rank `src` writes at index i of its region in rank `dst`'s buffer. */
export function symmetricPattern(seed: number, src: number, dst: number, i: number): number {
  let h = (seed ^ Math.imul(src, 0x9e3779b1) ^ Math.imul(dst, 0x85ebca77) ^ Math.imul(i, 0xc2b2ae3d)) >>> 0;
  h = (h ^ (h >>> 15)) >>> 0;
  h = Math.imul(h, 0x2c1b3c6d) >>> 0;
  return (h ^ (h >>> 12)) >>> 0;
}

let compiled: CompiledKernel | undefined;
function kernels(): CompiledKernel {
  compiled ??= compileKernel({
    source: path.join(packageRoot(), "test", "fixtures", "cuda", "symmetric_kernels.cu"),
  });
  return compiled;
}

/** Rank `rank` stores its region into every buffer of the table and adds rank + 1 to every counter. */
export function pushFrom(
  device: Device,
  table: DeviceTensor,
  rank: number,
  ranks: number,
  words: number,
  seed: number,
): void {
  const args = new KernelArgs(5).ptr(0, table.ptr).i32(1, rank).i32(2, ranks).i32(3, words).u32(4, seed);
  loadKernel(device, kernels(), "symmetric_push").launch(8, 256, 0, null, args);
}

/** The words of buffer `p` once every rank has pushed: regions 0 … ranks − 1, then the counter. */
export function expectedBuffer(ranks: number, words: number, seed: number, p: number): Uint32Array {
  const want = new Uint32Array(ranks * words + 1);
  for (let s = 0; s < ranks; s++)
    for (let i = 0; i < words; i++) want[s * words + i] = symmetricPattern(seed, s, p, i);
  want[ranks * words] = (ranks * (ranks + 1)) / 2;
  return want;
}

function firstDifference(what: string, got: Uint32Array, want: Uint32Array): string | undefined {
  let count = 0;
  let first = -1;
  for (let i = 0; i < want.length; i++)
    if (got[i] !== want[i]) {
      if (first < 0) first = i;
      count++;
    }
  if (count === 0) return undefined;
  const hex = (v: number | undefined) => `0x${(v ?? 0).toString(16)}`;
  return `${what}: ${count} of ${want.length} words differ, first at ${first} (got ${hex(got[first])}, want ${hex(want[first])})`;
}

/**
 * Every rank's buffer after every rank pushed, read (1) by copies from the heap's address of each rank
 * and (2) by the pull kernel through the device table; plus the last word of each slot (beyond what was
 * written, so still zero). Returns the problems found, empty when all is well.
 */
export function checkAllBuffers(
  heap: SymmetricHeap,
  device: Device,
  table: DeviceTensor,
  words: number,
  seed: number,
): string[] {
  const { ranks } = heap;
  const n = ranks * words + 1;
  const problems: string[] = [];
  for (let p = 0; p < ranks; p++) {
    const got = new Uint32Array(n);
    device.copyDtoH(got, heap.address(p), n * 4);
    const d = firstDifference(`rank ${p}'s buffer read by copy`, got, expectedBuffer(ranks, words, seed, p));
    if (d) problems.push(d);
    const tail = new Uint32Array(1);
    device.copyDtoH(tail, heap.address(p) + BigInt(heap.stride - 4), 4);
    if (tail[0] !== 0) problems.push(`rank ${p}'s last word is 0x${tail[0]!.toString(16)}, not zero`);
  }
  const out = DeviceTensor.empty(device, "int32", [ranks * n]);
  try {
    out.fill(0xee);
    const args = new KernelArgs(4).ptr(0, table.ptr).i32(1, ranks).i32(2, words).ptr(3, out.ptr);
    loadKernel(device, kernels(), "symmetric_pull").launch(8, 256, 0, null, args);
    device.synchronize();
    const pulled = new Uint32Array(out.toHost().buffer);
    for (let p = 0; p < ranks; p++) {
      const got = pulled.subarray(p * n, (p + 1) * n);
      const d = firstDifference(
        `rank ${p}'s buffer read by the pull kernel`,
        got,
        expectedBuffer(ranks, words, seed, p),
      );
      if (d) problems.push(d);
    }
  } finally {
    out.dispose();
  }
  return problems;
}
