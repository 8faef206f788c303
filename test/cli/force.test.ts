/**
 * The CLI's writers refuse an existing file unless --force: run --save-weights, bench --out and --plot,
 * plot --out. Each row is the argv, the exit code and a fragment of the output; every refused file is
 * checked to be as it was. Bench rows stop in its checks (a later bad value), before a GPU is looked for.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import { writePlot } from "../../src/cli/plot.js";
import { UsageError } from "../../src/cli/usage.js";
import { readSafetensorsHeader } from "../../src/weights/safetensors.js";
import { repoRoot, runCli } from "../helpers/cli.js";

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-force-"));
after(() => fs.rmSync(dir, { recursive: true, force: true }));
const existing = (name: string) => {
  const file = path.join(dir, name);
  fs.writeFileSync(file, `old ${name}\n`);
  return file;
};
const results = path.join(repoRoot, "test/fixtures/results/2026-12-03-h200-unfused-flash-ep8-shared1.json");

interface Row {
  args: string[];
  code: number;
  message: RegExp;
  /** Files that must hold what they held before. */
  unchanged: string[];
}

const weights = existing("w.safetensors");
const out = existing("r.json");
const svg = existing("p.svg");
const plotOut = existing("plot.svg");
const refused = (flag: string, file: string) =>
  new RegExp(`${flag} ${file.replace(/[.]/g, "\\.")}: the file exists; pass --force to overwrite it`);

const rows: Row[] = [
  {
    args: ["run", "--tokens", "1", "--save-weights", weights],
    code: 1,
    message: refused("--save-weights", weights),
    unchanged: [weights],
  },
  {
    args: ["run", "--tokens", "1", "--force"],
    code: 1,
    message: /--force applies to --save-weights: give the file to overwrite/,
    unchanged: [],
  },
  { args: ["bench", "--out", out], code: 1, message: refused("--out", out), unchanged: [out] },
  { args: ["bench", "--plot", svg], code: 1, message: refused("--plot", svg), unchanged: [svg] },
  {
    args: ["bench", "--force"],
    code: 1,
    message: /--force applies to --out and --plot: give the file to overwrite/,
    unchanged: [],
  },
  // --force passes the check: the next bad value is the one reported, and nothing is written.
  {
    args: ["bench", "--out", out, "--plot", svg, "--force", "--iters", "5"],
    code: 1,
    message: /--iters must be at least 20/,
    unchanged: [out, svg],
  },
  // Two flags naming one file are refused even with --force.
  {
    args: ["bench", "--out", out, "--plot", out, "--force"],
    code: 1,
    message: /--plot \S+r\.json: the same file as --out/,
    unchanged: [out],
  },
  {
    args: ["plot", results, "--out", plotOut],
    code: 1,
    message: refused("--out", plotOut),
    unchanged: [plotOut],
  },
  {
    args: ["plot", results, "--out", results, "--force"],
    code: 1,
    message: /is the results file \S+ being plotted; write the SVG elsewhere/,
    unchanged: [results],
  },
  {
    args: ["run", "--help"],
    code: 0,
    message: /--force\s+overwrite an existing --save-weights file/,
    unchanged: [],
  },
  {
    args: ["bench", "--help"],
    code: 0,
    message: /--force\s+overwrite existing --out and --plot files/,
    unchanged: [],
  },
  { args: ["plot", "--help"], code: 0, message: /--force\s+overwrite an existing --out file/, unchanged: [] },
];

describe("--force: an existing output file is refused without it", { concurrency: 2 }, () => {
  for (const [i, r] of rows.entries()) {
    it(`row ${i + 1}: ${r.args.map((a) => path.basename(a)).join(" ")}`, async () => {
      const before = r.unchanged.map((f) => fs.readFileSync(f));
      const res = await runCli(r.args);
      assert.equal(res.code, r.code, res.stderr);
      assert.match(r.code === 0 ? res.stdout + res.stderr : res.stderr, r.message);
      assert.deepEqual(
        r.unchanged.map((f) => fs.readFileSync(f)),
        before,
      );
    });
  }
});

describe("--force overwrites", () => {
  it("run --save-weights --force replaces the file with the weights", async () => {
    const file = existing("forced.safetensors");
    const res = await runCli(["run", "--tokens", "1", "--json", "--save-weights", file, "--force"]);
    assert.equal(res.code, 0, res.stderr);
    assert.ok(readSafetensorsHeader(file).tensors.size > 0);
    assert.deepEqual(
      fs.readdirSync(dir).filter((f) => f.includes("partial")),
      [],
      "no temporary file is left",
    );
  });

  it("plot --out --force replaces the SVG", async () => {
    const file = existing("forced.svg");
    const res = await runCli(["plot", results, "--out", file, "--force"]);
    assert.equal(res.code, 0, res.stderr);
    assert.match(fs.readFileSync(file, "utf8"), /^<svg/);
  });

  it("writePlot (bench --plot's writer) refuses an existing file unless overwrite", () => {
    const file = existing("direct.svg");
    assert.throws(
      () => writePlot(file, "<svg/>\n"),
      (e: unknown) => e instanceof UsageError && e.message === `${file} exists; pass --force to replace it`,
    );
    assert.equal(fs.readFileSync(file, "utf8"), "old direct.svg\n");
    writePlot(file, "<svg/>\n", { overwrite: true });
    assert.equal(fs.readFileSync(file, "utf8"), "<svg/>\n");
  });
});
