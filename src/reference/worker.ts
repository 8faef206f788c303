/**
 * A CPU reference worker thread (threads.ts starts it): it takes a forward's setup, then runs the expert
 * tasks it is given with moe.ts's own code and replies through its port.
 */
import { parentPort, workerData } from "node:worker_threads";
import { type ExpertJob, ExpertScratch, type ExpertTask, runExpertTask } from "./moe.js";
import { GONE, READY, signal, type TaskReply, type WorkerStart } from "./threads.js";

const start = workerData as WorkerStart;
const scratch = new ExpertScratch();
let job: ExpertJob | null = null;

process.on("exit", () => signal(start, GONE));

parentPort?.on("message", (m: { setup: ExpertJob } | { task: number; message: ExpertTask }) => {
  if ("setup" in m) {
    job = m.setup;
    return;
  }
  let reply: TaskReply;
  try {
    if (job === null) throw new Error("a task came before its setup");
    reply = { task: m.task, result: runExpertTask(job, m.message, scratch) };
  } catch (e) {
    const error = e instanceof Error ? e : new Error(String(e));
    reply = { task: m.task, error: { name: error.name, message: error.message } };
  }
  start.port.postMessage(reply);
  signal(start);
});

signal(start, READY);
