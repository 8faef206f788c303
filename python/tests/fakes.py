"""Test doubles: a fake libcuda (records what the runtime asks of the driver) and a fake tensor."""

from __future__ import annotations

import ctypes
import os
import struct

from megamoe_torch.driver import CUlaunchConfig, Driver

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "export")

ERROR_NAMES = {1: b"CUDA_ERROR_INVALID_VALUE", 700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}


class FakeLib:
    """Stands for libcuda.so.1. ``arg_sizes[fn]`` lists the byte size of each kernel parameter of the
    function handle ``fn`` so a launch's parameters can be snapshotted as the real driver copies them."""

    def __init__(self):
        self.calls = []
        self.launches = []
        self.arg_sizes = {}
        self.fail_next = {}  # function name -> CUresult to return once
        self._next_handle = 0x1000
        self.functions = {}  # handle -> (module handle, name)
        self.modules = {}

    def _handle(self):
        self._next_handle += 0x10
        return self._next_handle

    def _result(self, name):
        return self.fail_next.pop(name, 0)

    # error names
    def cuGetErrorName(self, code, pstr):
        if code not in ERROR_NAMES:
            return 1
        pstr._obj.value = ERROR_NAMES[code]
        return 0

    def cuGetErrorString(self, code, pstr):
        pstr._obj.value = b"fake description"
        return 0

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuDeviceGetAttribute(self, out, attr, dev):
        out._obj.value = {16: 132, 75: 9, 76: 0, 97: 232448, 38: 50 * 2**20}.get(attr, 0)
        return 0

    def cuDevicePrimaryCtxRetain(self, out, dev):
        out._obj.value = 0xC0
        return 0

    def cuCtxGetCurrent(self, out):
        (out.contents if hasattr(out, "contents") else out._obj).value = 0xC0
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("cuCtxSetCurrent", ctx))
        return 0

    def cuModuleLoadData(self, out, image):
        h = self._handle()
        self.modules[h] = bytes(image.raw)
        out._obj.value = h
        self.calls.append(("cuModuleLoadData", h))
        return self._result("cuModuleLoadData")

    def cuModuleUnload(self, mod):
        return 0

    def cuModuleGetFunction(self, out, mod, name):
        h = self._handle()
        self.functions[h] = (mod, name.decode())
        out._obj.value = h
        return self._result("cuModuleGetFunction")

    def cuFuncSetAttribute(self, fn, attr, value):
        self.calls.append(("cuFuncSetAttribute", fn, attr, value))
        return 0

    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, estr, il, sw, l2, oob):
        desc = (dtype, rank, address, list(dims[:rank]), list(strides[:max(rank - 1, 0)]), list(box[:rank]),
                list(estr[:rank]), il, sw, l2, oob)
        self.calls.append(("cuTensorMapEncodeTiled", out) + desc)
        # A recognisable 128-byte image: the address, the rank and the dims.
        image = struct.pack("<QI", address, rank) + b"".join(struct.pack("<Q", d) for d in desc[3])
        image = image.ljust(128, bytes([0xA0 + rank]))
        ctypes.memmove(out, image, 128)
        return self._result("cuTensorMapEncodeTiled")

    def cuLaunchKernelEx(self, config_address, fn, params_address, extra):
        c = CUlaunchConfig.from_address(config_address)
        attrs = []
        for i in range(c.numAttrs):
            a = c.attrs[i]
            if a.id == 4:
                attrs.append(("cluster", (a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z)))
            elif a.id == 6:
                attrs.append(("programmatic", a.value.programmaticStreamSerializationAllowed))
            else:
                attrs.append((a.id, None))
        sizes = self.arg_sizes.get(fn, [])
        params = (ctypes.c_void_p * max(len(sizes), 1)).from_address(params_address)
        args = [ctypes.string_at(params[i], n) for i, n in enumerate(sizes)]
        self.launches.append({
            "fn": fn, "grid": (c.gridDimX, c.gridDimY, c.gridDimZ), "block": (c.blockDimX, c.blockDimY, c.blockDimZ),
            "shared": c.sharedMemBytes, "stream": c.hStream or 0, "attrs": attrs, "args": args,
            "param_addresses": [params[i] for i in range(len(sizes))], "extra": extra,
        })
        self.calls.append(("cuLaunchKernelEx", fn))
        return self._result("cuLaunchKernelEx")

    def cuMemcpyDtoDAsync_v2(self, dst, src, n, stream):
        self.calls.append(("copy", dst, src, n, stream))
        return self._result("cuMemcpyDtoDAsync_v2")

    def cuMemsetD8Async(self, dst, byte, n, stream):
        self.calls.append(("memset", dst, byte, n, stream))
        return self._result("cuMemsetD8Async")

    def cuStreamSynchronize(self, stream):
        return 0


def fake_driver():
    lib = FakeLib()
    return Driver(lib=lib), lib


class FakeTensor:
    """Duck-typed tensor: dtype name, shape, device string, contiguity flag, address."""

    _next = 0x7F0000000000

    def __init__(self, dtype, shape, device="cuda:0", contiguous=True, ptr=None):
        self.dtype = dtype
        self.shape = tuple(shape)
        self.device = device
        self._contiguous = contiguous
        if ptr is None:
            FakeTensor._next += 1 << 24
            ptr = FakeTensor._next
        self._ptr = ptr

    def is_contiguous(self):
        return self._contiguous

    def data_ptr(self):
        return self._ptr

    def stride(self):
        s, out = 1, []
        for d in reversed(self.shape):
            out.append(s)
            s *= d
        return tuple(reversed(out)) if self._contiguous else tuple(2 * v for v in reversed(out))
