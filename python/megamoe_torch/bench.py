"""Time an exported layer from PyTorch: ``python -m megamoe_torch.bench --export DIR --tokens 1,8,64``.

For each T it reports

- the device time of one forward replayed from a CUDA graph (torch.cuda.CUDAGraph), each replay timed
  with a pair of torch.cuda.Events and preceded by a write of a buffer twice the L2's size, so every
  replay starts with a cold L2 (weights from HBM), as a lab measures;
- the host time of one eager ``forward`` call (time.perf_counter around batches of calls into a
  preallocated ``out``; the device is drained between batches so a full launch queue cannot block the
  host and be counted).

The weights are random bytes of the manifest's dtypes (the kernels' speed does not depend on their
values): float8_e4m3fn bytes avoid the NaN codes 0x7F / 0xFF; float32 scales are uniform in
[2^-10, 2^-6]; E8M0 scales (uint8 or float8_e8m0fnu weights named *_scale) are exponents 118 … 126
(2^-9 … 2^-1); other uint8 weights (packed FP4) are any byte; bfloat16 ones are N(0, 0.02²). x is
N(0, 1) in bf16, each token's topK experts distinct and uniform, its weights a softmax.

``--node-json FILE`` adds a column of Node's graph figures ({"<T>": microseconds, …}) and the ratio.
torch is imported when the benchmark runs, not when this module is imported.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from .driver import CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, default_driver
from .layer import MegaMoE
from .manifest import Manifest, TensorSpec, load_manifest


def random_weight(torch, spec: TensorSpec, device, gen):
    """Random contents of the right dtype for a weight (see the module's description)."""
    n = math.prod(spec.shape)
    u8 = torch.uint8
    if spec.dtype == "float8_e4m3fn":
        b = torch.randint(0, 256, (n,), dtype=u8, device=device, generator=gen)
        b = torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b)  # 0x7F / 0xFF (NaN) -> 0x7E / 0xFE (±448)
        return b.view(torch.float8_e4m3fn).view(spec.shape)
    if spec.dtype in ("uint8", "float8_e8m0fnu"):
        if spec.name.endswith("_scale"):
            b = torch.randint(118, 127, (n,), dtype=u8, device=device, generator=gen)
        else:
            b = torch.randint(0, 256, (n,), dtype=u8, device=device, generator=gen)
        return (b if spec.dtype == "uint8" else b.view(torch.float8_e8m0fnu)).view(spec.shape)
    if spec.dtype == "float32":
        lo, hi = 2.0**-10, 2.0**-6
        t = torch.rand(n, dtype=torch.float32, device=device, generator=gen) * (hi - lo) + lo
        return t.view(spec.shape)
    if spec.dtype in ("bfloat16", "float16"):
        t = torch.randn(n, dtype=torch.float32, device=device, generator=gen) * 0.02
        return t.to(getattr(torch, spec.dtype)).view(spec.shape)
    return torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)


def random_inputs(torch, manifest: Manifest, T: int, device, gen):
    layer = manifest.layer
    x = torch.randn((T, layer.hidden), dtype=torch.float32, device=device, generator=gen).to(torch.bfloat16)
    scores = torch.rand((T, layer.experts), device=device, generator=gen)
    ids = scores.argsort(dim=1)[:, : layer.top_k].to(torch.int32).contiguous()
    w = torch.softmax(torch.randn((T, layer.top_k), device=device, generator=gen), dim=1).contiguous()
    out = torch.empty((T, layer.hidden), dtype=torch.bfloat16, device=device)
    return x, ids, w, out


def time_graph(torch, moe: MegaMoE, inputs, replays: int, flush: bool, l2_bytes: int):
    x, ids, w, out = inputs
    side = torch.cuda.Stream(moe.device)
    side.wait_stream(torch.cuda.current_stream(moe.device))
    with torch.cuda.stream(side):
        for _ in range(3):
            moe.forward(x, ids, w, out=out)
    torch.cuda.current_stream(moe.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.forward(x, ids, w, out=out)
    scrub = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=moe.device) if flush else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for _ in range(3):
        graph.replay()
    for i, (start, end) in enumerate(events):
        if scrub is not None:
            scrub.fill_(i & 0xFF)
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(moe.device)
    return [s.elapsed_time(e) * 1000.0 for s, e in events]  # µs


def time_host(torch, moe: MegaMoE, inputs, calls: int, batch: int = 50):
    x, ids, w, out = inputs
    per_call = []
    done = 0
    while done < calls:
        n = min(batch, calls - done)
        torch.cuda.synchronize(moe.device)
        t0 = time.perf_counter()
        for _ in range(n):
            moe.forward(x, ids, w, out=out)
        per_call.append((time.perf_counter() - t0) / n * 1e6)
        done += n
    torch.cuda.synchronize(moe.device)
    return per_call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megamoe_torch.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, help="the directory `megamoe export` wrote")
    p.add_argument("--tokens", default="1,8,64", help="comma-separated token counts (default 1,8,64)")
    p.add_argument("--replays", type=int, default=200, help="timed graph replays per T (default 200)")
    p.add_argument("--host-calls", type=int, default=2000, help="eager calls timed per T (default 2000)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--no-flush", action="store_true", help="do not write 2 × L2 between replays (warm L2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--node-json", help='Node\'s graph figures to print beside: {"<T>": microseconds, ...}')
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)

    import torch

    manifest = load_manifest(a.export)
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    for T in tokens:
        manifest.range_for(T)  # ValueError for a T the export does not serve
    device = torch.device("cuda", a.device)
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(a.seed)
    weights = {name: random_weight(torch, spec, device, gen) for name, spec in manifest.weights.items()}
    moe = MegaMoE(manifest, weights, device=device)
    del weights
    drv = default_driver()
    l2 = drv.device_attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, drv.device(a.device))
    node = {}
    if a.node_json:
        with open(a.node_json) as f:
            node = {int(k): float(v) for k, v in json.load(f).items()}

    rows = []
    for T in tokens:
        inputs = random_inputs(torch, manifest, T, device, gen)
        moe.forward(*inputs[:3], out=inputs[3])
        moe.check_status()
        graph_us = time_graph(torch, moe, inputs, a.replays, not a.no_flush, l2)
        host_us = time_host(torch, moe, inputs, a.host_calls)
        moe.check_status()
        tr = manifest.range_for(T)
        row = {
            "tokens": T,
            "range": [tr.lo, tr.hi],
            "steps": len(tr.steps),
            "graph_us_median": statistics.median(graph_us),
            "graph_us_mean": statistics.fmean(graph_us),
            "graph_us_min": min(graph_us),
            "host_us_per_call_median": statistics.median(host_us),
            "host_us_per_call_min": min(host_us),
        }
        if T in node:
            row["node_us"] = node[T]
            row["graph_vs_node"] = row["graph_us_median"] / node[T]
        rows.append(row)

    props = torch.cuda.get_device_properties(device)
    print(f"{manifest.layer.name}: {manifest.layer.expert_format} experts, export by {manifest.producer}; "
          f"{props.name}, torch {torch.__version__}; L2 {'flushed' if not a.no_flush else 'warm'}, "
          f"{a.replays} replays, {a.host_calls} eager calls")
    head = f"{'T':>6} {'range':>13} {'steps':>5} {'graph µs (med)':>15} {'mean':>8} {'min':>8} {'host µs/call':>13}"
    if node:
        head += f" {'node µs':>9} {'ratio':>7}"
    print(head)
    for r in rows:
        line = (f"{r['tokens']:>6} {str(r['range'][0]) + '-' + str(r['range'][1]):>13} {r['steps']:>5} "
                f"{r['graph_us_median']:>15.2f} {r['graph_us_mean']:>8.2f} {r['graph_us_min']:>8.2f} "
                f"{r['host_us_per_call_median']:>13.2f}")
        if node:
            line += f" {r.get('node_us', float('nan')):>9.2f} {r.get('graph_vs_node', float('nan')):>7.3f}"
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({
                "layer": manifest.layer.name, "producer": manifest.producer, "device": props.name,
                "torch": torch.__version__, "l2_flushed": not a.no_flush, "replays": a.replays,
                "host_calls": a.host_calls, "rows": rows,
            }, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
