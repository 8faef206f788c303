/**
 * The second process of test/gpu/symmetric.test.ts's two-process run: joins the group as rank
 * $SYM_RANK of $SYM_RANKS at $SYM_SOCKET on device 0, pushes its region into every rank's buffer,
 * waits for the others, checks every buffer, and exits 0, or 1 with the problems on stderr.
 */
import { openDevice } from "../../src/cuda/index.js";
import { SymmetricHeap } from "../../src/parallel/symmetric.js";
import { checkAllBuffers, pushFrom } from "./symmetric.js";

const env = (name: string): number => {
  const v = Number(process.env[name]);
  if (!Number.isSafeInteger(v)) throw new Error(`${name} is not set to an integer`);
  return v;
};

/** One rank's part of the two-process protocol; the parent runs the same with its own rank. */
export async function runRank(options: {
  rank: number;
  ranks: number;
  words: number;
  seed: number;
  socketPath: string;
}): Promise<string[]> {
  const { rank, ranks, words, seed, socketPath } = options;
  const device = openDevice(0);
  const heap = await SymmetricHeap.join({
    device,
    rank,
    ranks,
    bytes: (ranks * words + 1) * 4,
    socketPath,
    timeoutMs: 120_000,
  });
  try {
    heap.zero();
    device.synchronize();
    await heap.barrier(); // every buffer zeroed before anyone pushes
    const table = heap.addressTableOn(device);
    try {
      pushFrom(device, table, rank, ranks, words, seed);
      device.synchronize();
      await heap.barrier(); // every rank's pushes done
      const problems = checkAllBuffers(heap, device, table, words, seed).map((p) => `rank ${rank} sees ${p}`);
      await heap.barrier(); // nobody tears down while another still reads
      return problems;
    } finally {
      table.dispose();
    }
  } finally {
    heap.dispose();
  }
}

if (process.env.SYM_SOCKET) {
  runRank({
    rank: env("SYM_RANK"),
    ranks: env("SYM_RANKS"),
    words: env("SYM_WORDS"),
    seed: env("SYM_SEED"),
    socketPath: process.env.SYM_SOCKET,
  }).then(
    (problems) => {
      for (const p of problems) console.error(p);
      process.exitCode = problems.length === 0 ? 0 : 1;
    },
    (e: unknown) => {
      console.error((e as Error).stack ?? e);
      process.exitCode = 1;
    },
  );
}
