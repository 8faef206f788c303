import assert from "node:assert/strict";
import { test } from "node:test";
import {
  allocHostArray,
  checkHostArray,
  contiguousStrides,
  DTYPE_BYTES,
  DTYPES,
  describeTensor,
  elementCount,
  isDType,
  tensorBytes,
} from "../../src/cuda/tensor.js";

test("element counts, strides and bytes of contiguous shapes", () => {
  assert.equal(elementCount([]), 1);
  assert.equal(elementCount([7, 0, 3]), 0);
  assert.equal(elementCount([4, 128, 3]), 1536);
  assert.deepEqual(contiguousStrides([4, 128, 3]), [384, 3, 1]);
  assert.deepEqual(contiguousStrides([5]), [1]);
  assert.deepEqual(contiguousStrides([]), []);
  assert.equal(tensorBytes("bf16", [4, 128]), 1024);
  assert.equal(tensorBytes("fp8_e4m3", [4, 128]), 512);
  assert.equal(tensorBytes("int64", [3]), 24);
  assert.deepEqual(
    DTYPES.map((d) => DTYPE_BYTES[d]),
    [1, 2, 4, 4, 8, 1],
  );
  assert.equal(describeTensor("fp32", [2, 3]), "fp32[2, 3]");
});

test("bad shapes and dtypes are rejected with the offending value", () => {
  assert.throws(() => elementCount([2, -1]), /dimension 1 is -1/);
  assert.throws(() => elementCount([2, 1.5]), /dimension 1 is 1.5/);
  assert.throws(() => elementCount([2 ** 30, 2 ** 30]), /too many elements/);
  assert.throws(() => tensorBytes("fp16" as never, [2]), /unknown dtype "fp16"/);
  assert.ok(isDType("bf16"));
  assert.ok(!isDType("float"));
});

test("host arrays must be the dtype's typed array with the shape's length", () => {
  checkHostArray("fp8_e4m3", [2, 4], new Uint8Array(8));
  checkHostArray("bf16", [2, 4], new Uint16Array(8));
  checkHostArray("fp32", [8], new Float32Array(8));
  checkHostArray("int32", [8], new Int32Array(8));
  checkHostArray("int64", [8], new BigInt64Array(8));
  checkHostArray("uint8", [8], new Uint8Array(8));
  assert.throws(
    () => checkHostArray("bf16", [2, 4], new Float32Array(8)),
    /bf16\[2, 4\] needs a Uint16Array on the host, got Float32Array/,
  );
  assert.throws(
    () => checkHostArray("fp32", [2, 4], new Float32Array(7)),
    /fp32\[2, 4\] has 8 elements but the Float32Array has 7/,
  );
  assert.throws(() => checkHostArray("int64", [1], [1n]), /needs a BigInt64Array on the host, got object/);
  assert.throws(() => checkHostArray("fp8_e4m3", [1], new Int8Array(1)), /got Int8Array/);
  assert.throws(() => checkHostArray("int32", [1], null), /got null/);
});

test("allocHostArray gives the right kind", () => {
  assert.ok(allocHostArray("bf16", 3) instanceof Uint16Array);
  assert.ok(allocHostArray("fp8_e4m3", 3) instanceof Uint8Array);
  assert.ok(allocHostArray("int64", 3) instanceof BigInt64Array);
  assert.equal(allocHostArray("fp32", 5).length, 5);
});
