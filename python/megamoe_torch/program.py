"""Running a manifest's steps: the torch-free core of the runtime.

A :class:`Program` is built once from a checked :class:`~.manifest.Manifest`, a :class:`~.driver.Driver`,
the loaded kernels (``CUfunction`` handles by kernel id), the device addresses of the buffers (and of the
weights, for ``prepare``) and the encoded tensor maps (128 bytes by id). It packs every launch's
arguments and ``CUlaunchConfig`` once per launch site, with every value that does not depend on the
call already written. A call of T tokens then only

- looks up the range holding T (a list index),
- for a site whose last call had another T, writes that T's scalars and grid (computed once per T),
- writes the input pointers (the tensors' addresses plus their offsets),
- sets the stream and calls ``cuLaunchKernelEx`` / ``cuMemcpyDtoDAsync_v2`` / ``cuMemsetD8Async``.

No allocation on the device, no synchronization; the driver copies the argument bytes as it queues or
captures a launch, so rewriting them for the next call is safe. One Program is not for concurrent
calls from several threads (its workspace buffers are shared by every call anyway).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from .args import PACKERS, ArgBlock
from .driver import LaunchConfig
from .expr import Expr
from .manifest import INPUTS, CopyStep, LaunchStep, Manifest, MemsetStep, Ref

INPUT_INDEX = {name: i for i, name in enumerate(INPUTS)}


class _Value:
    """A T-dependent value: fn(T) -> int, plus a constant base (a buffer's address for a pointer)."""

    __slots__ = ("expr", "base")

    def __init__(self, expr: Expr, base: int = 0):
        self.expr = expr
        self.base = base

    def __call__(self, T: int):
        return self.base + self.expr.evaluate(T)


class LaunchSite:
    __slots__ = (
        "step", "fn", "args", "config", "cfg", "cfg_address", "params_address", "view", "launch", "driver",
        "t_slots", "t_fns", "in_slots", "in_fns", "grid_fns", "grid_dynamic", "table", "last_T", "in_offsets",
    )

    def __init__(self, program: "Program", step: LaunchStep, max_tokens: int):
        self.step = step
        self.driver = program.driver
        self.launch = program.driver.launch_kernel_ex_raw
        self.fn = program.functions[step.kernel]
        self.args = ArgBlock(step.args)
        self.view = self.args.view
        self.params_address = self.args.params_address
        self.config = LaunchConfig(step.block, step.shared_bytes, step.cluster, step.programmatic_stream_serialization)
        self.cfg = self.config.config
        self.cfg_address = self.config.address
        self.t_slots: List = []  # (pack_into, block offset)
        self.t_fns: List = []  # T -> value
        self.in_slots: List = []  # (pack_into, block offset, input index)
        self.in_fns: List = []  # T -> byte offset into the input
        for a, off in zip(step.args, self.args.offsets):
            if a.kind == "tensorMap":
                self.args.write_bytes(off, program.tensor_maps[a.map])
            elif a.kind == "pointer":
                self._pointer(program, off, a.ref)
            elif a.kind == "struct":
                for f in a.fields:
                    if f.kind == "pointer":
                        self._pointer(program, off + f.offset, f.ref)
                    else:
                        self._scalar(off + f.offset, f.kind, f.value)
            else:
                self._scalar(off, a.kind, a.value)
        self.grid_dynamic = any(g.depends_on_t for g in step.grid)
        self.grid_fns = step.grid
        if not self.grid_dynamic:
            self.config.set_grid(*(g.const for g in step.grid))
        self.table: List = [None] * (max_tokens + 1)
        self.last_T = -1
        self.in_offsets = ()

    def _pointer(self, program: "Program", off: int, ref) -> None:
        pack = PACKERS["pointer"].pack_into
        if ref is None:
            pack(self.view, off, 0)
        elif ref.where == "input":
            self.in_slots.append((pack, off, INPUT_INDEX[ref.buffer]))
            self.in_fns.append(ref.offset.evaluate)
        elif ref.offset.depends_on_t:
            self.t_slots.append((pack, off))
            self.t_fns.append(_Value(ref.offset, program.addresses[ref.buffer]))
        else:
            self.args.write("pointer", off, program.addresses[ref.buffer] + ref.offset.const)

    def _scalar(self, off: int, kind: str, value) -> None:
        if isinstance(value, Expr) and value.depends_on_t:
            self.t_slots.append((PACKERS[kind].pack_into, off))
            self.t_fns.append(value.evaluate if kind != "f32" else (lambda T, e=value: float(e.evaluate(T))))
        else:
            v = value.const if isinstance(value, Expr) else value
            self.args.write(kind, off, v)

    def entry(self, T: int):
        e = self.table[T]
        if e is None:
            grid = tuple(g.evaluate(T) for g in self.grid_fns) if self.grid_dynamic else None
            e = (grid, tuple(f(T) for f in self.t_fns), tuple(f(T) for f in self.in_fns))
            self.table[T] = e
        return e

    def set_tokens(self, T: int) -> None:
        grid, values, self.in_offsets = self.entry(T)
        if grid is not None:
            c = self.cfg
            c.gridDimX, c.gridDimY, c.gridDimZ = grid
        view = self.view
        for (pack, off), v in zip(self.t_slots, values):
            pack(view, off, v)
        self.last_T = T

    def set_inputs(self, ptrs: Sequence[int]) -> None:
        view = self.view
        for (pack, off, idx), io in zip(self.in_slots, self.in_offsets):
            pack(view, off, ptrs[idx] + io)

    def run(self, T: int, ptrs: Sequence[int], stream: int) -> None:
        if T != self.last_T:
            self.set_tokens(T)
        if self.in_slots:
            self.set_inputs(ptrs)
        self.cfg.hStream = stream
        rc = self.launch(self.cfg_address, self.fn, self.params_address, None)
        if rc:
            c = self.cfg
            self.driver.fail(
                "cuLaunchKernelEx", rc,
                f"{self.step.path}: kernel {self.step.kernel}, T = {T}, grid {c.gridDimX}x{c.gridDimY}x{c.gridDimZ}, "
                f"block {'x'.join(map(str, self.step.block))}, {self.step.shared_bytes} B shared, "
                f"cluster {'x'.join(map(str, self.step.cluster))}",
            )


class _RefValue:
    __slots__ = ("input_index", "base", "offset")

    def __init__(self, program: "Program", ref: Ref):
        self.input_index = INPUT_INDEX[ref.buffer] if ref.where == "input" else -1
        self.base = 0 if ref.where == "input" else program.addresses[ref.buffer]
        self.offset = ref.offset

    def address(self, T: int, ptrs: Sequence[int]) -> int:
        base = ptrs[self.input_index] if self.input_index >= 0 else self.base
        return base + self.offset.evaluate(T)


class CopySite:
    __slots__ = ("step", "dst", "src", "call", "driver", "last_T", "n", "dst_off", "src_off")

    def __init__(self, program: "Program", step: CopyStep):
        self.step = step
        self.dst = _RefValue(program, step.dst)
        self.src = _RefValue(program, step.src)
        self.call = program.driver.memcpy_dtod_async_raw
        self.driver = program.driver
        self.last_T = -1

    def run(self, T: int, ptrs: Sequence[int], stream: int) -> None:
        if T != self.last_T:
            self.n = self.step.bytes.evaluate(T)
            self.dst_off = self.dst.offset.evaluate(T)
            self.src_off = self.src.offset.evaluate(T)
            self.last_T = T
        n = self.n
        if n <= 0:
            return
        dst, src = self.dst, self.src
        rc = self.call((ptrs[dst.input_index] if dst.input_index >= 0 else dst.base) + self.dst_off,
                       (ptrs[src.input_index] if src.input_index >= 0 else src.base) + self.src_off, n, stream)
        if rc:
            self.driver.fail("cuMemcpyDtoDAsync_v2", rc, f"{self.step.path}: {n} bytes, T = {T}")


class MemsetSite:
    __slots__ = ("step", "dst", "call", "driver", "last_T", "n", "dst_off")

    def __init__(self, program: "Program", step: MemsetStep):
        self.step = step
        self.dst = _RefValue(program, step.dst)
        self.call = program.driver.memset_d8_async_raw
        self.driver = program.driver
        self.last_T = -1

    def run(self, T: int, ptrs: Sequence[int], stream: int) -> None:
        if T != self.last_T:
            self.n = self.step.bytes.evaluate(T)
            self.dst_off = self.dst.offset.evaluate(T)
            self.last_T = T
        n = self.n
        if n <= 0:
            return
        dst = self.dst
        rc = self.call((ptrs[dst.input_index] if dst.input_index >= 0 else dst.base) + self.dst_off,
                       self.step.byte, n, stream)
        if rc:
            self.driver.fail("cuMemsetD8Async", rc, f"{self.step.path}: {n} bytes, T = {T}")


class Program:
    """The packed steps of one export (see the module's description)."""

    def __init__(self, manifest: Manifest, driver, functions: Dict[str, int], addresses: Dict[str, int],
                 tensor_maps: Dict[str, bytes]):
        self.manifest = manifest
        self.driver = driver
        self.functions = functions
        self.addresses = addresses
        self.tensor_maps = tensor_maps
        max_t = manifest.layer.max_tokens
        self.prepare_sites = [self._site(s, 1) for s in manifest.prepare]
        self.range_sites = [tuple(self._site(s, max_t) for s in tr.steps) for tr in manifest.forward]
        self.sites_for_t = [()] + [self.range_sites[manifest._range_index[T]] for T in range(1, max_t + 1)]
        # Per converted input: its steps, its index among the inputs and the buffer read in its place.
        self.conversions = {
            name: (tuple(self._site(s, max_t) for s in c.steps), INPUT_INDEX[name], c.buffer)
            for name, c in manifest.input_conversions.items()
        }

    def _site(self, step, max_tokens: int):
        if isinstance(step, LaunchStep):
            return LaunchSite(self, step, max_tokens)
        if isinstance(step, CopyStep):
            return CopySite(self, step)
        return MemsetSite(self, step)

    def run_prepare(self, stream: int) -> None:
        for site in self.prepare_sites:
            site.run(1, (), stream)

    def run_forward(self, T: int, ptrs: Sequence[int], stream: int, convert: Sequence[str] = ()) -> None:
        """Queue the steps for T tokens; ``ptrs`` the addresses of x, topk_ids, topk_weights, out. The
        inputs named in ``convert`` were handed over in their conversion's dtype: its steps run first,
        and the forward reads its buffer in the input's place."""
        for name in convert:
            sites, index, buffer = self.conversions[name]
            for site in sites:
                site.run(T, ptrs, stream)
            ptrs = list(ptrs)
            ptrs[index] = self.addresses[buffer]
        for site in self.sites_for_t[T]:
            site.run(T, ptrs, stream)

    def precompute(self) -> None:
        """Fill every launch site's per-T table now (else each T's first call does it)."""
        for tr, sites in zip(self.manifest.forward, self.range_sites):
            for site in sites:
                if isinstance(site, LaunchSite):
                    for T in range(tr.lo, tr.hi + 1):
                        site.entry(T)
