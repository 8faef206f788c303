/**
 * The symmetric heap (src/parallel/symmetric.ts) against the CPU stand-in for libcuda
 * (test/fixtures/cuda/mock_libcuda.c, four mock devices), whose VMM calls map memfds for real and log
 * every call: the call sequence of each mode (create, reserve, map, access for every device), teardown
 * in order also after a failure at any step, the checks before anything is allocated, process groups
 * (descriptors exported, passed and imported; disagreements, unreachable peers, timeouts), and the GPU
 * test file end to end (two processes included). Skipped without a C compiler / CUDA headers.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, test } from "node:test";
import koffi from "koffi";
import { CudaError, type Device, openDevice, packageRoot } from "../../src/cuda/index.js";
import { compilerAvailable } from "../../src/cuda/jit.js";
import { fdPassingProblem } from "../../src/parallel/fd-socket.js";
import { SymmetricHeap, SymmetricHeapError } from "../../src/parallel/symmetric.js";
import { buildMockLibcuda, type MockBuild } from "../cuda/mock-cuda.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("symmetric heap on the mock driver");
const MIB2 = 2 * 1024 * 1024; // the mock's granularity

let mock: MockBuild = { ok: false, reason: "not built" };
try {
  mock = buildMockLibcuda();
} catch (e) {
  mock = { ok: false, reason: (e as Error).message };
}
const skip = mock.ok ? false : mock.reason;
after(() => {
  if (mock.ok) fs.rmSync(mock.dir, { recursive: true, force: true });
});

interface MockVmm {
  trace(): string[];
  reset(): void;
  live(): { handles: number; reservations: number; mappings: number };
  fail(call: string, nth: number, code: number): void;
  support(dev: number, vmm: boolean, posixFd: boolean): void;
  peer(a: number, b: number, can: boolean): void;
}

function bindMock(library: string): MockVmm {
  const lib = koffi.load(library);
  const trace = lib.func("size_t mock_vmm_trace(void *out, size_t cap)");
  const reset = lib.func("void mock_vmm_trace_reset()");
  const live = lib.func("void mock_vmm_live(void *out)");
  const fail = lib.func("void mock_vmm_fail(const char *name, int nth, int code)");
  const support = lib.func("void mock_set_device_support(int dev, int vmm, int posix)");
  const peer = lib.func("void mock_set_peer_access(int a, int b, int can)");
  return {
    trace() {
      const out = Buffer.alloc(1 << 16);
      trace(out, out.length);
      const text = out.toString("utf8", 0, out.indexOf(0));
      return text.split("\n").filter((l) => l.length > 0);
    },
    reset: () => reset(),
    live() {
      const out = new BigInt64Array(3);
      live(out);
      return { handles: Number(out[0]), reservations: Number(out[1]), mappings: Number(out[2]) };
    },
    fail: (call, nth, code) => fail(call, nth, code),
    support: (dev, vmm, posixFd) => support(dev, vmm ? 1 : 0, posixFd ? 1 : 0),
    peer: (a, b, can) => peer(a, b, can ? 1 : 0),
  };
}

/**
 * The trace with addresses as slots of the reservation ("slot2") and handles numbered by first
 * appearance ("h0", "h1", ...), so expected sequences read as the heap's steps. Several reservations
 * (process groups in one process) are "r0.slot1", "r1.slot0" by the order of their reserve lines;
 * `known` gives the bases of a trace without them (a teardown).
 */
function normalize(lines: string[], stride: number, known: bigint[] = []): string[] {
  const bases = [...known];
  const handles = new Map<string, number>();
  for (const l of lines) {
    const m = /^reserve 0x([0-9a-f]+)/.exec(l);
    if (m) bases.push(BigInt(`0x${m[1]}`));
  }
  return lines.map((l) =>
    l
      .replace(/0x([0-9a-f]+)/g, (_, hex: string) => {
        const a = BigInt(`0x${hex}`);
        const i = bases.findLastIndex((b) => a >= b);
        const slot = `slot${(a - bases[i]!) / BigInt(stride)}`;
        return bases.length > 1 ? `r${i}.${slot}` : slot;
      })
      .replace(/\bh(\d+)\b/g, (_, id: string) => {
        if (!handles.has(id)) handles.set(id, handles.size);
        return `h${handles.get(id)}`;
      }),
  );
}

/** The construction trace of `ranks` slots, rank r created on devices[r], access for `access`. */
function expectedBuild(devices: number[], access: number[]): string[] {
  const lines = [`reserve slot0 size=${devices.length * MIB2}`];
  devices.forEach((d, r) => {
    lines.push(`create h${r} dev=${d} size=${MIB2} export=0`);
    lines.push(`map slot${r} size=${MIB2} h${r}`);
    lines.push(`access slot${r} size=${MIB2} ${access.map((a) => `dev${a}=3`).join(" ")}`);
  });
  return lines;
}

/** Teardown after what `built` shows: unmap each mapped slot, release each handle, free the range. */
function expectedTeardown(built: string[]): string[] {
  const unmaps = built
    .filter((l) => l.startsWith("map "))
    .map((l) => l.replace(/^map (\S+ size=\d+) h\d+$/, "unmap $1"));
  const releases = built
    .filter((l) => /^(create|import) h\d+/.test(l))
    .map((l) => `release ${l.split(" ")[1]}`);
  const free = built.filter((l) => l.startsWith("reserve ")).map((l) => l.replace(/^reserve/, "free"));
  return [...unmaps, ...releases, ...free];
}

describe("symmetric heap against the mock libcuda", { skip }, () => {
  let vmm: MockVmm;
  let dev: Device[];
  before(() => {
    if (!mock.ok) return;
    process.env.MEGAMOE_LIBCUDA = mock.library;
    process.env.MOCK_CUDA_DEVICES = "4";
    vmm = bindMock(mock.library);
    dev = [0, 1, 2, 3].map((i) => openDevice(i));
  });

  const baseline = () => vmm.live();

  test("one rank per device: create, map and access for every device per slot; teardown in order", () => {
    const start = baseline();
    vmm.reset();
    const heap = SymmetricHeap.create(dev, 1000);
    assert.equal(heap.stride, MIB2);
    assert.equal(heap.granularity, MIB2);
    assert.equal(heap.rank, undefined);
    const built = normalize(vmm.trace(), heap.stride);
    assert.deepEqual(built, expectedBuild([0, 1, 2, 3], [0, 1, 2, 3]));
    assert.deepEqual(vmm.live(), {
      handles: start.handles + 4,
      reservations: start.reservations + 1,
      mappings: start.mappings + 4,
    });
    // each slot is its own memory: distinct data in each, read back through the addresses
    const table = heap.addressTable();
    for (let r = 0; r < 4; r++) {
      assert.equal(table[r], heap.base + BigInt(r * MIB2));
      assert.equal(heap.deviceOf(r), dev[r]);
      dev[r]!.copyHtoD(heap.address(r), new Uint32Array(new ArrayBuffer(64)).fill(0x1000 + r + seed));
    }
    for (let r = 0; r < 4; r++) {
      const back = new Uint32Array(new ArrayBuffer(64));
      dev[0]!.copyDtoH(back, heap.address(r));
      assert.ok(
        back.every((v) => v === (0x1000 + r + seed) >>> 0),
        `rank ${r}'s data through the mapping`,
      );
    }
    heap.zero();
    for (let r = 0; r < 4; r++) {
      const back = new Uint32Array(new ArrayBuffer(MIB2));
      dev[r]!.copyDtoH(back, heap.address(r));
      assert.ok(
        back.every((v) => v === 0),
        `rank ${r} zeroed`,
      );
    }
    const base = heap.base;
    vmm.reset();
    heap.dispose();
    assert.deepEqual(normalize(vmm.trace(), MIB2, [base]), expectedTeardown(built));
    assert.deepEqual(vmm.live(), start);
    heap.dispose(); // idempotent
    assert.throws(() => heap.base, /used after dispose/);
  });

  test("virtual ranks: R allocations on one device, access for that device only; mixed layouts", () => {
    const start = baseline();
    vmm.reset();
    const heap = SymmetricHeap.virtualRanks(dev[2]!, 3, 3 * MIB2 + 1);
    assert.equal(heap.stride, 4 * MIB2, "rounded up to the granularity");
    const lines = normalize(vmm.trace(), heap.stride);
    assert.equal(lines[0], `reserve slot0 size=${12 * MIB2}`);
    assert.deepEqual(
      lines.filter((l) => l.startsWith("access")),
      [0, 1, 2].map((r) => `access slot${r} size=${4 * MIB2} dev2=3`),
    );
    assert.deepEqual(heap.localRanks, [0, 1, 2]);
    heap.dispose();
    vmm.reset();
    const mixed = SymmetricHeap.create([dev[0]!, dev[0]!, dev[1]!], 10);
    assert.deepEqual(normalize(vmm.trace(), MIB2), expectedBuild([0, 0, 1], [0, 1]));
    mixed.dispose();
    assert.deepEqual(vmm.live(), start);
  });

  for (const [call, nth, rank] of [
    ["cuMemGetAllocationGranularity", 1, undefined],
    ["cuMemAddressReserve", 1, undefined],
    ["cuMemCreate", 1, 0],
    ["cuMemCreate", 3, 2],
    ["cuMemMap", 2, 1],
    ["cuMemSetAccess", 4, 3],
  ] as const) {
    test(`${call} failing (call ${nth}) undoes what was built, in order`, () => {
      const start = baseline();
      vmm.reset();
      vmm.fail(call, nth, 2 /* CUDA_ERROR_OUT_OF_MEMORY */);
      assert.throws(
        () => SymmetricHeap.create(dev, 4096),
        (e: unknown) =>
          e instanceof CudaError &&
          e.call === call &&
          e.errorName === "CUDA_ERROR_OUT_OF_MEMORY" &&
          (rank === undefined || e.message.includes(`rank ${rank} on device ${rank}`)),
      );
      const lines = normalize(vmm.trace(), MIB2);
      const failedAt = lines.findIndex((l) => l.includes("injected failure"));
      assert.ok(failedAt >= 0, lines.join("\n"));
      assert.deepEqual(lines.slice(failedAt + 1), expectedTeardown(lines.slice(0, failedAt)));
      assert.deepEqual(vmm.live(), start, "nothing left allocated or mapped");
    });
  }

  test("a failing teardown step does not stop the others, and every failure is reported", () => {
    const heap = SymmetricHeap.virtualRanks(dev[0]!, 3, 100);
    const base = heap.base;
    const start = baseline();
    vmm.reset();
    vmm.fail("cuMemUnmap", 2, 1 /* CUDA_ERROR_INVALID_VALUE */);
    assert.throws(
      () => heap.dispose(),
      (e: unknown) =>
        e instanceof AggregateError &&
        /cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE.*\[rank 1\]/.test(e.message) &&
        /cuMemAddressFree failed/.test(e.message),
    );
    const lines = normalize(vmm.trace(), MIB2, [base]);
    assert.deepEqual(
      lines.filter((l) => l.startsWith("unmap") || l.startsWith("release")),
      ["unmap slot0 size=2097152", "unmap slot2 size=2097152", "release h0", "release h1", "release h2"],
    );
    // the mock refuses to free a range with a mapping left (rank 1's): one mapping, the range stay
    assert.deepEqual(vmm.live(), { ...start, handles: start.handles - 3, mappings: start.mappings - 2 });
    assert.equal(heap.isDisposed, true);
  });

  test("bad sizes and rank counts, missing VMM support and unreachable peers fail before allocating", async () => {
    const start = baseline();
    vmm.reset();
    assert.throws(
      () => SymmetricHeap.create([], 16),
      /number of ranks \(devices\.length\) must be an integer ≥ 1 \(got 0\)/,
    );
    assert.throws(
      () => SymmetricHeap.virtualRanks(dev[0]!, 0, 16),
      /number of ranks must be an integer ≥ 1 \(got 0\)/,
    );
    assert.throws(() => SymmetricHeap.virtualRanks(dev[0]!, 2.5, 16), /got 2\.5/);
    for (const bytes of [0, -4, 1.5, Number.NaN, 2 ** 60])
      assert.throws(
        () => SymmetricHeap.virtualRanks(dev[0]!, 2, bytes),
        (e: unknown) =>
          e instanceof SymmetricHeapError && /bytes per rank must be an integer ≥ 1/.test(e.message),
        `bytes ${bytes}`,
      );
    vmm.support(2, false, true);
    try {
      assert.throws(
        () => SymmetricHeap.create([dev[0]!, dev[1]!, dev[2]!, dev[2]!], 16),
        /device 2 \(Mock H200 \(CPU\)\), holding ranks 2, 3, does not support CUDA virtual memory management/,
      );
    } finally {
      vmm.support(2, true, true);
    }
    vmm.peer(1, 3, false);
    try {
      assert.throws(
        () => SymmetricHeap.create(dev, 16),
        /device 1 \(Mock H200 \(CPU\)\) cannot access device 3 \(Mock H200 \(CPU\)\)'s memory \(cuDeviceCanAccessPeer is 0\): rank 1 could not reach the buffers of rank 3/,
      );
      SymmetricHeap.create([dev[0]!, dev[1]!, dev[2]!], 16).dispose(); // the pair not involved
    } finally {
      vmm.peer(1, 3, true);
    }
    vmm.support(1, true, false);
    try {
      await assert.rejects(
        SymmetricHeap.join({ device: dev[1]!, rank: 0, ranks: 2, bytes: 16, socketPath: "/tmp/unused.sock" }),
        /device 1 \(Mock H200 \(CPU\)\) cannot export allocations as POSIX file descriptors/,
      );
    } finally {
      vmm.support(1, true, true);
    }
    await assert.rejects(
      SymmetricHeap.join({ device: dev[0]!, rank: 2, ranks: 2, bytes: 16, socketPath: "/tmp/unused.sock" }),
      /rank must be an integer in \[0, 2\) \(got 2\)/,
    );
    // the one heap built (the three devices whose peers all reach each other) is the only VMM traffic
    const only = expectedBuild([0, 1, 2], [0, 1, 2]);
    assert.deepEqual(normalize(vmm.trace(), MIB2), [...only, ...expectedTeardown(only)]);
    assert.deepEqual(vmm.live(), start);
  });

  describe("process groups, here with every rank in this process", {
    skip: fdPassingProblem() ?? false,
  }, () => {
    let dir: string;
    before(() => {
      dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-sym-"));
    });
    after(() => fs.rmSync(dir, { recursive: true, force: true }));

    test("three ranks on three devices: export, pass, import; one memory seen from every rank", async () => {
      const start = baseline();
      vmm.reset();
      const socketPath = path.join(dir, "g3.sock");
      const heaps = await Promise.all(
        [0, 1, 2].map((rank) =>
          SymmetricHeap.join({ device: dev[rank]!, rank, ranks: 3, bytes: 5000, socketPath }),
        ),
      );
      assert.equal(fs.existsSync(socketPath), false, "the listener is gone once everyone joined");
      const lines = normalize(vmm.trace(), MIB2);
      assert.equal(lines.filter((l) => / export=1$/.test(l)).length, 3);
      assert.equal(lines.filter((l) => l.startsWith("export")).length, 3);
      assert.equal(lines.filter((l) => l.startsWith("import")).length, 6, "each rank imports the other two");
      heaps.forEach((h, rank) => {
        assert.equal(h.rank, rank);
        assert.deepEqual(h.localRanks, [rank]);
        assert.equal(h.deviceOf((rank + 1) % 3), undefined);
      });
      assert.equal(new Set(heaps.map((h) => h.base)).size, 3, "each joined heap is its own reservation");
      // each rank writes into the next rank's buffer through its own mapping...
      heaps.forEach((h, rank) => {
        const words = new Uint32Array(new ArrayBuffer(256)).fill(0xc0de00 + rank);
        dev[rank]!.copyHtoD(h.address((rank + 1) % 3) + 1024n, words);
      });
      await Promise.all(heaps.map((h) => h.barrier()));
      // ...and every rank sees every buffer the same
      for (const [rank, h] of heaps.entries())
        for (let p = 0; p < 3; p++) {
          const back = new Uint32Array(new ArrayBuffer(256));
          dev[rank]!.copyDtoH(back, h.address(p) + 1024n);
          const writer = (p + 2) % 3;
          assert.ok(
            back.every((v) => v === 0xc0de00 + writer),
            `rank ${rank} reading rank ${p}'s buffer`,
          );
        }
      for (const h of heaps) h.zero();
      const back = new Uint32Array(new ArrayBuffer(256));
      dev[0]!.copyDtoH(back, heaps[0]!.address(1) + 1024n);
      assert.ok(
        back.every((v) => v === 0),
        "rank 1's zero() shows in rank 0's mapping",
      );
      for (const h of heaps) h.dispose();
      assert.deepEqual(vmm.live(), start);
    });

    test("disagreeing sizes, a rank taken twice, an unreachable peer, a missing rank: every process fails", async () => {
      const start = baseline();
      const join = (
        rank: number,
        device: Device,
        bytes: number,
        socketPath: string,
        ranks = 2,
        timeoutMs = 5000,
      ) => SymmetricHeap.join({ device, rank, ranks, bytes, socketPath, timeoutMs });
      const settle = async (...ps: Promise<SymmetricHeap>[]) =>
        (await Promise.allSettled(ps)).map((r) =>
          r.status === "rejected" ? (r.reason as Error).message : "joined",
        );

      let s = path.join(dir, "sizes.sock");
      let [a, b] = await settle(join(0, dev[0]!, 5000, s), join(1, dev[0]!, 3 * MIB2, s));
      assert.match(
        a!,
        /rank 1 \(process \d+\) asked for 2 ranks × 6291456 bytes \(stride 6291456\); rank 0 for 2 × 5000 \(stride 2097152\)/,
      );
      assert.match(b!, /rank 0 stopped the group: rank 1 \(process \d+\) asked for/);

      s = path.join(dir, "twice.sock");
      const results = await settle(
        join(0, dev[0]!, 64, s, 3),
        join(1, dev[1]!, 64, s, 3),
        join(1, dev[2]!, 64, s, 3),
      );
      assert.match(results[0]!, /process \d+ claims rank 1, which is already taken by process \d+/);
      assert.ok(
        results.slice(1).every((m) => /rank 0 stopped the group: process \d+ claims rank 1/.test(m)),
        results.join("\n"),
      );

      vmm.peer(1, 0, false);
      try {
        s = path.join(dir, "peer.sock");
        [a, b] = await settle(join(0, dev[0]!, 64, s), join(1, dev[1]!, 64, s));
        assert.match(
          b!,
          /device 1 \(Mock H200 \(CPU\)\) \(rank 1\) cannot access the memory of rank 0 \(process \d+, GPU at PCI 0000:18:00\) \(cuDeviceCanAccessPeer is 0\)/,
        );
        assert.match(a!, /rank 1 failed: device 1 .* cannot access the memory of rank 0/);
      } finally {
        vmm.peer(1, 0, true);
      }

      [a] = await settle(join(0, dev[0]!, 64, path.join(dir, "alone.sock"), 3, 150));
      assert.match(a!, /rank 0 at .*alone\.sock: ranks 1, 2 did not join: timed out waiting for connections/);
      [b] = await settle(join(1, dev[0]!, 64, path.join(dir, "nobody.sock"), 2, 100));
      assert.match(b!, /timed out after 100 ms connecting to .*nobody\.sock/);
      assert.deepEqual(vmm.live(), start, "every failed join released what it made");
    });
  });
});

test("the symmetric GPU test file passes against the mock, two processes included (JIT through nvcc)", {
  skip: skip || (!compilerAvailable("nvcc") && "nvcc not found") || (fdPassingProblem() ?? false),
}, () => {
  if (!mock.ok) return;
  const cache = fs.mkdtempSync(path.join(mock.dir, "cache-"));
  const { NODE_TEST_CONTEXT: _, ...parentEnv } = process.env;
  const r = spawnSync(
    process.execPath,
    [
      "--import",
      "tsx",
      "--test",
      "--test-reporter=spec",
      path.join(packageRoot(), "test", "gpu", "symmetric.test.ts"),
    ],
    {
      encoding: "utf8",
      env: {
        ...parentEnv,
        MEGAMOE_LIBCUDA: mock.library,
        MOCK_CUDA_DEVICES: "1",
        MEGAMOE_REQUIRE_GPU: "1",
        MEGAMOE_CACHE_DIR: cache,
        MEGAMOE_JIT_COMPILER: "nvcc",
        MEGAMOE_SEED: String(seed),
      },
    },
  );
  assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
  assert.match(r.stdout, /pass 4/);
  assert.match(r.stdout, /fail 0/);
});
