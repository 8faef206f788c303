import assert from "node:assert/strict";
import { test } from "node:test";
import koffi from "koffi";
import {
  alignedHostBytes,
  allocTensorMapBytes,
  KernelArgs,
  TENSOR_MAP_ALIGN,
} from "../../src/cuda/kernel-args.js";

/** Read `n` bytes of native memory at `address` (checks the addresses in `params` really point at the slots). */
function readNative(address: bigint, n: number): Uint8Array {
  return new Uint8Array(koffi.view(address, n)).slice();
}

test("scalar slots are 8 bytes apart and params holds their addresses", () => {
  const args = new KernelArgs(5);
  assert.equal(args.params.length, 5);
  for (let i = 1; i < 5; i++) assert.equal(args.params[i]! - args.params[i - 1]!, 8n);
  assert.equal(koffi.address(args.params), args.paramsAddress);
  assert.equal(args.params[0]! % 8n, 0n);
});

test("setters write little-endian values into the slots the driver reads", () => {
  const args = new KernelArgs(6);
  args
    .ptr(0, 0x1122334455667788n)
    .i32(1, -2)
    .u32(2, 0xdeadbeef)
    .f32(3, 1.5)
    .u64(4, 2n ** 64n - 2n)
    .i64(5, -3n);
  assert.deepEqual([...readNative(args.params[0]!, 8)], [0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
  assert.deepEqual([...readNative(args.params[1]!, 4)], [0xfe, 0xff, 0xff, 0xff]);
  assert.deepEqual([...readNative(args.params[2]!, 4)], [0xef, 0xbe, 0xad, 0xde]);
  assert.deepEqual([...readNative(args.params[3]!, 4)], [0x00, 0x00, 0xc0, 0x3f]); // 1.5f
  assert.deepEqual([...readNative(args.params[4]!, 8)], [0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
  assert.deepEqual([...readNative(args.params[5]!, 8)], [0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
  // mutate in place: same addresses, new values
  const before = [...args.params];
  args.ptr(0, 42n);
  assert.deepEqual([...args.params], before);
  assert.deepEqual([...readNative(args.params[0]!, 8)], [42, 0, 0, 0, 0, 0, 0, 0]);
  assert.deepEqual([...args.slotBytes(0)], [42, 0, 0, 0, 0, 0, 0, 0]);
});

test("tensor-map slots are 128 bytes, aligned as cuda.h declares CUtensorMap, between scalar slots", () => {
  assert.ok(TENSOR_MAP_ALIGN >= 64 && TENSOR_MAP_ALIGN % 64 === 0);
  const args = new KernelArgs(5, { tensorMaps: [1, 3] });
  for (const i of [1, 3]) {
    assert.equal(args.params[i]! % BigInt(TENSOR_MAP_ALIGN), 0n, `slot ${i} alignment`);
    const view = args.tensorMap(i);
    assert.equal(view.byteLength, 128);
    assert.equal(koffi.address(view), args.params[i]);
  }
  // slots do not overlap
  const spans = [0, 1, 2, 3, 4].map((i) => [
    args.params[i]!,
    args.params[i]! + BigInt(args.slotBytes(i).byteLength),
  ]);
  spans.sort((a, b) => (a[0]! < b[0]! ? -1 : 1));
  for (let i = 1; i < spans.length; i++) assert.ok(spans[i]![0]! >= spans[i - 1]![1]!, "overlapping slots");
  const map = new Uint8Array(128).map((_, i) => (i * 7 + 1) & 0xff);
  args.setTensorMap(3, map).ptr(4, 7n);
  assert.deepEqual(readNative(args.params[3]!, 128), map);
  assert.throws(() => args.ptr(1, 0n), /not a scalar slot/);
  assert.throws(() => args.tensorMap(0), /not declared as a tensor map/);
  assert.throws(() => args.setTensorMap(1, new Uint8Array(64)), /128 bytes/);
});

test("struct slots hold by-value bytes", () => {
  const args = new KernelArgs(2, { structs: { 1: 20 } });
  assert.equal(args.params[1]! % 16n, 0n);
  const bytes = new Uint8Array(20).map((_, i) => i + 1);
  args.struct(1, bytes);
  assert.deepEqual(readNative(args.params[1]!, 20), bytes);
  assert.throws(() => args.struct(1, new Uint8Array(40)), /exceed/);
  assert.throws(() => args.struct(0, bytes), /not declared as a struct/);
});

test("bad indices and out-of-range values throw", () => {
  const args = new KernelArgs(2);
  assert.throws(() => args.i32(2, 1), RangeError);
  assert.throws(() => args.i32(-1, 1), RangeError);
  assert.throws(() => args.i32(0, 2 ** 31), /32-bit integer/);
  assert.throws(() => args.i32(0, 1.5), /32-bit integer/);
  assert.throws(() => args.u32(0, -1), /unsigned 32-bit/);
  assert.throws(() => args.u64(0, -1n), /out of range/);
  assert.throws(() => args.i64(0, 2n ** 63n), /out of range/);
  assert.throws(() => new KernelArgs(2, { tensorMaps: [2] }), /outside/);
  assert.throws(() => new KernelArgs(2, { tensorMaps: [1], structs: { 1: 8 } }), /declared twice/);
  assert.equal(new KernelArgs(0).params.length, 0);
});

test("aligned host buffers", () => {
  for (const align of [16, 64, 256]) {
    const b = alignedHostBytes(100, align);
    assert.equal(b.address % BigInt(align), 0n);
    assert.equal(koffi.address(b.view), b.address);
    assert.equal(b.view.byteLength, 100);
  }
  assert.throws(() => alignedHostBytes(8, 48), /power of two/);
  const m = allocTensorMapBytes();
  assert.equal(m.byteLength, 128);
  assert.equal(koffi.address(m) % BigInt(TENSOR_MAP_ALIGN), 0n);
});
