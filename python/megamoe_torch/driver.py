"""ctypes bindings to the CUDA driver (libcuda.so.1): the few calls the runtime makes.

Struct layouts and enum values are those of cuda.h (CUDA 12.x and 13.0 agree on all of them; checked
against /usr/local/cuda/include/cuda.h of CUDA 13.0, and by tests/test_driver.py, which compiles the
header's ``sizeof``/``offsetof`` when gcc and the header are present). Importing this module loads
nothing; :class:`Driver` opens the library.

Every call goes through the non-``_ptsz`` entry points, so stream handle 0 is the legacy default stream,
as torch uses it. Errors raise :class:`CudaError` with the function's and the error's names.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from ctypes import (
    POINTER, Structure, Union, c_char, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64,
    c_ubyte, c_void_p,
)
from typing import Optional

from .errors import CudaError

# ----------------------------------------------------------------------------------------------------
# Enum values (cuda.h)

CUDA_SUCCESS = 0
#: CUlaunchAttributeID: CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4,
#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 (cuda.h, enum CUlaunchAttributeID_enum).
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: CUfunction_attribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8.
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
#: CUdevice_attribute values used here.
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
#: CU_TENSOR_MAP_NUM_QWORDS = 16: a CUtensorMap is 128 bytes, declared alignas(128) in CUDA 13
#: (cuTensorMapEncodeTiled documents 64-byte alignment; 128 satisfies both).
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 128

# ----------------------------------------------------------------------------------------------------
# Structs (cuda.h, 64-bit Linux)

CUdeviceptr = c_uint64  # typedef unsigned long long CUdeviceptr_v2; typedef CUdeviceptr_v2 CUdeviceptr;


class _ClusterDim(Structure):
    _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]


class CUlaunchAttributeValue(Union):
    """``typedef union CUlaunchAttributeValue_union { char pad[64]; …; struct { unsigned int x, y, z; }
    clusterDim; …; int programmaticStreamSerializationAllowed; … }``: 64 bytes, 8-byte aligned (it holds
    pointers, e.g. CUaccessPolicyWindow's base_ptr)."""

    _fields_ = [
        ("pad", c_char * 64),
        ("clusterDim", _ClusterDim),
        ("programmaticStreamSerializationAllowed", c_int),
        ("_align", c_void_p),
    ]


class CUlaunchAttribute(Structure):
    """``typedef struct CUlaunchAttribute_st { CUlaunchAttributeID id; char pad[8 - sizeof(CUlaunchAttributeID)];
    CUlaunchAttributeValue value; }``: id @0, value @8, 72 bytes."""

    _fields_ = [("id", c_int), ("pad", c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(Structure):
    """``typedef struct CUlaunchConfig_st { unsigned int gridDimX, gridDimY, gridDimZ, blockDimX,
    blockDimY, blockDimZ, sharedMemBytes; CUstream hStream; CUlaunchAttribute *attrs; unsigned int
    numAttrs; }``: gridDimX @0, blockDimX @12, sharedMemBytes @24, hStream @32, attrs @40, numAttrs @48,
    56 bytes."""

    _fields_ = [
        ("gridDimX", c_uint),
        ("gridDimY", c_uint),
        ("gridDimZ", c_uint),
        ("blockDimX", c_uint),
        ("blockDimY", c_uint),
        ("blockDimZ", c_uint),
        ("sharedMemBytes", c_uint),
        ("hStream", c_void_p),
        ("attrs", POINTER(CUlaunchAttribute)),
        ("numAttrs", c_uint),
    ]


class LaunchConfig:
    """A ``CUlaunchConfig`` and its attributes at a fixed host address, built once per launch site.

    ``cluster`` other than (1, 1, 1) adds CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION; ``programmatic`` adds
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION with value 1.
    """

    __slots__ = ("config", "attrs", "address", "n_attrs")

    def __init__(self, block, shared_bytes: int, cluster=(1, 1, 1), programmatic: bool = False):
        attrs = []
        if tuple(cluster) != (1, 1, 1):
            a = CUlaunchAttribute()
            a.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
            attrs.append(a)
        if programmatic:
            a = CUlaunchAttribute()
            a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        self.n_attrs = len(attrs)
        self.attrs = (CUlaunchAttribute * max(len(attrs), 1))(*attrs)
        c = CUlaunchConfig()
        c.gridDimX = c.gridDimY = c.gridDimZ = 1
        c.blockDimX, c.blockDimY, c.blockDimZ = block
        c.sharedMemBytes = shared_bytes
        c.hStream = None
        c.attrs = ctypes.cast(self.attrs, POINTER(CUlaunchAttribute)) if attrs else None
        c.numAttrs = len(attrs)
        self.config = c
        self.address = ctypes.addressof(c)

    def set_grid(self, x: int, y: int, z: int) -> None:
        c = self.config
        c.gridDimX = x
        c.gridDimY = y
        c.gridDimZ = z


# ----------------------------------------------------------------------------------------------------
# The library

#: name -> (argtypes); every function returns CUresult (int). Signatures from cuda.h (CUDA 13.0).
_SIGNATURES = {
    "cuGetErrorName": (c_int, POINTER(c_char_p)),  # (CUresult error, const char **pStr)
    "cuGetErrorString": (c_int, POINTER(c_char_p)),
    "cuInit": (c_uint,),
    "cuDriverGetVersion": (POINTER(c_int),),
    "cuDeviceGet": (POINTER(c_int), c_int),  # (CUdevice *device, int ordinal)
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, c_int),  # (int *pi, CUdevice_attribute, CUdevice)
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),  # (CUcontext *pctx, CUdevice dev)
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxSetCurrent": (c_void_p,),
    "cuModuleLoadData": (POINTER(c_void_p), c_void_p),  # (CUmodule *module, const void *image)
    "cuModuleUnload": (c_void_p,),
    "cuModuleGetFunction": (POINTER(c_void_p), c_void_p, c_char_p),  # (CUfunction *, CUmodule, const char *)
    "cuFuncSetAttribute": (c_void_p, c_int, c_int),  # (CUfunction, CUfunction_attribute, int value)
    # (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
    "cuLaunchKernelEx": (c_void_p, c_void_p, c_void_p, c_void_p),
    # (CUtensorMap *, CUtensorMapDataType, cuuint32_t rank, void *globalAddress, const cuuint64_t *globalDim,
    #  const cuuint64_t *globalStrides, const cuuint32_t *boxDim, const cuuint32_t *elementStrides,
    #  CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill)
    "cuTensorMapEncodeTiled": (
        c_void_p, c_int, c_uint32, c_void_p, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_uint32),
        POINTER(c_uint32), c_int, c_int, c_int, c_int,
    ),
    # cuMemcpyDtoDAsync is #defined to cuMemcpyDtoDAsync_v2 (CUdeviceptr dst, CUdeviceptr src, size_t, CUstream)
    "cuMemcpyDtoDAsync_v2": (CUdeviceptr, CUdeviceptr, c_size_t, c_void_p),
    # (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
    "cuMemsetD8Async": (CUdeviceptr, c_ubyte, c_size_t, c_void_p),
    "cuStreamSynchronize": (c_void_p,),
}


def _open_libcuda():
    errors = []
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise CudaError("dlopen", -1, "LIBCUDA_NOT_FOUND", "the CUDA driver library libcuda.so.1 could not be loaded",
                    "; ".join(errors))


class Driver:
    """The bound functions. ``lib`` is for tests: any object with the functions as attributes
    (they then receive plain Python ints / ctypes objects and return a CUresult int)."""

    def __init__(self, lib=None):
        self.fake = lib is not None
        if lib is None:
            lib = _open_libcuda()
            for name, argtypes in _SIGNATURES.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError:
                    raise CudaError(name, -1, "SYMBOL_NOT_FOUND",
                                    "libcuda.so.1 lacks this function: the driver is older than CUDA 12.0") from None
                fn.argtypes = argtypes
                fn.restype = c_int
        self.lib = lib
        # Hot-path entries, bound once.
        self.launch_kernel_ex_raw = lib.cuLaunchKernelEx
        self.memcpy_dtod_async_raw = lib.cuMemcpyDtoDAsync_v2
        self.memset_d8_async_raw = lib.cuMemsetD8Async
        self.ctx_get_current_raw = lib.cuCtxGetCurrent
        self.ctx_set_current_raw = lib.cuCtxSetCurrent

    # -- errors --------------------------------------------------------------------------------------

    def error_name(self, code: int) -> str:
        s = c_char_p()
        try:
            if self.lib.cuGetErrorName(code, ctypes.byref(s)) == 0 and s.value:
                return s.value.decode()
        except Exception:
            pass
        return f"CUDA_ERROR_{code}"

    def error_string(self, code: int) -> str:
        s = c_char_p()
        try:
            if self.lib.cuGetErrorString(code, ctypes.byref(s)) == 0 and s.value:
                return s.value.decode()
        except Exception:
            pass
        return ""

    def fail(self, function: str, code: int, detail: str = ""):
        raise CudaError(function, code, self.error_name(code), self.error_string(code), detail)

    def check(self, function: str, code: int, detail: str = "") -> None:
        if code != 0:
            self.fail(function, code, detail)

    # -- calls ---------------------------------------------------------------------------------------

    def init(self) -> None:
        self.check("cuInit", self.lib.cuInit(0))

    def device(self, ordinal: int) -> int:
        d = c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(d), ordinal), f"ordinal {ordinal}")
        return d.value

    def device_attribute(self, attribute: int, device: int) -> int:
        v = c_int()
        self.check("cuDeviceGetAttribute", self.lib.cuDeviceGetAttribute(ctypes.byref(v), attribute, device),
                   f"attribute {attribute}")
        return v.value

    def primary_context(self, device: int) -> int:
        """The device's primary context (the one the CUDA runtime, hence torch, uses), retained."""
        ctx = c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
        return ctx.value or 0

    def current_context(self) -> int:
        ctx = c_void_p()
        self.check("cuCtxGetCurrent", self.lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        return ctx.value or 0

    def set_current_context(self, ctx: int) -> None:
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))

    def load_module(self, image: bytes, detail: str = "") -> int:
        mod = c_void_p()
        buf = ctypes.create_string_buffer(image, len(image))
        self.check("cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(mod), buf), detail)
        return mod.value or 0

    def unload_module(self, module: int) -> None:
        self.check("cuModuleUnload", self.lib.cuModuleUnload(module))

    def get_function(self, module: int, name: str) -> int:
        fn = c_void_p()
        self.check("cuModuleGetFunction", self.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
                   f"kernel {name!r}")
        return fn.value or 0

    def set_max_dynamic_shared(self, function: int, nbytes: int, detail: str = "") -> None:
        self.check("cuFuncSetAttribute",
                   self.lib.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                   f"{detail} MAX_DYNAMIC_SHARED_SIZE_BYTES = {nbytes}".strip())

    def encode_tensor_map_tiled(self, data_type: int, address: int, dims, strides_bytes, box, element_strides,
                                interleave: int, swizzle: int, l2_promotion: int, oob_fill: int,
                                detail: str = "") -> bytes:
        """Encode a tiled CUtensorMap; returns its 128 bytes (to be copied into argument slots)."""
        rank = len(dims)
        raw = (c_ubyte * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
        base = ctypes.addressof(raw)
        addr = base + (-base) % TENSOR_MAP_ALIGN
        c_dims = (c_uint64 * rank)(*dims)
        c_strides = (c_uint64 * max(rank - 1, 1))(*(list(strides_bytes) or [0]))
        c_box = (c_uint32 * rank)(*box)
        c_estr = (c_uint32 * rank)(*element_strides)
        self.check(
            "cuTensorMapEncodeTiled",
            self.lib.cuTensorMapEncodeTiled(addr, data_type, rank, address, c_dims, c_strides, c_box, c_estr,
                                            interleave, swizzle, l2_promotion, oob_fill),
            detail,
        )
        return ctypes.string_at(addr, TENSOR_MAP_BYTES)

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyDtoDAsync_v2", self.memcpy_dtod_async_raw(dst, src, nbytes, stream))

    def memset_d8_async(self, dst: int, byte: int, nbytes: int, stream: int) -> None:
        self.check("cuMemsetD8Async", self.memset_d8_async_raw(dst, byte, nbytes, stream))

    def stream_synchronize(self, stream: int) -> None:
        self.check("cuStreamSynchronize", self.lib.cuStreamSynchronize(stream))


_default: Optional[Driver] = None


def default_driver() -> Driver:
    """The process's Driver over libcuda.so.1 (opened and cuInit'ed on first use)."""
    global _default
    if _default is None:
        d = Driver()
        d.init()
        _default = d
    return _default
