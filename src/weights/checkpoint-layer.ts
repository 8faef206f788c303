/**
 * One MoE block of a DeepSeek-V4 checkpoint as a MoEWeightSource: tensors read lazily with positioned
 * reads at their shard offsets (an expert at a time, never a whole shard), E8M0 scales decoded and
 * codes checked on the way. `Checkpoint.layer(L)` / `mtp(i)` (checkpoint.ts) build it.
 */
import fs from "node:fs";
import { QUANT_BLOCK, type ValidatedConfig } from "../config/config.js";
import {
  countFp4ToFp8Inexact,
  describeE8m0Problem,
  E2M1_MAX,
  E8M0_BIAS,
  firstBadE8m0,
  fp4BlocksExact,
} from "../numerics/fp4.js";
import { FP8_E4M3_MAX, firstE4m3Nan } from "../numerics/fp8.js";
import type { TensorLocation } from "./checkpoint.js";
import { CheckpointError, type V4Block, type V4Projection, v4Names } from "./checkpoint-format.js";
import { ExpertCache } from "./expert-cache.js";
import { openForReading, readExactly } from "./safetensors.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  emptyMxfp4Matrix,
  type Fp4Exactness,
  type Fp4ExpertWeights,
  type GateWeights,
  type MoEWeightSource,
  MXFP4_GROUP,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
} from "./types.js";

/**
 * 2^(b − 127) for the E8M0 scale bytes of FP8 weights (exact in fp32: b = 0 is the subnormal 2^−127);
 * 0xFF, and bytes whose scale times 448 overflows fp32, throw naming where (checkE8m0).
 */
export function e8m0ToScales(bytes: Uint8Array, file: string, name: string, cols: number): Float32Array {
  checkE8m0(bytes, file, name, cols, FP8_E4M3_MAX, "e4m3");
  const out = new Float32Array(bytes.length);
  for (let i = 0; i < bytes.length; i++) out[i] = 2 ** (bytes[i] - E8M0_BIAS);
  return out;
}

/** Throws naming tensor, row and column of the first scale byte firstBadE8m0 refuses for `format`'s codes. */
function checkE8m0(
  bytes: Uint8Array,
  file: string,
  name: string,
  cols: number,
  largest = E2M1_MAX,
  format = "e2m1",
): void {
  const i = firstBadE8m0(bytes, largest);
  if (i >= 0) {
    throw new CheckpointError(
      `${file}: tensor ${name}[${Math.floor(i / cols)}, ${i % cols}] ${describeE8m0Problem(bytes[i], largest, format)}`,
    );
  }
}

function checkE4m3(codes: Uint8Array, file: string, name: string, cols: number): void {
  const i = firstE4m3Nan(codes);
  if (i >= 0) {
    throw new CheckpointError(
      `${file}: tensor ${name}[${Math.floor(i / cols)}, ${i % cols}] is e4m3 NaN (code 0x${codes[i].toString(16)})`,
    );
  }
}

export class CheckpointLayer implements MoEWeightSource {
  private readonly experts: ExpertCache;
  private sharedWeights: ExpertWeights | null | undefined;
  private gateWeights: GateWeights | undefined;

  constructor(
    readonly block: V4Block,
    readonly config: ValidatedConfig,
    private readonly locations: Map<string, TensorLocation>,
    cachedExperts: number,
  ) {
    this.experts = new ExpertCache(config, cachedExperts);
  }

  /** Shards this block's tensors lie in. */
  get files(): string[] {
    return [...new Set([...this.locations.values()].map((l) => l.file))].sort();
  }

  expert(e: number): RoutedExpertWeights {
    return this.experts.get(e, () => {
      const name = (w: V4Projection, p: "weight" | "scale") => v4Names.routed(this.block, e, w, p);
      return this.config.expertFormat === "fp4"
        ? this.readFp4(name, this.config.intermediate)
        : this.readFp8(name, this.config.intermediate);
    });
  }

  shared(): ExpertWeights | null {
    if (this.sharedWeights === undefined) {
      this.sharedWeights =
        this.config.numShared === 0
          ? null
          : this.readFp8(
              (w, p) => v4Names.shared(this.block, w, p),
              this.config.intermediate * this.config.numShared,
            );
    }
    return this.sharedWeights;
  }

  gate(): GateWeights {
    if (this.gateWeights === undefined) {
      const weight = new Uint16Array(this.config.numExperts * this.config.hidden);
      this.read(v4Names.gateWeight(this.block), weight);
      let bias: Float32Array | null = null;
      let tid2eid: Int32Array | null = null;
      if (this.config.router.hashRouted === true) tid2eid = this.readTid2eid();
      else if (this.config.router.correctionBias) {
        bias = new Float32Array(this.config.numExperts);
        this.read(v4Names.gateBias(this.block), bias);
      }
      this.gateWeights = { weight, bias, tid2eid };
    }
    return this.gateWeights;
  }

  /**
   * FP4 experts: how many routed elements the kernels' e4m3 form does not hold exactly
   * (countFp4ToFp8Inexact, docs/numerics.md). Reads every expert's scale bytes, and its codes only where
   * a 128 × 128 block spans more than 14 (an inexact element needs one).
   */
  fp4Exactness(): Fp4Exactness {
    const { hidden: h, intermediate: inter, numExperts } = this.config;
    if (this.config.expertFormat !== "fp4") {
      throw new CheckpointError(`${this.block}: the routed experts are FP8; exactness applies to FP4 ones`);
    }
    let inexact = 0;
    // W1, W3 ([I, H]) and W2 ([H, I]) have as many scale bytes each: one buffer serves all three. W1 and
    // W3 are the kernels' W1 rows 0..I−1 and I..2I−1, so their 128-row blocks are the kernels'.
    const s = new Uint8Array((inter * h) / MXFP4_GROUP);
    for (let e = 0; e < numExperts; e++) {
      const name = (w: V4Projection, p: "weight" | "scale") => v4Names.routed(this.block, e, w, p);
      let exact = true;
      for (const w of ["w1", "w3", "w2"] as const) {
        const [rows, cols] = w === "w2" ? [h, inter] : [inter, h];
        this.read(name(w, "scale"), s);
        checkE8m0(s, this.fileOf(name(w, "scale")), name(w, "scale"), cols / MXFP4_GROUP);
        exact = exact && fp4BlocksExact(s, rows, cols);
      }
      if (exact) continue;
      const x = this.readFp4(name, inter);
      inexact += countFp4ToFp8Inexact(x.w1) + countFp4ToFp8Inexact(x.w2);
    }
    return { elements: numExperts * 3 * inter * h, inexact };
  }

  /** Positioned read of a whole tensor into `into` (byte lengths were checked when the block was opened). */
  private read(name: string, into: ArrayBufferView): void {
    const loc = this.locations.get(name);
    if (loc === undefined) throw new CheckpointError(`${this.block}: tensor ${name} was not checked`);
    const bytes = new Uint8Array(into.buffer, into.byteOffset, into.byteLength);
    if (bytes.length !== loc.info.end - loc.info.begin) {
      throw new CheckpointError(
        `${loc.file}: tensor ${name} holds ${loc.info.end - loc.info.begin} bytes, expected ${bytes.length}`,
      );
    }
    const fd = openForReading(loc.file);
    try {
      readExactly(fd, bytes, loc.header.dataStart + loc.info.begin, `tensor ${name}`, loc.file);
    } finally {
      fs.closeSync(fd);
    }
  }

  private fileOf(name: string): string {
    return this.locations.get(name)?.file ?? this.block;
  }

  /** w1 (gate) and w3 (up) stacked into W1 [2I, H], gate rows first; w2 as W2 [H, I]. */
  private readFp8(name: (w: V4Projection, p: "weight" | "scale") => string, inter: number): ExpertWeights {
    const h = this.config.hidden;
    const matrix = (rows: number, cols: number): BlockQuantized => ({
      q: new Uint8Array(rows * cols),
      scales: new Float32Array((rows / QUANT_BLOCK) * (cols / QUANT_BLOCK)),
      rows,
      cols,
    });
    const w1 = matrix(2 * inter, h);
    const w2 = matrix(h, inter);
    const part = (w: V4Projection, m: BlockQuantized, r0: number, rows: number) => {
      const q = m.q.subarray(r0 * m.cols, (r0 + rows) * m.cols);
      this.read(name(w, "weight"), q);
      checkE4m3(q, this.fileOf(name(w, "weight")), name(w, "weight"), m.cols);
      const blockCols = m.cols / QUANT_BLOCK;
      const raw = new Uint8Array((rows / QUANT_BLOCK) * blockCols);
      this.read(name(w, "scale"), raw);
      m.scales.set(
        e8m0ToScales(raw, this.fileOf(name(w, "scale")), name(w, "scale"), blockCols),
        (r0 / QUANT_BLOCK) * blockCols,
      );
    };
    part("w1", w1, 0, inter);
    part("w3", w1, inter, inter);
    part("w2", w2, 0, h);
    return { w1, w2 };
  }

  private readFp4(name: (w: V4Projection, p: "weight" | "scale") => string, inter: number): Fp4ExpertWeights {
    const h = this.config.hidden;
    const w1 = emptyMxfp4Matrix(2 * inter, h);
    const w2 = emptyMxfp4Matrix(h, inter);
    const part = (w: V4Projection, m: Mxfp4Matrix, r0: number, rows: number) => {
      this.read(name(w, "weight"), m.packed.subarray((r0 * m.cols) / 2, ((r0 + rows) * m.cols) / 2));
      const groups = m.cols / MXFP4_GROUP;
      const s = m.scales.subarray(r0 * groups, (r0 + rows) * groups);
      this.read(name(w, "scale"), s);
      checkE8m0(s, this.fileOf(name(w, "scale")), name(w, "scale"), groups);
    };
    part("w1", w1, 0, inter);
    part("w3", w1, inter, inter);
    part("w2", w2, 0, h);
    return { format: "fp4", w1, w2 };
  }

  /** tid2eid as int32 [vocab, topK]; every id must be an expert and distinct within its row. */
  private readTid2eid(): Int32Array {
    const name = v4Names.tid2eid(this.block);
    const loc = this.locations.get(name);
    if (loc === undefined) throw new CheckpointError(`${this.block}: tensor ${name} was not checked`);
    const [vocab, k] = loc.info.shape;
    const out = new Int32Array(vocab * k);
    if (loc.info.dtype === "I32") this.read(name, out);
    else {
      const wide = new BigInt64Array(vocab * k);
      this.read(name, wide);
      for (let i = 0; i < wide.length; i++) {
        const v = wide[i];
        out[i] = v >= -1n && v < BigInt(this.config.numExperts) ? Number(v) : -2;
      }
    }
    const E = this.config.numExperts;
    for (let t = 0; t < vocab; t++) {
      for (let j = 0; j < k; j++) {
        const id = out[t * k + j];
        if (id < 0 || id >= E) {
          throw new CheckpointError(
            `${loc.file}: tensor ${name}[${t}, ${j}] is not an expert id in [0, ${E})`,
          );
        }
        for (let i = 0; i < j; i++) {
          if (out[t * k + i] === id) {
            throw new CheckpointError(`${loc.file}: tensor ${name}[${t}]: expert ${id} appears twice`);
          }
        }
      }
    }
    return out;
  }
}
