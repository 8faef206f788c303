"""End to end on a Hopper GPU (skipped without torch, CUDA or nvcc): a tiny export whose kernels
(tests/gpu/kernels.cu) check their own arguments, run through MegaMoE as an engine would.

Set MEGAMOE_TEST_CUBIN to a cubin built from tests/gpu/kernels.cu (nvcc -cubin -arch=sm_90a) where
nvcc is missing.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch

    HAVE_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
except ImportError:  # CI and the development machine: no torch
    torch = None
    HAVE_GPU = False


def build_cubin(out_dir):
    given = os.environ.get("MEGAMOE_TEST_CUBIN")
    path = os.path.join(out_dir, "kernels", "k.cubin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if given:
        shutil.copy(given, path)
        return path
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        return None
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-o", path, os.path.join(HERE, "gpu", "kernels.cu")], check=True)
    return path


def ref(name, offset=0):
    return {"buffer": name, "offset": offset}


def mul(*a):
    return {"op": "mul", "args": list(a)}


def fwd_args(want_cluster, two=2):
    return [
        {"kind": "tensorMap", "map": "m.w13"},
        {"kind": "pointer", "ref": ref("x")},
        {"kind": "u32", "value": "T"},
        {"kind": "tensorMap", "map": "m.pool_x"},
        {"kind": "pointer", "ref": ref("topk_ids")},
        {"kind": "pointer", "ref": ref("topk_weights")},
        {"kind": "pointer", "ref": ref("out")},
        {"kind": "pointer", "ref": ref("w13_prepared")},
        {"kind": "i32", "value": {"op": "sub", "args": ["T", 9]}},
        {"kind": "f32", "value": 0.5},
        {"kind": "u64", "value": mul("T", 2**32)},
        {"kind": "u32", "value": want_cluster},
        {"kind": "struct", "bytes": 48, "fields": [
            {"offset": 0, "kind": "pointer", "ref": ref("status")},
            {"offset": 8, "kind": "u32", "value": "T"},
            {"offset": 12, "kind": "i32", "value": -1},
            {"offset": 16, "kind": "f32", "value": two},
            {"offset": 24, "kind": "u64", "value": 12345},
            {"offset": 32, "kind": "pointer", "ref": None},
        ]},
    ]


def manifest(sm_count, two=2):
    return {
        "format": "megamoe-export", "version": 1, "producer": "tests/test_gpu.py", "arch": "sm_90a",
        "smCount": sm_count,
        "layer": {"name": "tiny", "hidden": 256, "topK": 2, "experts": 4, "intermediate": 128,
                  "sharedIntermediate": 0, "expertFormat": "fp8", "scaleFormat": "fp32", "maxTokens": 64},
        "kernels": [
            {"id": "prep", "cubin": "kernels/k.cubin", "function": "prep", "maxDynamicSharedBytes": 0},
            {"id": "fwd_small", "cubin": "kernels/k.cubin", "function": "fwd", "maxDynamicSharedBytes": 65536},
            {"id": "fwd_large", "cubin": "kernels/k.cubin", "function": "fwd", "maxDynamicSharedBytes": 0},
        ],
        "buffers": [
            {"name": "w13_prepared", "bytes": 262144, "lifetime": "weights", "init": "none"},
            {"name": "w2_prepared", "bytes": 131072, "lifetime": "weights", "init": "none"},
            {"name": "scales", "bytes": 256, "lifetime": "weights", "init": "zero"},
            {"name": "pool", "bytes": 65536, "lifetime": "workspace", "init": "none"},
            {"name": "scratch", "bytes": 512, "lifetime": "workspace", "init": "fill:0xff"},
            {"name": "status", "bytes": 16, "lifetime": "workspace", "init": "zero"},
        ],
        "weights": {
            "w13": {"dtype": "float8_e4m3fn", "shape": [4, 256, 256]},
            "w13_scale": {"dtype": "float32", "shape": [4, 2, 2]},
            "w2": {"dtype": "float8_e4m3fn", "shape": [4, 256, 128]},
            "w2_scale": {"dtype": "float32", "shape": [4, 2, 1]},
        },
        "inputs": {
            "x": {"dtype": "bfloat16", "shape": ["T", 256]},
            "topk_ids": {"dtype": "int32", "shape": ["T", 2]},
            "topk_weights": {"dtype": "float32", "shape": ["T", 2]},
            "out": {"dtype": "bfloat16", "shape": ["T", 256]},
        },
        "tensorMaps": [
            {"id": "src.w13", "buffer": "w13", "offset": 0, "dataType": "uint8", "dims": [256, 1024],
             "stridesBytes": [256], "box": [128, 64], "elementStrides": [1, 1], "interleave": "none",
             "swizzle": "128B", "l2Promotion": "256B", "oobFill": "none"},
            {"id": "m.w13", "buffer": "w13_prepared", "offset": 0, "dataType": "uint8", "dims": [256, 1024],
             "stridesBytes": [256], "box": [128, 64], "elementStrides": [1, 1], "interleave": "none",
             "swizzle": "128B", "l2Promotion": "256B", "oobFill": "none"},
            {"id": "m.pool_x", "buffer": "pool", "offset": 256, "dataType": "bfloat16", "dims": [128, 64, 2],
             "stridesBytes": [512, 32768], "box": [64, 16, 1], "elementStrides": [1, 1, 1], "interleave": "none",
             "swizzle": "128B", "l2Promotion": "128B", "oobFill": "nan_request_zero_fma"},
        ],
        "prepare": [
            {"kind": "launch", "kernel": "prep", "grid": [64, 1, 1], "block": [256, 1, 1], "sharedBytes": 0,
             "cluster": [1, 1, 1], "programmaticStreamSerialization": False,
             "args": [{"kind": "tensorMap", "map": "src.w13"}, {"kind": "pointer", "ref": ref("w13")},
                      {"kind": "pointer", "ref": ref("w13_prepared")}, {"kind": "u32", "value": 262144}]},
            {"kind": "copy", "dst": ref("w2_prepared"), "src": ref("w2"), "bytes": 131072},
            {"kind": "copy", "dst": ref("scales", 64), "src": ref("w2_scale"), "bytes": 32},
        ],
        "status": {"buffer": "status", "words": 4},
        "forward": [
            {"tokens": [1, 8], "steps": [
                {"kind": "memset", "dst": ref("scratch"), "byte": 0, "bytes": mul("T", 64)},
                {"kind": "launch", "kernel": "fwd_small", "grid": [{"op": "ceil_div", "args": [mul("T", 256), 128]}, 1, 1],
                 "block": [128, 1, 1], "sharedBytes": 65536, "cluster": [1, 1, 1],
                 "programmaticStreamSerialization": True, "args": fwd_args(1, two)},
                {"kind": "copy", "dst": ref("pool"), "src": ref("x"), "bytes": mul("T", 512)},
            ]},
            {"tokens": [9, 64], "steps": [
                {"kind": "launch", "kernel": "fwd_large",
                 "grid": [mul(2, {"op": "ceil_div", "args": ["T", 8]}), 1, 1],
                 "block": [128, 1, 1], "sharedBytes": 0, "cluster": [2, 1, 1],
                 "programmaticStreamSerialization": False, "args": fwd_args(2, two)},
            ]},
        ],
    }


@unittest.skipUnless(HAVE_GPU, "needs torch and a Hopper GPU")
class GpuTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        if build_cubin(cls.tmp) is None:
            raise unittest.SkipTest("needs nvcc or MEGAMOE_TEST_CUBIN")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        with open(os.path.join(cls.tmp, "manifest.json"), "w") as f:
            json.dump(manifest(sms), f)
        cls.bad = os.path.join(cls.tmp, "bad")
        os.makedirs(cls.bad)
        shutil.copytree(os.path.join(cls.tmp, "kernels"), os.path.join(cls.bad, "kernels"))
        with open(os.path.join(cls.bad, "manifest.json"), "w") as f:
            json.dump(manifest(sms, two=3), f)
        g = torch.Generator(device="cuda").manual_seed(1)
        cls.dev = torch.device("cuda", 0)
        b = lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)  # noqa: E731
        cls.w13 = b(262144).view(torch.float8_e4m3fn).view(4, 256, 256)
        cls.w13_scale = torch.rand(4, 2, 2, device="cuda", generator=g)
        cls.w2 = b(131072).view(torch.float8_e4m3fn).view(4, 256, 128)
        cls.w2_scale = torch.rand(4, 2, 1, device="cuda", generator=g)
        from megamoe_torch import MegaMoE

        cls.moe = MegaMoE.from_export(cls.tmp, cls.w13, cls.w13_scale, cls.w2, cls.w2_scale)
        cls.g = g

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def inputs(self, T):
        x = torch.randn(T, 256, device="cuda", generator=self.g).to(torch.bfloat16)
        ids = torch.randint(0, 4, (T, 2), device="cuda", generator=self.g, dtype=torch.int32)
        ids[::3, 1] = -1  # masked slots
        w = torch.rand(T, 2, device="cuda", generator=self.g)
        return x, ids, w

    def expected(self, x, ids, w):
        prepared = self.moe.buffers["w13_prepared"][:256].float()
        s = torch.where(ids >= 0, w, torch.zeros_like(w))
        s = s[:, 0] + s[:, 1]
        return (x.float() * s[:, None] + prepared[None, :] * 0.5).to(torch.bfloat16)

    def test_prepare(self):
        bufs = self.moe.buffers
        self.assertTrue(torch.equal(bufs["w13_prepared"], self.w13.view(torch.uint8).flatten() ^ 0x5A))
        self.assertTrue(torch.equal(bufs["w2_prepared"], self.w2.view(torch.uint8).flatten()))
        self.assertTrue(torch.equal(bufs["scales"][64:96], self.w2_scale.flatten().view(torch.uint8)))
        self.assertEqual(int(bufs["scales"][:64].sum()), 0)

    def test_forward_bits_every_range(self):
        for T in (1, 5, 8, 9, 17, 33, 64):
            with self.subTest(T=T):
                x, ids, w = self.inputs(T)
                out = torch.full((T, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
                self.moe.forward(x, ids, w, out=out)
                self.moe.check_status()
                self.assertTrue(torch.equal(out.view(torch.int16), self.expected(x, ids, w).view(torch.int16)))
                if T <= 8:
                    self.assertTrue(torch.equal(self.moe.buffers["pool"][: 512 * T], x.view(torch.uint8).flatten()))
                    self.assertEqual(int(self.moe.buffers["scratch"][: 64 * T].sum()), 0)
                new = self.moe.forward(x, ids, w)
                self.assertTrue(torch.equal(new.view(torch.int16), out.view(torch.int16)))

    def test_graph_replay_equals_eager(self):
        for T in (7, 40):
            x, ids, w = self.inputs(T)
            out = torch.empty(T, 256, dtype=torch.bfloat16, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.moe.forward(x, ids, w, out=out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.moe.forward(x, ids, w, out=out)
            for _ in range(3):
                x2, ids2, w2 = self.inputs(T)
                x.copy_(x2)
                ids.copy_(ids2)
                w.copy_(w2)
                graph.replay()
                eager = self.moe.forward(x2, ids2, w2)
                torch.cuda.synchronize()
                self.assertTrue(torch.equal(out.view(torch.int16), eager.view(torch.int16)))
            self.moe.check_status()

    def test_calls_allocate_nothing_and_host_time(self):
        x, ids, w = self.inputs(8)
        out = torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")
        self.moe.forward(x, ids, w, out=out)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        n, per = 0, []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                self.moe.forward(x, ids, w, out=out)
            per.append((time.perf_counter() - t0) / 100 * 1e6)
            n += 100
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.memory_allocated(), before)
        per.sort()
        print(f"\n[test_gpu] eager forward host time, 3 steps (memset, launch, copy): median {per[len(per) // 2]:.2f} µs, "
              f"min {per[0]:.2f} µs per call")

    def test_bad_inputs(self):
        x, ids, w = self.inputs(3)
        with self.assertRaises(TypeError):
            self.moe.forward(x, ids.long(), w)
        with self.assertRaises(ValueError):
            self.moe.forward(x.cpu(), ids, w)
        x, ids, w = self.inputs(65)
        with self.assertRaises(ValueError) as cm:
            self.moe.forward(x, ids, w)
        self.assertIn("1 ≤ T ≤ 64", str(cm.exception))

    def test_status_words(self):
        from megamoe_torch import MegaMoE, MegaMoEStatusError

        moe = MegaMoE.from_export(self.bad, self.w13, self.w13_scale, self.w2, self.w2_scale)
        moe.check_status()
        x, ids, w = self.inputs(4)
        moe.forward(x, ids, w)
        with self.assertRaises(MegaMoEStatusError) as cm:
            moe.check_status()
        self.assertEqual(cm.exception.words, (1004, 0, 4, 1))

    def test_fused_experts(self):
        from megamoe_torch import fused_experts

        x, ids, w = self.inputs(6)
        got = fused_experts(x, self.w13, self.w2, w, ids, use_fp8_w8a8=True, w1_scale=self.w13_scale,
                            w2_scale=self.w2_scale, block_shape=[128, 128], export_dir=self.tmp)
        self.assertTrue(torch.equal(got.view(torch.int16), self.expected(x, ids, w).view(torch.int16)))


if __name__ == "__main__":
    unittest.main()
