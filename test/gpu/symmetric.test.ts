/**
 * The symmetric heap on a GPU (src/parallel/symmetric.ts): R = 2, 4, 8 virtual ranks on one device,
 * each its own VMM allocation mapped side by side; every rank's kernel stores its region into every
 * rank's buffer and adds to every rank's counter through the address table, then every buffer is read
 * back through the heap's addresses, by copies and by a kernel's loads. Then two processes on the same
 * GPU, one rank each, sharing their buffers through exported file descriptors passed over a Unix
 * socket, run the same exchange. Skipped without a GPU (fails instead with MEGAMOE_REQUIRE_GPU=1).
 *
 * On the GPU host: `MEGAMOE_REQUIRE_GPU=1 node --test dist-test/test/gpu/symmetric.test.js`.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { SymmetricHeap } from "../../src/parallel/symmetric.js";
import { describeGpu, testDevice } from "../helpers/gpu.js";
import { testSeed } from "../helpers/random.js";
import { checkAllBuffers, pushFrom } from "../helpers/symmetric.js";
import { runRank } from "../helpers/symmetric-peer.js";

const seed = testSeed("symmetric heap on a GPU");

describeGpu("symmetric heap on a GPU", () => {
  for (const ranks of [2, 4, 8]) {
    test(`${ranks} virtual ranks on one device: pushes, atomics and loads through the mapped addresses`, () => {
      const device = testDevice();
      const words = 4099 + ranks; // odd sizes: the buffer is not a multiple of anything
      const bytes = (ranks * words + 1) * 4;
      const live = device.allocatedBytes;
      const heap = SymmetricHeap.virtualRanks(device, ranks, bytes);
      try {
        assert.equal(heap.ranks, ranks);
        assert.equal(heap.stride % heap.granularity, 0);
        assert.ok(heap.stride >= bytes && heap.stride - bytes < heap.granularity, `stride ${heap.stride}`);
        assert.equal(
          heap.base % BigInt(heap.granularity),
          0n,
          "the reservation is aligned to the granularity",
        );
        const table = heap.addressTable();
        for (let r = 0; r < ranks; r++)
          assert.equal(table[r], heap.base + BigInt(r * heap.stride), `rank ${r}'s address`);
        assert.deepEqual(heap.localRanks, [...Array(ranks).keys()]);
        // poison, then zero: zero() must clear every rank's whole slot
        for (let r = 0; r < ranks; r++) device.memsetD8(heap.address(r), 0xab, heap.stride);
        heap.zero();
        const deviceTable = heap.addressTableOn(device);
        try {
          for (let s = 0; s < ranks; s++) pushFrom(device, deviceTable, s, ranks, words, seed + ranks);
          device.synchronize();
          const problems = checkAllBuffers(heap, device, deviceTable, words, seed + ranks);
          assert.deepEqual(problems, []);
        } finally {
          deviceTable.dispose();
        }
      } finally {
        heap.dispose();
      }
      assert.equal(heap.isDisposed, true);
      assert.throws(() => heap.address(0), /used after dispose/);
      assert.equal(device.allocatedBytes, live, "the heap's memory is not the cuMemAlloc allocator's");
    });
  }

  test("two processes on one GPU share their buffers through exported descriptors", async () => {
    const here = fileURLToPath(import.meta.url);
    const peer = path.join(path.dirname(here), "..", "helpers", `symmetric-peer${path.extname(here)}`);
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-sym-"));
    const socketPath = path.join(dir, "group.sock");
    const words = 5003;
    const { NODE_TEST_CONTEXT: _, ...parentEnv } = process.env;
    const loader = path.extname(here) === ".ts" ? ["--import", "tsx"] : [];
    const child = spawn(process.execPath, [...loader, peer], {
      env: {
        ...parentEnv,
        SYM_SOCKET: socketPath,
        SYM_RANK: "1",
        SYM_RANKS: "2",
        SYM_WORDS: String(words),
        SYM_SEED: String(seed),
      },
      stdio: ["ignore", "inherit", "pipe"],
    });
    let stderr = "";
    child.stderr.on("data", (chunk) => {
      stderr += chunk;
    });
    const exited = new Promise<number | null>((resolve) => child.on("exit", resolve));
    try {
      const problems = await runRank({ rank: 0, ranks: 2, words, seed, socketPath });
      assert.deepEqual(problems, []);
      assert.equal(await exited, 0, `the rank-1 process failed:\n${stderr}`);
    } finally {
      child.kill();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
