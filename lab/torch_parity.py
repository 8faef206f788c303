"""Lab helper (lab/torch-parity.sh runs it on the GPU host): the PyTorch side of the Node = PyTorch check.

    python3 lab/torch_parity.py DIR [--calls 10000] [--json FILE]

DIR is what lab/torch-parity.ts wrote: an export, the weights in the engine layouts, and per case the
inputs and Node's output. This adopts the weights with megamoe_torch, then for every case:
- eager: forward's output bits against Node's (every bf16 must be equal);
- graph: per token count, one forward captured by torch.cuda.graph into static tensors, replayed after
  each case's inputs are copied in: bits against Node's again;
- the output against a float64 layer in torch (dequantized weights, x not quantized): relative error and
  calc_diff within the bounds src/reference/error-bounds.ts documents for FP8 against the FP64 ideal;
then --calls eager forwards of the largest case, and the device memory before and after.
Prints one line per case and a verdict; exit status 1 on any mismatch.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from megamoe_torch import MegaMoE  # noqa: E402

# src/reference/error-bounds.ts: MAX_REL_FP8_VS_IDEAL, MAX_DIFF_FP8_VS_IDEAL
MAX_REL_VS_IDEAL = 0.1
MAX_DIFF_VS_IDEAL = 5e-3
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--calls", type=int, default=10000)
parser.add_argument("--json")
args = parser.parse_args()
root = args.dir
spec = json.load(open(os.path.join(root, "parity.json")))
dev = torch.device("cuda", 0)


def load(name):
    f = spec["files"][name]
    raw = bytearray(open(os.path.join(root, f["file"]), "rb").read())
    t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(getattr(torch, f["dtype"])).reshape(f["shape"]).to(dev)


names = ["w13", "w13_scale", "w2", "w2_scale"]
weights = {n: load(n) for n in names}
shared = tuple(load(f"shared_{n}") for n in names) if "shared_w13" in spec["files"] else None
moe = MegaMoE.from_export(os.path.join(root, "export"), **weights, shared=shared)


def dequant_fp8(q, s):
    """Block FP8 codes [..., n, k] with scales [..., n/128, k/128] as float64."""
    v = q.to(torch.float64)
    s = s.to(torch.float64).repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    return v * s


def dequant_fp4(packed, scales):
    """MXFP4 [..., n, k/2] (low nibble first) with UE8M0 [..., n, k/32] as float64."""
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64, device=packed.device)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([table[lo], table[hi]], dim=-1).flatten(-2)
    scale = torch.pow(2.0, scales.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return codes * scale


fp4 = spec["experts"] == "fp4"
if fp4:
    W1 = dequant_fp4(weights["w13"], weights["w13_scale"])
    W2 = dequant_fp4(weights["w2"], weights["w2_scale"])
else:
    W1 = dequant_fp8(weights["w13"], weights["w13_scale"])
    W2 = dequant_fp8(weights["w2"], weights["w2_scale"])
S = None if shared is None else (dequant_fp8(shared[0], shared[1]), dequant_fp8(shared[2], shared[3]))
del weights  # the layer holds its own copies: the caller may free its tensors
clamp = spec.get("clamp")


def mlp(rows, w1, w2):
    h = rows @ w1.t()
    inter = h.shape[-1] // 2
    g, u = h[:, :inter], h[:, inter:]
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return (F.silu(g) * u) @ w2.t()


def ideal(x, ids, rw):
    xf = x.to(torch.float64)
    out = torch.zeros_like(xf)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, mlp(xf[tok], W1[e], W2[e]) * rw[tok, slot].to(torch.float64)[:, None])
    if S is not None:
        out += mlp(xf, *S)
    return out


def calc_diff(a, b):
    a, b = a.to(torch.float64), b.to(torch.float64)
    denom = (a * a + b * b).sum().item()
    return 1 - 2 * (a * b).sum().item() / denom if denom > 0 else 0.0


bits = lambda t: t.view(torch.int16)  # noqa: E731
rows = []
failed = False
by_tokens = {}
for case in spec["cases"]:
    name, T = case["name"], case["tokens"]
    x, ids, rw, ref = (load(f"{name}.{p}") for p in ("x", "ids", "w", "out"))
    out = torch.full_like(ref, float("nan"))
    moe.forward(x, ids, rw, out=out)
    moe.check_status()
    eager_bad = int((bits(out) != bits(ref)).sum().item())
    want = ideal(x, ids, rw)
    rel = ((out.to(torch.float64) - want).norm() / want.norm()).item() if want.norm() > 0 else 0.0
    diff = calc_diff(out, want)
    row = dict(case=name, tokens=T, eager_mismatches=eager_bad, rel_vs_ideal=rel, calc_diff_vs_ideal=diff)
    rows.append(row)
    by_tokens.setdefault(T, []).append((row, x, ids, rw, ref))

# Graphs: one capture per T, replayed for each of its cases with the inputs copied into the statics.
for T, cases in by_tokens.items():
    _, x0, ids0, rw0, ref0 = cases[0]
    sx, sids, srw = x0.clone(), ids0.clone(), rw0.clone()
    sout = torch.empty_like(ref0)
    moe.forward(sx, sids, srw, out=sout)  # warm (nothing to compile: the export is loaded)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe.forward(sx, sids, srw, out=sout)
    for row, x, ids, rw, ref in cases:
        sx.copy_(x)
        sids.copy_(ids)
        srw.copy_(rw)
        sout.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        row["graph_mismatches"] = int((bits(sout) != bits(ref)).sum().item())
    moe.check_status()

for row in rows:
    ok = (row["eager_mismatches"] == 0 and row["graph_mismatches"] == 0
          and row["rel_vs_ideal"] <= MAX_REL_VS_IDEAL and row["calc_diff_vs_ideal"] <= MAX_DIFF_VS_IDEAL)
    row["ok"] = ok
    failed |= not ok
    print(f"{row['case']:>16}  T={row['tokens']:<5} eager {row['eager_mismatches']} and graph "
          f"{row['graph_mismatches']} bf16 differ from Node's; vs float64: rel {row['rel_vs_ideal']:.3e} "
          f"(≤ {MAX_REL_VS_IDEAL}), calc_diff {row['calc_diff_vs_ideal']:.3e} (≤ {MAX_DIFF_VS_IDEAL})  "
          f"{'ok' if ok else 'FAIL'}")

# Many calls: the device memory is what it was (no allocation per call).
T = max(by_tokens)
_, x, ids, rw, ref = by_tokens[T][0]
out = torch.empty_like(ref)
moe.forward(x, ids, rw, out=out)
torch.cuda.synchronize()
free0, _ = torch.cuda.mem_get_info(dev)
alloc0 = torch.cuda.memory_allocated(dev)
for _ in range(args.calls):
    moe.forward(x, ids, rw, out=out)
moe.check_status()
free1, _ = torch.cuda.mem_get_info(dev)
alloc1 = torch.cuda.memory_allocated(dev)
memory = dict(calls=args.calls, tokens=T, free_before=free0, free_after=free1, torch_allocated_before=alloc0,
              torch_allocated_after=alloc1, last_equal=bool(torch.equal(bits(out), bits(ref))))
memory_ok = free0 == free1 and alloc0 == alloc1 and memory["last_equal"]
failed |= not memory_ok
print(f"{args.calls} calls at T={T}: device free {free0} -> {free1} B, torch allocated {alloc0} -> {alloc1} B, "
      f"last output equal: {memory['last_equal']}  {'ok' if memory_ok else 'FAIL'}")

verdict = dict(shape=spec["shape"], experts=spec["experts"], shared=spec["shared"], cases=rows, memory=memory,
               ok=not failed)
if args.json:
    with open(args.json, "w") as f:
        json.dump(verdict, f, indent=1)
print(f"torch-parity {spec['shape']} {spec['experts']} shared {int(spec['shared'])}: {'PASS' if not failed else 'FAIL'}")
sys.exit(1 if failed else 0)
