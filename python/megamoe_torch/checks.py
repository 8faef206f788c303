"""Argument checks for weights and per-call inputs, written against duck-typed tensors.

A tensor here is anything with ``dtype`` (a torch dtype or, in tests, its name), ``shape`` (a tuple),
``device``, ``is_contiguous()``, ``data_ptr()`` and ``stride()``; torch tensors are such things. Bad
input raises TypeError (not a tensor, wrong dtype) or ValueError (shape, T out of bounds, device,
layout, overlap), naming the argument and what was expected.
"""

from __future__ import annotations

from typing import Callable, Dict

from .manifest import Manifest, TensorSpec

#: Weight dtypes that hold the same bytes: E8M0 scales arrive as uint8 or as torch.float8_e8m0fnu.
WEIGHT_DTYPE_ALIASES = {"uint8": ("uint8", "float8_e8m0fnu"), "float8_e8m0fnu": ("float8_e8m0fnu", "uint8")}


def dtype_name(dtype) -> str:
    s = str(dtype)
    return s[6:] if s.startswith("torch.") else s


def describe(t) -> str:
    """'float16 [3, 4096]' for a tensor, the type's name for anything else."""
    try:
        return f"{dtype_name(t.dtype)} [{', '.join(str(int(d)) for d in t.shape)}]"
    except Exception:
        return type(t).__name__


def _is_tensor(t) -> bool:
    return hasattr(t, "dtype") and hasattr(t, "shape") and hasattr(t, "data_ptr")


def _strides(t) -> str:
    try:
        return str(tuple(t.stride()))
    except Exception:
        return "?"


def check_weight(name: str, spec: TensorSpec, t, device, arg: str = "") -> None:
    """``t`` must be ``spec``'s dtype and shape, on ``device``, contiguous and 16-byte aligned."""
    label = arg or name
    want = f"{spec.dtype} [{', '.join(map(str, spec.shape))}]"
    if not _is_tensor(t):
        raise TypeError(f"{label} must be a tensor {want} (the export's weights.{name}), got {type(t).__name__}")
    got = dtype_name(t.dtype)
    if got not in WEIGHT_DTYPE_ALIASES.get(spec.dtype, (spec.dtype,)):
        raise TypeError(f"{label} must be {want} (the export's weights.{name}), got {describe(t)}")
    if tuple(t.shape) != spec.shape:
        raise ValueError(f"{label} must be {want} (the export's weights.{name}), got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{label} must be on {device} (the layer's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{label} must be contiguous ({label}.contiguous() copies it), got strides {_strides(t)}")
    if t.data_ptr() % 16:
        raise ValueError(f"{label} must start on a 16-byte boundary, got address {t.data_ptr():#x}")


class InputChecker:
    """The per-call checks of ``forward(x, topk_ids, topk_weights, out)``; ``check`` returns T.

    ``resolve_dtype`` turns a dtype name into what the tensors' ``dtype`` compares equal to (torch's
    dtype objects for torch, the name itself for the tests' fake tensors).
    """

    def __init__(self, manifest: Manifest, device, resolve_dtype: Callable[[str], object] = lambda n: n):
        layer = manifest.layer
        self.max_t = layer.max_tokens
        self.hidden = layer.hidden
        self.top_k = layer.top_k
        self.device = device
        self.bf16 = resolve_dtype("bfloat16")
        self.i32 = resolve_dtype("int32")
        self.f32 = resolve_dtype("float32")
        try:
            self.i64 = resolve_dtype("int64")
        except Exception:
            self.i64 = "int64"
        self.specs: Dict[str, TensorSpec] = manifest.inputs
        # int64 ids, when the export converts them (inputConversions)
        self.ids_i64 = "topk_ids" in manifest.input_conversions

    # -- messages (slow path) ------------------------------------------------------------------------

    def _x_want(self) -> str:
        return f"bfloat16 [T, {self.hidden}] with 1 ≤ T ≤ {self.max_t}"

    def _bad_x(self, x):
        if not _is_tensor(x):
            raise TypeError(f"x must be a tensor, {self._x_want()}, got {type(x).__name__}")
        msg = f"x must be {self._x_want()}, got {describe(x)}"
        if x.dtype != self.bf16:
            raise TypeError(msg)
        raise ValueError(msg)

    def _bad_other(self, name: str, t, dtype, dtype_label: str, cols: int, T: int):
        want = f"{dtype_label} [{T}, {cols}] (T = {T} from x)"
        if not _is_tensor(t):
            raise TypeError(f"{name} must be a tensor, {want}, got {type(t).__name__}")
        if t.dtype != dtype:
            if name == "topk_ids" and not self.ids_i64 and (t.dtype == self.i64 or dtype_name(t.dtype) == "int64"):
                raise TypeError(
                    f"topk_ids must be int32 [{T}, {cols}], got int64: this export has no int64 conversion "
                    "(pass topk_ids.to(torch.int32); -1 marks an unused slot)")
            raise TypeError(f"{name} must be {want}, got {describe(t)}")
        raise ValueError(f"{name} must be {want}, got {describe(t)}")

    def _placement(self, name: str, t) -> None:
        if self.device is not None and t.device != self.device:
            raise ValueError(f"{name} must be on {self.device} (the layer's device), got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous ({name}.contiguous() copies it), got strides {_strides(t)}")

    # -- the check (fast path: a few comparisons per tensor) -------------------------------------------

    def check(self, x, topk_ids, topk_weights, out=None) -> int:
        try:
            shape = x.shape
            ok = x.dtype == self.bf16 and len(shape) == 2 and shape[1] == self.hidden
        except AttributeError:
            ok = False
        if not ok:
            self._bad_x(x)
        T = shape[0]
        if not 1 <= T <= self.max_t:
            self._bad_x(x)
        self._placement("x", x)
        k = self.top_k
        try:
            ok = (topk_ids.dtype == self.i32 or (self.ids_i64 and topk_ids.dtype == self.i64)) and \
                tuple(topk_ids.shape) == (T, k)
        except AttributeError:
            ok = False
        if not ok:
            self._bad_other("topk_ids", topk_ids, self.i32, "int32", k, T)
        self._placement("topk_ids", topk_ids)
        try:
            ok = topk_weights.dtype == self.f32 and tuple(topk_weights.shape) == (T, k)
        except AttributeError:
            ok = False
        if not ok:
            self._bad_other("topk_weights", topk_weights, self.f32, "float32", k, T)
        self._placement("topk_weights", topk_weights)
        if out is not None:
            try:
                ok = out.dtype == self.bf16 and tuple(out.shape) == (T, self.hidden)
            except AttributeError:
                ok = False
            if not ok:
                self._bad_other("out", out, self.bf16, "bfloat16", self.hidden, T)
            self._placement("out", out)
            n = T * self.hidden * 2
            xo, oo = x.data_ptr(), out.data_ptr()
            if xo < oo + n and oo < xo + n:
                raise ValueError("out must not overlap x (the layer reads x while it writes out)")
        return T
