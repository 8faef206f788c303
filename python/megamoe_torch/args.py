"""Kernel arguments in host memory: one block per launch site, and its ``void **kernelParams``.

``cuLaunchKernelEx`` takes an array whose i-th entry is the address of the i-th argument's value. Each
argument gets a slot in one aligned host block (the layout Node's KernelArgs uses):

- a scalar (u32, i32, f32: 4 bytes, the rest of the slot zero) or a pointer / u64 (8 bytes): an 8-byte
  slot on an 8-byte boundary;
- a tensor map: 128 bytes on a 128-byte boundary (CUtensorMap is ``alignas(128)`` in CUDA 13's cuda.h,
  ``cuTensorMapEncodeTiled`` asks 64);
- a struct passed by value: its size rounded up to 8, on a 16-byte boundary; its named fields at their
  offsets, every other byte zero.

The driver copies the bytes when the launch is queued (or captured), so a block can be rewritten for
the next call right after. Nothing here needs torch or a GPU.
"""

from __future__ import annotations

import ctypes
import struct
from typing import List, Sequence, Tuple

from .manifest import SCALAR_KINDS, Arg

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 128
SCALAR_SLOT_BYTES = 8
STRUCT_ALIGN = 16
BLOCK_ALIGN = 128

#: struct.Struct per scalar kind, "pointer" as u64.
PACKERS = {kind: struct.Struct(fmt) for kind, (fmt, _n, _lo, _hi) in SCALAR_KINDS.items()}
PACKERS["pointer"] = PACKERS["u64"]


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


def slot_layout(args: Sequence[Arg]) -> Tuple[List[int], List[int], int]:
    """(offsets, sizes, total bytes) of each argument's slot, relative to a 128-aligned block start."""
    offsets, sizes = [], []
    end = 0
    for a in args:
        if a.kind == "tensorMap":
            size, align = TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN
        elif a.kind == "struct":
            size, align = _round_up(a.bytes, 8), STRUCT_ALIGN
        else:
            size, align = SCALAR_SLOT_BYTES, SCALAR_SLOT_BYTES
        end = _round_up(end, align)
        offsets.append(end)
        sizes.append(size)
        end += size
    return offsets, sizes, end


class HostBlock:
    """Zeroed host memory with an aligned start that never moves (a ctypes array kept alive here)."""

    __slots__ = ("_raw", "address", "size", "view")

    def __init__(self, size: int, align: int = BLOCK_ALIGN):
        self.size = size
        self._raw = (ctypes.c_ubyte * (max(size, 1) + align))()
        base = ctypes.addressof(self._raw)
        pad = (-base) % align
        self.address = base + pad
        self.view = memoryview(self._raw).cast("B")[pad:pad + size]

    def bytes(self) -> bytes:
        return bytes(self.view)


class ArgBlock:
    """The argument block of one launch: ``params_address`` is what ``cuLaunchKernelEx`` gets as
    ``kernelParams``; ``offsets[i]`` is argument i's slot in ``block``."""

    __slots__ = ("args", "offsets", "sizes", "block", "view", "_params", "params_address")

    def __init__(self, args: Sequence[Arg]):
        self.args = tuple(args)
        self.offsets, self.sizes, total = slot_layout(self.args)
        self.block = HostBlock(max(total, SCALAR_SLOT_BYTES), BLOCK_ALIGN)
        self.view = self.block.view
        n = len(self.args)
        self._params = (ctypes.c_void_p * max(n, 1))(*[self.block.address + o for o in self.offsets])
        self.params_address = ctypes.addressof(self._params)

    def param_addresses(self) -> List[int]:
        return [self._params[i] or 0 for i in range(len(self.args))]

    def write(self, kind: str, offset: int, value) -> None:
        """Write a scalar or pointer (``kind`` as in the manifest) at a block offset, range-checked."""
        if kind == "f32":
            value = float(value)
        else:
            _fmt, _n, lo, hi = SCALAR_KINDS["u64" if kind == "pointer" else kind]
            if not isinstance(value, int) or not lo <= value <= hi:
                raise OverflowError(f"{value!r} does not fit a {kind}")
        PACKERS[kind].pack_into(self.view, offset, value)

    def write_bytes(self, offset: int, data: bytes) -> None:
        self.view[offset:offset + len(data)] = data

    def bytes(self) -> bytes:
        return self.block.bytes()

    def slot_bytes(self, i: int) -> bytes:
        o = self.offsets[i]
        return bytes(self.view[o:o + self.sizes[i]])
