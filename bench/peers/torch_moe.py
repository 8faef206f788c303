"""The PyTorch peer of megamoe's layer benchmark: the same MoE workload in torch on the GPU host.

Same shapes (the presets), token counts, routing distribution (k distinct experts per token, uniform;
weights normalized to routed_scaling_factor), random bf16 activations and FP8 e4m3 weights with
128x128 block scales (never zeros). The pipeline: per-token FP8 quantization, permutation to expert
order (each expert's rows padded to 16, as the grouped GEMM needs), L1 by torch._scaled_grouped_mm,
SwiGLU (clamped) and FP8 re-quantization in torch, L2 likewise, un-permutation, weighted combine plus
the shared expert (a dense FP8 MLP through torch._scaled_mm), bf16 out.

torch's FP8 grouped GEMM on SM90 takes rowwise scales only: activations get one scale per row
(max over the row), weights one per output channel (the max of that row's 128x128 block scales,
re-quantized). That is the closest rowwise equivalent of the block-scaled layer; it moves the same
bytes and does the same FLOPs, which is what the timing compares.

Timed with CUDA events after warm-up, median of --iters runs, L2 flushed (a 2x L2 buffer written)
before each run; --graph times CUDA-graph replays. Writes megamoe's results JSON (impl "torch").

  python3 bench/peers/torch_moe.py --shape flash-ep8 --tokens 1,2,4,...,8192 --shared 1 --out f.json
  python3 bench/peers/torch_moe.py --grouped-gemm-only --out g.json
"""

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

PRESETS = {
    "tiny": dict(E=8, H=256, I=128, k=2, shared=1, scale=1.5, clamp=10.0),
    "flash": dict(E=256, H=4096, I=2048, k=6, shared=1, scale=1.5, clamp=10.0),
    "pro": dict(E=384, H=7168, I=3072, k=6, shared=1, scale=2.5, clamp=10.0),
    "flash-ep8": dict(E=32, H=4096, I=2048, k=6, shared=1, scale=1.5, clamp=10.0),
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quant_rows(x):
    """Per-row FP8 with one fp32 scale per row (rowwise: what _scaled_grouped_mm accepts)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-10)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(-1)


def random_fp8_weight(g, n, k, gen):
    """Random FP8 weights [g, n, k] and a rowwise fp32 scale per output channel [g, n]."""
    w = torch.randn(g, n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * (1.0 / k**0.5)
    amax = w.abs().amax(dim=-1).float().clamp(min=1e-10)
    scale = amax / FP8_MAX
    return (w.float() / scale.unsqueeze(-1)).to(FP8), scale


class TorchMoE:
    def __init__(self, p, max_tokens, seed, grouped=True):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.p = p
        self.grouped = grouped
        E, H, I = p["E"], p["H"], p["I"]
        self.w1, self.s1 = random_fp8_weight(E, 2 * I, H, gen)
        self.w2, self.s2 = random_fp8_weight(E, H, I, gen)
        if p["shared"]:
            self.sw1, self.ss1 = random_fp8_weight(1, 2 * I * p["shared"], H, gen)
            self.sw2, self.ss2 = random_fp8_weight(1, H, I * p["shared"], gen)

    def grouped_mm(self, a, sa, w, sw, offs):
        if self.grouped:
            return torch._scaled_grouped_mm(
                a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
            )
        out = torch.zeros(a.shape[0], w.shape[1], device="cuda", dtype=torch.bfloat16)
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                out[start:end] = torch._scaled_mm(
                    a[start:end], w[e].t(), sa[start:end, None], sw[e][None, :],
                    out_dtype=torch.bfloat16, use_fast_accum=True,
                )
            start = end
        return out

    def swiglu_quant(self, y):
        I = y.shape[-1] // 2
        c = self.p["clamp"]
        g = y[:, :I].float().clamp(max=c)
        u = y[:, I:].float().clamp(-c, c)
        return quant_rows(torch.nn.functional.silu(g) * u)

    def forward(self, x, ids, weights, shared):
        p = self.p
        E, k = p["E"], p["k"]
        T = x.shape[0]
        xq, xs = quant_rows(x)
        flat = ids.reshape(-1)
        # No host synchronization (graph-capturable): rows are laid out for the upper bound
        # T·k + 15·E (each expert padded to 16), and output sizes are given to repeat_interleave.
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, device="cuda", dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + 15) // 16 * 16
        offs = torch.cumsum(padded, 0).to(torch.int32)
        starts = offs - padded
        n = T * k
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=n)
        dest = torch.repeat_interleave(starts, counts, output_size=n) + torch.arange(n, device="cuda") - first
        rows = n + 15 * E
        src_tok = order // k
        a = torch.zeros(rows, p["H"], device="cuda", dtype=torch.uint8)
        sa = torch.ones(rows, device="cuda", dtype=torch.float32)
        a[dest] = xq.view(torch.uint8)[src_tok]  # FP8 moved as bytes: index_put has no FP8 kernel
        a = a.view(FP8)
        sa[dest] = xs[src_tok]
        y1 = self.grouped_mm(a, sa, self.w1, self.s1, offs)
        hq, hs = self.swiglu_quant(y1)
        y2 = self.grouped_mm(hq, hs, self.w2, self.s2, offs)
        per_slot = torch.empty(T * k, p["H"], device="cuda", dtype=torch.bfloat16)
        per_slot[order] = y2[dest]
        out = (per_slot.view(T, k, p["H"]).float() * weights.unsqueeze(-1)).sum(dim=1)
        if shared and p["shared"]:
            s1 = torch._scaled_mm(xq, self.sw1[0].t(), xs[:, None], self.ss1[0][None, :], out_dtype=torch.bfloat16, use_fast_accum=True)
            shq, shs = self.swiglu_quant(s1)
            s2 = torch._scaled_mm(shq, self.sw2[0].t(), shs[:, None], self.ss2[0][None, :], out_dtype=torch.bfloat16, use_fast_accum=True)
            out = out + s2.float()
        return out.to(torch.bfloat16)


def random_routing(T, p, gen):
    scores = torch.rand(T, p["E"], device="cuda", generator=gen)
    ids = scores.topk(p["k"], dim=-1).indices.to(torch.int64)
    w = torch.rand(T, p["k"], device="cuda", generator=gen) + 0.5
    return ids, (w / w.sum(-1, keepdim=True) * p["scale"]).float()


def time_cuda(fn, iters, graph, flush):
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(3):
        run()
    times = []
    for i in range(iters):
        flush.fill_(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times), min(times), max(times)


def fp8_rate():
    n = 8192
    a = torch.randn(n, n, device="cuda").to(FP8)
    b = torch.randn(n, n, device="cuda").to(FP8).t()
    one = torch.ones((), device="cuda")
    f = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
    flush = torch.empty(1, device="cuda")
    us, _, _ = time_cuda(f, 10, False, flush)
    return 2 * n**3 / (us * 1e-6) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="flash-ep8", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default=",".join(str(2**i) for i in range(14)))
    ap.add_argument("--shared", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--grouped-gemm-only", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * 64 * 2**20 // 4, device="cuda", dtype=torch.float32)
    rows = []
    rate = fp8_rate()
    print(f"dense FP8 rate (_scaled_mm 8192^3, fast accum): {rate:.0f} TFLOP/s", flush=True)
    if args.grouped_gemm_only:
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        for name, n, k in (("flash-L1", 4096, 4096), ("flash-L2", 4096, 2048)):
            w, sw = random_fp8_weight(32, n, k, gen)
            for m in (64, 512, 4096):
                a, sa = quant_rows(torch.randn(32 * m, k, device="cuda", generator=gen, dtype=torch.bfloat16))
                offs = torch.arange(1, 33, device="cuda", dtype=torch.int32) * m
                f = lambda: torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
                med, lo, hi = time_cuda(f, args.iters, False, flush)
                flops = 2 * 32 * m * n * k
                nbytes = 32 * n * k + 32 * m * k + 32 * m * n * 2
                rows.append(dict(config=name, tokens=32 * m, shared=False, impl="torch-grouped-gemm", us_median=med, us_min=lo, us_max=hi,
                                 floor_us=max(nbytes / 4.25e12, flops / (rate * 1e12)) * 1e6, tflops=flops / (med * 1e6), tbps=nbytes / (med * 1e6),
                                 m_per_group=m, groups=32, n=n, k=k))
                print(f"{name} M/group={m}: {med:.1f} us, {flops / (med * 1e6):.0f} TFLOP/s", flush=True)
    else:
        p = PRESETS[args.shape]
        tokens = [int(t) for t in args.tokens.split(",")]
        impl = "torch"
        moe = TorchMoE(p, max(tokens), args.seed)
        gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
        for T in tokens:
            x = torch.randn(T, p["H"], device="cuda", generator=gen, dtype=torch.bfloat16)
            ids, w = random_routing(T, p, gen)
            f = lambda: moe.forward(x, ids, w, args.shared == 1)
            try:
                f()
            except RuntimeError as e:  # the grouped GEMM refused the problem: loop over experts instead
                print(f"_scaled_grouped_mm failed ({str(e).splitlines()[0]}); falling back to a _scaled_mm loop", flush=True)
                moe.grouped = False
                impl = "torch-loop"
            try:
                med, lo, hi = time_cuda(f, args.iters, args.graph and moe.grouped, flush)
            except RuntimeError as e:
                print(f"T={T}: graph capture failed ({str(e).splitlines()[0]}); timing eagerly", flush=True)
                med, lo, hi = time_cuda(f, args.iters, False, flush)
            rows.append(dict(config=args.shape, tokens=T, shared=args.shared == 1, impl=impl, us_median=med, us_min=lo, us_max=hi,
                             floor_us=0.0, tflops=0.0, tbps=0.0, graph=args.graph))
            print(f"{args.shape} T={T}: {med:.1f} us ({impl})", flush=True)
    doc = dict(device=dict(name=props.name, sms=props.multi_processor_count, torch=torch.__version__),
               commit=os.environ.get("MEGAMOE_COMMIT", "unknown"), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               command="python3 " + " ".join(sys.argv), fp8_tflops=rate, rows=rows)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
