/**
 * The constants and struct layouts the driver layer hard-codes, checked against the installed cuda.h by
 * compiling a small C program (skipped without a C compiler or the CUDA headers).
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import {
  DeviceAttribute,
  FALLBACK_ERROR_NAMES,
  FunctionAttribute,
  LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
  LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
  LAUNCH_CONFIG_LAYOUT,
  MEM_ACCESS_DESC_LAYOUT,
  MEM_ALLOCATION_PROP_LAYOUT,
  MEM_LOCATION_SIZE,
  MemAccessFlags,
  MemAllocationType,
  MemAllocGranularity,
  MemHandleType,
  MemLocationType,
  StreamCaptureMode,
  TensorMapDataType,
  TensorMapInterleave,
  TensorMapL2Promotion,
  TensorMapOobFill,
  TensorMapSwizzle,
} from "../../src/cuda/driver.js";
import { TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES } from "../../src/cuda/kernel-args.js";
import { locateCudaInclude } from "../../src/cuda/locate.js";

const include = locateCudaInclude();
const cc =
  spawnSync("cc", ["--version"]).status === 0
    ? "cc"
    : spawnSync("gcc", ["--version"]).status === 0
      ? "gcc"
      : undefined;
const skip = !include.ok
  ? `CUDA headers not found: ${include.reason}`
  : !cc
    ? "no C compiler (cc/gcc)"
    : false;

/** [name in cuda.h, value in TypeScript] */
function expectedConstants(): [string, number][] {
  const list: [string, number][] = [];
  const add = (prefix: string, table: Record<string, number>, rename: (k: string) => string = (k) => k) => {
    for (const [k, v] of Object.entries(table)) list.push([`${prefix}${rename(k)}`, v]);
  };
  const bytesSuffix = (k: string) => (k === "NONE" ? k : `${k.slice(1)}B`);
  add("CU_DEVICE_ATTRIBUTE_", DeviceAttribute);
  add("CU_FUNC_ATTRIBUTE_", FunctionAttribute);
  add("CU_TENSOR_MAP_DATA_TYPE_", TensorMapDataType);
  add("CU_TENSOR_MAP_SWIZZLE_", TensorMapSwizzle, bytesSuffix);
  add("CU_TENSOR_MAP_INTERLEAVE_", TensorMapInterleave, bytesSuffix);
  add("CU_TENSOR_MAP_L2_PROMOTION_", TensorMapL2Promotion, (k) => (k === "NONE" ? k : `L2_${k.slice(1)}B`));
  add("CU_TENSOR_MAP_FLOAT_OOB_FILL_", TensorMapOobFill);
  add("CU_STREAM_CAPTURE_MODE_", StreamCaptureMode);
  add("CU_MEM_ALLOCATION_TYPE_", MemAllocationType);
  add("CU_MEM_LOCATION_TYPE_", MemLocationType);
  add("CU_MEM_HANDLE_TYPE_", MemHandleType);
  add("CU_MEM_ACCESS_FLAGS_", MemAccessFlags);
  add("CU_MEM_ALLOC_GRANULARITY_", MemAllocGranularity);
  list.push(["CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION]);
  list.push([
    "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION",
    LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
  ]);
  for (const [code, name] of Object.entries(FALLBACK_ERROR_NAMES)) list.push([name, Number(code)]);
  return list;
}

test("hard-coded CUDA constants and layouts match cuda.h", { skip }, () => {
  if (!include.ok || !cc) return;
  const constants = expectedConstants();
  const layout: [string, string, number][] = [
    ["sizeof(CUlaunchConfig)", "size", LAUNCH_CONFIG_LAYOUT.size],
    ["offsetof(CUlaunchConfig, gridDimX)", "gridDimX", LAUNCH_CONFIG_LAYOUT.gridDimX],
    ["offsetof(CUlaunchConfig, blockDimX)", "blockDimX", LAUNCH_CONFIG_LAYOUT.blockDimX],
    ["offsetof(CUlaunchConfig, sharedMemBytes)", "sharedMemBytes", LAUNCH_CONFIG_LAYOUT.sharedMemBytes],
    ["offsetof(CUlaunchConfig, hStream)", "hStream", LAUNCH_CONFIG_LAYOUT.hStream],
    ["offsetof(CUlaunchConfig, attrs)", "attrs", LAUNCH_CONFIG_LAYOUT.attrs],
    ["offsetof(CUlaunchConfig, numAttrs)", "numAttrs", LAUNCH_CONFIG_LAYOUT.numAttrs],
    ["sizeof(CUlaunchAttribute)", "attributeSize", LAUNCH_CONFIG_LAYOUT.attributeSize],
    ["offsetof(CUlaunchAttribute, value)", "attributeValue", LAUNCH_CONFIG_LAYOUT.attributeValue],
    ["offsetof(CUlaunchAttributeValue, clusterDim.x)", "clusterDim.x", 0],
    ["offsetof(CUlaunchAttributeValue, clusterDim.z)", "clusterDim.z", 8],
    ["sizeof(CUtensorMap)", "CUtensorMap size", TENSOR_MAP_BYTES],
    ["_Alignof(CUtensorMap)", "CUtensorMap alignment", TENSOR_MAP_ALIGN],
    ["sizeof(CUdeviceptr)", "CUdeviceptr size", 8],
    ["sizeof(CUmemGenericAllocationHandle)", "CUmemGenericAllocationHandle size", 8],
    ["sizeof(CUmemLocation)", "CUmemLocation size", MEM_LOCATION_SIZE],
    ["sizeof(CUmemAllocationProp)", "CUmemAllocationProp size", MEM_ALLOCATION_PROP_LAYOUT.size],
    ["offsetof(CUmemAllocationProp, type)", "prop.type", MEM_ALLOCATION_PROP_LAYOUT.type],
    [
      "offsetof(CUmemAllocationProp, requestedHandleTypes)",
      "prop.requestedHandleTypes",
      MEM_ALLOCATION_PROP_LAYOUT.requestedHandleTypes,
    ],
    [
      "offsetof(CUmemAllocationProp, location.type)",
      "prop.location.type",
      MEM_ALLOCATION_PROP_LAYOUT.locationType,
    ],
    ["offsetof(CUmemAllocationProp, location.id)", "prop.location.id", MEM_ALLOCATION_PROP_LAYOUT.locationId],
    [
      "offsetof(CUmemAllocationProp, win32HandleMetaData)",
      "prop.win32HandleMetaData",
      MEM_ALLOCATION_PROP_LAYOUT.win32HandleMetaData,
    ],
    ["offsetof(CUmemAllocationProp, allocFlags)", "prop.allocFlags", MEM_ALLOCATION_PROP_LAYOUT.allocFlags],
    ["sizeof(CUmemAccessDesc)", "CUmemAccessDesc size", MEM_ACCESS_DESC_LAYOUT.size],
    ["offsetof(CUmemAccessDesc, location.type)", "desc.location.type", MEM_ACCESS_DESC_LAYOUT.locationType],
    ["offsetof(CUmemAccessDesc, location.id)", "desc.location.id", MEM_ACCESS_DESC_LAYOUT.locationId],
    ["offsetof(CUmemAccessDesc, flags)", "desc.flags", MEM_ACCESS_DESC_LAYOUT.flags],
    ["sizeof(CUstream)", "handle size", 8],
  ];
  const lines = [
    "#include <cuda.h>",
    "#include <stddef.h>",
    "#include <stdio.h>",
    "int main(void) {",
    ...constants.map(([name]) => `  printf("%lld\\n", (long long)(${name}));`),
    ...layout.map(([expr]) => `  printf("%lld\\n", (long long)(${expr}));`),
    "  return 0;",
    "}",
  ];
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  try {
    const src = path.join(dir, "check.c");
    const exe = path.join(dir, "check");
    fs.writeFileSync(src, lines.join("\n"));
    const build = spawnSync(cc, ["-std=c11", `-I${include.path}`, "-o", exe, src], { encoding: "utf8" });
    assert.equal(build.status, 0, build.stderr);
    const run = spawnSync(exe, [], { encoding: "utf8" });
    assert.equal(run.status, 0, run.stderr);
    const values = run.stdout.trim().split("\n").map(Number);
    constants.forEach(([name, ours], i) => {
      assert.equal(ours, values[i], `${name}`);
    });
    layout.forEach(([expr, what, ours], i) => {
      assert.equal(ours, values[constants.length + i], `${what}: ${expr}`);
    });
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
