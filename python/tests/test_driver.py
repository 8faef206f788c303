"""driver.py's struct layouts and enum values against cuda.h, and its error path with a fake libcuda."""

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from fakes import fake_driver
from megamoe_torch import driver as d
from megamoe_torch import manifest as mf
from megamoe_torch.errors import CudaError

CUDA_INCLUDE = os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include")
HEADER = os.path.join(CUDA_INCLUDE, "cuda.h")

# name -> C expression printed by the probe; each is compared with what the package uses.
PROBES = {
    "sizeof(CUlaunchConfig)": ctypes.sizeof(d.CUlaunchConfig),
    "offsetof(CUlaunchConfig, gridDimX)": d.CUlaunchConfig.gridDimX.offset,
    "offsetof(CUlaunchConfig, gridDimY)": d.CUlaunchConfig.gridDimY.offset,
    "offsetof(CUlaunchConfig, gridDimZ)": d.CUlaunchConfig.gridDimZ.offset,
    "offsetof(CUlaunchConfig, blockDimX)": d.CUlaunchConfig.blockDimX.offset,
    "offsetof(CUlaunchConfig, blockDimY)": d.CUlaunchConfig.blockDimY.offset,
    "offsetof(CUlaunchConfig, blockDimZ)": d.CUlaunchConfig.blockDimZ.offset,
    "offsetof(CUlaunchConfig, sharedMemBytes)": d.CUlaunchConfig.sharedMemBytes.offset,
    "offsetof(CUlaunchConfig, hStream)": d.CUlaunchConfig.hStream.offset,
    "offsetof(CUlaunchConfig, attrs)": d.CUlaunchConfig.attrs.offset,
    "offsetof(CUlaunchConfig, numAttrs)": d.CUlaunchConfig.numAttrs.offset,
    "sizeof(CUlaunchAttribute)": ctypes.sizeof(d.CUlaunchAttribute),
    "offsetof(CUlaunchAttribute, id)": d.CUlaunchAttribute.id.offset,
    "offsetof(CUlaunchAttribute, value)": d.CUlaunchAttribute.value.offset,
    "sizeof(CUlaunchAttributeValue)": ctypes.sizeof(d.CUlaunchAttributeValue),
    "_Alignof(CUlaunchAttributeValue)": ctypes.alignment(d.CUlaunchAttributeValue),
    "offsetof(CUlaunchAttributeValue, clusterDim.x)": d.CUlaunchAttributeValue.clusterDim.offset,
    "offsetof(CUlaunchAttributeValue, clusterDim.z)": d.CUlaunchAttributeValue.clusterDim.offset + d._ClusterDim.z.offset,
    "offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed)":
        d.CUlaunchAttributeValue.programmaticStreamSerializationAllowed.offset,
    "sizeof(CUtensorMap)": d.TENSOR_MAP_BYTES,
    "_Alignof(CUtensorMap)": d.TENSOR_MAP_ALIGN,
    "sizeof(CUdeviceptr)": ctypes.sizeof(d.CUdeviceptr),
    "sizeof(CUresult)": ctypes.sizeof(ctypes.c_int),
    "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION": d.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
    "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION": d.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
    "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES": d.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": d.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE": d.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": d.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": d.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": d.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    "CU_TENSOR_MAP_NUM_QWORDS * 8": d.TENSOR_MAP_BYTES,
}
for name, (code, _n) in mf.TENSOR_MAP_DATA_TYPES.items():
    PROBES[f"CU_TENSOR_MAP_DATA_TYPE_{name.upper()}"] = code
for name, code in mf.TENSOR_MAP_INTERLEAVE.items():
    PROBES[f"CU_TENSOR_MAP_INTERLEAVE_{name.upper()}"] = code
for name, code in mf.TENSOR_MAP_SWIZZLE.items():
    PROBES[f"CU_TENSOR_MAP_SWIZZLE_{name.upper()}"] = code
for name, code in mf.TENSOR_MAP_L2_PROMOTION.items():
    PROBES[f"CU_TENSOR_MAP_L2_PROMOTION_{'L2_' + name.upper() if name != 'none' else 'NONE'}"] = code
for name, code in mf.TENSOR_MAP_OOB_FILL.items():
    PROBES[f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{name.upper()}"] = code


def probe_header():
    """Compile a C program printing every probe with gcc against cuda.h; None when that cannot run."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None or not os.path.isfile(HEADER):
        return None
    lines = "\n".join(f'  printf("%s=%lld\\n", "{k}", (long long)({k}));' for k in PROBES)
    src = f"#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\nint main(void) {{\n{lines}\n  return 0;\n}}\n"
    with tempfile.TemporaryDirectory() as tmp:
        c = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(c, "w") as f:
            f.write(src)
        r = subprocess.run([gcc, "-std=c11", f"-I{CUDA_INCLUDE}", c, "-o", exe], capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError(f"the cuda.h probe did not compile:\n{r.stderr[-3000:]}")
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split("=", 1) for line in out.splitlines())}


class HeaderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.values = probe_header()

    def test_layouts_and_enums_match_cuda_h(self):
        if self.values is None:
            self.skipTest(f"gcc or {HEADER} not available")
        for k, want in PROBES.items():
            with self.subTest(k):
                self.assertEqual(self.values[k], want, k)

    def test_signatures_have_the_header_parameter_counts(self):
        if not os.path.isfile(HEADER):
            self.skipTest(f"{HEADER} not available")
        with open(HEADER, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for name, argtypes in d._SIGNATURES.items():
            c_name = name[:-3] if name.endswith("_v2") else name  # cuMemcpyDtoDAsync is #defined to its _v2
            with self.subTest(name):
                m = re.search(r"CUresult CUDAAPI " + re.escape(c_name) + r"\(([^)]*)\);", text)
                self.assertIsNotNone(m, f"{c_name} not declared in cuda.h")
                params = [p for p in m.group(1).split(",") if p.strip() and p.strip() != "void"]
                self.assertEqual(len(params), len(argtypes), f"{name}: cuda.h has {m.group(1)}")


class LayoutTest(unittest.TestCase):
    """Without the header: the sizes cuda.h gives on 64-bit Linux (CUDA 12 and 13)."""

    def test_sizes(self):
        self.assertEqual(ctypes.sizeof(d.CUlaunchConfig), 56)
        self.assertEqual(ctypes.sizeof(d.CUlaunchAttribute), 72)
        self.assertEqual(d.CUlaunchConfig.hStream.offset, 32)
        self.assertEqual(d.CUlaunchConfig.attrs.offset, 40)
        self.assertEqual(d.CUlaunchConfig.numAttrs.offset, 48)
        self.assertEqual(d.CUlaunchAttribute.value.offset, 8)

    def test_launch_config_bytes(self):
        lc = d.LaunchConfig((384, 1, 1), 99328, (2, 1, 1), True)
        lc.set_grid(6, 2, 1)
        lc.config.hStream = 0xABC
        raw = ctypes.string_at(lc.address, 56)
        self.assertEqual(raw[:28], bytes.fromhex("06000000" "02000000" "01000000" "80010000" "01000000" "01000000")
                         + (99328).to_bytes(4, "little"))
        self.assertEqual(int.from_bytes(raw[32:40], "little"), 0xABC)
        self.assertEqual(int.from_bytes(raw[48:52], "little"), 2)
        attrs = int.from_bytes(raw[40:48], "little")
        a0 = ctypes.string_at(attrs, 72)
        a1 = ctypes.string_at(attrs + 72, 72)
        self.assertEqual(a0[:4], (4).to_bytes(4, "little"))
        self.assertEqual(a0[8:20], bytes.fromhex("02000000" "01000000" "01000000"))
        self.assertEqual(a1[:4], (6).to_bytes(4, "little"))
        self.assertEqual(a1[8:12], (1).to_bytes(4, "little"))

    def test_no_attributes(self):
        lc = d.LaunchConfig((128, 1, 1), 0)
        self.assertEqual(lc.config.numAttrs, 0)
        self.assertFalse(lc.config.attrs)


class FakeDriverTest(unittest.TestCase):
    def test_errors_carry_function_and_error_names(self):
        drv, lib = fake_driver()
        lib.fail_next["cuModuleLoadData"] = 1
        with self.assertRaises(CudaError) as cm:
            drv.load_module(b"\x7fELF...", "kernels/x.cubin")
        e = cm.exception
        self.assertEqual((e.function, e.name, e.code), ("cuModuleLoadData", "CUDA_ERROR_INVALID_VALUE", 1))
        self.assertIn("cuModuleLoadData failed: CUDA_ERROR_INVALID_VALUE (1)", str(e))
        self.assertIn("kernels/x.cubin", str(e))
        self.assertIsInstance(e, RuntimeError)

    def test_calls(self):
        drv, lib = fake_driver()
        self.assertEqual(drv.device(1), 1)
        self.assertEqual(drv.device_attribute(d.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0), 132)
        mod = drv.load_module(b"\x7fELF-image")
        self.assertEqual(lib.modules[mod], b"\x7fELF-image")
        fn = drv.get_function(mod, "megamoe_fused")
        self.assertEqual(lib.functions[fn], (mod, "megamoe_fused"))
        drv.set_max_dynamic_shared(fn, 195040)
        self.assertEqual(lib.calls[-1], ("cuFuncSetAttribute", fn, 8, 195040))
        self.assertEqual(drv.primary_context(0), 0xC0)

    def test_tensor_map_encoding_arguments(self):
        drv, lib = fake_driver()
        image = drv.encode_tensor_map_tiled(9, 0x7000_0000_0100, (128, 64, 2), (512, 32768), (64, 16, 1), (1, 1, 1),
                                            0, 3, 2, 1)
        call = lib.calls[-1]
        self.assertEqual(call[0], "cuTensorMapEncodeTiled")
        self.assertEqual(call[1] % 128, 0)  # the map is written to a 128-aligned block
        self.assertEqual(call[2:], (9, 3, 0x7000_0000_0100, [128, 64, 2], [512, 32768], [64, 16, 1], [1, 1, 1], 0, 3, 2, 1))
        self.assertEqual(len(image), 128)
        self.assertEqual(image[:8], (0x7000_0000_0100).to_bytes(8, "little"))


if __name__ == "__main__":
    unittest.main()
