/** Checks of the command line's values that commander cannot make: files to read or write, strict integers. */
import fs from "node:fs";
import path from "node:path";
import { outputFileProblem } from "../cuda/mkdir.js";

/** A bad command-line value: the flag, the value and what was expected. Exit code 1, no stack trace. */
export class UsageError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "UsageError";
  }
}

/**
 * The integer `value` spells, when it is written in decimal digits and lies in [min, max]; else a
 * UsageError naming the flag, the value and the range. (Number() alone would take "0x10", "1e3" and
 * "  7 " too.)
 */
export function parseIntegerIn(flag: string, value: string, min: number, max: number): number {
  const n = /^\d+$/.test(value) ? Number(value) : Number.NaN;
  if (!(n >= min && n <= max)) {
    throw new UsageError(`${flag} must be an integer in [${min}, ${max}] in decimal digits, got "${value}"`);
  }
  return n;
}

/** A file the command reads: it must exist and be a file (not a folder). */
export function checkInputFile(flag: string, file: string): void {
  let stat: fs.Stats;
  try {
    stat = fs.statSync(file);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    const why = code === "ENOENT" || code === "ENOTDIR" ? "no such file" : (e as Error).message;
    throw new UsageError(`${flag} ${file}: ${why}`);
  }
  if (!stat.isFile()) {
    throw new UsageError(
      `${flag} ${file}: ${stat.isDirectory() ? "is a folder, not a file" : "is not a regular file"}`,
    );
  }
}

/**
 * A file the command writes: checked before any work, so a long run does not fail at its end. An
 * existing file is refused unless `force` (the command's --force) is on.
 */
export function checkOutputFile(flag: string, file: string, force = false): void {
  const problem = outputFileProblem(file);
  if (problem !== undefined) throw new UsageError(`${flag} ${file}: cannot be written (${problem})`);
  if (!force && fs.existsSync(file)) {
    throw new UsageError(`${flag} ${file}: the file exists; pass --force to overwrite it`);
  }
}

/** Whether two paths name one file: the same absolute path, or (both existing) the same file through links. */
export function sameFile(a: string, b: string): boolean {
  if (path.resolve(a) === path.resolve(b)) return true;
  try {
    const sa = fs.statSync(a);
    const sb = fs.statSync(b);
    return sa.dev === sb.dev && sa.ino === sb.ino;
  } catch {
    return false; // one does not exist (yet): an output not yet written is no other file
  }
}
