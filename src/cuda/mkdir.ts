/**
 * Creating a folder and its missing parents without `fs.mkdirSync(dir, { recursive: true })`: on
 * pseudo file systems (/proc) that call spins forever, because mkdir there says ENOENT for a parent
 * that exists. Walking the path one level at a time turns every such case into an error.
 */

import fs from "node:fs";
import path from "node:path";

/** A folder that cannot be created or written: the path, and why. */
export class DirectoryError extends Error {
  constructor(
    readonly dir: string,
    readonly reason: string,
  ) {
    super(`folder ${dir} is not usable: ${reason}`);
    this.name = "DirectoryError";
  }
}

/**
 * Make `dir` and any missing parents, one `mkdir` per level. Returns quietly when `dir` already is a
 * folder.
 * @throws DirectoryError when a part of the path is not a folder or a level cannot be created
 */
export function makeDirectory(dir: string): void {
  const target = path.resolve(dir);
  const missing: string[] = [];
  let at = target;
  for (;;) {
    let stat: fs.Stats | undefined;
    try {
      stat = fs.statSync(at);
    } catch (e) {
      // ENOTDIR: a file further up; the walk reaches it and names it
      const code = (e as NodeJS.ErrnoException).code;
      if (code !== "ENOENT" && code !== "ENOTDIR") {
        throw new DirectoryError(target, `${at}: ${(e as Error).message}`);
      }
    }
    if (stat !== undefined) {
      if (!stat.isDirectory()) throw new DirectoryError(target, `${at} is not a folder`);
      break;
    }
    missing.push(at);
    const parent = path.dirname(at);
    if (parent === at) break;
    at = parent;
  }
  for (const level of missing.reverse()) {
    try {
      fs.mkdirSync(level);
    } catch (e) {
      // Another process may have made it in between; anything else is final.
      if ((e as NodeJS.ErrnoException).code === "EEXIST" && fs.statSync(level).isDirectory()) continue;
      throw new DirectoryError(target, `cannot create ${level}: ${(e as Error).message}`);
    }
  }
}

/**
 * Whether files can be written in `dir` (creating it when missing): undefined when they can, else
 * the reason. Never throws.
 */
export function directoryProblem(dir: string): string | undefined {
  try {
    makeDirectory(dir);
    fs.accessSync(dir, fs.constants.W_OK);
    return undefined;
  } catch (e) {
    return e instanceof DirectoryError ? e.reason : (e as Error).message;
  }
}

/** Pseudo file systems: nothing megamoe writes belongs there, and mkdir in /proc misbehaves. */
const PSEUDO_FS = ["/proc", "/sys", "/dev"];

/**
 * Why `file` cannot be written, checked without creating anything (so a long run fails before it
 * starts, not after): undefined when it looks writable. Not a guarantee: permissions may change, and
 * a root user passes every access check.
 */
export function outputFileProblem(file: string): string | undefined {
  const target = path.resolve(file);
  const pseudo = PSEUDO_FS.find((p) => target === p || target.startsWith(`${p}/`));
  if (pseudo !== undefined) return `${target} is under ${pseudo}, a pseudo file system`;
  try {
    if (fs.statSync(target).isDirectory()) return `${target} is a folder`;
    fs.accessSync(target, fs.constants.W_OK);
    return undefined;
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code !== "ENOENT" && code !== "ENOTDIR") return (e as Error).message;
  }
  // The file is missing: the deepest existing folder above it must be a writable folder.
  let at = path.dirname(target);
  for (;;) {
    try {
      if (!fs.statSync(at).isDirectory()) return `${at} is not a folder`;
      fs.accessSync(at, fs.constants.W_OK);
      return undefined;
    } catch (e) {
      const code = (e as NodeJS.ErrnoException).code;
      if (code !== "ENOENT" && code !== "ENOTDIR") return `${at}: ${(e as Error).message}`;
    }
    const parent = path.dirname(at);
    if (parent === at) return `no folder above ${target} exists`;
    at = parent;
  }
}
