"""MegaMoE's construction and forward without torch or a GPU: a fake torch module and a fake libcuda.

What is checked: buffers allocated with their init, cubins loaded and their shared-memory limits set,
tensor maps encoded at their tensor's address plus offset (weights included), prepare run once on the
current stream with the weights' addresses and waited for, forward launching with the tensors'
addresses on torch's current stream, the CUDA context made current when another one is, the device
checks, and check_status's words.
"""

import contextlib
import itertools
import struct
import unittest
from unittest import mock

from fakes import FIXTURE, FakeTensor, fake_driver
from megamoe_torch import layer as layer_mod
from megamoe_torch.errors import MegaMoEStatusError
from megamoe_torch.manifest import load_manifest

M = load_manifest(FIXTURE)
STREAM = 0x5151


class FakeDevice:
    def __init__(self, type_, index=None):
        self.type = type_
        self.index = index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    __repr__ = __str__

    def __eq__(self, other):
        return str(self) == str(other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None


class FakeBuffer(FakeTensor):
    def __init__(self, torch, shape, dtype, device):
        super().__init__(dtype, shape, str(device), ptr=next(torch.addresses))
        self.torch = torch
        self.fills = []

    def fill_(self, v):
        self.fills.append(v)
        return self

    def __getitem__(self, s):
        return self

    def view(self, dtype):
        return self

    def tolist(self):
        return list(self.torch.status_words)


class FakeTorch:
    bfloat16, int32, float32, uint8, int64 = "bfloat16", "int32", "float32", "uint8", "int64"
    float8_e4m3fn = "float8_e4m3fn"

    def __init__(self):
        self.addresses = itertools.count(0x7F00_0000_0000, 0x10_0000)
        self.allocations = []
        self.synchronized = []
        self.status_words = [0, 0, 0, 0]
        torch = self

        class Cuda:
            @staticmethod
            def current_device():
                return 0

            @staticmethod
            def device(d):
                return contextlib.nullcontext()

            @staticmethod
            def init():
                pass

            @staticmethod
            def current_stream(device=None):
                class S:
                    cuda_stream = STREAM

                    def synchronize(self):
                        torch.synchronized.append("stream")

                return S()

            @staticmethod
            def synchronize(device=None):
                torch.synchronized.append("device")

        class C:
            @staticmethod
            def _cuda_getCurrentRawStream(index):
                return STREAM

        self.cuda = Cuda
        self._C = C

    def device(self, d, index=None):
        if isinstance(d, FakeDevice):
            return d
        if index is not None:
            return FakeDevice(d, index)
        t, _, i = str(d).partition(":")
        return FakeDevice(t, int(i) if i else None)

    def empty(self, size, dtype=None, device=None):
        b = FakeBuffer(self, (size,) if isinstance(size, int) else tuple(size), dtype, device)
        self.allocations.append(b)
        return b


def weights():
    return {name: FakeTensor(spec.dtype, spec.shape, ptr=0x6000_0000_0000 + i * 0x100_0000)
            for i, (name, spec) in enumerate(M.weights.items())}


def make(lib_setup=None, **kw):
    torch = FakeTorch()
    drv, lib = fake_driver()
    if lib_setup:
        lib_setup(lib)
    with mock.patch.object(layer_mod, "_torch", lambda: torch):
        moe = layer_mod.MegaMoE(M, weights(), device="cuda:0", driver=drv, **kw)
    return moe, torch, lib


class LayerTest(unittest.TestCase):
    def test_construction(self):
        moe, torch, lib = make()
        w = weights()
        # Buffers: one allocation each (after torch's context-creating 1-byte one), init applied.
        by_name = moe.buffers
        self.assertEqual(set(by_name), set(M.buffers))
        self.assertEqual(by_name["scratch"].fills, [0xFF])
        self.assertEqual(by_name["counters"].fills, [0])
        self.assertEqual(by_name["pool"].fills, [])
        self.assertEqual(by_name["pool"].shape, (65536,))
        # Cubins loaded, functions found, their dynamic shared memory limits set.
        loaded = [c for c in lib.calls if c[0] == "cuModuleLoadData"]
        self.assertEqual(len(loaded), 3)
        self.assertEqual(sorted(name for _m, name in lib.functions.values()),
                         ["megamoe_fused", "megamoe_fused", "megamoe_transform"])
        limits = sorted(c[3] for c in lib.calls if c[0] == "cuFuncSetAttribute")
        self.assertEqual(limits, [0, 99328, 195040])
        # Tensor maps at their tensor's address + offset.
        enc = {c[4]: c for c in lib.calls if c[0] == "cuTensorMapEncodeTiled"}
        self.assertIn(w["w13"].data_ptr(), enc)
        self.assertIn(by_name["w13_prepared"].data_ptr(), enc)
        self.assertIn(by_name["pool"].data_ptr() + 256, enc)
        # prepare: the transform launch, two copies from the weights, then a wait.
        copies = [c for c in lib.calls if c[0] == "copy"]
        self.assertEqual(copies, [
            ("copy", by_name["w2_prepared"].data_ptr(), w["w2"].data_ptr(), 131072, STREAM),
            ("copy", by_name["scales"].data_ptr() + 64, w["w2_scale"].data_ptr(), 32, STREAM),
        ])
        self.assertEqual(len(lib.launches), 1)
        self.assertEqual(torch.synchronized, ["stream"])
        # The weights are forgotten after prepare.
        self.assertNotIn("w13", moe._program.addresses)

    def test_prepare_reads_the_weights(self):
        torch = FakeTorch()
        drv, lib = fake_driver()
        orig = lib.cuModuleGetFunction

        def get_function(out, mod, name):
            rc = orig(out, mod, name)
            h = out._obj.value
            lib.arg_sizes[h] = [128, 128, 8, 8, 4] if name == b"megamoe_transform" else []
            return rc

        lib.cuModuleGetFunction = get_function
        with mock.patch.object(layer_mod, "_torch", lambda: torch):
            moe = layer_mod.MegaMoE(M, weights(), device="cuda:0", driver=drv)
        (launch,) = lib.launches
        w = weights()
        self.assertEqual(launch["args"][2], struct.pack("<Q", w["w13_scale"].data_ptr()))
        self.assertEqual(launch["args"][3], struct.pack("<Q", moe.buffers["scales"].data_ptr()))
        self.assertEqual(launch["stream"], STREAM)

    def test_forward(self):
        moe, torch, lib = make()
        lib.launches.clear()
        lib.calls.clear()
        x = FakeTensor("bfloat16", (5, 256), device="cuda:0")
        ids = FakeTensor("int32", (5, 2), device="cuda:0")
        wts = FakeTensor("float32", (5, 2), device="cuda:0")
        out = FakeTensor("bfloat16", (5, 256), device="cuda:0")
        self.assertIs(moe.forward(x, ids, wts, out=out), out)
        self.assertEqual([c[0] for c in lib.calls], ["memset", "cuLaunchKernelEx", "copy"])
        self.assertEqual(lib.calls[2][1:], (moe.buffers["pool"].data_ptr(), x.data_ptr(), 5 * 512, STREAM))
        self.assertEqual(lib.launches[0]["stream"], STREAM)
        # out allocated when not given
        got = moe.forward(x, ids, wts)
        self.assertEqual(got.shape, (5, 256))
        self.assertEqual(torch.synchronized, ["stream"])  # forward never waits

    def test_forward_makes_its_context_current(self):
        moe, torch, lib = make()

        def other_ctx(out):
            out.contents.value = 0xBAD
            return 0

        lib.cuCtxGetCurrent = other_ctx
        moe._driver.ctx_get_current_raw = other_ctx
        x = FakeTensor("bfloat16", (2, 256), device="cuda:0")
        moe.forward(x, FakeTensor("int32", (2, 2)), FakeTensor("float32", (2, 2)),
                    out=FakeTensor("bfloat16", (2, 256)))
        self.assertIn(("cuCtxSetCurrent", 0xC0), lib.calls)

    def test_device_checks(self):
        def sms(lib):
            orig = lib.cuDeviceGetAttribute

            def attr(out, a, dev):
                rc = orig(out, a, dev)
                if a == 16:
                    out._obj.value = 114
                return rc

            lib.cuDeviceGetAttribute = attr

        with self.assertRaises(RuntimeError) as cm:
            make(sms)
        self.assertIn("132 SMs", str(cm.exception))
        self.assertIn("114", str(cm.exception))

        def cc(lib):
            orig = lib.cuDeviceGetAttribute

            def attr(out, a, dev):
                rc = orig(out, a, dev)
                if a == 75:
                    out._obj.value = 10
                return rc

            lib.cuDeviceGetAttribute = attr

        with self.assertRaises(RuntimeError) as cm:
            make(cc)
        self.assertIn("sm_90a", str(cm.exception))

    def test_weights_checked(self):
        torch = FakeTorch()
        drv, lib = fake_driver()
        w = weights()
        w["w2"] = FakeTensor("bfloat16", (4, 256, 128))
        with mock.patch.object(layer_mod, "_torch", lambda: torch):
            with self.assertRaises(TypeError) as cm:
                layer_mod.MegaMoE(M, w, device="cuda:0", driver=drv)
        self.assertIn("w2 must be float8_e4m3fn [4, 256, 128]", str(cm.exception))
        self.assertEqual(lib.calls, [])  # nothing loaded or allocated before the checks

    def test_check_status(self):
        moe, torch, lib = make()
        moe.check_status()
        torch.status_words = [3, 17, 5, 9]
        with self.assertRaises(MegaMoEStatusError) as cm:
            moe.check_status()
        self.assertEqual(cm.exception.words, (3, 17, 5, 9))
        self.assertIn("block 17", str(cm.exception))

        def fail(device=None):
            raise RuntimeError("CUDA error: unspecified launch failure")

        torch.cuda.synchronize = staticmethod(fail)
        with self.assertRaises(MegaMoEStatusError) as cm:
            moe.check_status()
        self.assertIsNone(cm.exception.words)
        self.assertIn("unspecified launch failure", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
