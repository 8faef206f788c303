/**
 * Writing files so that none is ever left damaged under its final name: every file is written under a
 * temporary name in its own folder (a rename within one file system is atomic; across two it would copy),
 * flushed to disk, and renamed onto its final name only once every file of the set is complete. On a
 * failure the temporary files are removed, so the folder is as it was. Every writer of a user-named file
 * (weights, checkpoints, results, plots) goes through here; it imports only config.ts, so any layer may
 * use it.
 */
import { randomBytes } from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { describeValue } from "../config/config.js";

/** The option every writer takes: replace what stands at the target instead of refusing it. */
export interface OverwriteOption {
  /** Replace an existing file (a checkpoint's files, for saveCheckpoint); default false: refuse it. */
  overwrite?: boolean;
}

/** Why an `overwrite` option's value is not one: null when it is a boolean or absent. */
export function overwriteProblem(value: unknown): string | null {
  return value === undefined || typeof value === "boolean"
    ? null
    : `overwrite must be true or false, got ${describeValue(value)}`;
}

/** The temporary name of `file`: beside it, hidden, unique to this process and call, marked "partial". */
export function asideName(file: string): string {
  const tag = `${process.pid}-${randomBytes(4).toString("hex")}`;
  return path.join(path.dirname(file), `.${path.basename(file)}.partial-${tag}`);
}

/** The path a rename must replace: a link's target, so that writing through a link keeps the link. */
function finalPath(file: string): string {
  try {
    return fs.realpathSync(file);
  } catch {
    return file; // nothing there yet (or a dangling link, which the rename replaces)
  }
}

function flushFile(file: string): void {
  const fd = fs.openSync(file, "r+");
  try {
    fs.fsyncSync(fd);
  } finally {
    fs.closeSync(fd);
  }
}

/** Makes the renames durable; some platforms and file systems cannot sync a folder, and need not. */
function flushFolder(dir: string): void {
  try {
    const fd = fs.openSync(dir, "r");
    try {
      fs.fsyncSync(fd);
    } finally {
      fs.closeSync(fd);
    }
  } catch {
    // the renames are made; only their durability across a power loss is left to the system
  }
}

/**
 * Calls `write` with one temporary name per file of `files` (each must be written), flushes them, then
 * renames each onto its final name in the order given: the last file named appears last (a checkpoint's
 * index and config.json after its shards). When `write` or a flush throws, every temporary file is
 * removed and the error rethrown; the final names were never touched. Refusing an existing target is the
 * caller's (see targetFileProblem), before any work.
 */
export function writeAside<T>(files: readonly string[], write: (temps: string[]) => T): T {
  const finals = files.map(finalPath);
  const temps = finals.map(asideName);
  const removeFrom = (i: number) => {
    for (const t of temps.slice(i)) fs.rmSync(t, { force: true });
  };
  let result: T;
  try {
    result = write(temps);
    for (const t of temps) flushFile(t);
  } catch (err) {
    removeFrom(0);
    throw err;
  }
  for (let i = 0; i < finals.length; i++) {
    try {
      fs.renameSync(temps[i], finals[i]);
    } catch (err) {
      removeFrom(i);
      throw err;
    }
  }
  for (const dir of new Set(finals.map((f) => path.dirname(f)))) flushFolder(dir);
  return result;
}

/** Writes `data` to `file` through a temporary name (see writeAside). */
export function writeFileAside(file: string, data: string | NodeJS.ArrayBufferView): void {
  writeAside([file], ([temp]) => fs.writeFileSync(temp, data));
}

/**
 * Why `file` may not be written: null when nothing stands there, or a file does and `overwrite` is on;
 * else the reason, ending with `how` (the way to overwrite: "pass { overwrite: true }", "pass --force").
 */
export function targetFileProblem(file: string, overwrite: boolean, how: string): string | null {
  let stat: fs.Stats;
  try {
    stat = fs.statSync(file);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    return code === "ENOENT" || code === "ENOTDIR" ? null : `${file}: ${(e as Error).message}`;
  }
  if (stat.isDirectory()) return `${file} is a folder, not a file`;
  return overwrite ? null : `${file} exists; ${how} to replace it`;
}
