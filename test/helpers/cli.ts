/** The megamoe CLI in a child process, for the CLI tests. */
import { spawn } from "node:child_process";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const main = path.join(repoRoot, "src/cli/main.ts");

/**
 * Runs `megamoe ARGS` from source (async, so tests may run two at a time), uncoloured: picocolors
 * colours whenever CI is set, and the tests match plain text.
 */
export function runCli(
  args: readonly string[],
  env: NodeJS.ProcessEnv = {},
): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ["--import", "tsx", main, ...args], {
      cwd: repoRoot,
      env: { ...process.env, NO_COLOR: "1", ...env },
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
