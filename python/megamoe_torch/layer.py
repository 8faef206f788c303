"""``MegaMoE``: an exported layer run from PyTorch, and a ``fused_experts`` with vLLM's argument names.

torch is imported when a layer is built, not when this module is imported.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, Mapping, Optional, Sequence, Union

from .checks import InputChecker, check_weight
from .driver import (
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, Driver,
    default_driver,
)
from .errors import MegaMoEStatusError
from .manifest import ROUTED_WEIGHTS, SHARED_WEIGHTS, Manifest, load_manifest
from .program import Program

BUFFER_ALIGN = 256


def _torch():
    import torch  # noqa: PLC0415 (lazy on purpose: the GPU-free modules must import without torch)

    return torch


def _stream_getter(torch, index: int):
    """The raw handle of torch's current stream on device ``index``, cheaply (no Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


def _shared_weights(shared) -> Dict[str, object]:
    if shared is None:
        return {}
    if isinstance(shared, Mapping):
        out = {}
        for key, t in shared.items():
            name = key if key.startswith("shared_") else f"shared_{key}"
            if name not in SHARED_WEIGHTS:
                raise ValueError(f"shared: unknown key {key!r}; expected {', '.join(ROUTED_WEIGHTS)}")
            out[name] = t
        missing = [n[7:] for n in SHARED_WEIGHTS if n not in out]
        if missing:
            raise ValueError(f"shared: missing {', '.join(missing)}")
        return out
    if isinstance(shared, (tuple, list)) and len(shared) == 4:
        return dict(zip(SHARED_WEIGHTS, shared))
    raise TypeError("shared must be a tuple (w13, w13_scale, w2, w2_scale) or a dict with those keys, "
                    f"got {type(shared).__name__}")


def gather_weights(manifest: Manifest, w13, w13_scale, w2, w2_scale, shared=None) -> Dict[str, object]:
    """The weights by manifest name, checked against the export having a shared expert or not."""
    weights = dict(zip(ROUTED_WEIGHTS, (w13, w13_scale, w2, w2_scale)))
    extra = _shared_weights(shared)
    has_shared = manifest.layer.shared_intermediate > 0
    if has_shared and not extra:
        raise ValueError(f"shared: this export has a shared expert (sharedIntermediate "
                         f"{manifest.layer.shared_intermediate}): pass shared=(w13, w13_scale, w2, w2_scale)")
    if extra and not has_shared:
        raise ValueError("shared: this export has no shared expert (sharedIntermediate 0): pass shared=None "
                         "or export with --shared 1")
    weights.update(extra)
    return weights


class MegaMoE:
    """One exported layer on one GPU. Build with :meth:`from_export`; call :meth:`forward`."""

    def __init__(self, manifest: Manifest, weights: Dict[str, object], device=None, driver: Optional[Driver] = None):
        torch = _torch()
        self.manifest = manifest
        self._torch = torch
        if device is None:
            w = weights["w13"]
            device = w.device if getattr(w.device, "type", None) == "cuda" else torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        for name, spec in manifest.weights.items():
            check_weight(name, spec, weights[name], device, arg=name if not name.startswith("shared_") else f"shared {name[7:]}")
        self._checker = InputChecker(manifest, device, lambda n: getattr(torch, n))
        layer = manifest.layer
        self.hidden = layer.hidden
        self.top_k = layer.top_k
        self.max_tokens = layer.max_tokens

        drv = driver or default_driver()
        self._driver = drv
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)  # make torch create its (primary) context on this device
            dev = drv.device(device.index)
            self._ctx = drv.primary_context(dev)
            if drv.current_context() != self._ctx:
                drv.set_current_context(self._ctx)
            major = drv.device_attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            minor = drv.device_attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            if (major, minor) != (9, 0):
                raise RuntimeError(f"{manifest.file}: the export is for {manifest.arch} (Hopper, compute capability 9.0); "
                                   f"{device} is {major}.{minor}")
            sms = drv.device_attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
            if sms != manifest.sm_count:
                raise RuntimeError(f"{manifest.file}: the grids were planned for {manifest.sm_count} SMs; {device} has "
                                   f"{sms}: export again on (or for) this GPU")
            optin = drv.device_attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)

            # Buffers: byte tensors from torch's allocator (its blocks are 512-byte aligned).
            self.buffers = {}
            addresses = {}
            for name, b in manifest.buffers.items():
                t = torch.empty(b.bytes, dtype=torch.uint8, device=device)
                if t.data_ptr() % BUFFER_ALIGN:
                    raise RuntimeError(f"buffer {name}: torch returned an address not {BUFFER_ALIGN}-byte aligned")
                if b.fill is not None:
                    t.fill_(b.fill)
                self.buffers[name] = t
                addresses[name] = t.data_ptr()
            for name in manifest.weights:
                addresses[name] = weights[name].data_ptr()

            self._modules = []
            functions = {}
            for kid, k in manifest.kernels.items():
                if k.max_dynamic_shared_bytes > optin:
                    raise RuntimeError(f"kernel {kid}: {k.max_dynamic_shared_bytes} bytes of dynamic shared memory exceed "
                                       f"{device}'s {optin}")
                with open(k.cubin_path, "rb") as f:
                    image = f.read()
                mod = drv.load_module(image, f"{k.cubin_path}")
                self._modules.append(mod)
                fn = drv.get_function(mod, k.function)
                drv.set_max_dynamic_shared(fn, k.max_dynamic_shared_bytes, kid)
                functions[kid] = fn

            maps = {}
            for mid, m in manifest.tensor_maps.items():
                maps[mid] = drv.encode_tensor_map_tiled(
                    m.data_type_code, addresses[m.buffer] + m.offset, m.dims, m.strides_bytes, m.box,
                    m.element_strides, m.interleave, m.swizzle, m.l2_promotion, m.oob_fill,
                    detail=f"{m.path} ({mid}: dims {list(m.dims)}, box {list(m.box)})")

            self._program = Program(manifest, drv, functions, addresses, maps)
            self._stream = _stream_getter(torch, device.index)
            self._program.run_prepare(self._stream())
            # The caller may free its weights once we return: wait for prepare to have read them.
            torch.cuda.current_stream(device).synchronize()
        self._program.addresses = {n: a for n, a in addresses.items() if n in manifest.buffers}
        self._program.precompute()
        self._ctx_out = ctypes.c_void_p()
        self._ctx_ref = ctypes.pointer(self._ctx_out)
        self._bf16 = torch.bfloat16
        self._i64 = torch.int64
        self._convert_ids = ("topk_ids",)

    @classmethod
    def from_export(cls, export_dir: str, w13, w13_scale, w2, w2_scale,
                    shared: Union[Sequence, Mapping, None] = None, device=None) -> "MegaMoE":
        """Load ``export_dir`` (written by ``megamoe export``), adopt the weights and prepare them.

        The weights are the layouts engines hold (docs/export.md, "Weights"); the manifest's ``weights``
        entries give each one's dtype and shape. ``shared`` is the shared expert's (w13, w13_scale, w2,
        w2_scale), as a tuple or a dict, when the export has one. The preparation runs on torch's current
        stream and is waited for, so the caller may free its tensors afterwards.
        """
        manifest = load_manifest(export_dir)
        weights = gather_weights(manifest, w13, w13_scale, w2, w2_scale, shared)
        return cls(manifest, weights, device=device)

    def _make_current(self) -> None:
        drv = self._driver
        drv.ctx_get_current_raw(self._ctx_ref)
        if self._ctx_out.value != self._ctx:
            drv.set_current_context(self._ctx)

    def forward(self, x, topk_ids, topk_weights, out=None):
        """The layer for T tokens on torch's current stream: x bf16 [T, H], topk_ids int32 [T, k] (−1: an
        unused slot), topk_weights float32 [T, k]; returns out, bf16 [T, H].

        Allocates nothing but ``out`` when it is not given and never waits for the device. For CUDA graph
        capture pass ``out`` (and capture with the tensors whose addresses the replays will reuse).
        """
        T = self._checker.check(x, topk_ids, topk_weights, out)
        if out is None:
            out = self._torch.empty((T, self.hidden), dtype=self._bf16, device=self.device)
        self._make_current()
        self._program.run_forward(
            T, (x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(), out.data_ptr()), self._stream(),
            self._convert_ids if topk_ids.dtype == self._i64 else ())
        return out

    __call__ = forward

    def check_status(self) -> None:
        """Wait for the device, then read the kernels' watchdog words; raise MegaMoEStatusError if a wait
        never completed (a trap surfaces as a CUDA error at the synchronization: reported the same way)."""
        torch = self._torch
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            raise MegaMoEStatusError(
                f"the fused MoE kernel failed ({e}); a wait inside it that never completes traps after 2 s: "
                "please report this with the layer's shape and token count", None, str(e)) from e
        st = self.manifest.status
        words = self.buffers[st.buffer][: 4 * st.words].view(torch.int32).tolist()
        if any(words):
            raise MegaMoEStatusError(
                f"the fused MoE kernel's watchdog: a wait never completed (code {words[0]}, block "
                f"{words[1] if len(words) > 1 else '?'}, waited for {words[2:4]}); words {words}", words)

    def close(self) -> None:
        """Unload the kernels' modules and drop the buffers (the layer is unusable afterwards)."""
        for mod in self._modules:
            self._driver.unload_module(mod)
        self._modules = []
        self.buffers = {}
        self._program = None


# ----------------------------------------------------------------------------------------------------
# vLLM's fused_experts

_cache: Dict[tuple, MegaMoE] = {}
_cache_lock = threading.Lock()


def _refuse(name: str, value, expected: str):
    raise ValueError(f"{name}={value!r} is not supported by megamoe_torch.fused_experts: expected {expected}")


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace: bool = False, activation: str = "silu",
                  apply_router_weight_on_input: bool = False, use_fp8_w8a8: bool = False,
                  use_int8_w8a8: bool = False, use_int8_w8a16: bool = False, use_int4_w4a16: bool = False,
                  per_channel_quant: bool = False, global_num_experts: int = -1, expert_map=None,
                  w1_scale=None, w2_scale=None, w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None,
                  block_shape=None, allow_deep_gemm: bool = False, *, export_dir: Optional[str] = None, out=None):
    """vLLM's ``fused_experts`` for the FP8 block-scaled case, run by an exported megamoe layer.

    The argument names and order follow vLLM's ``fused_experts`` (vllm-project/vllm,
    vllm/model_executor/layers/fused_moe/fused_moe.py: ``fused_experts(hidden_states, w1, w2,
    topk_weights, topk_ids, inplace=False, activation="silu", apply_router_weight_on_input=False,
    use_fp8_w8a8=False, …, global_num_experts=-1, expert_map=None, w1_scale=None, w2_scale=None, w1_zp,
    w2_zp, a1_scale, a2_scale, block_shape=None, allow_deep_gemm=False)``); only ``use_fp8_w8a8=True``
    with ``block_shape=[128, 128]``, SiLU, no expert map and dynamic activation scales is served.
    ``export_dir`` (or the environment variable MEGAMOE_EXPORT) names the export. One MegaMoE is built
    and cached per (export, device, weight addresses): weights replaced in place at the same addresses
    are not noticed (call ``clear_cache()``). ``inplace`` writes the result into ``hidden_states`` through
    one extra copy.
    """
    export_dir = export_dir or os.environ.get("MEGAMOE_EXPORT")
    if not export_dir:
        raise ValueError("export_dir: pass export_dir=… or set MEGAMOE_EXPORT to a `megamoe export` directory")
    if not use_fp8_w8a8:
        _refuse("use_fp8_w8a8", use_fp8_w8a8, "True (FP8 block-scaled experts)")
    for name, v in (("use_int8_w8a8", use_int8_w8a8), ("use_int8_w8a16", use_int8_w8a16),
                    ("use_int4_w4a16", use_int4_w4a16), ("per_channel_quant", per_channel_quant),
                    ("apply_router_weight_on_input", apply_router_weight_on_input)):
        if v:
            _refuse(name, v, "False")
    if activation != "silu":
        _refuse("activation", activation, "'silu'")
    if block_shape is None or list(block_shape) != [128, 128]:
        _refuse("block_shape", block_shape, "[128, 128]")
    for name, v in (("expert_map", expert_map), ("w1_zp", w1_zp), ("w2_zp", w2_zp), ("a1_scale", a1_scale),
                    ("a2_scale", a2_scale)):
        if v is not None:
            _refuse(name, "<tensor>", "None (the layer quantizes activations itself, per 128, dynamically)")
    if w1_scale is None or w2_scale is None:
        raise ValueError("w1_scale and w2_scale are required (the FP8 block scales)")
    experts = w1.shape[0]
    if global_num_experts not in (-1, experts):
        _refuse("global_num_experts", global_num_experts, f"-1 or {experts} (no expert parallelism)")
    device = hidden_states.device
    key = (os.path.realpath(export_dir), str(device), w1.data_ptr(), w1_scale.data_ptr(), w2.data_ptr(),
           w2_scale.data_ptr())
    layer = _cache.get(key)
    if layer is None:
        with _cache_lock:
            layer = _cache.get(key)
            if layer is None:
                manifest = load_manifest(export_dir)
                if manifest.layer.shared_intermediate:
                    raise ValueError(f"export_dir: {export_dir} has a shared expert; fused_experts runs routed experts "
                                     "only: export with --shared 0")
                layer = MegaMoE(manifest, gather_weights(manifest, w1, w1_scale, w2, w2_scale), device=device)
                _cache[key] = layer
    if inplace and out is None:
        result = layer.forward(hidden_states, topk_ids, topk_weights)
        hidden_states.copy_(result)
        return hidden_states
    return layer.forward(hidden_states, topk_ids, topk_weights, out=out)


def clear_cache() -> None:
    """Forget the layers fused_experts built."""
    with _cache_lock:
        _cache.clear()


__all__ = ["MegaMoE", "fused_experts", "clear_cache", "gather_weights"]
