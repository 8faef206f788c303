/**
 * Constants of the CUDA driver API the bindings use (values from cuda.h, CUDA 13.0;
 * test/cuda/cuda-header.test.ts checks them against the header).
 */

/** `CUdevice_attribute` values used here. */
export const DeviceAttribute = {
  MAX_THREADS_PER_BLOCK: 1,
  MAX_SHARED_MEMORY_PER_BLOCK: 8,
  WARP_SIZE: 10,
  MAX_REGISTERS_PER_BLOCK: 12,
  CLOCK_RATE: 13,
  MULTIPROCESSOR_COUNT: 16,
  PCI_BUS_ID: 33,
  PCI_DEVICE_ID: 34,
  MEMORY_CLOCK_RATE: 36,
  GLOBAL_MEMORY_BUS_WIDTH: 37,
  L2_CACHE_SIZE: 38,
  PCI_DOMAIN_ID: 50,
  COMPUTE_CAPABILITY_MAJOR: 75,
  COMPUTE_CAPABILITY_MINOR: 76,
  MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 81,
  MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 97,
  VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 102,
  HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 103,
  CLUSTER_LAUNCH: 120,
} as const;

/** `CUfunction_attribute` values. */
export const FunctionAttribute = {
  MAX_THREADS_PER_BLOCK: 0,
  SHARED_SIZE_BYTES: 1,
  CONST_SIZE_BYTES: 2,
  LOCAL_SIZE_BYTES: 3,
  NUM_REGS: 4,
  PTX_VERSION: 5,
  BINARY_VERSION: 6,
  MAX_DYNAMIC_SHARED_SIZE_BYTES: 8,
  PREFERRED_SHARED_MEMORY_CARVEOUT: 9,
  NON_PORTABLE_CLUSTER_SIZE_ALLOWED: 14,
} as const;

/** `CUtensorMapDataType`. */
export const TensorMapDataType = {
  UINT8: 0,
  UINT16: 1,
  UINT32: 2,
  INT32: 3,
  UINT64: 4,
  INT64: 5,
  FLOAT16: 6,
  FLOAT32: 7,
  FLOAT64: 8,
  BFLOAT16: 9,
  FLOAT32_FTZ: 10,
  TFLOAT32: 11,
  TFLOAT32_FTZ: 12,
} as const;

/** `CUtensorMapSwizzle` (the 128B_ATOM variants are Blackwell-only and left out). */
export const TensorMapSwizzle = { NONE: 0, B32: 1, B64: 2, B128: 3 } as const;
/** `CUtensorMapInterleave`. */
export const TensorMapInterleave = { NONE: 0, B16: 1, B32: 2 } as const;
/** `CUtensorMapL2promotion`. */
export const TensorMapL2Promotion = { NONE: 0, B64: 1, B128: 2, B256: 3 } as const;
/** `CUtensorMapFloatOOBfill`. */
export const TensorMapOobFill = { NONE: 0, NAN_REQUEST_ZERO_FMA: 1 } as const;

/** `CUstreamCaptureMode`. */
export const StreamCaptureMode = { GLOBAL: 0, THREAD_LOCAL: 1, RELAXED: 2 } as const;

/** `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`. */
export const LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;
/** `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`. */
export const LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
/** Byte layout of `CUlaunchConfig` / `CUlaunchAttribute` on 64-bit Linux (checked against cuda.h by a test). */
export const LAUNCH_CONFIG_LAYOUT = {
  size: 56,
  gridDimX: 0,
  blockDimX: 12,
  sharedMemBytes: 24,
  hStream: 32,
  attrs: 40,
  numAttrs: 48,
  attributeSize: 72,
  attributeValue: 8,
} as const;

/** Dynamic shared memory a kernel may use without opting in through `setMaxDynamicSharedMemory`. */
export const DEFAULT_MAX_DYNAMIC_SHARED_BYTES = 48 * 1024;

// ---------------------------------------------------------------------------------------------------
// Virtual memory management (cuMemCreate / cuMemMap / cuMemSetAccess and the shareable handles)

/** `CUmemAllocationType`. */
export const MemAllocationType = { PINNED: 1 } as const;
/** `CUmemLocationType`. */
export const MemLocationType = { DEVICE: 1 } as const;
/** `CUmemAllocationHandleType`: NONE cannot be exported; POSIX_FILE_DESCRIPTOR exports an `int` fd. */
export const MemHandleType = { NONE: 0, POSIX_FILE_DESCRIPTOR: 1 } as const;
/** `CUmemAccess_flags`. */
export const MemAccessFlags = { PROT_NONE: 0, PROT_READ: 1, PROT_READWRITE: 3 } as const;
/** `CUmemAllocationGranularity_flags`. */
export const MemAllocGranularity = { MINIMUM: 0, RECOMMENDED: 1 } as const;

/**
 * Byte layouts on 64-bit Linux (cuda.h, CUDA 13.0; test/cuda/cuda-header.test.ts compiles the offsets):
 *
 *   struct CUmemLocation       { CUmemLocationType type; int id; }                           8 bytes
 *     type @0 (int), id @4 (int)
 *   struct CUmemAllocationProp { CUmemAllocationType type; CUmemAllocationHandleType requestedHandleTypes;
 *                                CUmemLocation location; void *win32HandleMetaData;
 *                                struct { unsigned char compressionType, gpuDirectRDMACapable;
 *                                         unsigned short usage; unsigned char reserved[4]; } allocFlags; }
 *     type @0, requestedHandleTypes @4, location.type @8, location.id @12, win32HandleMetaData @16
 *     (must be NULL on Linux), allocFlags @24 (compressionType @24, gpuDirectRDMACapable @25, usage @26,
 *     reserved @28): 32 bytes, every field we leave unset must be zero
 *   struct CUmemAccessDesc     { CUmemLocation location; CUmemAccess_flags flags; }            12 bytes
 *     location.type @0, location.id @4, flags @8
 */
export const MEM_ALLOCATION_PROP_LAYOUT = {
  size: 32,
  type: 0,
  requestedHandleTypes: 4,
  locationType: 8,
  locationId: 12,
  win32HandleMetaData: 16,
  allocFlags: 24,
} as const;
export const MEM_ACCESS_DESC_LAYOUT = { size: 12, locationType: 0, locationId: 4, flags: 8 } as const;
export const MEM_LOCATION_SIZE = 8;

/** A zeroed `CUmemAllocationProp` for pinned device memory on `ordinal`, exportable as `handleTypes`. */
export function memAllocationProp(ordinal: number, handleTypes: number): Uint8Array {
  const bytes = new Uint8Array(MEM_ALLOCATION_PROP_LAYOUT.size);
  const v = new DataView(bytes.buffer);
  v.setInt32(MEM_ALLOCATION_PROP_LAYOUT.type, MemAllocationType.PINNED, true);
  v.setInt32(MEM_ALLOCATION_PROP_LAYOUT.requestedHandleTypes, handleTypes, true);
  v.setInt32(MEM_ALLOCATION_PROP_LAYOUT.locationType, MemLocationType.DEVICE, true);
  v.setInt32(MEM_ALLOCATION_PROP_LAYOUT.locationId, ordinal, true);
  return bytes;
}

/** An array of `CUmemAccessDesc`, one per device ordinal, each granted `flags`. */
export function memAccessDescs(ordinals: readonly number[], flags: number): Uint8Array {
  const size = MEM_ACCESS_DESC_LAYOUT.size;
  const bytes = new Uint8Array(size * ordinals.length);
  const v = new DataView(bytes.buffer);
  ordinals.forEach((ordinal, i) => {
    v.setInt32(i * size + MEM_ACCESS_DESC_LAYOUT.locationType, MemLocationType.DEVICE, true);
    v.setInt32(i * size + MEM_ACCESS_DESC_LAYOUT.locationId, ordinal, true);
    v.setInt32(i * size + MEM_ACCESS_DESC_LAYOUT.flags, flags, true);
  });
  return bytes;
}
