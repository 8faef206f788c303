"""forward()'s argument checks and the weight checks, against fake tensors."""

import unittest

from fakes import FIXTURE, FakeTensor
from megamoe_torch.checks import InputChecker, check_weight
from megamoe_torch.layer import gather_weights
from megamoe_torch.manifest import load_manifest

M = load_manifest(FIXTURE)  # hidden 256, topK 2, maxTokens 64


def inputs(T=3, **override):
    t = {
        "x": FakeTensor("bfloat16", (T, 256)),
        "topk_ids": FakeTensor("int32", (T, 2)),
        "topk_weights": FakeTensor("float32", (T, 2)),
        "out": FakeTensor("bfloat16", (T, 256)),
    }
    t.update(override)
    return t


class InputCheckTest(unittest.TestCase):
    def setUp(self):
        self.check = InputChecker(M, "cuda:0").check

    def call(self, **kw):
        t = inputs(**kw)
        return self.check(t["x"], t["topk_ids"], t["topk_weights"], t["out"])

    def assertBad(self, cls, words, **kw):
        with self.assertRaises(cls) as cm:
            self.call(**kw)
        for w in words:
            self.assertIn(w, str(cm.exception))
        return cm.exception

    def test_good_inputs_return_t(self):
        for T in (1, 3, 8, 9, 64):
            self.assertEqual(self.call(T=T), T)
        t = inputs(T=5)
        self.assertEqual(self.check(t["x"], t["topk_ids"], t["topk_weights"]), 5)

    def test_x(self):
        e = self.assertBad(TypeError, [], x=FakeTensor("float16", (3, 256)))
        self.assertEqual(str(e), "x must be bfloat16 [T, 256] with 1 ≤ T ≤ 64, got float16 [3, 256]")
        self.assertBad(ValueError, ["x must be bfloat16 [T, 256]", "got bfloat16 [3, 128]"], x=FakeTensor("bfloat16", (3, 128)))
        self.assertBad(ValueError, ["got bfloat16 [3, 256, 1]"], x=FakeTensor("bfloat16", (3, 256, 1)))
        self.assertBad(ValueError, ["1 ≤ T ≤ 64", "got bfloat16 [65, 256]"], T=65)
        self.assertBad(ValueError, ["1 ≤ T ≤ 64", "got bfloat16 [0, 256]"], T=0)
        self.assertBad(TypeError, ["x must be a tensor", "got list"], x=[[1.0] * 256])
        self.assertBad(ValueError, ["x must be on cuda:0", "got cpu"], x=FakeTensor("bfloat16", (3, 256), device="cpu"))
        self.assertBad(ValueError, ["x must be contiguous"], x=FakeTensor("bfloat16", (3, 256), contiguous=False))

    def test_topk_ids(self):
        e = self.assertBad(TypeError, ["topk_ids must be int32 [3, 2]", "int64", "no int64 conversion"],
                           topk_ids=FakeTensor("int64", (3, 2)))
        self.assertIn("topk_ids.to(torch.int32)", str(e))
        self.assertBad(TypeError, ["topk_ids must be int32 [3, 2] (T = 3 from x)", "got float32 [3, 2]"],
                       topk_ids=FakeTensor("float32", (3, 2)))
        self.assertBad(ValueError, ["topk_ids must be int32 [3, 2]", "got int32 [3, 3]"], topk_ids=FakeTensor("int32", (3, 3)))
        self.assertBad(ValueError, ["got int32 [4, 2]"], topk_ids=FakeTensor("int32", (4, 2)))
        self.assertBad(ValueError, ["topk_ids must be on cuda:0", "got cuda:1"], topk_ids=FakeTensor("int32", (3, 2), device="cuda:1"))
        self.assertBad(ValueError, ["topk_ids must be contiguous"], topk_ids=FakeTensor("int32", (3, 2), contiguous=False))
        self.assertBad(TypeError, ["topk_ids must be a tensor"], topk_ids=None)

    def test_topk_weights(self):
        self.assertBad(TypeError, ["topk_weights must be float32 [3, 2]", "got bfloat16 [3, 2]"],
                       topk_weights=FakeTensor("bfloat16", (3, 2)))
        self.assertBad(ValueError, ["topk_weights must be float32 [3, 2]", "got float32 [2, 3]"],
                       topk_weights=FakeTensor("float32", (2, 3)))
        self.assertBad(ValueError, ["topk_weights must be on cuda:0"], topk_weights=FakeTensor("float32", (3, 2), device="cpu"))

    def test_out(self):
        self.assertBad(TypeError, ["out must be bfloat16 [3, 256]", "got float32 [3, 256]"], out=FakeTensor("float32", (3, 256)))
        self.assertBad(ValueError, ["out must be bfloat16 [3, 256]", "got bfloat16 [4, 256]"], out=FakeTensor("bfloat16", (4, 256)))
        self.assertBad(ValueError, ["out must be contiguous"], out=FakeTensor("bfloat16", (3, 256), contiguous=False))
        x = FakeTensor("bfloat16", (3, 256), ptr=0x10000)
        self.assertBad(ValueError, ["out must not overlap x"], x=x, out=FakeTensor("bfloat16", (3, 256), ptr=0x10000 + 512))
        self.assertEqual(self.call(x=x, out=FakeTensor("bfloat16", (3, 256), ptr=0x10000 + 1536)), 3)

    def test_every_message_names_its_argument(self):
        bad = {
            "x": FakeTensor("float16", (3, 256)),
            "topk_ids": FakeTensor("int16", (3, 2)),
            "topk_weights": FakeTensor("float64", (3, 2)),
            "out": FakeTensor("bfloat16", (3, 255)),
        }
        for name, t in bad.items():
            with self.subTest(name):
                with self.assertRaises((TypeError, ValueError)) as cm:
                    self.call(**{name: t})
                self.assertTrue(str(cm.exception).startswith(name + " must"), str(cm.exception))


class WeightCheckTest(unittest.TestCase):
    def test_weights(self):
        spec = M.weights["w13"]
        check_weight("w13", spec, FakeTensor("float8_e4m3fn", (4, 256, 256), ptr=0x1000), "cuda:0")
        with self.assertRaises(TypeError) as cm:
            check_weight("w13", spec, FakeTensor("bfloat16", (4, 256, 256)), "cuda:0")
        self.assertEqual(str(cm.exception), "w13 must be float8_e4m3fn [4, 256, 256] (the export's weights.w13), "
                                            "got bfloat16 [4, 256, 256]")
        with self.assertRaises(ValueError) as cm:
            check_weight("w13", spec, FakeTensor("float8_e4m3fn", (4, 256, 128)), "cuda:0")
        self.assertIn("got float8_e4m3fn [4, 256, 128]", str(cm.exception))
        with self.assertRaises(ValueError):
            check_weight("w13", spec, FakeTensor("float8_e4m3fn", (4, 256, 256), device="cpu"), "cuda:0")
        with self.assertRaises(ValueError):
            check_weight("w13", spec, FakeTensor("float8_e4m3fn", (4, 256, 256), contiguous=False), "cuda:0")
        with self.assertRaises(ValueError) as cm:
            check_weight("w13", spec, FakeTensor("float8_e4m3fn", (4, 256, 256), ptr=0x1008), "cuda:0")
        self.assertIn("16-byte", str(cm.exception))
        with self.assertRaises(TypeError):
            check_weight("w13", spec, "weights", "cuda:0")

    def test_e8m0_scales_as_uint8_or_float8_e8m0fnu(self):
        from megamoe_torch.manifest import TensorSpec

        spec = TensorSpec("w13_scale", "uint8", (4, 2, 8), 1)
        check_weight("w13_scale", spec, FakeTensor("uint8", (4, 2, 8), ptr=0x2000), "cuda:0")
        check_weight("w13_scale", spec, FakeTensor("float8_e8m0fnu", (4, 2, 8), ptr=0x2000), "cuda:0")
        with self.assertRaises(TypeError):
            check_weight("w13_scale", spec, FakeTensor("int8", (4, 2, 8), ptr=0x2000), "cuda:0")

    def test_gather_weights(self):
        w = [FakeTensor("x", (1,)) for _ in range(4)]
        self.assertEqual(list(gather_weights(M, *w)), ["w13", "w13_scale", "w2", "w2_scale"])
        with self.assertRaises(ValueError) as cm:
            gather_weights(M, *w, shared=tuple(w))
        self.assertIn("no shared expert", str(cm.exception))
        with self.assertRaises(TypeError):
            gather_weights(M, *w, shared=w[0])


class SharedGatherTest(unittest.TestCase):
    def test_shared_forms(self):
        import copy
        import json

        from megamoe_torch.manifest import parse_manifest

        with open(M.file) as f:
            data = json.load(f)
        data = copy.deepcopy(data)
        data["layer"]["sharedIntermediate"] = 128
        for name in ("shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale"):
            data["weights"][name] = {"dtype": "float32", "shape": [1]}
        m = parse_manifest(data, M.file)
        w = [FakeTensor("x", (1,)) for _ in range(4)]
        s = [FakeTensor("y", (1,)) for _ in range(4)]
        with self.assertRaises(ValueError) as cm:
            gather_weights(m, *w)
        self.assertIn("shared=(w13, w13_scale, w2, w2_scale)", str(cm.exception))
        by_tuple = gather_weights(m, *w, shared=tuple(s))
        by_dict = gather_weights(m, *w, shared={"w13": s[0], "w13_scale": s[1], "w2": s[2], "w2_scale": s[3]})
        by_full = gather_weights(m, *w, shared={"shared_w13": s[0], "shared_w13_scale": s[1], "shared_w2": s[2],
                                                 "shared_w2_scale": s[3]})
        self.assertEqual(by_tuple, by_dict)
        self.assertEqual(by_tuple, by_full)
        self.assertIs(by_tuple["shared_w2"], s[2])
        with self.assertRaises(ValueError):
            gather_weights(m, *w, shared={"w13": s[0]})
        with self.assertRaises(ValueError):
            gather_weights(m, *w, shared={"w1": s[0], "w13_scale": s[1], "w2": s[2], "w2_scale": s[3]})


if __name__ == "__main__":
    unittest.main()
