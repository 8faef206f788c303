/**
 * ptxas's resource report (-v), per entry function, and what the CI kernel check refuses in it
 * (scripts/compile-kernels.ts): spills and stack frames in kernels marked no-spill, and wgmma
 * serialization anywhere.
 */

/** What ptxas reports for one entry function. */
export interface FunctionReport {
  name: string;
  registers: number;
  stackBytes: number;
  spillStores: number;
  spillLoads: number;
  sharedBytes: number;
  /** ptxas made every wgmma wait for the previous one (warning C7518): a mainloop bug, never intended. */
  wgmmaSerialized: boolean;
}

/** Splits ptxas -v output into one report per entry function. */
export function parsePtxasReport(log: string): FunctionReport[] {
  const reports: FunctionReport[] = [];
  let current: FunctionReport | undefined;
  // The function the next "bytes stack frame" line describes: ptxas also reports every non-inlined
  // callee ("Function properties for <callee>") after the entry, which must not overwrite the entry's.
  let described: string | undefined;
  for (const line of log.split("\n")) {
    const properties = /Function properties for (\S+)/.exec(line);
    if (properties) {
      described = properties[1];
      continue;
    }
    const entry = /Compiling entry function '([^']+)'/.exec(line);
    if (entry) {
      current = {
        name: entry[1],
        registers: 0,
        stackBytes: 0,
        spillStores: 0,
        spillLoads: 0,
        sharedBytes: 0,
        wgmmaSerialized: false,
      };
      reports.push(current);
      continue;
    }
    if (current === undefined) continue;
    const frame = /(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads/.exec(line);
    if (frame && described === current.name) {
      current.stackBytes = Number(frame[1]);
      current.spillStores = Number(frame[2]);
      current.spillLoads = Number(frame[3]);
    }
    const regs = /Used (\d+) registers/.exec(line);
    if (regs) current.registers = Number(regs[1]);
    const smem = /(\d+) bytes smem/.exec(line);
    if (smem) current.sharedBytes = Number(smem[1]);
  }
  // The warning names its function and may come before that function's entry line.
  for (const m of log.matchAll(
    /wgmma\.mma_async instructions are serialized[^\n]*in the function '([^']+)'/g,
  )) {
    const report = reports.find((r) => r.name === m[1]);
    if (report) report.wgmmaSerialized = true;
  }
  return reports;
}

/** Why a compile's functions fail the check (none: []). `noSpill`: the variant must not spill. */
export function ptxasProblems(functions: readonly FunctionReport[], noSpill: boolean): string[] {
  if (functions.length === 0) return ["no entry function in ptxas report"];
  const serialized = functions
    .filter((f) => f.wgmmaSerialized)
    .map((f) => `${f.name}: ptxas serializes its wgmmas (C7518)`);
  if (!noSpill) return serialized;
  return serialized.concat(
    functions.flatMap((f) => {
      const p: string[] = [];
      if (f.spillStores > 0 || f.spillLoads > 0)
        p.push(`${f.name} spills (${f.spillStores}/${f.spillLoads} B)`);
      if (f.stackBytes > 0) p.push(`${f.name} uses a ${f.stackBytes} B stack frame`);
      return p;
    }),
  );
}
