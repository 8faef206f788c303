/**
 * Results of a peer implementation (lab/peers/torch_moe.py) read back for comparison: the same
 * results-file format as ours, plus what the peer measured about the machine (its dense FP8 rate).
 */
import fs from "node:fs";
import { describeValue } from "../config/config.js";
import type { ResultRow } from "../cuda/index.js";

export interface PeerResults {
  file: string;
  /** Dense FP8 rate the peer measured (`torch._scaled_mm` 8192³), TFLOP/s; undefined when absent. */
  fp8Tflops?: number;
  /** The peer's device description, as written. */
  device: unknown;
  rows: ResultRow[];
}

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

const NUMERIC_FIELDS = ["tokens", "us_median", "us_min", "us_max", "floor_us", "tflops", "tbps"] as const;

/** Checks one row of a results file; throws naming the row and the field that is wrong. */
export function parseResultRow(v: unknown, where: string): ResultRow {
  if (!isRecord(v)) throw new Error(`${where}: a row must be an object`);
  if (typeof v.config !== "string") throw new Error(`${where}: "config" must be a string`);
  if (typeof v.impl !== "string") throw new Error(`${where}: "impl" must be a string`);
  for (const f of NUMERIC_FIELDS) {
    if (typeof v[f] !== "number" || !Number.isFinite(v[f])) {
      // describeValue, not JSON: a 1e400 in the file parses to Infinity, which JSON prints as null.
      throw new Error(`${where}: "${f}" must be a finite number, got ${describeValue(v[f])}`);
    }
  }
  return { ...v, shared: v.shared === true } as ResultRow;
}

/** Parses a results document (ours or a peer's). */
export function parsePeerResults(text: string, file: string): PeerResults {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (e) {
    throw new Error(`${file}: not JSON (${(e as Error).message})`);
  }
  if (!isRecord(doc) || !Array.isArray(doc.rows)) throw new Error(`${file}: expected { rows: [...] }`);
  const rows = doc.rows.map((r, i) => parseResultRow(r, `${file} row ${i}`));
  const rate = doc.fp8_tflops;
  return {
    file,
    device: doc.device,
    fp8Tflops: typeof rate === "number" && Number.isFinite(rate) && rate > 0 ? rate : undefined,
    rows,
  };
}

export function readPeerResults(file: string): PeerResults {
  let text: string;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    throw new Error(`cannot read peer results ${file}: ${(e as Error).message}`);
  }
  return parsePeerResults(text, file);
}

/**
 * The peer row measuring the same case as `ours`: same config, token count, shared-expert setting and
 * timing mode (CUDA-graph replays or eager launches; a row without `graph` is eager). Graph and eager
 * times are never compared with each other: launch cost is most of a small layer's eager time.
 */
export function matchPeerRow(peer: readonly ResultRow[], ours: ResultRow): ResultRow | undefined {
  const graph = ours.graph === true;
  return peer.find(
    (p) =>
      p.config === ours.config &&
      p.tokens === ours.tokens &&
      p.shared === ours.shared &&
      (p.graph === true) === graph,
  );
}
