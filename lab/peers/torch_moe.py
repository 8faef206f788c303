"""The PyTorch peer of megamoe's layer benchmark: the same MoE workload in torch, on the GPU host.

Workload (mirrors `megamoe bench --impl unfused`): the shape of a preset (E experts, hidden H,
intermediate IH, top-k, shared experts), a list of token counts, random routing (k distinct experts
per token, uniform; weights normalized to routed_scaling_factor), random bf16 activations, FP8 e4m3
weights made with 128x128 block scales (random magnitudes, never zero).

Pipeline, all on the device, no host synchronization (so a forward can be captured in a CUDA graph):
  per-token FP8 quantization of x -> permutation of the (token, slot) rows to expert order (argsort of
  the ids; each expert's rows padded to 16) -> L1 by torch._scaled_grouped_mm -> SwiGLU (clamped) and
  FP8 re-quantization -> L2 by torch._scaled_grouped_mm -> un-permutation -> weighted combine plus the
  shared expert (a dense FP8 MLP through torch._scaled_mm) -> bf16 out.

Scales. torch._scaled_grouped_mm on SM90 (torch 2.11, CUDA 13.0) takes FP8 with *rowwise* fp32 scales
only: one scale per row of A (shape [M_total]) and one per output channel of each group's B (shape
[G, N]); block-scaled recipes (1x128 activations, 128x128 weights) need cuBLASLt grouped GEMM, which
newer torch builds with CUDA >= 13.4 only. So the block scales are turned into the closest rowwise
equivalent: activations get one scale per token (amax of the whole row instead of per 128 channels),
weights one scale per output channel (the largest block scale of that row of blocks, the block codes
re-quantized against it). Same bytes moved and same FLOPs as the block-scaled layer, which is what the
timing compares; the numerics are a little coarser.

Timing: CUDA events around each run, all runs queued back to back and read after one synchronization
(like megamoe's timeKernel), L2 flushed before each run (a buffer of 2x the L2 size is written), after
warm-up (--warmup runs, then --warmup-ms of GPU time); median/min/max of --iters runs. --graph times
CUDA-graph replays instead of eager launches.
Before timing, one forward at min(64, max tokens) tokens is compared with an FP32 reference made from
the same FP8 weights; a grouped GEMM that is refused, or that fails the check, is replaced by a loop of
torch._scaled_mm per expert (rows marked impl "torch-loop", and the reason printed).

Floor (same model as megamoe's, see src/bench/layer.ts): max(bytes / read-stream bandwidth, FLOPs / FP8
rate), bytes = FP8 weights and 128x128 block scales of every expert touched + the shared expert's + bf16
in and out, all at the read rate (they are nearly all weight reads). The read stream (the fastest of a few
full reductions over 2 GiB, see measure_read_tbps) and the dense FP8 rate (torch._scaled_mm 8192^3, fast
accumulation) are measured here and written to the JSON (read_tbps, read_method, fp8_tflops); the device
copy (tensor.copy_ of 2 GiB, read + write) is measured and written too (copy_tbps), for the record only.

Usage (GPU host):
  python3 lab/peers/torch_moe.py --shape flash-ep8 --shared 1 --out torch-flash-ep8-shared1.json
  python3 lab/peers/torch_moe.py --shape flash-ep8 --shared 1 --graph --out torch-graph.json
  python3 lab/peers/torch_moe.py --grouped-gemm-only --out torch-grouped-gemm.json
  python3 lab/peers/torch_moe.py --grouped-gemm-only --blockwise --out torch-grouped-gemm.json  # + block scales
  python3 lab/peers/torch_moe.py --dry-run --shape tiny      # CPU tensors, emulated FP8 GEMMs
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # py_compile and --help work without torch; everything else needs it
    torch = None
    F = None

# The project's presets (src/config/config.ts): experts, hidden, intermediate, top-k, shared experts,
# routed_scaling_factor, SwiGLU clamp.
PRESETS = {
    "tiny": dict(E=8, H=256, IH=128, k=2, shared=1, scale=1.5, clamp=10.0),
    "flash": dict(E=256, H=4096, IH=2048, k=6, shared=1, scale=1.5, clamp=10.0),
    "pro": dict(E=384, H=7168, IH=3072, k=6, shared=1, scale=2.5, clamp=10.0),
    "flash-ep8": dict(E=32, H=4096, IH=2048, k=6, shared=1, scale=1.5, clamp=10.0),
}
BLOCK = 128
FP8_MAX = 448.0
# Rows per expert are padded to this: the grouped GEMM's groups start on 16-row boundaries.
GROUP_ALIGN = 16
DEFAULT_TOKENS = [2**i for i in range(14)]
DRY_RUN_TOKENS = [1, 7, 64]
GROUPED_GEMM_M = [64, 512, 4096]
DRY_RUN_M = [16, 48]
GROUPED_GEMM_GROUPS = 32
CHECK_TOKENS = 64
# FP8 activations against an FP32 reference on the same FP8 weights: a few percent. A wrong layout or
# scale is off by ~100%.
CHECK_TOLERANCE = 0.1
# Floor constants of megamoe's grouped-GEMM benchmark (src/cuda/hardware.ts: READ_BYTES_PER_S,
# FP8_PEAK_FLOPS), so the two grouped-GEMM floors are the same numbers.
GEMM_FLOOR_READ_TBPS = 4.3
GEMM_FLOOR_FP8_TFLOPS = 1500.0


def log(msg):
    print(msg, flush=True)


def first_line(e):
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------
# Quantization


def fp8():
    return torch.float8_e4m3fn


def quant_rows(x):
    """Per-token FP8: one fp32 scale per row, amax / 448 (the rowwise form the grouped GEMM takes)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(fp8())
    return q, scale.squeeze(-1)


def swiglu_quant(y, clamp):
    """silu(min(g, c)) * clamp(u, -c, c) on the L1 output [rows, 2*IH] (gate | up), then quant_rows."""
    inter = y.shape[-1] // 2
    g = y[:, :inter].float()
    u = y[:, inter:].float()
    if clamp is not None:
        g = g.clamp(max=clamp)
        u = u.clamp(-clamp, clamp)
    return quant_rows(F.silu(g) * u)


def block_quantize(w):
    """128x128 block FP8 of a float [n, k] matrix: codes [n, k] and fp32 scales [n/128, k/128]."""
    n, k = w.shape
    blocks = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(fp8())
    return q.view(n, k), scale


def block_to_rowwise(q, block_scale):
    """The closest rowwise form of block-scaled FP8: each row of blocks takes its largest block scale,
    and every block's codes are re-quantized against it (ratio <= 1, so nothing overflows; small blocks
    next to large ones lose low bits). Returns codes [n, k] and one fp32 scale per row [n]."""
    n, k = q.shape
    row_block_scale = block_scale.amax(dim=1, keepdim=True)  # [n/128, 1]
    ratio = block_scale / row_block_scale  # [n/128, k/128], in (0, 1]
    codes = q.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) * ratio[:, None, :, None]
    return codes.to(fp8()).view(n, k), row_block_scale.repeat_interleave(BLOCK, dim=0).squeeze(1)


def random_weight_blocks(n, k, gen, dev):
    """A random [n, k] weight in 128x128 block FP8 (block magnitudes spread over 2^-3..2^3, so the block
    scales differ): codes [n, k] and scales [n/128, k/128]."""
    magnitude = torch.exp2(torch.rand(n // BLOCK, 1, k // BLOCK, 1, generator=gen, device=dev) * 6 - 3)
    w = torch.randn(n // BLOCK, BLOCK, k // BLOCK, BLOCK, generator=gen, device=dev) * magnitude
    return block_quantize((w / math.sqrt(k)).view(n, k))


def random_weight(n, k, gen, dev):
    """random_weight_blocks in rowwise form."""
    return block_to_rowwise(*random_weight_blocks(n, k, gen, dev))


def quant_blocks_1x128(x):
    """Per-128-channel FP8 of the rows of x [m, k] (megamoe's activation format): codes [m, k] and fp32
    scales [m, k/128]."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    scale = xb.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    return (xb / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(fp8()).view(m, k), scale


def blockwise_scales(sa, sw):
    """The scale layouts PyTorch's block-scaled FP8 GEMM asks for: sa [M, K/128] outer-dim-major, and sw
    [N/128, K/128] transposed with K/128 padded to a multiple of 4."""
    kb = sw.shape[1]
    sw_padded = torch.zeros(sw.shape[0], -(-kb // 4) * 4, dtype=torch.float32, device=sw.device)
    sw_padded[:, :kb] = sw
    return sa.t().contiguous().t(), sw_padded.t()


def blockwise_mm(a, sa_op, w, sw_op):
    """a [M, K] (1x128 scales) times w [N, K] (128x128 scales) -> bf16 [M, N]: megamoe's numerics through
    PyTorch's block-scaled FP8 GEMM (cuBLASLt on SM90), the scales laid out by blockwise_scales."""
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        return F.scaled_mm(
            a, w.t(), sa_op, F.ScalingType.BlockWise1x128, sw_op, F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
    return torch._scaled_mm(a, w.t(), scale_a=sa_op, scale_b=sw_op, out_dtype=torch.bfloat16)


def dequant_blocks(q, scale, rows_per_scale):
    """Float values of block FP8 codes q [n, k] with scales [n / rows_per_scale, k/128]."""
    n, k = q.shape
    v = q.float().view(n // rows_per_scale, rows_per_scale, k // BLOCK, BLOCK)
    return (v * scale[:, None, :, None]).view(n, k)


class MoEWeights:
    """Routed experts' W1 [E, 2*IH, H] and W2 [E, H, IH] in FP8 with per-output-channel scales, and the
    shared expert's (IH * numShared wide). Made one matrix at a time to bound the temporaries."""

    def __init__(self, p, dev, seed, with_shared):
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        E, H, IH = p["E"], p["H"], p["IH"]
        self.w1 = torch.empty(E, 2 * IH, H, dtype=fp8(), device=dev)
        self.s1 = torch.empty(E, 2 * IH, dtype=torch.float32, device=dev)
        self.w2 = torch.empty(E, H, IH, dtype=fp8(), device=dev)
        self.s2 = torch.empty(E, H, dtype=torch.float32, device=dev)
        for e in range(E):
            q, s = random_weight(2 * IH, H, gen, dev)
            self.w1[e].copy_(q)
            self.s1[e].copy_(s)
            q, s = random_weight(H, IH, gen, dev)
            self.w2[e].copy_(q)
            self.s2[e].copy_(s)
        self.shared = None
        if with_shared and p["shared"] > 0:
            SIH = IH * p["shared"]
            sw1, ss1 = random_weight(2 * SIH, H, gen, dev)
            sw2, ss2 = random_weight(H, SIH, gen, dev)
            self.shared = (sw1, ss1, sw2, ss2)


# ---------------------------------------------------------------------------------------------------
# GEMMs: torch's FP8 kernels, a per-expert loop of them, and a float emulation for CPU dry runs


def scaled_mm(a, sa, w, sw, mode):
    """a [M, K] FP8 x w [N, K] FP8 (rowwise scales sa [M], sw [N]) -> bf16 [M, N]."""
    if mode == "emulated":
        return ((a.float() @ w.float().t()) * sa[:, None] * sw[None, :]).to(torch.bfloat16)
    return torch._scaled_mm(
        a, w.t(), scale_a=sa[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16, use_fast_accum=True
    )


def grouped_mm(a, sa, w, sw, offs, mode):
    """Rows [offs[g-1], offs[g]) of a times group g of w [G, N, K] -> bf16 [M_total, N]. Rows after
    offs[-1] are not written."""
    if mode == "grouped":
        # mat_b must be "transposed" ([G, K, N] with unit stride along K): a view of w [G, N, K].
        return torch._scaled_grouped_mm(
            a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )
    # loop / emulated: needs the offsets on the host (a synchronization; not graph-capturable).
    mm = "emulated" if mode == "emulated" else "mm"
    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = scaled_mm(a[start:end], sa[start:end], w[g], sw[g], mm)
        start = end
    return out


# ---------------------------------------------------------------------------------------------------
# The layer


class TorchMoE:
    def __init__(self, p, weights, max_tokens, dev, gemm):
        self.p = p
        self.w = weights
        self.dev = dev
        self.gemm = gemm  # "grouped", "loop" or "emulated"
        self.quant = quant_rows
        self.swiglu = swiglu_quant
        E, H, k = p["E"], p["H"], p["k"]
        slots = max_tokens * k
        # The expert-ordered rows, sized once for the upper bound T*k + 15*E: zeros at first, so
        # padding rows always hold finite stale values.
        self.a_buf = torch.zeros(slots + (GROUP_ALIGN - 1) * E, H, dtype=torch.uint8, device=dev)
        self.sa_buf = torch.ones(slots + (GROUP_ALIGN - 1) * E, dtype=torch.float32, device=dev)
        self.ones = torch.ones(slots, dtype=torch.int64, device=dev)
        self.arange = torch.arange(slots, dtype=torch.int64, device=dev)

    def forward(self, x, ids, rw, shared):
        """x bf16 [T, H], ids int64 [T, k], rw fp32 [T, k] -> bf16 [T, H]."""
        p = self.p
        E, H, k = p["E"], p["H"], p["k"]
        T = x.shape[0]
        n = T * k
        xq, xs = self.quant(x)
        flat = ids.reshape(-1)
        # Dispatch layout on the device (bincount would read the max id on the host).
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=self.dev).scatter_add_(0, flat, self.ones[:n])
        padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        ends = torch.cumsum(padded, 0)
        offs = ends.to(torch.int32)
        first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
        e_sorted = flat[order]
        dest = (ends - padded)[e_sorted] + self.arange[:n] - first[e_sorted]  # padded row of sorted slot j
        rows = n + (GROUP_ALIGN - 1) * E
        a = self.a_buf[:rows]
        sa = self.sa_buf[:rows]
        src_tok = order // k
        a[dest] = xq.view(torch.uint8)[src_tok]  # FP8 moved as bytes: index_put has no FP8 kernel
        sa[dest] = xs[src_tok]
        y1 = grouped_mm(a.view(fp8()), sa, self.w.w1, self.w.s1, offs, self.gemm)
        hq, hs = self.swiglu(y1, p["clamp"])
        y2 = grouped_mm(hq, hs, self.w.w2, self.w.s2, offs, self.gemm)
        slot_row = torch.empty_like(dest)
        slot_row[order] = dest  # padded row of each (token, slot)
        gathered = y2.index_select(0, slot_row).view(T, k, H)
        weights = rw.to(torch.bfloat16).unsqueeze(1)  # [T, 1, k]
        if shared and self.w.shared is not None:
            sw1, ss1, sw2, ss2 = self.w.shared
            mm = "emulated" if self.gemm == "emulated" else "mm"
            s1 = scaled_mm(xq, xs, sw1, ss1, mm)
            shq, shs = self.swiglu(s1, p["clamp"])
            s2 = scaled_mm(shq, shs, sw2, ss2, mm)
            # out = shared + sum_j w_j * y_j in one batched GEMM (fp32 accumulation, bf16 out).
            return torch.baddbmm(s2.unsqueeze(1), weights, gathered).squeeze(1)
        return torch.bmm(weights, gathered).squeeze(1)


def reference_forward(p, w, x, ids, rw, shared):
    """FP32 reference on the same FP8 weights (dequantized), activations not quantized."""
    T, H = x.shape
    xf = x.float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)

    def mlp(rows, w1, s1, w2, s2):
        h = rows @ (w1.float() * s1[:, None]).t()
        inter = h.shape[-1] // 2
        g, u = h[:, :inter], h[:, inter:]
        c = p["clamp"]
        if c is not None:
            g, u = g.clamp(max=c), u.clamp(-c, c)
        return (F.silu(g) * u) @ (w2.float() * s2[:, None]).t()

    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = mlp(xf[tok], w.w1[e], w.s1[e], w.w2[e], w.s2[e])
        out.index_add_(0, tok, y * rw[tok, slot][:, None])
    if shared and w.shared is not None:
        out += mlp(xf, *w.shared)
    return out


def relative_error(out, ref):
    diff = (out.float() - ref).norm().item()
    norm = ref.norm().item()
    return diff / norm if norm > 0 else float("inf")


def random_routing(T, p, gen, dev):
    """k distinct experts per token, uniform; weights in [0.5, 1.5) normalized to routed_scaling_factor."""
    scores = torch.rand(T, p["E"], generator=gen, device=dev)
    ids = scores.topk(p["k"], dim=-1).indices
    w = torch.rand(T, p["k"], generator=gen, device=dev) + 0.5
    return ids, (w / w.sum(-1, keepdim=True) * p["scale"]).float()


def expert_bytes(H, inter):
    """FP8 W1 + W2 and their 128x128 block scales: megamoe's floor model (the rowwise scales the torch
    kernels read are fewer bytes still; the difference is < 0.1%)."""
    elements = 3 * inter * H
    return elements + elements // (BLOCK * BLOCK) * 4


def layer_floor(p, T, ids, shared, read_tbps, fp8_tflops):
    H, IH = p["H"], p["IH"]
    SIH = IH * p["shared"]
    use_shared = shared and p["shared"] > 0
    touched = int(torch.unique(ids).numel())
    nbytes = touched * expert_bytes(H, IH) + (expert_bytes(H, SIH) if use_shared else 0) + 4 * T * H
    flops = 2 * T * p["k"] * 3 * IH * H + (2 * T * 3 * SIH * H if use_shared else 0)
    floor_us = max(nbytes / (read_tbps * 1e12), flops / (fp8_tflops * 1e12)) * 1e6
    return nbytes, flops, touched, floor_us


# ---------------------------------------------------------------------------------------------------
# Timing


class Timer:
    """CUDA-event timing with an L2 flush before each run; on CPU (dry run) wall-clock timing."""

    def __init__(self, dev, iters, warmup, warmup_ms=0.0):
        self.dev = dev
        self.iters = iters
        self.warmup = warmup
        self.warmup_ms = warmup_ms
        self.flush = None
        if dev.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 * 2**20
            self.flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device=dev)

    def capture(self, fn):
        """A CUDA graph of fn (warmed up on a side stream first, as capture requires)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    def time(self, fn, graph=False, flush=True):
        """(median, min, max) in microseconds; with graph=True, of CUDA-graph replays of fn."""
        if self.dev.type != "cuda":
            fn()
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times), min(times), max(times)
        run = self.capture(fn).replay if graph else fn
        for _ in range(self.warmup):
            run()
        if self.warmup_ms > 0:
            # One run timed alone sizes the rest of the warm-up (the clock settles under the power cap).
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            for _ in range(min(math.ceil(self.warmup_ms / max(start.elapsed_time(end), 1e-3)), 100_000)):
                run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            if flush:
                self.flush.fill_(i + 1)
            starts[i].record()
            run()
            ends[i].record()
        ends[-1].synchronize()
        times = [s.elapsed_time(e) * 1000 for s, e in zip(starts, ends)]
        return statistics.median(times), min(times), max(times)


def measure_fp8_rate(timer, dev):
    """Dense FP8 rate: torch._scaled_mm 8192^3, tensorwise scales, fast accumulation (TFLOP/s)."""
    n = 8192
    a = torch.randn(n, n, device=dev).to(fp8())
    b = torch.randn(n, n, device=dev).to(fp8())
    one = torch.ones((), device=dev)
    us, _, _ = timer.time(
        lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True),
        flush=False,
    )
    return 2 * n**3 / (us * 1e-6) / 1e12


def measure_read_tbps(timer, dev):
    """Read-stream bandwidth, bytes read per second (TB/s), over 2 GiB: torch has no read-only kernel, so
    this times full reductions to one scalar (the 2 GiB read, a few bytes written) of the same buffer seen
    as fp32, int64 and bf16 (each dtype takes its own vectorized reduce kernel), and keeps the fastest:
    every one of them is a lower bound of the read ceiling. Returns (TB/s, which reduction)."""
    size = 2**31
    buf = torch.empty(size, dtype=torch.uint8, device=dev).fill_(0x3C)  # 0x3C3C... is finite as fp32 and bf16
    candidates = (
        ("sum of fp32", lambda: buf.view(torch.float32).sum()),
        ("sum of int64", lambda: buf.view(torch.int64).sum()),
        ("sum of bf16", lambda: buf.view(torch.bfloat16).sum(dtype=torch.float32)),
    )
    best = (0.0, "none")
    for name, fn in candidates:
        us, _, _ = timer.time(fn, flush=False)
        tbps = size / (us * 1e-6) / 1e12
        log(f"read stream by {name}: {tbps:.2f} TB/s")
        best = max(best, (tbps, name))
    del buf
    return best


def measure_copy_tbps(timer, dev):
    """Device copy bandwidth, bytes read + written per second (TB/s), over 2 GiB."""
    size = 2**31
    src = torch.empty(size, dtype=torch.uint8, device=dev).fill_(0x3C)
    dst = torch.empty_like(src)
    us, _, _ = timer.time(lambda: dst.copy_(src), flush=False)
    del src, dst
    return 2 * size / (us * 1e-6) / 1e12


# ---------------------------------------------------------------------------------------------------
# Runs


def choose_gemm(p, weights, args, dev, gen, shared):
    """Checks the layer at min(64, max tokens) against the FP32 reference; returns the GEMM mode to
    use ("grouped", else "loop"; "emulated" in a dry run) and the check's record."""
    T = min(CHECK_TOKENS, max(args.tokens))
    x = torch.randn(T, p["H"], generator=gen, device=dev, dtype=torch.bfloat16)
    ids, rw = random_routing(T, p, gen, dev)
    ref = reference_forward(p, weights, x, ids, rw, shared)
    modes = ["emulated"] if args.dry_run else (["loop"] if args.loop else ["grouped", "loop"])
    record = dict(tokens=T, tolerance=CHECK_TOLERANCE)
    for mode in modes:
        try:
            out = TorchMoE(p, weights, T, dev, mode).forward(x, ids, rw, shared)
            err = relative_error(out, ref)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            log(f"check: the {mode} GEMM failed at T={T}: {first_line(e)}")
            record[f"{mode}_error"] = first_line(e)
            continue
        record[f"{mode}_rel_err"] = err
        log(f"check: {mode} GEMM at T={T}: |out - ref| / |ref| = {err:.3g} (tolerance {CHECK_TOLERANCE})")
        if err <= CHECK_TOLERANCE:
            record["mode"] = mode
            return mode, record
        log(f"check: the {mode} GEMM is off by {err:.3g}; not using it")
    record["mode"] = modes[-1]
    log(f"check: WARNING no GEMM path passed the check; timing {modes[-1]} anyway (rows marked check_ok=false)")
    record["failed"] = True
    return modes[-1], record


def run_layer(args, dev, timer, read_tbps, fp8_tflops):
    p = PRESETS[args.shape]
    shared = args.shared == 1
    t0 = time.perf_counter()
    weights = MoEWeights(p, dev, args.seed, shared)
    log(f"{args.shape}: weights made in {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + 1)
    mode, check = choose_gemm(p, weights, args, dev, gen, shared)
    moe = TorchMoE(p, weights, max(args.tokens), dev, mode)
    compiled = False
    if args.compile:
        moe.quant = torch.compile(quant_rows, dynamic=True)
        moe.swiglu = torch.compile(swiglu_quant, dynamic=True)
        T = min(args.tokens)
        x = torch.randn(T, p["H"], generator=gen, device=dev, dtype=torch.bfloat16)
        ids, rw = random_routing(T, p, gen, dev)
        try:
            moe.forward(x, ids, rw, shared)
            compiled = True
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to eager torch
            log(f"torch.compile failed ({first_line(e)}); quantization and SwiGLU stay eager")
            moe.quant, moe.swiglu = quant_rows, swiglu_quant
    rows = []
    for T in args.tokens:
        x = torch.randn(T, p["H"], generator=gen, device=dev, dtype=torch.bfloat16)
        ids, rw = random_routing(T, p, gen, dev)
        nbytes, flops, touched, floor_us = layer_floor(p, T, ids, shared, read_tbps, fp8_tflops)
        row_mode = moe.gemm
        fn = lambda: moe.forward(x, ids, rw, shared)  # noqa: E731
        try:
            fn()
        except (RuntimeError, ValueError, NotImplementedError) as e:
            if moe.gemm != "grouped":
                raise
            log(f"T={T}: _scaled_grouped_mm refused the problem ({first_line(e)}); looping _scaled_mm per expert")
            row_mode = "loop"
            moe.gemm = "loop"
            fn()
        graph = args.graph and row_mode == "grouped" and dev.type == "cuda"
        if args.graph and not graph:
            log(f"T={T}: the {row_mode} GEMM reads offsets on the host, which capture forbids; timing eagerly")
        try:
            med, lo, hi = timer.time(fn, graph=graph)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            if not graph:
                raise
            log(f"T={T}: CUDA-graph capture failed ({first_line(e)}); timing eagerly")
            graph = False
            med, lo, hi = timer.time(fn, graph=False)
        moe.gemm = mode  # a refusal at one T does not decide the next
        impl = "torch" if row_mode in ("grouped", "emulated") else "torch-loop"
        rows.append(
            result_row(
                args.shape,
                T,
                shared,
                impl,
                (med, lo, hi),
                floor_us,
                flops,
                nbytes,
                experts_touched=touched,
                bytes=nbytes,
                flops=flops,
                graph=graph,
                gemm=row_mode,
                compiled=compiled,
                check_ok=not check.get("failed", False),
            )
        )
        log(f"{args.shape} T={T}: {med:.1f} us ({impl}{', graph' if graph else ''}), floor {floor_us:.1f} us")
    return rows, check


def gemm_bytes(m_total, n, k, groups):
    """megamoe's grouped-GEMM byte count: A, its per-128 scales, B and its block scales, bf16 out."""
    kb = k // BLOCK
    return m_total * k + 4 * kb * (-(-m_total // 4) * 4) + groups * n * k + 4 * groups * (n // BLOCK) * kb + 2 * m_total * n


def run_grouped_gemm(args, dev, timer):
    """torch._scaled_grouped_mm alone on the shape's L1 (N = 2*IH, K = H) and L2 (N = H, K = IH)."""
    p = PRESETS[args.shape]
    family = args.shape.split("-ep")[0]
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    G = GROUPED_GEMM_GROUPS
    rows = []
    for name, n, k in ((f"{family}-L1", 2 * p["IH"], p["H"]), (f"{family}-L2", p["H"], p["IH"])):
        w = torch.empty(G, n, k, dtype=fp8(), device=dev)
        sw = torch.empty(G, n, dtype=torch.float32, device=dev)
        for g in range(G):
            q, s = random_weight(n, k, gen, dev)
            w[g].copy_(q)
            sw[g].copy_(s)
        for m in args.m_per_group:
            a, sa = quant_rows(torch.randn(G * m, k, generator=gen, device=dev, dtype=torch.bfloat16))
            offs = torch.arange(1, G + 1, device=dev, dtype=torch.int32) * m
            mode = "emulated" if args.dry_run else ("loop" if args.loop else "grouped")
            try:
                grouped_mm(a, sa, w, sw, offs, mode)
            except (RuntimeError, ValueError, NotImplementedError) as e:
                if mode != "grouped":
                    raise
                log(f"{name} M/group={m}: _scaled_grouped_mm refused ({first_line(e)}); looping _scaled_mm")
                mode = "loop"
            timing = timer.time(lambda: grouped_mm(a, sa, w, sw, offs, mode))  # noqa: B023
            impl = "torch-grouped-gemm" if mode != "loop" else "torch-loop"
            rows.append(grouped_gemm_row(name, m, n, k, impl, timing, gemm=mode))
            log(f"{name} M/group={m}: {timing[0]:.1f} us, {rows[-1]['tflops']:.0f} TFLOP/s ({mode})")
        del w, sw
        if args.blockwise:
            rows += time_blockwise(args, dev, timer, gen, name, n, k)
    return rows


def result_row(config, tokens, shared, impl, times, floor_us, flop_count, byte_count, **extra):
    """A row of the results format megamoe reads (src/cuda/timing.ts ResultRow): times is Timer.time's
    (median, min, max) in microseconds, flop_count and byte_count the work behind the rates; extra fields
    are kept."""
    med, lo, hi = times
    return dict(
        config=config,
        tokens=tokens,
        shared=shared,
        impl=impl,
        us_median=med,
        us_min=lo,
        us_max=hi,
        floor_us=floor_us,
        tflops=flop_count / (med * 1e6),
        tbps=byte_count / (med * 1e6),
        **extra,
    )


def grouped_gemm_row(name, m, n, k, impl, times, **extra):
    """A results row of one grouped-GEMM case (GROUPED_GEMM_GROUPS groups of m rows): times is Timer.time's
    (median, min, max); wall_end_s records when the timed runs ended, to match the row with a clock log."""
    G = GROUPED_GEMM_GROUPS
    flops = 2 * G * m * n * k
    nbytes = gemm_bytes(G * m, n, k, G)
    floor_us = max(nbytes / (GEMM_FLOOR_READ_TBPS * 1e12), flops / (GEMM_FLOOR_FP8_TFLOPS * 1e12)) * 1e6
    return result_row(
        name, G * m, False, impl, times, floor_us, flops, nbytes, m_per_group=m, groups=G, n=n, k=k,
        wall_end_s=time.time(), **extra,
    )


def time_blockwise(args, dev, timer, gen, name, n, k):
    """--blockwise: the same grouped shapes in megamoe's numerics (1x128 activation scales, 128x128 weight
    scales), one PyTorch block-scaled GEMM per group, checked against FP32 on group 0 before timing."""
    G = GROUPED_GEMM_GROUPS
    rows = []
    w = torch.empty(G, n, k, dtype=fp8(), device=dev)
    sw = torch.empty(G, n // BLOCK, k // BLOCK, dtype=torch.float32, device=dev)
    for g in range(G):
        q, s = random_weight_blocks(n, k, gen, dev)
        w[g].copy_(q)
        sw[g].copy_(s)
    for m in args.m_per_group:
        a, sa = quant_blocks_1x128(torch.randn(G * m, k, generator=gen, device=dev, dtype=torch.bfloat16))
        # Each group's operands and scale layouts are made once, outside the timing: one GEMM call per group.
        calls = []
        for g in range(G):
            sa_op, sw_op = blockwise_scales(sa[g * m : (g + 1) * m], sw[g])
            calls.append((a[g * m : (g + 1) * m], sa_op, w[g], sw_op))
        try:
            got = blockwise_mm(*calls[0]).float()
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
            log(f"{name} M/group={m}: blockwise FP8 GEMM refused ({first_line(e)}); no blockwise row")
            continue
        ref = dequant_blocks(a[:m], sa[:m], 1) @ dequant_blocks(w[0], sw[0], BLOCK).t()
        rel = float((got - ref).norm() / ref.norm())
        if not rel < 2e-2:
            log(f"{name} M/group={m}: blockwise FP8 GEMM off by {rel:.3g} (relative); no blockwise row")
            continue

        def run(calls=calls):
            return [blockwise_mm(*c) for c in calls]

        # 32 Python calls take longer than the GPU work at small M: replayed as a CUDA graph where it captures.
        try:
            timing, mode = timer.time(run, graph=True), "graph"
        except RuntimeError as e:
            log(f"{name} M/group={m}: blockwise loop not graph-capturable ({first_line(e)}); timed eager")
            timing, mode = timer.time(run), "eager"
        # series: megamoe bench --peer compares these rows in columns of their own.
        row = grouped_gemm_row(
            name, m, n, k, "torch-blockwise-loop", timing, series="blockwise", gemm="blockwise-loop", timing=mode,
            check_rel=rel,
        )
        rows.append(row)
        tflops = row["tflops"]
        log(f"{name} M/group={m}: {timing[0]:.1f} us, {tflops:.0f} TFLOP/s (blockwise loop, {mode}, rel {rel:.2e})")
    del w, sw
    return rows


def commit():
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def int_list(text):
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="flash-ep8", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int_list, help="token counts (default 1,2,4,...,8192)")
    ap.add_argument("--shared", type=int, choices=(0, 1), default=1, help="include the shared expert")
    ap.add_argument("--iters", type=int, default=30, help="timed runs per case (median; at least 20)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--warmup-ms",
        type=float,
        default=0.0,
        help="then untimed runs for about this much GPU time per case (a second or so: the sustained clock)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager launches")
    ap.add_argument("--compile", action="store_true", help="torch.compile the quantization and SwiGLU steps")
    ap.add_argument("--loop", action="store_true", help="use the per-expert _scaled_mm loop, not the grouped GEMM")
    ap.add_argument("--grouped-gemm-only", action="store_true", help="time torch._scaled_grouped_mm alone")
    ap.add_argument(
        "--blockwise",
        action="store_true",
        help="grouped GEMM: also time megamoe's numerics (1x128 and 128x128 block scales) through PyTorch's "
        "block-scaled FP8 GEMM, one call per group",
    )
    ap.add_argument("--m-per-group", type=int_list, help="grouped GEMM: rows per group (default 64,512,4096)")
    ap.add_argument("--fp8-tflops", type=float, help="FP8 rate for the floor instead of measuring it")
    ap.add_argument("--read-tbps", type=float, help="read-stream bandwidth for the floor instead of measuring it")
    ap.add_argument("--copy-tbps", type=float, help="copy bandwidth to record instead of measuring (not in the floor)")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, emulated FP8 GEMMs: checks the plumbing")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = DRY_RUN_TOKENS if args.dry_run else DEFAULT_TOKENS
    if args.m_per_group is None:
        args.m_per_group = DRY_RUN_M if args.dry_run else GROUPED_GEMM_M
    if args.dry_run:
        args.iters = min(args.iters, 2)
    elif args.iters < 20:
        ap.error("--iters must be at least 20")
    if args.blockwise and not args.grouped_gemm_only:
        ap.error("--blockwise applies to --grouped-gemm-only")
    if not (math.isfinite(args.warmup_ms) and args.warmup_ms >= 0):
        ap.error("--warmup-ms must be a finite number >= 0")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if torch is None:
        sys.exit("torch_moe.py needs PyTorch (import torch failed)")
    if args.dry_run:
        dev = torch.device("cpu")
        log("dry run: CPU tensors, FP8 GEMMs emulated in float; times are not GPU times")
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on the GPU host, or use --dry-run")
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)
    timer = Timer(dev, args.iters, args.warmup, args.warmup_ms)
    if args.dry_run:
        fp8_tflops = args.fp8_tflops or GEMM_FLOOR_FP8_TFLOPS
        read_tbps, read_method = args.read_tbps or GEMM_FLOOR_READ_TBPS, "assumed (dry run)"
        copy_tbps = args.copy_tbps
        device = dict(name="cpu (dry run)", torch=torch.__version__)
    else:
        props = torch.cuda.get_device_properties(dev)
        fp8_tflops = args.fp8_tflops or measure_fp8_rate(timer, dev)
        log(f"dense FP8 rate (_scaled_mm 8192^3, fast accum): {fp8_tflops:.0f} TFLOP/s")
        if args.read_tbps:
            read_tbps, read_method = args.read_tbps, "--read-tbps"
        else:
            read_tbps, read_method = measure_read_tbps(timer, dev)
        log(f"read stream: {read_tbps:.2f} TB/s ({read_method}; the floor's bandwidth)")
        copy_tbps = args.copy_tbps or measure_copy_tbps(timer, dev)
        log(f"device copy (copy_ of 2 GiB, read + write): {copy_tbps:.2f} TB/s (recorded, not in the floor)")
        device = dict(
            name=props.name,
            sms=props.multi_processor_count,
            memoryBytes=props.total_memory,
            l2Bytes=getattr(props, "L2_cache_size", None),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            read_tbps=read_tbps,
            read_method=read_method,
            copy_tbps=copy_tbps,
            fp8_tflops=fp8_tflops,
        )
    check = None
    if args.grouped_gemm_only:
        rows = run_grouped_gemm(args, dev, timer)
    else:
        rows, check = run_layer(args, dev, timer, read_tbps, fp8_tflops)
    doc = dict(
        device=device,
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        command="python3 " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        fp8_tflops=None if args.dry_run else fp8_tflops,
        read_tbps=None if args.dry_run else read_tbps,
        read_method=None if args.dry_run else read_method,
        copy_tbps=None if args.dry_run else copy_tbps,
        dry_run=args.dry_run,
        check=check,
        rows=rows,
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        log(f"results written to {args.out}")


if __name__ == "__main__":
    main()
