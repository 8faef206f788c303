/** The per-device memos the launchers keep their kernels and buffers in (no GPU: any object keys them). */
import assert from "node:assert/strict";
import { test } from "node:test";
import type { Device } from "../../src/cuda/index.js";
import { perDeviceMemo, perDeviceOnce } from "../../src/cuda/index.js";

const fakeDevice = (): Device => ({}) as Device;

test("perDeviceMemo makes one value per (device, key); perDeviceOnce one per device", () => {
  const [a, b] = [fakeDevice(), fakeDevice()];
  let made = 0;
  const memo = perDeviceMemo<string, number>();
  assert.equal(
    memo(a, "x", () => ++made),
    1,
  );
  assert.equal(
    memo(a, "x", () => ++made),
    1,
  );
  assert.equal(
    memo(a, "y", () => ++made),
    2,
  );
  assert.equal(
    memo(b, "x", () => ++made),
    3,
  );
  const once = perDeviceOnce<number>();
  assert.equal(
    once(a, () => ++made),
    4,
  );
  assert.equal(
    once(a, () => ++made),
    4,
  );
  assert.equal(
    once(b, () => ++made),
    5,
  );
});
