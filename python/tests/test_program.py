"""Argument packing byte for byte and the steps a call queues, through a fake libcuda."""

import ctypes
import struct
import unittest

from fakes import FIXTURE, fake_driver
from megamoe_torch.args import ArgBlock, HostBlock, slot_layout
from megamoe_torch.errors import CudaError
from megamoe_torch.manifest import load_manifest
from megamoe_torch.program import Program

M = load_manifest(FIXTURE)
# Device addresses the test pretends the buffers and weights have.
ADDR = {name: 0x7000_0000_0000 + i * 0x100_0000 for i, name in enumerate(list(M.buffers) + list(M.weights))}
FN = {"transform": 0xF0, "fused_m8": 0xF1, "fused_m32": 0xF2}
# Each fixture kernel's parameter sizes, as the kernel would declare them.
SIZES = {
    0xF0: [128, 128, 8, 8, 4],
    0xF1: [128, 8, 4, 128, 8, 8, 8, 8, 8, 8, 4, 4, 8, 44],
    0xF2: [128, 8, 8, 8, 8, 4, 4],
}
X, IDS, W, OUT = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000
STREAM = 0x5555


def map_image(n: int) -> bytes:
    return bytes([n]) * 128


def build():
    drv, lib = fake_driver()
    lib.arg_sizes.update(SIZES)
    maps = {mid: map_image(i + 1) for i, mid in enumerate(M.tensor_maps)}
    return Program(M, drv, FN, ADDR, maps), lib, maps


def q(v):
    return struct.pack("<Q", v)


def u32(v):
    return struct.pack("<I", v)


def i32(v):
    return struct.pack("<i", v)


def f32(v):
    return struct.pack("<f", v)


class SlotLayoutTest(unittest.TestCase):
    def test_offsets_of_the_fused_launch(self):
        offsets, sizes, total = slot_layout(M.forward[0].steps[1].args)
        # tm, ptr, u32, tm (next 128 boundary), 6 pointers, i32, f32, u64, struct (16-aligned, 44 -> 48)
        self.assertEqual(offsets, [0, 128, 136, 256, 384, 392, 400, 408, 416, 424, 432, 440, 448, 464])
        self.assertEqual(sizes, [128, 8, 8, 128, 8, 8, 8, 8, 8, 8, 8, 8, 8, 48])
        self.assertEqual(total, 512)

    def test_block_and_params_addresses(self):
        block = ArgBlock(M.forward[0].steps[1].args)
        self.assertEqual(block.block.address % 128, 0)
        addrs = block.param_addresses()
        self.assertEqual([a - block.block.address for a in addrs], block.offsets)
        for i, a in enumerate(block.args):
            if a.kind == "tensorMap":
                self.assertEqual(addrs[i] % 128, 0)
        params = (ctypes.c_void_p * len(addrs)).from_address(block.params_address)
        self.assertEqual(list(params), addrs)

    def test_host_block_alignment(self):
        for align in (8, 64, 128, 256):
            b = HostBlock(24, align)
            self.assertEqual(b.address % align, 0)
            self.assertEqual(b.bytes(), bytes(24))

    def test_write_range_checks(self):
        block = ArgBlock(M.forward[0].steps[1].args)
        with self.assertRaises(OverflowError):
            block.write("u32", 136, -1)
        with self.assertRaises(OverflowError):
            block.write("i32", 432, 2**31)
        with self.assertRaises(OverflowError):
            block.write("pointer", 128, 2**64)
        block.write("f32", 440, 3)
        self.assertEqual(block.slot_bytes(11), f32(3.0) + bytes(4))


class PackingTest(unittest.TestCase):
    def expected_fused_m8(self, T, maps, x=X, ids=IDS, w=W, out=OUT):
        struct_bytes = (q(ADDR["status"]) + u32(T) + i32(-1) + f32(2.0) + bytes(4) + q(12345) + q(0) + bytes(4))
        self.assertEqual(len(struct_bytes), 44)
        return [
            maps["m.w13"],
            q(x),
            u32(T),
            maps["m.pool_x"],
            q(ids),
            q(w),
            q(out + T * 0),
            q(ADDR["counters"] + 128),
            q(ADDR["pool"] + T * 512),
            q(0),
            i32(T - 9),
            f32(0.5),
            q(T * 2**32),
            struct_bytes,
        ]

    def test_fused_launch_bytes(self):
        program, lib, maps = build()
        program.run_forward(3, (X, IDS, W, OUT), STREAM)
        (launch,) = lib.launches
        self.assertEqual(launch["args"], self.expected_fused_m8(3, maps))
        self.assertIsNone(launch["extra"])

    def test_whole_block_bytes(self):
        program, lib, maps = build()
        program.run_forward(5, (X, IDS, W, OUT), STREAM)
        site = program.range_sites[0][1]
        want = bytearray(512)
        for off, piece in zip(site.args.offsets, self.expected_fused_m8(5, maps)):
            want[off:off + len(piece)] = piece
        self.assertEqual(site.args.bytes(), bytes(want))

    def test_only_t_and_inputs_change_between_calls(self):
        program, lib, maps = build()
        program.run_forward(3, (X, IDS, W, OUT), STREAM)
        program.run_forward(3, (X + 512, IDS, W, OUT + 512), STREAM)
        program.run_forward(7, (X, IDS, W, OUT), STREAM)
        program.run_forward(2, (X, IDS, W, OUT), STREAM)
        got = [l["args"] for l in lib.launches]
        self.assertEqual(got[0], self.expected_fused_m8(3, maps))
        self.assertEqual(got[1], self.expected_fused_m8(3, maps, x=X + 512, out=OUT + 512))
        self.assertEqual(got[2], self.expected_fused_m8(7, maps))
        self.assertEqual(got[3], self.expected_fused_m8(2, maps))

    def test_second_range_bytes(self):
        program, lib, maps = build()
        program.run_forward(40, (X, IDS, W, OUT), STREAM)
        (launch,) = lib.launches
        self.assertEqual(launch["args"], [maps["m.w13"], q(X), q(IDS), q(W), q(OUT), u32(40), u32(32)])
        program.run_forward(9, (X, IDS, W, OUT), STREAM)
        self.assertEqual(lib.launches[1]["args"][5:], [u32(9), u32(16)])

    def test_prepare_bytes(self):
        program, lib, maps = build()
        program.run_prepare(STREAM)
        (launch,) = lib.launches
        self.assertEqual(launch["args"], [maps["src.w13"], maps["m.w13"], q(ADDR["w13_scale"]), q(ADDR["scales"]), u32(1024)])
        self.assertEqual(launch["grid"], (4, 2, 1))


class StepsTest(unittest.TestCase):
    def test_prepare_steps_in_order(self):
        program, lib, _ = build()
        program.run_prepare(STREAM)
        self.assertEqual(lib.calls, [
            ("cuLaunchKernelEx", 0xF0),
            ("copy", ADDR["w2_prepared"], ADDR["w2"], 131072, STREAM),
            ("copy", ADDR["scales"] + 64, ADDR["w2_scale"], 32, STREAM),
        ])
        self.assertEqual(lib.launches[0]["attrs"], [])
        self.assertEqual(lib.launches[0]["stream"], STREAM)

    def test_small_range(self):
        program, lib, _ = build()
        for T in (1, 4, 8):
            lib.calls.clear()
            lib.launches.clear()
            program.run_forward(T, (X, IDS, W, OUT), STREAM)
            self.assertEqual(lib.calls, [
                ("memset", ADDR["scratch"], 0, 64 * T, STREAM),
                ("cuLaunchKernelEx", 0xF1),
                ("copy", ADDR["pool"], X, 512 * T, STREAM),
            ])
            (launch,) = lib.launches
            self.assertEqual(launch["grid"], (-(-2 * T // 8), 1, 1))
            self.assertEqual(launch["block"], (384, 1, 1))
            self.assertEqual(launch["shared"], 99328)
            self.assertEqual(launch["attrs"], [("programmatic", 1)])
            self.assertEqual(launch["stream"], STREAM)

    def test_large_range_cluster(self):
        program, lib, _ = build()
        for T, gx in ((9, 2), (16, 2), (17, 4), (33, 6), (64, 8)):
            lib.launches.clear()
            program.run_forward(T, (X, IDS, W, OUT), 0)
            (launch,) = lib.launches
            self.assertEqual(launch["grid"], (gx, 2, 1))
            self.assertEqual(launch["shared"], 195040)
            self.assertEqual(launch["attrs"], [("cluster", (2, 1, 1))])
            self.assertEqual(launch["stream"], 0)

    def test_precompute_fills_every_t(self):
        program, _lib, _ = build()
        program.precompute()
        site = program.range_sites[1][0]
        self.assertEqual([site.table[T][0][0] for T in (9, 64)], [2, 8])
        self.assertIsNone(site.table[8])  # not this site's range

    def test_driver_errors_name_the_call_and_step(self):
        program, lib, _ = build()
        lib.fail_next["cuLaunchKernelEx"] = 1
        with self.assertRaises(CudaError) as cm:
            program.run_forward(3, (X, IDS, W, OUT), STREAM)
        e = cm.exception
        self.assertEqual((e.function, e.name, e.code), ("cuLaunchKernelEx", "CUDA_ERROR_INVALID_VALUE", 1))
        self.assertIn("forward[0].steps[1]", str(e))
        self.assertIn("fused_m8", str(e))
        lib.fail_next["cuMemsetD8Async"] = 700
        with self.assertRaises(CudaError) as cm:
            program.run_forward(3, (X, IDS, W, OUT), STREAM)
        self.assertEqual(cm.exception.name, "CUDA_ERROR_ILLEGAL_ADDRESS")
        self.assertIn("forward[0].steps[0]", str(cm.exception))
        lib.fail_next["cuMemcpyDtoDAsync_v2"] = 999
        with self.assertRaises(CudaError) as cm:
            program.run_forward(3, (X, IDS, W, OUT), STREAM)
        self.assertEqual(cm.exception.name, "CUDA_ERROR_999")


if __name__ == "__main__":
    unittest.main()
