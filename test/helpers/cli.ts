/** The megamoe CLI in a child process, for the CLI tests. */
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const main = path.join(repoRoot, "src/cli/main.ts");
const built = path.join(repoRoot, "dist/cli/main.js");

/** The newest modification time of the .ts files under `dir`. */
function newestTs(dir: string): number {
  let newest = 0;
  for (const e of fs.readdirSync(dir, { withFileTypes: true, recursive: true })) {
    if (e.isFile() && e.name.endsWith(".ts"))
      newest = Math.max(newest, fs.statSync(path.join(e.parentPath, e.name)).mtimeMs);
  }
  return newest;
}

/**
 * Node's arguments for the CLI: the built one when it is newer than every source (npm test builds
 * first; it starts in about half of tsx's time, and the CLI tests start it some 150 times), else the
 * sources through tsx.
 */
export const cliArgs: readonly string[] =
  fs.existsSync(built) && fs.statSync(built).mtimeMs >= newestTs(path.join(repoRoot, "src"))
    ? [built]
    : ["--import", "tsx", main];

// picocolors colours its output whenever CI is set; the tests match plain text.
function plainEnv(env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  return { ...process.env, NO_COLOR: "1", ...env };
}

export interface CliResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs `megamoe ARGS` uncoloured, async, so tests may run two at a time. */
export function runCli(args: readonly string[], env: NodeJS.ProcessEnv = {}): Promise<CliResult> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [...cliArgs, ...args], {
      cwd: repoRoot,
      env: plainEnv(env),
      timeout: 120_000,
    });
    let stdout = "";
    let stderr = "";
    child.stdout.setEncoding("utf8").on("data", (d: string) => {
      stdout += d;
    });
    child.stderr.setEncoding("utf8").on("data", (d: string) => {
      stderr += d;
    });
    child.on("close", (code) => resolve({ code, stdout, stderr }));
  });
}

/** Runs `megamoe ARGS` uncoloured and waits for it. */
export function runCliSync(args: readonly string[], env: NodeJS.ProcessEnv = {}): CliResult {
  const r = spawnSync(process.execPath, [...cliArgs, ...args], {
    cwd: repoRoot,
    encoding: "utf8",
    env: plainEnv(env),
  });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}
