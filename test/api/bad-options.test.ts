/**
 * The census of bad arguments, options and values to the public API that the first census
 * (bad-inputs.test.ts) let through: misspelt option fields, seeds and vocab of RandomV4Weights, codec
 * modes, values described by type, checkpoint layer indices, configs too large to allocate and
 * planDispatch's arguments. Each row is a call, with the error class and a fragment of the message it
 * must raise, or "accepted" with the documented reason and a check of what it then does.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import { describeValue } from "../../src/config/config.js";
import {
  Checkpoint,
  CheckpointError,
  ConfigError,
  checksum,
  cuda,
  DispatchError,
  decodeE2m1,
  decodeE4m3,
  decodeE5m2,
  decodeE8m0,
  encodeE8m0,
  FusedMoEKernel,
  FusedMoEKernelError,
  GeneratedWeights,
  generateActivations,
  groupByExpert,
  InputError,
  MoELayer,
  openCheckpoint,
  planDispatch,
  planGroupedGemm,
  quantizeActivations,
  RandomV4Weights,
  RouterError,
  randomRouting,
  resolveConfig,
  routeOnDevice,
  routeTokens,
  SymmetricHeap,
  SymmetricHeapError,
  saveMoEWeights,
  validateConfig,
} from "../../src/index.js";
import { tinyV4, writeTinyV4 } from "../helpers/v4-checkpoint.js";

type ErrorClass = new (...args: never[]) => Error;
type Row =
  | { call: string; run: () => unknown; error: ErrorClass; message: RegExp }
  | { call: string; run: () => unknown; accepted: string; check: (result: unknown) => void };

const err = (call: string, run: () => unknown, error: ErrorClass, message: RegExp): Row => ({
  call,
  run,
  error,
  message,
});
const ok = (call: string, run: () => unknown, accepted: string, check: (r: unknown) => void): Row => ({
  call,
  run,
  accepted,
  check,
});

const tiny = resolveConfig("tiny");
const T = 2;
const weights = new GeneratedWeights(tiny, 1);
const layer = new MoELayer(weights);
const x = generateActivations(1, T, tiny.hidden);
const routing = randomRouting(1, T, tiny);
const hashed = tinyV4({}, true);

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-bad-options-"));
after(() => fs.rmSync(dir, { recursive: true, force: true }));
const v4Dir = path.join(dir, "v4");
writeTinyV4(v4Dir, 7);
const checkpoint = openCheckpoint(v4Dir) as Checkpoint;
assert.ok(checkpoint instanceof Checkpoint);
const legacyFile = path.join(dir, "tiny.safetensors");
saveMoEWeights(legacyFile, weights);
const legacy = openCheckpoint(legacyFile);
assert.ok(!(legacy instanceof Checkpoint));

const rankRouting = (over: Record<string, unknown> = {}) => ({
  ids: routing.ids,
  weights: routing.weights,
  tokens: T,
  ...over,
});

const rows: Row[] = [
  // 1. Misspelt and unknown option fields: an error in every options object, as in configs.
  err(
    "Checkpoint.layer(0, { maxToken })",
    () => checkpoint.layer(0, { maxToken: 64 } as never),
    CheckpointError,
    /unknown layer options field maxToken \(did you mean maxTokens\?\); known: maxTokens, cachedExperts/,
  ),
  err(
    "Checkpoint.mtp(0, { cachedExpert })",
    () => checkpoint.mtp(0, { cachedExpert: 1 } as never),
    CheckpointError,
    /unknown mtp options field cachedExpert \(did you mean cachedExperts\?\)/,
  ),
  err(
    'Checkpoint.byName("layers.3", { maxToken })',
    () => checkpoint.byName("layers.3", { maxToken: 64 } as never),
    CheckpointError,
    /unknown layer options field maxToken/,
  ),
  err(
    "Checkpoint.layer(0, null)",
    () => checkpoint.layer(0, null as never),
    CheckpointError,
    /layer options must be an object, got null/,
  ),
  err(
    "a saved file's layer({ maxToken })",
    () => legacy.layer({ maxToken: 64 } as never),
    CheckpointError,
    /unknown layer options field maxToken \(did you mean maxTokens\?\)/,
  ),
  ok(
    "Checkpoint.layer(0, { maxTokens, cachedExperts })",
    () => checkpoint.layer(0, { maxTokens: 32, cachedExperts: 1 }),
    "both fields known",
    (l) => assert.equal((l as { config: { maxTokens: number } }).config.maxTokens, 32),
  ),
  err(
    "new RandomV4Weights(…, { vocabSize })",
    () => new RandomV4Weights(hashed, 1, { vocabSize: 10 } as never),
    RangeError,
    /unknown RandomV4Weights options field vocabSize \(did you mean vocab\?\); known: vocab, cachedExperts/,
  ),
  err(
    "new RandomV4Weights(…, null)",
    () => new RandomV4Weights(hashed, 1, null as never),
    RangeError,
    /RandomV4Weights options must be an object, got null/,
  ),
  err(
    "new GeneratedWeights(…, { cachedExpert })",
    () => new GeneratedWeights(tiny, 1, { cachedExpert: 2 } as never),
    RangeError,
    /unknown GeneratedWeights options field cachedExpert \(did you mean cachedExperts\?\)/,
  ),
  err(
    "new GeneratedWeights(…, [])",
    () => new GeneratedWeights(tiny, 1, [] as never),
    RangeError,
    /GeneratedWeights options must be an object, got Array/,
  ),
  err(
    "new MoELayer(…, { backnd })",
    () => new MoELayer(weights, { backnd: "cpu" } as never),
    InputError,
    /unknown MoELayer options field backnd \(did you mean backend\?\)/,
  ),
  err(
    "forward(…, { routng })",
    () => layer.forward(x, T, { routng: routing } as never),
    InputError,
    /unknown forward options field routng \(did you mean routing\?\)/,
  ),
  err(
    "routeTokens(…, { tokenMasks })",
    () => routeTokens(x, T, weights.gate(), tiny, { tokenMasks: new Uint8Array(T) } as never),
    RouterError,
    /unknown route options field tokenMasks \(did you mean tokenMask\?\)/,
  ),
  err(
    "randomRouting(…, { emptyExpert })",
    () => randomRouting(1, T, tiny, { emptyExpert: [1] } as never),
    RouterError,
    /unknown randomRouting options field emptyExpert \(did you mean emptyExperts\?\)/,
  ),
  err(
    "planGroupedGemm(…, { tiles })",
    () => planGroupedGemm({ mTotal: 8, n: 256, k: 128, groups: 1 }, { tiles: "m64n128" } as never),
    RangeError,
    /unknown planGroupedGemm options field tiles \(did you mean tile\?\)/,
  ),
  ok(
    "planGroupedGemm(…, { smCount })",
    () => planGroupedGemm({ mTotal: 8, n: 256, k: 128, groups: 1 }, { smCount: 132 }),
    "a known field",
    (plan) => assert.ok((plan as { grid: number }).grid >= 1),
  ),
  err(
    "routeOnDevice(…, { logit })",
    () =>
      routeOnDevice(null as never, null as never, null as never, tiny, null as never, null, {
        logit: "fast",
      } as never),
    RangeError,
    /unknown routeOnDevice options field logit \(did you mean logits\?\); known: logits, tokenIds/,
  ),
  err(
    "new FusedMoEKernel(…, { rnk })",
    () => new FusedMoEKernel(null as never, null as never, 8, { rnk: 0 } as never),
    FusedMoEKernelError,
    /unknown FusedMoEKernel ep options field rnk \(did you mean rank\?\); known: layout, rank, peers, hostStatus/,
  ),
  err(
    "cuda.timeKernel(…, { iter })",
    () => cuda.timeKernel(null as never, () => {}, { iter: 5 } as never),
    RangeError,
    /unknown timeKernel options field iter \(did you mean iters\?\)/,
  ),
  err(
    "cuda.writeResults(…, { comit })",
    () => cuda.writeResults(path.join(dir, "results.json"), { device: "d", rows: [], comit: "abc" } as never),
    TypeError,
    /unknown writeResults meta field comit \(did you mean commit\?\)/,
  ),
  err(
    "cuda.compileKernel({ source, define })",
    () => cuda.compileKernel({ source: "quant/quant.cu", define: { HIDDEN: 256 } } as never),
    TypeError,
    /unknown compileKernel options field define \(did you mean defines\?\)/,
  ),

  // 2. RandomV4Weights: the generators' one seed rule, and a bounded vocab.
  err(
    "new RandomV4Weights(…, -1)",
    () => new RandomV4Weights(tiny, -1),
    RangeError,
    /seed must be an integer in \[0, 4294967295\], got number -1/,
  ),
  err(
    "new RandomV4Weights(…, NaN)",
    () => new RandomV4Weights(tiny, Number.NaN),
    RangeError,
    /got number NaN/,
  ),
  err("new RandomV4Weights(…, 1.7)", () => new RandomV4Weights(tiny, 1.7), RangeError, /got number 1\.7/),
  err(
    "new RandomV4Weights(…, 2^32)",
    () => new RandomV4Weights(tiny, 2 ** 32),
    RangeError,
    /got number 4294967296/,
  ),
  err(
    'new RandomV4Weights(…, "1")',
    () => new RandomV4Weights(tiny, "1" as never),
    RangeError,
    /got the string "1"/,
  ),
  ok(
    "new RandomV4Weights(…, 2^32 − 1)",
    () => new RandomV4Weights(tiny, 2 ** 32 - 1),
    "the largest seed of the one rule",
    (w) => assert.equal((w as RandomV4Weights).seed, 2 ** 32 - 1),
  ),
  err(
    "new RandomV4Weights(…, { vocab: 0 })",
    () => new RandomV4Weights(hashed, 1, { vocab: 0 }),
    RangeError,
    /RandomV4Weights options\.vocab must be an integer in \[1, 16777216\], got number 0/,
  ),
  err(
    "new RandomV4Weights(…, { vocab: 2^24 + 1 })",
    () => new RandomV4Weights(hashed, 1, { vocab: 2 ** 24 + 1 }),
    RangeError,
    /vocab must be an integer in \[1, 16777216\], got number 16777217/,
  ),
  err(
    "new RandomV4Weights(…, { vocab: 2.5 })",
    () => new RandomV4Weights(hashed, 1, { vocab: 2.5 }),
    RangeError,
    /got number 2\.5/,
  ),
  err(
    'new RandomV4Weights(…, { vocab: "64" })',
    () => new RandomV4Weights(hashed, 1, { vocab: "64" as never }),
    RangeError,
    /got the string "64"/,
  ),
  ok(
    "new RandomV4Weights(…, { vocab: 1 })",
    () => new RandomV4Weights(hashed, 1, { vocab: 1 }).gate(),
    "one token id: a table of one row",
    (g) => assert.equal((g as { tid2eid: Int32Array }).tid2eid.length, hashed.topK),
  ),

  // 3. Codec modes.
  err(
    'encodeE8m0(3, "bogus")',
    () => encodeE8m0(3, "bogus" as never),
    RangeError,
    /encodeE8m0: rounding must be "zero" or "up", got the string "bogus"/,
  ),
  err("encodeE8m0(3)", () => (encodeE8m0 as (x: number) => number)(3), RangeError, /got undefined/),
  ok(
    'encodeE8m0(3, "zero" | "up")',
    () => [encodeE8m0(3, "zero"), encodeE8m0(3, "up")],
    "the two modes: 2^1 and 2^2",
    (r) => assert.deepEqual(r, [128, 129]),
  ),
  err(
    'quantizeActivations(…, "FP32")',
    () => quantizeActivations(x, T, tiny.hidden, "FP32" as never),
    RangeError,
    /scale format must be "fp32" or "ue8m0", got the string "FP32"/,
  ),

  // 4. Values described by type: "1" and 1n never read as the number 1.
  err(
    'decodeE4m3("1")',
    () => decodeE4m3("1" as never),
    RangeError,
    /e4m3 code must be an integer in \[0, 255\], got the string "1"/,
  ),
  err("decodeE5m2(1n)", () => decodeE5m2(1n as never), RangeError, /got the bigint 1n/),
  err(
    'decodeE2m1("1")',
    () => decodeE2m1("1" as never),
    RangeError,
    /e2m1 code must be an integer in \[0, 15\], got the string "1"/,
  ),
  err(
    'decodeE8m0("127")',
    () => decodeE8m0("127" as never),
    RangeError,
    /UE8M0 byte must be an integer in \[0, 255\], got the string "127"/,
  ),
  err(
    'checksum("abc")',
    () => checksum("abc" as never),
    TypeError,
    /checksum: bytes must be a typed array, got the string "abc"/,
  ),
  err(
    "groupByExpert(5)",
    () => groupByExpert(5 as never, T, tiny),
    RouterError,
    /routing must be \{ ids: Int32Array, weights: Float32Array \}, got number 5/,
  ),
  err(
    'new GeneratedWeights(cfg, "1")',
    () => new GeneratedWeights(tiny, "1" as never),
    RangeError,
    /seed must be an integer in \[0, 4294967295\], got the string "1"/,
  ),
  err(
    "new GeneratedWeights(cfg, 1n)",
    () => new GeneratedWeights(tiny, 1n as never),
    RangeError,
    /seed must be an integer in \[0, 4294967295\], got the bigint 1n/,
  ),
  err(
    "new GeneratedWeights(cfg, true)",
    () => new GeneratedWeights(tiny, true as never),
    RangeError,
    /got the boolean true/,
  ),
  err(
    'weights.expert("0")',
    () => weights.expert("0" as never),
    RangeError,
    /expert index must be an integer in \[0, 8\), got the string "0"/,
  ),
  err(
    'validateConfig({ …, hidden: "256" })',
    () => validateConfig({ ...tiny, hidden: "256" } as never),
    ConfigError,
    /hidden must be an integer in \[128, 65536\], got the string "256"/,
  ),

  // 5. Checkpoint layer indices: a non-integer says so, not "out of range".
  err(
    'checkpoint.layer("1")',
    () => checkpoint.layer("1" as never),
    CheckpointError,
    /^layer must be an integer, got the string "1"$/,
  ),
  err(
    "checkpoint.layer(1.5)",
    () => checkpoint.layer(1.5),
    CheckpointError,
    /layer must be an integer, got number 1\.5/,
  ),
  err(
    "checkpoint.layer(undefined)",
    () => (checkpoint.layer as (l?: number) => unknown)(),
    CheckpointError,
    /layer must be an integer, got undefined/,
  ),
  err(
    'checkpoint.mtp("0")',
    () => checkpoint.mtp("0" as never),
    CheckpointError,
    /MTP block must be an integer, got the string "0"/,
  ),
  err(
    "checkpoint.byName(3)",
    () => checkpoint.byName(3 as never),
    CheckpointError,
    /layer name must be a string, got number 3/,
  ),
  err(
    "checkpoint.layer(4)",
    () => checkpoint.layer(4),
    CheckpointError,
    /layer 4 is out of range: num_hidden_layers is 4 \(layers 0\.\.3\)/,
  ),

  // 6. Configs whose largest arrays cannot be allocated (2^32 elements at most).
  err(
    "resolveConfig tiny { hidden 65536, intermediate 65536, maxTokens 1 }",
    () => resolveConfig("tiny", { hidden: 65536, intermediate: 65536, maxTokens: 1 }),
    ConfigError,
    /2 · intermediate · hidden = 2 · 65536 · 65536 = 8589934592 elements of one W1 exceed 4294967296 \(2\^32\)/,
  ),
  err(
    "resolveConfig tiny { hidden 65536, intermediate 16384, numShared 3 }",
    () => resolveConfig("tiny", { hidden: 65536, intermediate: 16384, numShared: 3, maxTokens: 1 }),
    ConfigError,
    /2 · intermediate · numShared · hidden = 2 · 16384 · 3 · 65536 = 6442450944 elements of one W1 exceed/,
  ),
  err(
    "resolveConfig tiny { hidden 65536, maxTokens 65536 }",
    () => resolveConfig("tiny", { hidden: 65536, maxTokens: 65536 }),
    ConfigError,
    /maxTokens · topK · hidden = 65536 · 2 · 65536 = 8589934592 expert outputs exceed 4294967296/,
  ),
  ok(
    "resolveConfig tiny { hidden 65536, intermediate 32768, maxTokens 1 }",
    () => resolveConfig("tiny", { hidden: 65536, intermediate: 32768, maxTokens: 1 }),
    "one W1 of exactly 2^32 elements: the limit itself (validateConfig's TSDoc)",
    (c) => assert.equal((c as { intermediate: number }).intermediate, 32768),
  ),
  ok(
    "resolveConfig pro { maxTokens 65536 }",
    () => resolveConfig("pro", { maxTokens: 65536 }),
    "the largest preset at the largest token count: 65536 · 6 · 7168 < 2^32",
    (c) => assert.equal((c as { maxTokens: number }).maxTokens, 65536),
  ),

  // 7. planDispatch's arguments, each checked for its kind.
  err(
    "planDispatch without weights",
    () => planDispatch([{ ids: routing.ids, tokens: T }] as never, 8, 2),
    DispatchError,
    /planDispatch: routing\[0\]\.weights must be a Float32Array, got undefined/,
  ),
  err(
    "planDispatch with the config for numExperts",
    () => planDispatch([rankRouting()], tiny as never, 2),
    DispatchError,
    /planDispatch: numExperts must be a positive integer, got Object/,
  ),
  err(
    'planDispatch topK "2"',
    () => planDispatch([rankRouting()], 8, "2" as never),
    DispatchError,
    /planDispatch: topK must be a positive integer, got the string "2"/,
  ),
  err(
    "planDispatch [null]",
    () => planDispatch([null] as never, 8, 2),
    DispatchError,
    /planDispatch: routing\[0\] must be \{ ids, weights, tokens \}, got null/,
  ),
  err(
    "planDispatch ids as an Array",
    () => planDispatch([rankRouting({ ids: Array.from(routing.ids) })] as never, 8, 2),
    DispatchError,
    /routing\[0\]\.ids must be an Int32Array, got Array/,
  ),
  err(
    "planDispatch tokens -1",
    () => planDispatch([rankRouting({ tokens: -1 })] as never, 8, 2),
    DispatchError,
    /routing\[0\]\.tokens must be a non-negative integer, got number -1/,
  ),
  ok(
    "planDispatch of one rank's routing",
    () => planDispatch([rankRouting()], 8, 2),
    "well-formed arguments",
    (plan) => assert.equal((plan as { ranks: number }).ranks, 1),
  ),
];

const clear = rows.filter((r) => "error" in r).length;
const accepted = rows.length - clear;

describe(`bad options and arguments to the public API: ${rows.length} tried, ${clear} clear errors, ${accepted} accepted as documented`, () => {
  for (const row of rows) {
    if ("error" in row) {
      it(`${row.call}: ${row.error.name}`, () => {
        assert.throws(row.run, (e: unknown) => {
          assert.ok(e instanceof row.error, `${row.call}: threw ${String(e)}, expected ${row.error.name}`);
          assert.match((e as Error).message, row.message);
          return true;
        });
      });
    } else {
      it(`${row.call}: accepted (${row.accepted})`, () => {
        row.check(row.run());
      });
    }
  }

  it("SymmetricHeap.join({ …, timeout }): SymmetricHeapError before any CUDA call", async () => {
    await assert.rejects(
      SymmetricHeap.join({
        device: null as never,
        rank: 0,
        ranks: 2,
        bytes: 16,
        socketPath: path.join(dir, "s.sock"),
        timeout: 5,
      } as never),
      (e: unknown) => {
        assert.ok(e instanceof SymmetricHeapError);
        assert.match(
          e.message,
          /unknown SymmetricHeap\.join options field timeout \(did you mean timeoutMs\?\)/,
        );
        return true;
      },
    );
  });

  it("writeResults with an unknown meta field writes no file", () => {
    assert.equal(fs.existsSync(path.join(dir, "results.json")), false);
  });

  it("describeValue names every type and quotes strings", () => {
    assert.equal(describeValue("1"), 'the string "1"');
    assert.equal(describeValue(1n), "the bigint 1n");
    assert.equal(describeValue(true), "the boolean true");
    assert.equal(describeValue(Symbol("s")), "the symbol Symbol(s)");
    assert.equal(describeValue(1), "number 1");
    assert.equal(describeValue(Number.NaN), "number NaN");
    assert.equal(describeValue(null), "null");
    assert.equal(describeValue(undefined), "undefined");
    assert.equal(describeValue([1]), "Array");
    assert.equal(describeValue(new Uint8Array(1)), "Uint8Array");
    assert.equal(
      describeValue(() => {}),
      "function",
    );
  });
});
