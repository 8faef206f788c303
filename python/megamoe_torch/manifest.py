"""Reading and checking an export's manifest.json (docs/export.md, version 1) without torch.

``load_manifest(dir_or_file)`` returns a frozen :class:`Manifest` or raises :class:`ManifestError` naming
the file, the JSON path of the first value that breaks the format and what was expected there. Every
check that needs no GPU happens here, once: field types, unique names, references to kernels, buffers
and tensor maps, expressions (their ops and, for every T of each token range, their values against the
bounds of their use), token ranges covering 1 … maxTokens, tensor-map geometry and extents, cubin files.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

from .errors import ManifestError
from .expr import Expr, ExprError, compile_expr

FORMAT = "megamoe-export"
VERSION = 1
ARCH = "sm_90a"

#: Bytes per element of the dtype names the manifest may use for weights and inputs (torch's names).
DTYPE_BYTES = {
    "float8_e4m3fn": 1,
    "float8_e8m0fnu": 1,
    "uint8": 1,
    "int8": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int32": 4,
    "int64": 8,
}

#: CUtensorMapDataType (cuda.h, CUDA 12/13: CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0 …) -> (code, bytes).
TENSOR_MAP_DATA_TYPES = {
    "uint8": (0, 1),
    "uint16": (1, 2),
    "uint32": (2, 4),
    "int32": (3, 4),
    "uint64": (4, 8),
    "int64": (5, 8),
    "float16": (6, 2),
    "float32": (7, 4),
    "float64": (8, 8),
    "bfloat16": (9, 2),
    "float32_ftz": (10, 4),
    "tfloat32": (11, 4),
    "tfloat32_ftz": (12, 4),
}
#: CUtensorMapInterleave, CUtensorMapSwizzle (the SM100 128B_ATOM kinds left out),
#: CUtensorMapL2promotion, CUtensorMapFloatOOBfill, by the names the manifest uses.
TENSOR_MAP_INTERLEAVE = {"none": 0, "16B": 1, "32B": 2}
TENSOR_MAP_SWIZZLE = {"none": 0, "32B": 1, "64B": 2, "128B": 3}
TENSOR_MAP_L2_PROMOTION = {"none": 0, "64B": 1, "128B": 2, "256B": 3}
TENSOR_MAP_OOB_FILL = {"none": 0, "nan_request_zero_fma": 1}

#: Scalar argument kinds: (struct format, bytes, lowest, highest).
SCALAR_KINDS = {
    "u32": ("<I", 4, 0, 2**32 - 1),
    "i32": ("<i", 4, -(2**31), 2**31 - 1),
    "u64": ("<Q", 8, 0, 2**64 - 1),
    "f32": ("<f", 4, None, None),
}
FLOAT32_MAX = 3.4028234663852886e38

#: The weights every export names, and the shared expert's (present when layer.sharedIntermediate > 0).
ROUTED_WEIGHTS = ("w13", "w13_scale", "w2", "w2_scale")
SHARED_WEIGHTS = ("shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale")
#: The per-call tensors, in the order forward() takes them.
INPUTS = ("x", "topk_ids", "topk_weights", "out")

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_CLUSTER_BLOCKS = 8  # portable cluster size; larger needs a non-portable attribute the format lacks


# ----------------------------------------------------------------------------------------------------
# The parsed manifest


@dataclass(frozen=True)
class Layer:
    name: str
    hidden: int
    top_k: int
    experts: int
    intermediate: int
    shared_intermediate: int
    expert_format: str
    scale_format: str
    max_tokens: int
    extra: Dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Kernel:
    id: str
    cubin: str
    cubin_path: str
    function: str
    max_dynamic_shared_bytes: int
    defines: Dict[str, object]


@dataclass(frozen=True)
class Buffer:
    name: str
    bytes: int
    lifetime: str  # "weights" | "workspace"
    init: str  # "none" | "zero" | "fill:<byte>"
    fill: Optional[int]  # the byte the buffer starts as, None for "none"


@dataclass(frozen=True)
class TensorSpec:
    """A weight or an input: a dtype name (torch's) and a shape whose entries are ints or "T"."""

    name: str
    dtype: str
    shape: Tuple[Union[int, str], ...]
    itemsize: int

    def shape_for(self, T: int) -> Tuple[int, ...]:
        return tuple(T if d == "T" else d for d in self.shape)

    def bytes_for(self, T: int) -> int:
        return self.itemsize * math.prod(self.shape_for(T))

    def describe(self) -> str:
        return f"{self.dtype} [{', '.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class TensorMap:
    id: str
    buffer: str
    offset: int
    data_type: str
    data_type_code: int
    element_bytes: int
    dims: Tuple[int, ...]
    strides_bytes: Tuple[int, ...]
    box: Tuple[int, ...]
    element_strides: Tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int
    path: str

    @property
    def rank(self) -> int:
        return len(self.dims)

    def extent_bytes(self) -> int:
        """Bytes from the map's first element to one past its last."""
        end = self.dims[0] * self.element_bytes
        for d, s in zip(self.dims[1:], self.strides_bytes):
            end += (d - 1) * s
        return end


@dataclass(frozen=True)
class Ref:
    buffer: str
    offset: Expr
    where: str  # "buffer" | "weight" | "input"
    path: str


@dataclass(frozen=True)
class Arg:
    """One kernel argument. kind: tensorMap (``map``), pointer (``ref``, None for a null pointer),
    u32 / i32 / u64 / f32 (``value``: an Expr, or a float for an f32 literal), struct (``bytes``,
    ``fields``)."""

    kind: str
    path: str
    map: Optional[str] = None
    ref: Optional[Ref] = None
    value: Union[Expr, float, None] = None
    bytes: int = 0
    fields: Tuple["Field", ...] = ()


@dataclass(frozen=True)
class Field:
    offset: int
    kind: str  # pointer | u32 | i32 | u64 | f32
    path: str
    ref: Optional[Ref] = None
    value: Union[Expr, float, None] = None

    @property
    def size(self) -> int:
        return 8 if self.kind == "pointer" else SCALAR_KINDS[self.kind][1]


@dataclass(frozen=True)
class LaunchStep:
    kernel: str
    grid: Tuple[Expr, Expr, Expr]
    block: Tuple[int, int, int]
    shared_bytes: int
    cluster: Tuple[int, int, int]
    programmatic_stream_serialization: bool
    args: Tuple[Arg, ...]
    path: str
    kind: str = "launch"


@dataclass(frozen=True)
class CopyStep:
    dst: Ref
    src: Ref
    bytes: Expr
    path: str
    kind: str = "copy"


@dataclass(frozen=True)
class MemsetStep:
    dst: Ref
    byte: int
    bytes: Expr
    path: str
    kind: str = "memset"


Step = Union[LaunchStep, CopyStep, MemsetStep]


@dataclass(frozen=True)
class TokenRange:
    lo: int
    hi: int
    steps: Tuple[Step, ...]
    path: str


@dataclass(frozen=True)
class Conversion:
    """Steps that convert an input handed over in another dtype into a buffer read in its place."""

    input: str
    dtype: str
    buffer: str
    steps: Tuple[Step, ...]
    path: str


@dataclass(frozen=True)
class Status:
    buffer: str
    words: int


@dataclass(frozen=True)
class Manifest:
    file: str
    dir: str
    version: int
    producer: str
    arch: str
    sm_count: int
    layer: Layer
    kernels: Dict[str, Kernel]
    buffers: Dict[str, Buffer]
    weights: Dict[str, TensorSpec]
    inputs: Dict[str, TensorSpec]
    tensor_maps: Dict[str, TensorMap]
    prepare: Tuple[Step, ...]
    status: Status
    forward: Tuple[TokenRange, ...]
    input_conversions: Dict[str, Conversion] = field(default_factory=dict)
    _range_index: Tuple[int, ...] = field(repr=False, default=())

    @property
    def max_tokens(self) -> int:
        return self.layer.max_tokens

    def range_for(self, T: int) -> TokenRange:
        """The token range holding T (1 ≤ T ≤ maxTokens), else ValueError."""
        if not (isinstance(T, int) and 1 <= T <= self.layer.max_tokens):
            raise ValueError(f"T must be an integer with 1 ≤ T ≤ {self.layer.max_tokens}, got {T!r}")
        return self.forward[self._range_index[T]]

    def range_index(self, T: int) -> int:
        if not (isinstance(T, int) and 1 <= T <= self.layer.max_tokens):
            raise ValueError(f"T must be an integer with 1 ≤ T ≤ {self.layer.max_tokens}, got {T!r}")
        return self._range_index[T]

    def size_of(self, name: str, T: int = 1) -> int:
        """Bytes of a buffer, a weight or an input (for a call of T tokens)."""
        if name in self.buffers:
            return self.buffers[name].bytes
        if name in self.weights:
            return self.weights[name].bytes_for(T)
        return self.inputs[name].bytes_for(T)


# ----------------------------------------------------------------------------------------------------
# Reading


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return f"the integer {v}"
    if isinstance(v, float):
        return f"the number {v!r}"
    if isinstance(v, str):
        return f"the string {v!r}"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


class _Reader:
    def __init__(self, file: str):
        self.file = file

    def fail(self, path: str, expected: str):
        raise ManifestError(self.file, path, expected)

    def obj(self, v, path: str, required=(), optional=(), allow_extra=False) -> dict:
        if not isinstance(v, dict):
            self.fail(path, f"an object, got {_type_name(v)}")
        for k in required:
            if k not in v:
                self.fail(_join(path, k), "present (missing)")
        if not allow_extra:
            known = set(required) | set(optional)
            for k in v:
                if k not in known:
                    self.fail(_join(path, k), f"no such key (known: {', '.join(sorted(known))})")
        return v

    def list(self, v, path: str, length: Optional[int] = None, min_length: int = 0) -> list:
        if not isinstance(v, list):
            self.fail(path, f"a list, got {_type_name(v)}")
        if length is not None and len(v) != length:
            self.fail(path, f"a list of {length} entries, got {len(v)}")
        if len(v) < min_length:
            self.fail(path, f"a list of at least {min_length} entries, got {len(v)}")
        return v

    def int(self, v, path: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(path, f"an integer{_bounds(lo, hi)}, got {_type_name(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            self.fail(path, f"an integer{_bounds(lo, hi)}, got {v}")
        return v

    def str(self, v, path: str, choices=None) -> str:
        if not isinstance(v, str) or v == "":
            self.fail(path, f"a non-empty string, got {_type_name(v)}")
        if choices is not None and v not in choices:
            self.fail(path, f"one of {', '.join(repr(c) for c in choices)}, got {v!r}")
        return v

    def bool(self, v, path: str) -> bool:
        if not isinstance(v, bool):
            self.fail(path, f"true or false, got {_type_name(v)}")
        return v

    def expr(self, v, path: str) -> Expr:
        try:
            return compile_expr(v)
        except ExprError as e:
            self.fail(path + e.path, e.expected)


def _a(word: str) -> str:
    return f"an {word}" if word[:1] in "aeio" else f"a {word}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in {lo} … {hi}"
    if lo is not None:
        return f" ≥ {lo}"
    if hi is not None:
        return f" ≤ {hi}"
    return ""


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    pass


def load_manifest(path: str, check_all_tokens: bool = True) -> Manifest:
    """Read and check ``<dir>/manifest.json`` (``path`` is the directory or the file itself).

    With ``check_all_tokens`` (the default) every T-dependent value is also evaluated for every T of
    its range and checked against its bounds (grid limits, argument ranges, offsets inside buffers).
    """
    file = os.path.join(path, "manifest.json") if os.path.isdir(path) else path
    try:
        with open(file, "rb") as f:
            text = f.read()
    except OSError as e:
        raise ManifestError(file, "<file>", f"a readable manifest ({e.strerror})") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise ManifestError(file, "<json>", f"JSON without duplicate keys (key {e.args[0]!r} repeats)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(file, "<json>", f"valid JSON ({e})") from None
    return parse_manifest(data, file, check_all_tokens=check_all_tokens)


def parse_manifest(data, file: str, check_all_tokens: bool = True) -> Manifest:
    """Check an already decoded manifest; ``file`` names it in errors, its directory holds the cubins."""
    r = _Reader(file)
    root_dir = os.path.dirname(os.path.abspath(file))
    top = r.obj(
        data,
        "",
        required=(
            "format", "version", "producer", "arch", "smCount", "layer", "kernels", "buffers",
            "weights", "inputs", "tensorMaps", "prepare", "status", "forward",
        ),
        optional=("inputConversions",),
    )
    if top["format"] != FORMAT:
        r.fail("format", f"{FORMAT!r}, got {_type_name(top['format'])}")
    r.int(top["version"], "version")
    if top["version"] != VERSION:
        r.fail("version", f"{VERSION} (this runtime reads version {VERSION} only), got {top['version']}")
    producer = r.str(top["producer"], "producer")
    arch = r.str(top["arch"], "arch", choices=(ARCH,))
    sm_count = r.int(top["smCount"], "smCount", lo=1)

    layer = _layer(r, top["layer"])
    names: Dict[str, str] = {}  # name -> "buffer" | "weight" | "input"

    kernels: Dict[str, Kernel] = {}
    for i, k in enumerate(r.list(top["kernels"], "kernels", min_length=1)):
        p = f"kernels[{i}]"
        r.obj(k, p, required=("id", "cubin", "function", "maxDynamicSharedBytes"), optional=("defines",))
        kid = r.str(k["id"], f"{p}.id")
        if kid in kernels:
            r.fail(f"{p}.id", f"a kernel id not used before, got {kid!r} again")
        cubin = r.str(k["cubin"], f"{p}.cubin")
        cubin_path = _cubin_path(r, root_dir, cubin, f"{p}.cubin")
        function = r.str(k["function"], f"{p}.function")
        smem = r.int(k["maxDynamicSharedBytes"], f"{p}.maxDynamicSharedBytes", lo=0, hi=227 * 1024)
        defines = r.obj(k.get("defines", {}), f"{p}.defines", allow_extra=True)
        for dk, dv in defines.items():
            if not isinstance(dv, (int, float, str, bool)):
                r.fail(f"{p}.defines.{dk}", f"a number, string or boolean, got {_type_name(dv)}")
        kernels[kid] = Kernel(kid, cubin, cubin_path, function, smem, dict(defines))

    buffers: Dict[str, Buffer] = {}
    for i, b in enumerate(r.list(top["buffers"], "buffers")):
        p = f"buffers[{i}]"
        r.obj(b, p, required=("name", "bytes", "lifetime", "init"))
        name = _new_name(r, names, b["name"], f"{p}.name", "buffer")
        nbytes = r.int(b["bytes"], f"{p}.bytes", lo=1)
        lifetime = r.str(b["lifetime"], f"{p}.lifetime", choices=("weights", "workspace"))
        init, fill = _init(r, b["init"], f"{p}.init")
        buffers[name] = Buffer(name, nbytes, lifetime, init, fill)

    weights: Dict[str, TensorSpec] = {}
    r.obj(top["weights"], "weights", allow_extra=True)
    for name, w in top["weights"].items():
        p = f"weights.{name}"
        _new_name(r, names, name, p, "weight")
        weights[name] = _tensor_spec(r, name, w, p, allow_t=False)
    wanted = ROUTED_WEIGHTS + (SHARED_WEIGHTS if layer.shared_intermediate > 0 else ())
    for name in wanted:
        if name not in weights:
            r.fail(f"weights.{name}", "present (missing): every export names " + ", ".join(wanted))
    for name in weights:
        if name not in wanted:
            r.fail(f"weights.{name}", "one of " + ", ".join(wanted) + f" (sharedIntermediate is {layer.shared_intermediate})")

    inputs: Dict[str, TensorSpec] = {}
    r.obj(top["inputs"], "inputs", required=INPUTS)
    for name in INPUTS:
        p = f"inputs.{name}"
        _new_name(r, names, name, p, "input")
        inputs[name] = _tensor_spec(r, name, top["inputs"][name], p, allow_t=True)
    _check_inputs(r, inputs, layer)

    tensor_maps: Dict[str, TensorMap] = {}
    for i, t in enumerate(r.list(top["tensorMaps"], "tensorMaps")):
        m = _tensor_map(r, t, f"tensorMaps[{i}]", names, buffers, weights)
        if m.id in tensor_maps:
            r.fail(f"tensorMaps[{i}].id", f"a tensor map id not used before, got {m.id!r} again")
        tensor_maps[m.id] = m

    ctx = _StepContext(r, kernels, names, tensor_maps)
    prepare = tuple(
        ctx.step(s, f"prepare[{i}]", phase="prepare")
        for i, s in enumerate(r.list(top["prepare"], "prepare"))
    )

    st = r.obj(top["status"], "status", required=("buffer", "words"))
    status_buffer = r.str(st["buffer"], "status.buffer")
    if status_buffer not in buffers:
        r.fail("status.buffer", f"the name of a buffer, got {status_buffer!r}")
    words = r.int(st["words"], "status.words", lo=1)
    if buffers[status_buffer].bytes < 4 * words:
        r.fail("status.words", f"at most {buffers[status_buffer].bytes // 4} (the buffer's bytes / 4), got {words}")
    status = Status(status_buffer, words)

    ranges = []
    expect_lo = 1
    for i, fr in enumerate(r.list(top["forward"], "forward", min_length=1)):
        p = f"forward[{i}]"
        r.obj(fr, p, required=("tokens", "steps"))
        tokens = r.list(fr["tokens"], f"{p}.tokens", length=2)
        lo = r.int(tokens[0], f"{p}.tokens[0]", lo=1)
        hi = r.int(tokens[1], f"{p}.tokens[1]", lo=1)
        if lo != expect_lo:
            what = "the first range starts at 1" if i == 0 else f"forward[{i - 1}] ends at {expect_lo - 1}"
            r.fail(f"{p}.tokens[0]", f"{expect_lo} ({what}: ranges ascend without gaps or overlaps), got {lo}")
        if hi < lo:
            r.fail(f"{p}.tokens[1]", f"at least tokens[0] = {lo}, got {hi}")
        if hi > layer.max_tokens:
            r.fail(f"{p}.tokens[1]", f"at most layer.maxTokens = {layer.max_tokens}, got {hi}")
        steps = tuple(
            ctx.step(s, f"{p}.steps[{j}]", phase="forward")
            for j, s in enumerate(r.list(fr["steps"], f"{p}.steps", min_length=1))
        )
        ranges.append(TokenRange(lo, hi, steps, p))
        expect_lo = hi + 1
    if expect_lo != layer.max_tokens + 1:
        r.fail(f"forward[{len(ranges) - 1}].tokens[1]", f"layer.maxTokens = {layer.max_tokens} (the ranges cover 1 … maxTokens), got {expect_lo - 1}")

    conversions: Dict[str, Conversion] = {}
    conv = r.obj(top.get("inputConversions", {}), "inputConversions", allow_extra=True)
    for name, c in conv.items():
        p = f"inputConversions.{name}"
        if name != "topk_ids":
            r.fail(p, f"topk_ids (the one input with a conversion), got {name!r}")
        r.obj(c, p, required=("dtype", "buffer", "steps"))
        dtype = r.str(c["dtype"], f"{p}.dtype", choices=("int64",))
        buffer = r.str(c["buffer"], f"{p}.buffer")
        if buffer not in buffers:
            r.fail(f"{p}.buffer", f"the name of a buffer, got {buffer!r}")
        need = inputs[name].bytes_for(layer.max_tokens)
        if buffers[buffer].bytes < need:
            r.fail(f"{p}.buffer", f"a buffer of at least {need} bytes ({name} at maxTokens), got {buffers[buffer].bytes}")
        steps = tuple(
            ctx.step(s, f"{p}.steps[{j}]", phase="forward")
            for j, s in enumerate(r.list(c["steps"], f"{p}.steps", min_length=1))
        )
        conversions[name] = Conversion(name, dtype, buffer, steps, p)

    index = [0] * (layer.max_tokens + 1)
    for i, tr in enumerate(ranges):
        for T in range(tr.lo, tr.hi + 1):
            index[T] = i

    manifest = Manifest(
        file=file,
        dir=root_dir,
        version=VERSION,
        producer=producer,
        arch=arch,
        sm_count=sm_count,
        layer=layer,
        kernels=kernels,
        buffers=buffers,
        weights=weights,
        inputs=inputs,
        tensor_maps=tensor_maps,
        prepare=prepare,
        status=status,
        forward=tuple(ranges),
        input_conversions=conversions,
        _range_index=tuple(index),
    )
    _check_values(r, manifest, check_all_tokens)
    return manifest


def _layer(r: _Reader, v) -> Layer:
    ints = ("hidden", "topK", "experts", "intermediate", "sharedIntermediate", "maxTokens")
    r.obj(v, "layer", required=("name",) + ints + ("expertFormat", "scaleFormat"), allow_extra=True)
    known = {"name", "expertFormat", "scaleFormat", *ints}
    return Layer(
        name=r.str(v["name"], "layer.name"),
        hidden=r.int(v["hidden"], "layer.hidden", lo=1),
        top_k=r.int(v["topK"], "layer.topK", lo=1),
        experts=r.int(v["experts"], "layer.experts", lo=1),
        intermediate=r.int(v["intermediate"], "layer.intermediate", lo=1),
        shared_intermediate=r.int(v["sharedIntermediate"], "layer.sharedIntermediate", lo=0),
        expert_format=r.str(v["expertFormat"], "layer.expertFormat", choices=("fp8", "fp4")),
        scale_format=r.str(v["scaleFormat"], "layer.scaleFormat", choices=("fp32", "ue8m0")),
        max_tokens=r.int(v["maxTokens"], "layer.maxTokens", lo=1, hi=2**31 - 1),
        extra={k: v[k] for k in v if k not in known},
    )


def _cubin_path(r: _Reader, root: str, rel: str, path: str) -> str:
    if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
        r.fail(path, f"a path relative to the export directory, inside it, got {rel!r}")
    full = os.path.join(root, rel)
    try:
        with open(full, "rb") as f:
            head = f.read(4)
    except OSError as e:
        r.fail(path, f"an existing cubin file ({full}: {e.strerror})")
    if head != b"\x7fELF":
        r.fail(path, f"a cubin (an ELF file) at {full}, got a file starting {head!r}")
    return full


def _new_name(r: _Reader, names: Dict[str, str], name, path: str, where: str) -> str:
    name = r.str(name, path)
    if name in names:
        r.fail(path, f"a name unique across buffers, weights and inputs, got {name!r} (already a {names[name]})")
    names[name] = where
    return name


def _init(r: _Reader, v, path: str):
    v = r.str(v, path)
    if v == "none":
        return v, None
    if v == "zero":
        return v, 0
    if v.startswith("fill:"):
        text = v[5:]
        try:
            byte = int(text, 16) if text.lower().startswith("0x") else int(text, 10)
        except ValueError:
            byte = -1
        if 0 <= byte <= 255:
            return v, byte
    r.fail(path, f"'none', 'zero' or 'fill:<byte>' with a byte in 0 … 255, got {v!r}")


def _tensor_spec(r: _Reader, name: str, v, path: str, allow_t: bool) -> TensorSpec:
    r.obj(v, path, required=("dtype", "shape"))
    dtype = r.str(v["dtype"], f"{path}.dtype", choices=tuple(DTYPE_BYTES))
    shape = []
    for i, d in enumerate(r.list(v["shape"], f"{path}.shape", min_length=1)):
        if allow_t and d == "T":
            shape.append("T")
        elif allow_t and not isinstance(d, int):
            r.fail(f"{path}.shape[{i}]", f'a positive integer or "T", got {_type_name(d)}')
        else:
            shape.append(r.int(d, f"{path}.shape[{i}]", lo=1))
    return TensorSpec(name, dtype, tuple(shape), DTYPE_BYTES[dtype])


def _check_inputs(r: _Reader, inputs: Dict[str, TensorSpec], layer: Layer) -> None:
    want = {
        "x": ("bfloat16", ("T", layer.hidden)),
        "topk_ids": ("int32", ("T", layer.top_k)),
        "topk_weights": ("float32", ("T", layer.top_k)),
        "out": ("bfloat16", ("T", layer.hidden)),
    }
    for name, (dtype, shape) in want.items():
        spec = inputs[name]
        if spec.dtype != dtype:
            r.fail(f"inputs.{name}.dtype", f"{dtype!r} (the runtime's forward takes it so), got {spec.dtype!r}")
        if spec.shape != shape:
            r.fail(f"inputs.{name}.shape", f"{list(shape)} (from layer.hidden / layer.topK), got {list(spec.shape)}")


def _tensor_map(r: _Reader, t, p: str, names, buffers, weights) -> TensorMap:
    r.obj(
        t, p,
        required=("id", "buffer", "offset", "dataType", "dims", "stridesBytes", "box", "elementStrides",
                  "interleave", "swizzle", "l2Promotion", "oobFill"),
    )
    mid = r.str(t["id"], f"{p}.id")
    buf = r.str(t["buffer"], f"{p}.buffer")
    where = names.get(buf)
    if where not in ("buffer", "weight"):
        r.fail(f"{p}.buffer", "the name of a buffer or a weight (a tensor map is encoded once, so never over an input)"
               + (f", got {buf!r}" if where is None else f", got the input {buf!r}"))
    offset = r.int(t["offset"], f"{p}.offset", lo=0)
    data_type = r.str(t["dataType"], f"{p}.dataType", choices=tuple(TENSOR_MAP_DATA_TYPES))
    code, elem = TENSOR_MAP_DATA_TYPES[data_type]
    dims = tuple(r.int(d, f"{p}.dims[{i}]", lo=1, hi=2**32) for i, d in enumerate(r.list(t["dims"], f"{p}.dims", min_length=1)))
    rank = len(dims)
    if rank > 5:
        r.fail(f"{p}.dims", f"1 to 5 dimensions, got {rank}")
    interleave = TENSOR_MAP_INTERLEAVE[r.str(t["interleave"], f"{p}.interleave", choices=tuple(TENSOR_MAP_INTERLEAVE))]
    swizzle = TENSOR_MAP_SWIZZLE[r.str(t["swizzle"], f"{p}.swizzle", choices=tuple(TENSOR_MAP_SWIZZLE))]
    l2 = TENSOR_MAP_L2_PROMOTION[r.str(t["l2Promotion"], f"{p}.l2Promotion", choices=tuple(TENSOR_MAP_L2_PROMOTION))]
    oob = TENSOR_MAP_OOB_FILL[r.str(t["oobFill"], f"{p}.oobFill", choices=tuple(TENSOR_MAP_OOB_FILL))]
    align = 32 if interleave == 2 else 16
    strides = tuple(
        r.int(s, f"{p}.stridesBytes[{i}]", lo=align, hi=2**40 - 1)
        for i, s in enumerate(r.list(t["stridesBytes"], f"{p}.stridesBytes", length=rank - 1))
    )
    for i, s in enumerate(strides):
        if s % align:
            r.fail(f"{p}.stridesBytes[{i}]", f"a multiple of {align}, got {s}")
    box = tuple(r.int(b, f"{p}.box[{i}]", lo=1, hi=256) for i, b in enumerate(r.list(t["box"], f"{p}.box", length=rank)))
    estr = tuple(
        r.int(e, f"{p}.elementStrides[{i}]", lo=1, hi=8)
        for i, e in enumerate(r.list(t["elementStrides"], f"{p}.elementStrides", length=rank))
    )
    if interleave != 0 and rank < 3:
        r.fail(f"{p}.interleave", f"'none' for a map of rank {rank} (interleaved maps need rank ≥ 3)")
    if interleave == 2 and swizzle != 1:
        r.fail(f"{p}.swizzle", "'32B' (a 32B interleave requires the 32B swizzle)")
    if interleave == 0:
        inner = box[0] * elem
        if inner % 16:
            r.fail(f"{p}.box[0]", f"a box whose inner dimension is a multiple of 16 bytes, got {inner} bytes")
        span = {1: 32, 2: 64, 3: 128}.get(swizzle)
        if span is not None and inner > span:
            r.fail(f"{p}.box[0]", f"at most {span // elem} elements (the {span}-byte swizzle span), got {box[0]}")
    if offset % align:
        r.fail(f"{p}.offset", f"a multiple of {align} (the map's global address must be {align}-byte aligned), got {offset}")
    m = TensorMap(mid, buf, offset, data_type, code, elem, dims, strides, box, estr, interleave, swizzle, l2, oob, p)
    size = buffers[buf].bytes if where == "buffer" else weights[buf].bytes_for(1)
    if offset + m.extent_bytes() > size:
        r.fail(p, f"a map inside {buf!r} ({size} bytes), got one spanning bytes {offset} … {offset + m.extent_bytes()}")
    return m


class _StepContext:
    def __init__(self, r: _Reader, kernels, names, tensor_maps):
        self.r = r
        self.kernels = kernels
        self.names = names
        self.tensor_maps = tensor_maps

    def ref(self, v, path: str, phase: str) -> Ref:
        r = self.r
        r.obj(v, path, required=("buffer", "offset"))
        name = r.str(v["buffer"], f"{path}.buffer")
        where = self.names.get(name)
        allowed = ("buffer", "weight") if phase == "prepare" else ("buffer", "input")
        if where not in allowed:
            what = "a buffer or a weight (prepare runs before any call)" if phase == "prepare" else \
                "a buffer or an input (the caller may free its weights after prepare)"
            r.fail(f"{path}.buffer", f"the name of {what}, got {name!r}" + (f" ({_a(where)})" if where else ""))
        return Ref(name, r.expr(v["offset"], f"{path}.offset"), where, path)

    def scalar(self, kind: str, v, path: str):
        if kind == "f32" and isinstance(v, float):
            if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
                self.r.fail(path, f"a finite float32, got {v!r}")
            return v
        return self.r.expr(v, path)

    def arg(self, a, path: str, phase: str) -> Arg:
        r = self.r
        r.obj(a, path, required=("kind",), allow_extra=True)
        kind = r.str(a["kind"], f"{path}.kind", choices=("tensorMap", "pointer", "u32", "i32", "f32", "u64", "struct"))
        if kind == "tensorMap":
            r.obj(a, path, required=("kind", "map"))
            mid = r.str(a["map"], f"{path}.map")
            m = self.tensor_maps.get(mid)
            if m is None:
                r.fail(f"{path}.map", f"the id of an entry of tensorMaps, got {mid!r}")
            if phase == "forward" and self.names[m.buffer] == "weight":
                r.fail(f"{path}.map", f"a map over a buffer: {mid!r} is over the weight {m.buffer!r}, which the caller may free after prepare")
            return Arg("tensorMap", path, map=mid)
        if kind == "pointer":
            r.obj(a, path, required=("kind", "ref"))
            ref = None if a["ref"] is None else self.ref(a["ref"], f"{path}.ref", phase)
            return Arg("pointer", path, ref=ref)
        if kind == "struct":
            r.obj(a, path, required=("kind", "bytes", "fields"))
            nbytes = r.int(a["bytes"], f"{path}.bytes", lo=1, hi=4096)
            fields = []
            taken = []
            for i, f in enumerate(r.list(a["fields"], f"{path}.fields")):
                fp = f"{path}.fields[{i}]"
                r.obj(f, fp, required=("offset", "kind"), allow_extra=True)
                fkind = r.str(f["kind"], f"{fp}.kind", choices=("pointer", "u32", "i32", "f32", "u64"))
                if fkind == "pointer":
                    r.obj(f, fp, required=("offset", "kind", "ref"))
                    fld = Field(r.int(f["offset"], f"{fp}.offset", lo=0), fkind, fp,
                                ref=None if f["ref"] is None else self.ref(f["ref"], f"{fp}.ref", phase))
                else:
                    r.obj(f, fp, required=("offset", "kind", "value"))
                    fld = Field(r.int(f["offset"], f"{fp}.offset", lo=0), fkind, fp,
                                value=self.scalar(fkind, f["value"], f"{fp}.value"))
                if fld.offset % fld.size:
                    r.fail(f"{fp}.offset", f"a multiple of {fld.size} ({_a(fkind)} is naturally aligned), got {fld.offset}")
                if fld.offset + fld.size > nbytes:
                    r.fail(f"{fp}.offset", f"at most {nbytes - fld.size} ({_a(fkind)} inside the struct's {nbytes} bytes), got {fld.offset}")
                for (o, s, j) in taken:
                    if fld.offset < o + s and o < fld.offset + fld.size:
                        r.fail(f"{fp}.offset", f"bytes not already taken by fields[{j}], got {fld.offset}")
                taken.append((fld.offset, fld.size, i))
                fields.append(fld)
            return Arg("struct", path, bytes=nbytes, fields=tuple(fields))
        r.obj(a, path, required=("kind", "value"))
        return Arg(kind, path, value=self.scalar(kind, a["value"], f"{path}.value"))

    def step(self, s, path: str, phase: str) -> Step:
        r = self.r
        r.obj(s, path, required=("kind",), allow_extra=True)
        kind = r.str(s["kind"], f"{path}.kind", choices=("launch", "copy", "memset"))
        if kind == "copy":
            r.obj(s, path, required=("kind", "dst", "src", "bytes"))
            return CopyStep(self.ref(s["dst"], f"{path}.dst", phase), self.ref(s["src"], f"{path}.src", phase),
                            r.expr(s["bytes"], f"{path}.bytes"), path)
        if kind == "memset":
            r.obj(s, path, required=("kind", "dst", "byte", "bytes"))
            return MemsetStep(self.ref(s["dst"], f"{path}.dst", phase), r.int(s["byte"], f"{path}.byte", lo=0, hi=255),
                              r.expr(s["bytes"], f"{path}.bytes"), path)
        r.obj(s, path, required=("kind", "kernel", "grid", "block", "sharedBytes", "cluster",
                                  "programmaticStreamSerialization", "args"))
        kid = r.str(s["kernel"], f"{path}.kernel")
        kernel = self.kernels.get(kid)
        if kernel is None:
            r.fail(f"{path}.kernel", f"the id of an entry of kernels, got {kid!r}")
        grid = tuple(r.expr(g, f"{path}.grid[{i}]") for i, g in enumerate(r.list(s["grid"], f"{path}.grid", length=3)))
        block = tuple(r.int(b, f"{path}.block[{i}]", lo=1, hi=1024) for i, b in enumerate(r.list(s["block"], f"{path}.block", length=3)))
        if block[2] > 64:
            r.fail(f"{path}.block[2]", f"at most 64, got {block[2]}")
        if math.prod(block) > 1024:
            r.fail(f"{path}.block", f"at most 1024 threads, got {math.prod(block)}")
        shared = r.int(s["sharedBytes"], f"{path}.sharedBytes", lo=0, hi=kernel.max_dynamic_shared_bytes)
        cluster = tuple(r.int(c, f"{path}.cluster[{i}]", lo=1, hi=MAX_CLUSTER_BLOCKS) for i, c in enumerate(r.list(s["cluster"], f"{path}.cluster", length=3)))
        if math.prod(cluster) > MAX_CLUSTER_BLOCKS:
            r.fail(f"{path}.cluster", f"at most {MAX_CLUSTER_BLOCKS} blocks per cluster, got {math.prod(cluster)}")
        pss = r.bool(s["programmaticStreamSerialization"], f"{path}.programmaticStreamSerialization")
        args = tuple(self.arg(a, f"{path}.args[{i}]", phase) for i, a in enumerate(r.list(s["args"], f"{path}.args")))
        return LaunchStep(kid, grid, block, shared, cluster, pss, args, path)


# ----------------------------------------------------------------------------------------------------
# Values for every T


def _values_of(step: Step):
    """(path, value, checker-kind, extra) for every expression of a step."""
    if isinstance(step, LaunchStep):
        for i, g in enumerate(step.grid):
            yield f"{step.path}.grid[{i}]", g, "grid", (i, step.cluster[i])
        for a in step.args:
            if a.kind == "pointer" and a.ref is not None:
                yield f"{a.ref.path}.offset", a.ref.offset, "ptr", a.ref
            elif a.kind in SCALAR_KINDS and isinstance(a.value, Expr):
                yield a.path + ".value", a.value, a.kind, None
            elif a.kind == "struct":
                for f in a.fields:
                    if f.ref is not None:
                        yield f"{f.ref.path}.offset", f.ref.offset, "ptr", f.ref
                    elif isinstance(f.value, Expr):
                        yield f.path + ".value", f.value, f.kind, None
    else:
        yield f"{step.dst.path}.offset", step.dst.offset, "ptr", step.dst
        if isinstance(step, CopyStep):
            yield f"{step.src.path}.offset", step.src.offset, "ptr", step.src
        yield f"{step.path}.bytes", step.bytes, "bytes", step


def _check_value(r: _Reader, m: Manifest, path: str, v: int, kind: str, extra, T: int) -> None:
    at = f" (T = {T})" if T else ""
    if kind == "grid":
        axis, cluster = extra
        hi = MAX_GRID_X if axis == 0 else MAX_GRID_YZ
        if not 1 <= v <= hi:
            r.fail(path, f"a grid size in 1 … {hi}{at}, got {v}")
        if v % cluster:
            r.fail(path, f"a multiple of the cluster's {cluster}{at}, got {v}")
    elif kind == "ptr":
        size = m.size_of(extra.buffer, T or 1)
        if not 0 <= v <= size:
            r.fail(path, f"an offset in 0 … {size} (inside {extra.buffer!r}){at}, got {v}")
    elif kind == "bytes":
        step = extra
        if v < 0:
            r.fail(path, f"a byte count ≥ 0{at}, got {v}")
        refs = (step.dst, step.src) if isinstance(step, CopyStep) else (step.dst,)
        for ref in refs:
            off = ref.offset.evaluate(T or 1)
            size = m.size_of(ref.buffer, T or 1)
            if off + v > size:
                r.fail(path, f"at most {size - off} (bytes {off} … {off + v} of {ref.buffer!r}, {size} bytes){at}, got {v}")
    elif kind == "f32":
        if abs(v) > FLOAT32_MAX:
            r.fail(path, f"a float32{at}, got {v}")
    else:
        _fmt, _n, lo, hi = SCALAR_KINDS[kind]
        if not lo <= v <= hi:
            r.fail(path, f"{_a(kind)} in {lo} … {hi}{at}, got {v}")


def _check_values(r: _Reader, m: Manifest, all_tokens: bool) -> None:
    groups = [(m.prepare, None)] + [(tr.steps, tr) for tr in m.forward] + [
        (c.steps, TokenRange(1, m.layer.max_tokens, c.steps, c.path)) for c in m.input_conversions.values()]
    for steps, tr in groups:
        for step in steps:
            for path, e, kind, extra in _values_of(step):
                dynamic = e.depends_on_t or (kind == "bytes" and any(
                    ref.offset.depends_on_t or m.size_of(ref.buffer, 1) != m.size_of(ref.buffer, 2)
                    for ref in ((step.dst, step.src) if isinstance(step, CopyStep) else (step.dst,))))
                if kind == "ptr" and extra.where == "input":
                    dynamic = True
                if tr is None:
                    if e.depends_on_t:
                        r.fail(path, 'an expression without "T" (prepare runs once, for no call)')
                    _check_value(r, m, path, e.const, kind, extra, 0)
                elif not dynamic:
                    _check_value(r, m, path, e.const, kind, extra, 0)
                elif all_tokens:
                    for T in range(tr.lo, tr.hi + 1):
                        try:
                            v = e.evaluate(T)
                        except ArithmeticError as err:
                            r.fail(path, f"an expression that evaluates (T = {T}): {err}")
                        _check_value(r, m, path, v, kind, extra, T)
                else:
                    for T in (tr.lo, tr.hi):
                        _check_value(r, m, path, e.evaluate(T), kind, extra, T)
