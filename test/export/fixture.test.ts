/**
 * The real export the Python runtime's unit tests read (python/tests/fixtures/tiny-fp4/manifest.json,
 * with stand-in cubins: fakeCubin's ELF images): it must be what buildManifest makes today, so the two languages test one
 * contract. MEGAMOE_UPDATE_FIXTURES=1 rewrites it.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { resolveConfig } from "../../src/config/config.js";
import { packageRoot } from "../../src/cuda/jit.js";
import { buildManifest } from "../../src/export/layer.js";
import { fakeCubin } from "../cuda/mock-cuda.js";

const dir = path.join(packageRoot(), "python", "tests", "fixtures", "tiny-fp4");
const config = resolveConfig("tiny", { expertFormat: "fp4" });
const manifest = buildManifest(
  config,
  {
    maxTokens: 2048,
    shared: true,
    smCount: 132,
    weightScales: "ue8m0",
    arch: "sm_90a",
    producer: "megamoe (test fixture)",
  },
  32,
);

test("python/tests/fixtures/tiny-fp4 is buildManifest's export of tiny FP4 today", () => {
  const file = path.join(dir, "manifest.json");
  if (process.env.MEGAMOE_UPDATE_FIXTURES === "1") {
    fs.mkdirSync(path.join(dir, "kernels"), { recursive: true });
    fs.writeFileSync(file, `${JSON.stringify(manifest, null, 1)}\n`);
    for (const k of manifest.kernels) fs.writeFileSync(path.join(dir, k.cubin), fakeCubin([k.function]));
  }
  assert.deepEqual(
    JSON.parse(fs.readFileSync(file, "utf8")),
    manifest,
    "MEGAMOE_UPDATE_FIXTURES=1 rewrites it",
  );
  for (const k of manifest.kernels) assert.ok(fs.existsSync(path.join(dir, k.cubin)), k.cubin);
});
