/**
 * The fused pipeline's input buffer on the GPU: the boundary RMSNorm writes the FP8 rows and the gate
 * writes the routing straight into it, and the forward then skips the quantization pass with the same
 * bits as a forward that quantizes; every case the tag does not vouch for (no ticket, a stale ticket, a
 * narrowed batch, routing from the caller, over capacity) quantizes and still gives the right bits.
 * Skips with the reason without a GPU; with MEGAMOE_REQUIRE_GPU=1 it fails instead.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { resolveConfig } from "../../src/config/config.js";
import { DeviceTensor } from "../../src/cuda/index.js";
import { DeviceMoEWeights } from "../../src/kernels/device-weights.js";
import { routeOnDevice } from "../../src/kernels/gate/gate.js";
import { rmsNormOnDevice } from "../../src/kernels/norm/norm.js";
import { f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { FusedPipeline } from "../../src/pipeline/fused.js";
import type { InputTicket } from "../../src/pipeline/input-tag.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { describeGpu, testDevice } from "../helpers/gpu.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("prepared input tests");
const EPS = 1e-6;

describeGpu("fused pipeline: FP8 rows and routing written by the kernels before the layer", () => {
  test("the prepared forward skips the pass with the quantizing forward's bits; every other case quantizes", () => {
    const d = testDevice();
    const config = resolveConfig("tiny");
    const H = config.hidden;
    const k = config.topK;
    const capacity = 64;
    const weights = new GeneratedWeights(config, seed, { cachedExperts: config.numExperts });
    const dw = DeviceMoEWeights.upload(d, weights);
    const pipeline = new FusedPipeline(d, dw, capacity);
    const owned: DeviceTensor[] = [];
    const keep = <T extends DeviceTensor>(t: T) => {
      owned.push(t);
      return t;
    };
    try {
      const random = rng(seed + 1);
      const normWeight = keep(
        DeviceTensor.fromHost(
          d,
          "bf16",
          [H],
          Uint16Array.from({ length: H }, () => f32ToBf16Bits(0.5 + random())),
        ),
      );
      const tokens = 37;
      const residual = keep(
        DeviceTensor.fromHost(d, "bf16", [tokens, H], generateActivations(seed + 2, tokens, H)),
      );
      const y = keep(DeviceTensor.empty(d, "bf16", [tokens, H]));
      const gate = { weight: dw.gateWeight, bias: dw.gateBias };

      // A serving step: norm (bf16 for the gate, FP8 into the buffer) → gate (routing into the buffer).
      const step = (rows: number) => {
        const p = pipeline.prepareInput(rows);
        rmsNormOnDevice(
          d,
          { x: residual.view([rows, H]) },
          normWeight,
          EPS,
          { y: y.view([rows, H]), fp8: { q: p.xq, scales: p.xScales, format: config.scaleFormat } },
          null,
        );
        assert.ok(pipeline.tag.markRows(p.ticket));
        routeOnDevice(d, y.view([rows, H]), gate, config, { ids: p.ids, weights: p.weights }, null);
        assert.ok(pipeline.tag.markRouting(p.ticket));
        return p;
      };
      const run = (
        rows: number,
        routing: { ids: DeviceTensor; weights: DeviceTensor },
        ticket?: InputTicket,
      ) => {
        const out = keep(DeviceTensor.empty(d, "bf16", [rows, H]));
        out.fill(0xff);
        const quantized = pipeline.forward(
          {
            x: y.view([rows, H]),
            ids: routing.ids,
            weights: routing.weights,
            out,
            tokens: rows,
            shared: true,
          },
          null,
          ticket,
        );
        pipeline.checkStatus();
        return { quantized, out: out.toHost() as Uint16Array };
      };

      const p = step(tokens);
      const prepared = run(tokens, p, p.ticket);
      assert.equal(prepared.quantized, false, "a ready ticket must skip the quantization pass");
      assert.equal(prepared.out.indexOf(0xffff), -1, "unwritten output");
      // The same routing (copied out of the buffer), quantized by the layer: the same bits.
      const ids = keep(DeviceTensor.fromHost(d, "int32", [tokens, k], p.ids.toHost() as Int32Array));
      const w = keep(DeviceTensor.fromHost(d, "fp32", [tokens, k], p.weights.toHost() as Float32Array));
      const quantizing = run(tokens, { ids, weights: w });
      assert.equal(quantizing.quantized, true);
      assert.deepEqual(
        prepared.out,
        quantizing.out,
        "FP8 rows from the boundary kernel differ from the pass's",
      );

      // The pass above rewrote the buffer: the old ticket is dead.
      assert.equal(run(tokens, p, p.ticket).quantized, true, "stale ticket");
      // Routing given by the caller, with a ready ticket.
      const q = step(tokens);
      assert.equal(run(tokens, { ids, weights: w }, q.ticket).quantized, true, "caller routing");
      // A narrowed batch.
      const r = step(tokens);
      const narrowed = run(
        tokens - 5,
        { ids: r.ids.view([tokens - 5, k]), weights: r.weights.view([tokens - 5, k]) },
        r.ticket,
      );
      assert.equal(narrowed.quantized, true, "narrowed batch");
      assert.deepEqual(narrowed.out, quantizing.out.subarray(0, (tokens - 5) * H), "narrowed batch bits");
      // A ticket of another pipeline's buffer.
      const other = new FusedPipeline(d, dw, capacity);
      try {
        const s = step(tokens);
        const foreign = other.prepareInput(tokens);
        other.tag.markRows(foreign.ticket);
        other.tag.markRouting(foreign.ticket);
        assert.equal(run(tokens, s, foreign.ticket).quantized, true, "another buffer's ticket");
      } finally {
        other.dispose();
      }
      // Prefill over capacity cannot be prepared.
      assert.throws(() => pipeline.prepareInput(capacity + 1), RangeError);
    } finally {
      for (const t of owned) t.dispose();
      pipeline.dispose();
      dw.dispose();
    }
  });
});
