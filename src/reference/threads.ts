/**
 * Worker threads for the CPU reference, driven synchronously: the calling thread posts tasks and blocks
 * in Atomics.wait until results arrive (receiveMessageOnPort), so `referenceMoE` stays a plain function.
 * The pool is made on first use, kept for the next call and ended after a few idle seconds; it never
 * keeps the process alive. What a task computes is worker.ts's business, not this file's.
 */
import os from "node:os";
import { MessageChannel, type MessagePort, receiveMessageOnPort, Worker } from "node:worker_threads";
import { NumericsError } from "../numerics/fp32.js";

/** A worker's answer to one task: its index and either a result or the error it threw. */
export interface TaskReply {
  task: number;
  result?: unknown;
  error?: { name: string; message: string };
}

interface PoolWorker {
  worker: Worker;
  port: MessagePort;
}

/** Shared words: [0] counts events (a reply, a worker ready or gone); [1 + i] worker i's state. */
const EVENTS = 0;
export const READY = 1;
export const GONE = 2;

/** What a worker gets at its start (workerData). */
export interface WorkerStart {
  port: MessagePort;
  words: Int32Array;
  index: number;
}

/** A worker's signal: its state (READY, GONE) when given, and in any case an event that wakes the pool. */
export function signal(start: WorkerStart, state?: number): void {
  if (state !== undefined) Atomics.store(start.words, 1 + start.index, state);
  Atomics.add(start.words, EVENTS, 1);
  Atomics.notify(start.words, EVENTS);
}

/** How long a new worker may take to load its modules (tsx compiles them under the tests). */
const START_TIMEOUT_MS = 60_000;
/** Idle time after which the pool's workers end (their scratch buffers can be hundreds of MB). */
const IDLE_MS = 5_000;
/** At most this many workers, whatever the machine has. */
export const MAX_THREADS = 64;

let pool: PoolWorker[] = [];
let words = new Int32Array(new SharedArrayBuffer(4 * (1 + MAX_THREADS)));
let idleTimer: NodeJS.Timeout | null = null;
let warned = false;
/** Set while runTasks drives the pool: a call made from its `done` (a progress callback) runs alone. */
let busy = false;

/**
 * The code a worker starts with: it loads worker.js beside this module (worker.ts under tsx, whose
 * loader workers do not inherit), and when that fails marks itself gone with the reason on its port.
 */
function workerBootstrap(): string {
  const self = import.meta.url;
  const ts = self.endsWith(".ts");
  const entry = JSON.stringify(new URL(ts ? "./worker.ts" : "./worker.js", self).href);
  const before = ts ? 'import("tsx/esm/api").then((t) => t.register())' : "Promise.resolve()";
  return `const { workerData: w } = require("node:worker_threads");
${before}.then(() => import(${entry})).catch((e) => {
  w.port.postMessage({ task: -1, error: { name: String(e && e.name), message: String(e && e.message) } });
  Atomics.store(w.words, 1 + w.index, ${GONE});
  Atomics.add(w.words, ${EVENTS}, 1);
  Atomics.notify(w.words, ${EVENTS});
});`;
}

function endPool(): void {
  for (const w of pool) {
    void w.worker.terminate();
    w.port.close();
  }
  pool = [];
  words = new Int32Array(new SharedArrayBuffer(4 * (1 + MAX_THREADS)));
}

/** Blocks until `done()` or `ms` have passed, waking whenever a worker signals. */
function waitFor(done: () => boolean, ms: number): boolean {
  const end = Date.now() + ms;
  for (;;) {
    const seen = Atomics.load(words, EVENTS);
    if (done()) return true;
    const left = end - Date.now();
    if (left <= 0) return false;
    Atomics.wait(words, EVENTS, seen, Math.min(left, 200));
  }
}

/** At least `n` started workers, or null (then the caller runs its tasks itself). */
function workers(n: number): PoolWorker[] | null {
  if (idleTimer !== null) {
    clearTimeout(idleTimer);
    idleTimer = null;
  }
  if (pool.some((_, i) => Atomics.load(words, 1 + i) === GONE)) endPool();
  const bootstrap = workerBootstrap();
  while (pool.length < n) {
    const index = pool.length;
    const channel = new MessageChannel();
    const worker = new Worker(bootstrap, {
      eval: true,
      workerData: { port: channel.port2, words, index } satisfies WorkerStart,
      transferList: [channel.port2],
    });
    worker.unref();
    channel.port1.unref();
    pool.push({ worker, port: channel.port1 });
  }
  const started = waitFor(() => pool.every((_, i) => Atomics.load(words, 1 + i) !== 0), START_TIMEOUT_MS);
  if (!started || pool.some((_, i) => Atomics.load(words, 1 + i) !== READY)) {
    const failed = pool.map((w) => receiveMessageOnPort(w.port)?.message as TaskReply | undefined);
    const reason =
      failed.find((r) => r?.error !== undefined)?.error?.message ??
      `no answer in ${START_TIMEOUT_MS / 1000} s`;
    endPool();
    if (!warned) {
      warned = true;
      process.emitWarning(
        `megamoe: the CPU reference's worker threads did not start (${reason}); running on one thread`,
      );
    }
    return null;
  }
  return pool.slice(0, n);
}

/** The error a worker reported, as the same kind of error here. */
function rethrown(e: { name: string; message: string }): Error {
  if (e.name === "RangeError") return new RangeError(e.message);
  if (e.name === "NumericsError") return new NumericsError(e.message);
  if (e.name === "TypeError") return new TypeError(e.message);
  const error = new Error(e.message);
  error.name = e.name;
  return error;
}

/**
 * Runs tasks 0 .. count − 1 on `threads` workers: `setup` goes to each first (SharedArrayBuffers in it
 * are shared, not copied), then `task(i)` for each task as a worker frees up; `done(i, result)` is called
 * on this thread in completion order. Returns false, having run nothing, when no worker could start or
 * the pool is already running tasks (a call from inside `done`). The first error a task throws is
 * rethrown here once the tasks in flight have ended.
 */
export function runTasks(
  threads: number,
  setup: unknown,
  count: number,
  task: (i: number) => unknown,
  done: (i: number, result: unknown) => void,
): boolean {
  if (busy) return false;
  const used = workers(Math.min(threads, count));
  if (used === null) return false;
  busy = true;
  try {
    for (const w of used) w.worker.postMessage({ setup });
    let next = 0;
    let finished = 0;
    let inFlight = 0;
    let failure: Error | null = null;
    const post = (w: PoolWorker) => {
      w.worker.postMessage({ task: next, message: task(next) });
      next++;
      inFlight++;
    };
    for (const w of used) if (next < count) post(w);
    while (inFlight > 0) {
      // Read before looking: a reply that lands after the look has bumped it, and the wait returns at once.
      const seen = Atomics.load(words, EVENTS);
      let got = false;
      for (const [i, w] of used.entries()) {
        const reply = receiveMessageOnPort(w.port)?.message as TaskReply | undefined;
        if (reply === undefined) {
          if (Atomics.load(words, 1 + i) === GONE)
            throw new Error("megamoe: a CPU reference worker thread ended");
          continue;
        }
        got = true;
        inFlight--;
        finished++;
        if (reply.error !== undefined) failure ??= rethrown(reply.error);
        else if (failure === null) done(reply.task, reply.result);
        if (failure === null && next < count) {
          try {
            post(w);
          } catch (e) {
            failure = e as Error;
          }
        }
      }
      if (!got) Atomics.wait(words, EVENTS, seen, 1000);
    }
    if (failure !== null) throw failure;
    if (finished !== count) throw new Error(`megamoe: ${count - finished} CPU reference tasks did not run`);
    return true;
  } catch (e) {
    // A worker may still hold a task of this call: start afresh next time.
    endPool();
    throw e;
  } finally {
    busy = false;
    if (pool.length > 0) {
      idleTimer = setTimeout(endPool, IDLE_MS);
      idleTimer.unref();
    }
  }
}

/** Logical CPUs this process may use. */
export function availableThreads(): number {
  return Math.min(MAX_THREADS, os.availableParallelism());
}
