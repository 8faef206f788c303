"""The runtime on a real export (tests/fixtures/tiny-fp4: what `megamoe export` writes for the tiny layer
with FP4 experts, checked against the exporter by test/export/fixture.test.ts; its cubins are stand-ins),
through the fake libcuda: every range's launches, and int64 ids converted before the forward."""

import os
import struct
import unittest

from fakes import fake_driver
from megamoe_torch.args import slot_layout
from megamoe_torch.checks import InputChecker
from megamoe_torch.manifest import load_manifest
from megamoe_torch.program import Program

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny-fp4")
M = load_manifest(FIXTURE)
ADDR = {name: 0x7000_0000_0000 + i * 0x100_0000 for i, name in enumerate(list(M.buffers) + list(M.weights))}
X, IDS, W, OUT = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000


def build():
    drv, lib = fake_driver()
    functions = {kid: 0xF00 + i for i, kid in enumerate(M.kernels)}
    steps = [s for tr in M.forward for s in tr.steps] + [s for c in M.input_conversions.values() for s in c.steps]
    steps += list(M.prepare)
    for s in steps:
        if hasattr(s, "args"):
            lib.arg_sizes[functions[s.kernel]] = slot_layout(s.args)[1]
    maps = {mid: bytes([i % 251]) * 128 for i, mid in enumerate(M.tensor_maps)}
    return Program(M, drv, functions, ADDR, maps), lib, functions


def operands(launch):
    """The fused launch's Operands struct (its last argument): ids pointer and tokens."""
    block = launch["args"][-1]
    return struct.unpack_from("<Q", block, 16)[0], struct.unpack_from("<i", block, 19 * 8)[0]


class RealExportTest(unittest.TestCase):
    def test_layer_and_ranges(self):
        self.assertEqual((M.layer.hidden, M.layer.top_k, M.layer.max_tokens), (256, 2, 2048))
        self.assertEqual(M.forward[-1].hi, 2048)
        self.assertIn("topk_ids", M.input_conversions)

    def test_each_range_queues_quantization_then_the_fused_kernel(self):
        program, lib, fn = build()
        for T in (1, 48, 49, 121, 1536, 2048):
            lib.launches.clear()
            program.run_forward(T, (X, IDS, W, OUT), 0)
            quant, fused = lib.launches
            self.assertEqual(quant["fn"], fn["quant"])
            kernel = M.forward[M.range_index(T)].steps[1].kernel
            self.assertEqual(fused["fn"], fn[kernel])
            self.assertIn(("programmatic", 1), fused["attrs"])
            self.assertEqual(operands(fused), (IDS, T))
        self.assertEqual(M.forward[M.range_index(2048)].steps[1].kernel, "fused_m128x")

    def test_int64_ids_are_converted_first_and_read_from_the_buffer(self):
        program, lib, fn = build()
        program.run_forward(100, (X, IDS, W, OUT), 0, ("topk_ids",))
        convert, quant, fused = lib.launches
        self.assertEqual(convert["fn"], fn["ids_i64_to_i32"])
        src, dst = (struct.unpack_from("<Q", a)[0] for a in convert["args"][:2])
        count = struct.unpack_from("<I", convert["args"][2])[0]
        self.assertEqual((src, dst, count), (IDS, ADDR["topk_ids_i32"], 100 * 2))
        self.assertGreaterEqual(convert["grid"][0] * convert["block"][0], 200)
        self.assertEqual(operands(fused), (ADDR["topk_ids_i32"], 100))

    def test_the_checker_takes_int64_ids_for_this_export(self):
        from fakes import FakeTensor
        checker = InputChecker(M, "cuda:0")
        T = checker.check(FakeTensor("bfloat16", (5, 256)), FakeTensor("int64", (5, 2)),
                          FakeTensor("float32", (5, 2)))
        self.assertEqual(T, 5)


if __name__ == "__main__":
    unittest.main()
