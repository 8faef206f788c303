"""The package imports without torch, declares what it needs, and refuses what fused_experts cannot serve."""

import os
import subprocess
import sys
import unittest

from fakes import FIXTURE, FakeTensor
from megamoe_torch import fused_experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ImportTest(unittest.TestCase):
    def test_no_torch_at_import(self):
        code = ("import sys, megamoe_torch, megamoe_torch.bench, megamoe_torch.layer, megamoe_torch.program; "
                "print('torch' in sys.modules)")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "False")

    def test_public_names(self):
        import megamoe_torch

        for name in ("MegaMoE", "fused_experts", "load_manifest", "ManifestError", "CudaError", "MegaMoEStatusError"):
            self.assertTrue(hasattr(megamoe_torch, name), name)
        self.assertTrue(issubclass(megamoe_torch.ManifestError, ValueError))

    def test_pyproject(self):
        try:
            import tomllib
        except ImportError:
            self.skipTest("tomllib needs Python 3.11")
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            p = tomllib.load(f)
        self.assertEqual(p["project"]["name"], "megamoe-torch")
        self.assertEqual(p["project"]["requires-python"], ">=3.9")
        self.assertEqual(p["project"]["dependencies"], ["torch"])
        self.assertIn("build-backend", p["build-system"])


class FusedExpertsArgumentsTest(unittest.TestCase):
    """Refusals happen before torch is needed, so they run here."""

    def args(self):
        return dict(
            hidden_states=FakeTensor("bfloat16", (3, 256)),
            w1=FakeTensor("float8_e4m3fn", (4, 256, 256)),
            w2=FakeTensor("float8_e4m3fn", (4, 256, 128)),
            topk_weights=FakeTensor("float32", (3, 2)),
            topk_ids=FakeTensor("int32", (3, 2)),
            use_fp8_w8a8=True,
            w1_scale=FakeTensor("float32", (4, 2, 2)),
            w2_scale=FakeTensor("float32", (4, 2, 1)),
            block_shape=[128, 128],
            export_dir=FIXTURE,
        )

    def test_refusals_name_the_argument(self):
        cases = [
            ("use_fp8_w8a8", False),
            ("use_int8_w8a8", True),
            ("use_int4_w4a16", True),
            ("per_channel_quant", True),
            ("apply_router_weight_on_input", True),
            ("activation", "gelu"),
            ("block_shape", None),
            ("block_shape", [64, 128]),
            ("expert_map", FakeTensor("int32", (4,))),
            ("a1_scale", FakeTensor("float32", (1,))),
            ("w1_zp", FakeTensor("float32", (1,))),
            ("global_num_experts", 256),
        ]
        for name, value in cases:
            with self.subTest(name=name, value=value):
                kw = self.args()
                kw[name] = value
                with self.assertRaises(ValueError) as cm:
                    fused_experts(**kw)
                self.assertTrue(str(cm.exception).startswith(name), str(cm.exception))

    def test_export_dir_required(self):
        kw = self.args()
        kw["export_dir"] = None
        old = os.environ.pop("MEGAMOE_EXPORT", None)
        try:
            with self.assertRaises(ValueError) as cm:
                fused_experts(**kw)
            self.assertIn("MEGAMOE_EXPORT", str(cm.exception))
        finally:
            if old is not None:
                os.environ["MEGAMOE_EXPORT"] = old

    def test_scales_required(self):
        kw = self.args()
        kw["w2_scale"] = None
        with self.assertRaises(ValueError) as cm:
            fused_experts(**kw)
        self.assertIn("w2_scale", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
