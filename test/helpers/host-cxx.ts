/**
 * Host builds of the test fixtures (test/fixtures/*.cpp): the device headers compiled for the CPU, so
 * that unit tests check them without a GPU.
 */
import { spawnSync } from "node:child_process";
import path from "node:path";
import { fileURLToPath } from "node:url";

/** The host C++ compiler (g++, c++ or clang++), or null when none runs. */
export function findCxx(): string | null {
  for (const cxx of ["g++", "c++", "clang++"]) {
    if (spawnSync(cxx, ["--version"]).status === 0) return cxx;
  }
  return null;
}

/**
 * Builds test/fixtures/NAME.cpp into DIR/NAME with src/include on the include path (C++17, -O1, warnings
 * as errors, then `flags`) and returns the executable's path; a failed build throws with the compiler's log.
 */
export function buildFixture(cxx: string, dir: string, name: string, flags: readonly string[] = []): string {
  const exe = path.join(dir, name);
  const source = fileURLToPath(new URL(`../fixtures/${name}.cpp`, import.meta.url));
  const include = fileURLToPath(new URL("../../src/include", import.meta.url));
  const r = spawnSync(
    cxx,
    ["-std=c++17", "-O1", "-Wall", "-Werror", ...flags, `-I${include}`, "-o", exe, source],
    {
      encoding: "utf8",
    },
  );
  if (r.status !== 0) throw new Error(`${cxx} failed (${r.status}) on ${name}.cpp:\n${r.stderr}`);
  return exe;
}
