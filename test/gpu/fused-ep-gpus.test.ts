/**
 * In-kernel expert parallelism across GPUs (issue 25), skipped below two GPUs (test/gpu/fused-ep.test.ts
 * runs the same protocol as virtual ranks on one):
 * - one process, one rank per GPU (R = 2, 4, 8 up to the GPU count): every rank's output bit for bit the
 *   virtual-rank run's on GPU 0 and the host-planned layer's, over the routing edge cases, shared expert
 *   on and off, FP8 and FP4 experts;
 * - one process per GPU (FusedExpertParallel.join; test/helpers/fused-ep-peer.ts): each process's output
 *   the virtual-rank run's;
 * - a rank's process killed once the group has joined: every other rank's forward fails within seconds
 *   naming it, and once those processes have exited every GPU's free memory is what it was before.
 */
import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { type Device, openDevice } from "../../src/cuda/index.js";
import { ExpertParallelMoE } from "../../src/parallel/expert-parallel.js";
import { FusedExpertParallel } from "../../src/parallel/fused-expert-parallel.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import { epRoutingCases } from "../helpers/ep-protocol.js";
import { EP_GPU_CONFIG as config, differing, EP_GPU_MAX_TOKENS as MAX_TOKENS } from "../helpers/fused-ep.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("fused expert parallel across GPUs");
const gpus = availability.ok ? availability.deviceCount : 0;
const skip = gpus < 2 ? `needs two or more GPUs (this machine has ${gpus})` : false;
const CASES = epRoutingCases(config, MAX_TOKENS);
const CASE = "random routing, uneven tokens per rank, a rank without tokens";

/** The rank processes: each joins as its rank on its GPU (fused-ep-peer.ts); lines of stdout kept. */
function spawnRanks(ranks: number, env: (rank: number) => Record<string, string>) {
  const here = fileURLToPath(import.meta.url);
  const peer = path.join(path.dirname(here), "..", "helpers", `fused-ep-peer${path.extname(here)}`);
  const loader = path.extname(here) === ".ts" ? ["--import", "tsx"] : [];
  const { NODE_TEST_CONTEXT: _, ...parentEnv } = process.env;
  return Array.from({ length: ranks }, (_, rank) => {
    const child = spawn(process.execPath, [...loader, peer], {
      env: {
        ...parentEnv,
        FEP_RANK: String(rank),
        FEP_RANKS: String(ranks),
        FEP_SEED: String(seed),
        ...env(rank),
      },
      stdio: ["ignore", "pipe", "pipe"],
    });
    const p = { child, stdout: "", stderr: "", exit: undefined as Promise<number | null> | undefined };
    child.stdout!.setEncoding("utf8").on("data", (d: string) => {
      p.stdout += d;
    });
    child.stderr!.setEncoding("utf8").on("data", (d: string) => {
      p.stderr += d;
    });
    p.exit = new Promise((resolve) => child.on("exit", (code) => resolve(code)));
    return p;
  });
}

const waitFor = async (what: string, ok: () => boolean, seconds: number) => {
  const until = performance.now() + seconds * 1000;
  while (!ok()) {
    if (performance.now() > until) throw new Error(`no ${what} within ${seconds} s`);
    await new Promise((r) => setTimeout(r, 20));
  }
};

const kill = (children: { child: ChildProcess }[]) => {
  for (const { child } of children) if (child.exitCode === null) child.kill("SIGKILL");
};

describeGpu("in-kernel expert parallelism across GPUs", () => {
  for (const ranks of [2, 4, 8]) {
    test(`${ranks} ranks, one per GPU in one process: the virtual ranks' and the host plan's outputs`, {
      skip: skip || (ranks > gpus ? `needs ${ranks} GPUs (this machine has ${gpus})` : false),
    }, () => {
      for (const expertFormat of ["fp8", "fp4"] as const) {
        const weights = new GeneratedWeights({ ...config, expertFormat }, seed + ranks);
        const devices: Device[] = Array.from({ length: ranks }, (_, r) => openDevice(r));
        const virtual = new FusedExpertParallel(weights, {
          ranks,
          devices: testDevice(),
          maxTokens: MAX_TOKENS,
        });
        const real = new FusedExpertParallel(weights, { ranks, devices, maxTokens: MAX_TOKENS });
        const host = new ExpertParallelMoE(weights, { ranks, backend: "cuda", devices, pipeline: "fused" });
        try {
          for (const [name, make] of Object.entries(CASES)) {
            const inputs = make(ranks, seed + 31 * ranks);
            for (const shared of [true, false]) {
              const label = `${expertFormat}, ${name}, shared ${shared}`;
              const want = virtual.forward(inputs, { shared }).out;
              const got = real.forward(inputs, { shared }).out;
              const planned = host.forward(inputs, { shared }).out;
              got.forEach((o, s) => {
                assert.equal(differing(o, want[s]!), 0, `${label}: rank ${s} vs the virtual ranks`);
                assert.equal(differing(o, planned[s]!), 0, `${label}: rank ${s} vs ExpertParallelMoE`);
              });
            }
          }
        } finally {
          real.dispose();
          virtual.dispose();
          host.dispose();
        }
      }
    });
  }

  test("one process per GPU (join): each process's output the virtual ranks'", { skip }, async () => {
    const ranks = Math.min(gpus, 4);
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fep-"));
    const procs = spawnRanks(ranks, (rank) => ({
      FEP_SOCKET: path.join(dir, "group.sock"),
      FEP_CASE: CASE,
      FEP_OUT: path.join(dir, `out-${rank}.bin`),
    }));
    try {
      const codes = await Promise.all(procs.map((p) => p.exit));
      for (const [r, code] of codes.entries()) {
        assert.equal(code, 0, `rank ${r} exited ${code}: ${procs[r]!.stderr}`);
      }
      const weights = new GeneratedWeights(config, seed);
      const virtual = new FusedExpertParallel(weights, {
        ranks,
        devices: testDevice(),
        maxTokens: MAX_TOKENS,
      });
      try {
        const want = virtual.forward(CASES[CASE]!(ranks, seed)).out;
        want.forEach((w, r) => {
          const file = fs.readFileSync(path.join(dir, `out-${r}.bin`));
          const got = new Uint16Array(file.buffer, file.byteOffset, file.byteLength / 2);
          assert.equal(differing(got, w), 0, `rank ${r}'s process vs the virtual ranks`);
        });
      } finally {
        virtual.dispose();
      }
    } finally {
      kill(procs);
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  test("a rank's process killed: the others fail within seconds naming it, and the memory comes back", {
    skip,
  }, async () => {
    const ranks = Math.min(gpus, 4);
    const victim = ranks - 1;
    const devices = Array.from({ length: ranks }, (_, r) => openDevice(r));
    const freeBefore = devices.map((d) => d.memoryInfo().freeBytes);
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fep-"));
    const go = path.join(dir, "go");
    const procs = spawnRanks(ranks, (rank) => ({
      FEP_SOCKET: path.join(dir, "group.sock"),
      FEP_CASE: CASE,
      FEP_GO: go,
      ...(rank === victim ? {} : { FEP_OUT: path.join(dir, `out-${rank}.bin`) }),
    }));
    try {
      await waitFor("join", () => procs.every((p) => p.stdout.includes("joined")), 120);
      procs[victim]!.child.kill("SIGKILL");
      await procs[victim]!.exit;
      const started = performance.now();
      fs.writeFileSync(go, "");
      const codes = await Promise.all(procs.filter((_, r) => r !== victim).map((p) => p.exit));
      const seconds = (performance.now() - started) / 1000;
      assert.ok(seconds < 20, `the survivors took ${seconds.toFixed(1)} s`);
      // The victim is the last rank: survivor i is rank i.
      codes.forEach((code, i) => {
        const p = procs[i]!;
        assert.equal(code, 3, `rank ${i} exited ${code} (3: a failed forward): ${p.stdout} ${p.stderr}`);
        const line = p.stdout.split("\n").find((l) => l.startsWith("{"));
        const report = JSON.parse(line ?? "{}") as { blamed?: [number, number[]][] };
        const mine = report.blamed?.find(([r]) => r === i)?.[1];
        assert.deepEqual(mine, [victim], `rank ${i} blames rank ${victim}: ${line}`);
      });
      // The survivors' contexts ended with their processes: every GPU's memory is back (a 64 MiB margin).
      await waitFor(
        "memory back",
        () => devices.every((d, r) => d.memoryInfo().freeBytes >= freeBefore[r]! - 64 * 2 ** 20),
        30,
      );
    } finally {
      kill(procs);
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
