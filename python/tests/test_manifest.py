import copy
import json
import os
import tempfile
import unittest

from fakes import FIXTURE
from megamoe_torch.errors import ManifestError
from megamoe_torch.manifest import LaunchStep, load_manifest, parse_manifest

FILE = os.path.join(FIXTURE, "manifest.json")


def fixture_data():
    with open(FILE) as f:
        return json.load(f)


def launch(data, r=0, s=1):
    return data["forward"][r]["steps"][s]


def setp(obj, path, value):
    """Set obj[path...] (path a list of keys / indices); value DELETE removes the key."""
    for key in path[:-1]:
        obj = obj[key]
    if value is DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


DELETE = object()

F1 = ["forward", 0, "steps", 1]  # the fused_m8 launch
# (description, path to change, new value, expected JSON path of the error, words the message must hold)
MUTATIONS = [
    ("format", ["format"], "megamoe", "format", "megamoe-export"),
    ("version", ["version"], 2, "version", "version 1"),
    ("missing smCount", ["smCount"], DELETE, "smCount", "missing"),
    ("arch", ["arch"], "sm_100a", "arch", "sm_90a"),
    ("layer int as string", ["layer", "hidden"], "256", "layer.hidden", "integer"),
    ("layer format", ["layer", "expertFormat"], "int4", "layer.expertFormat", "fp8"),
    ("unknown top-level key", ["extra"], 1, "extra", "no such key"),
    ("duplicate kernel id", ["kernels", 1, "id"], "transform", "kernels[1].id", "not used before"),
    ("missing cubin", ["kernels", 0, "cubin"], "kernels/missing.cubin", "kernels[0].cubin", "existing cubin"),
    ("cubin not ELF", ["kernels", 0, "cubin"], "manifest.json", "kernels[0].cubin", "ELF"),
    ("cubin outside", ["kernels", 0, "cubin"], "../fakes.py", "kernels[0].cubin", "inside"),
    ("cubin absolute", ["kernels", 0, "cubin"], "/etc/passwd", "kernels[0].cubin", "relative"),
    ("defines value", ["kernels", 1, "defines", "BLOCK_M"], [8], "kernels[1].defines.BLOCK_M", "number"),
    ("duplicate buffer", ["buffers", 1, "name"], "w13_prepared", "buffers[1].name", "unique"),
    ("buffer named like a weight", ["weights", "w13", "dtype"], "float8_e4m3fn", None, None),  # valid: control
    ("zero-byte buffer", ["buffers", 0, "bytes"], 0, "buffers[0].bytes", "≥ 1"),
    ("fill byte", ["buffers", 5, "init"], "fill:300", "buffers[5].init", "0 … 255"),
    ("init word", ["buffers", 5, "init"], "ones", "buffers[5].init", "fill:<byte>"),
    ("lifetime", ["buffers", 0, "lifetime"], "per-call", "buffers[0].lifetime", "workspace"),
    ("missing weight", ["weights", "w2_scale"], DELETE, "weights.w2_scale", "missing"),
    ("unknown weight", ["weights", "shared_w13"], {"dtype": "uint8", "shape": [1]}, "weights.shared_w13", "sharedIntermediate"),
    ("weight dtype", ["weights", "w13", "dtype"], "float8", "weights.w13.dtype", "float8_e4m3fn"),
    ("weight shape T", ["weights", "w13", "shape", 0], "T", "weights.w13.shape[0]", "integer"),
    ("input dtype", ["inputs", "x", "dtype"], "float16", "inputs.x.dtype", "bfloat16"),
    ("input shape", ["inputs", "topk_ids", "shape"], ["T", 3], "inputs.topk_ids.shape", "layer.topK"),
    ("input shape entry", ["inputs", "out", "shape", 0], "N", "inputs.out.shape[0]", '"T"'),
    ("missing input", ["inputs", "out"], DELETE, "inputs.out", "missing"),
    ("map over input", ["tensorMaps", 1, "buffer"], "x", "tensorMaps[1].buffer", "never over an input"),
    ("map over nothing", ["tensorMaps", 1, "buffer"], "nope", "tensorMaps[1].buffer", "buffer or a weight"),
    ("duplicate map", ["tensorMaps", 1, "id"], "src.w13", "tensorMaps[1].id", "not used before"),
    ("swizzle", ["tensorMaps", 0, "swizzle"], "256B", "tensorMaps[0].swizzle", "128B"),
    ("dataType", ["tensorMaps", 0, "dataType"], "fp8", "tensorMaps[0].dataType", "uint8"),
    ("box over swizzle span", ["tensorMaps", 1, "box", 0], 256, "tensorMaps[1].box[0]", "128-byte swizzle"),
    ("box over 256", ["tensorMaps", 1, "box", 1], 512, "tensorMaps[1].box[1]", "1 … 256"),
    ("inner box not 16 bytes", ["tensorMaps", 2, "box", 0], 4, "tensorMaps[2].box[0]", "multiple of 16"),
    ("strides length", ["tensorMaps", 1, "stridesBytes"], [256, 256], "tensorMaps[1].stridesBytes", "2 entries"[0:0] + "1 entries"),
    ("stride alignment", ["tensorMaps", 1, "stridesBytes", 0], 264, "tensorMaps[1].stridesBytes[0]", "multiple of 16"),
    ("map offset alignment", ["tensorMaps", 2, "offset"], 8, "tensorMaps[2].offset", "16-byte aligned"),
    ("map past its buffer", ["tensorMaps", 2, "dims", 2], 3, "tensorMaps[2]", "inside 'pool'"),
    ("element strides", ["tensorMaps", 2, "elementStrides", 0], 9, "tensorMaps[2].elementStrides[0]", "1 … 8"),
    ("oobFill", ["tensorMaps", 2, "oobFill"], "nan", "tensorMaps[2].oobFill", "nan_request_zero_fma"),
    ("unknown kernel", F1 + ["kernel"], "fused_m16", "forward[0].steps[1].kernel", "kernels"),
    ("bad op", F1 + ["grid", 0, "op"], "div", "forward[0].steps[1].grid[0].op", "ceil_div"),
    ("ceil_div arity", F1 + ["grid", 0, "args"], ["T", 8, 2], "forward[0].steps[1].grid[0].args", "exactly 2"),
    ("non-integer grid", F1 + ["grid", 1], 1.5, "forward[0].steps[1].grid[1]", "non-integer"),
    ("grid length", F1 + ["grid"], [1, 1], "forward[0].steps[1].grid", "3 entries"),
    ("block threads", F1 + ["block"], [64, 32, 1], "forward[0].steps[1].block", "1024 threads"),
    ("shared over kernel", F1 + ["sharedBytes"], 99329, "forward[0].steps[1].sharedBytes", "99328"),
    ("cluster", F1 + ["cluster"], [4, 4, 1], "forward[0].steps[1].cluster", "8 blocks"),
    ("pss not bool", F1 + ["programmaticStreamSerialization"], 1, "forward[0].steps[1].programmaticStreamSerialization", "true or false"),
    ("missing pss", F1 + ["programmaticStreamSerialization"], DELETE, "forward[0].steps[1].programmaticStreamSerialization", "missing"),
    ("unknown step key", F1 + ["comment"], "hi", "forward[0].steps[1].comment", "no such key"),
    ("step kind", F1 + ["kind"], "kernel", "forward[0].steps[1].kind", "launch"),
    ("arg kind", F1 + ["args", 2, "kind"], "u16", "forward[0].steps[1].args[2].kind", "u32"),
    ("unknown map", F1 + ["args", 0, "map"], "m.nope", "forward[0].steps[1].args[0].map", "tensorMaps"),
    ("forward map over weight", F1 + ["args", 0, "map"], "src.w13", "forward[0].steps[1].args[0].map", "may free"),
    ("forward pointer to weight", F1 + ["args", 1, "ref", "buffer"], "w13", "forward[0].steps[1].args[1].ref.buffer", "buffer or an input"),
    ("pointer to nothing", F1 + ["args", 1, "ref", "buffer"], "y", "forward[0].steps[1].args[1].ref.buffer", "buffer or an input"),
    ("ref without offset", F1 + ["args", 1, "ref", "offset"], DELETE, "forward[0].steps[1].args[1].ref.offset", "missing"),
    ("prepare pointer to input", ["prepare", 0, "args", 2, "ref", "buffer"], "x", "prepare[0].args[2].ref.buffer", "buffer or a weight"),
    ("prepare depends on T", ["prepare", 0, "args", 4, "value"], "T", "prepare[0].args[4].value", "without \"T\""),
    ("u32 negative for T = 1", F1 + ["args", 2, "value"], {"op": "sub", "args": ["T", 2]}, "forward[0].steps[1].args[2].value", "T = 1"),
    ("i32 overflow", F1 + ["args", 10, "value"], 2**31, "forward[0].steps[1].args[10].value", "i32"),
    ("f32 literal infinite", F1 + ["args", 11, "value"], 1e39, "forward[0].steps[1].args[11].value", "float32"),
    ("u64 negative", F1 + ["args", 12, "value"], -1, "forward[0].steps[1].args[12].value", "u64"),
    ("pointer offset past buffer", F1 + ["args", 8, "ref", "offset"], {"op": "mul", "args": ["T", 65536]}, "forward[0].steps[1].args[8].ref.offset", "T = 2"),
    ("input offset past input", F1 + ["args", 1, "ref", "offset"], {"op": "mul", "args": ["T", 1024]}, "forward[0].steps[1].args[1].ref.offset", "inside 'x'"),
    ("struct field overlap", F1 + ["args", 13, "fields", 2, "offset"], 8, "forward[0].steps[1].args[13].fields[2].offset", "fields[1]"),
    ("struct field misaligned", F1 + ["args", 13, "fields", 4, "offset"], 20, "forward[0].steps[1].args[13].fields[4].offset", "multiple of 8"),
    ("struct field outside", F1 + ["args", 13, "fields", 3, "offset"], 44, "forward[0].steps[1].args[13].fields[3].offset", "inside the struct"),
    ("struct field kind", F1 + ["args", 13, "fields", 3, "kind"], "tensorMap", "forward[0].steps[1].args[13].fields[3].kind", "pointer"),
    ("copy past x", ["forward", 0, "steps", 2, "bytes"], {"op": "mul", "args": ["T", 1024]}, "forward[0].steps[2].bytes", "'x'"),
    ("memset byte", ["forward", 0, "steps", 0, "byte"], 256, "forward[0].steps[0].byte", "0 … 255"),
    ("memset past buffer", ["forward", 0, "steps", 0, "bytes"], 513, "forward[0].steps[0].bytes", "'scratch'"),
    ("grid not a cluster multiple", ["forward", 1, "steps", 0, "grid", 0], {"op": "ceil_div", "args": ["T", 8]}, "forward[1].steps[0].grid[0]", "cluster"),
    ("grid zero", F1 + ["grid", 0], {"op": "sub", "args": ["T", 1]}, "forward[0].steps[1].grid[0]", "T = 1"),
    ("range gap", ["forward", 1, "tokens"], [10, 64], "forward[1].tokens[0]", "9"),
    ("range overlap", ["forward", 1, "tokens"], [8, 64], "forward[1].tokens[0]", "without gaps or overlaps"),
    ("range not from 1", ["forward", 0, "tokens"], [2, 8], "forward[0].tokens[0]", "starts at 1"),
    ("range short of max", ["forward", 1, "tokens"], [9, 63], "forward[1].tokens[1]", "maxTokens = 64"),
    ("range past max", ["forward", 1, "tokens"], [9, 65], "forward[1].tokens[1]", "at most layer.maxTokens"),
    ("range reversed", ["forward", 0, "tokens"], [1, 0], "forward[0].tokens[1]", "≥ 1"),
    ("empty steps", ["forward", 1, "steps"], [], "forward[1].steps", "at least 1"),
    ("no ranges", ["forward"], [], "forward", "at least 1"),
    ("status buffer", ["status", "buffer"], "pool_x", "status.buffer", "buffer"),
    ("status words", ["status", "words"], 5, "status.words", "at most 4"),
]


class ManifestTest(unittest.TestCase):
    def test_fixture_loads(self):
        m = load_manifest(FIXTURE)
        self.assertEqual(m.layer.hidden, 256)
        self.assertEqual(m.layer.max_tokens, 64)
        self.assertEqual(list(m.kernels), ["transform", "fused_m8", "fused_m32"])
        self.assertEqual(m.buffers["scratch"].fill, 0xFF)
        self.assertEqual(m.buffers["counters"].fill, 0)
        self.assertIsNone(m.buffers["pool"].fill)
        self.assertEqual(m.weights["w13"].shape, (4, 256, 256))
        self.assertEqual(m.inputs["x"].shape, ("T", 256))
        self.assertEqual(m.inputs["x"].bytes_for(3), 3 * 256 * 2)
        t = m.tensor_maps["m.pool_x"]
        self.assertEqual((t.data_type_code, t.swizzle, t.l2_promotion, t.oob_fill), (9, 3, 2, 1))
        self.assertEqual(t.extent_bytes(), 128 * 2 + 63 * 512 + 1 * 32768)
        step = m.forward[0].steps[1]
        self.assertIsInstance(step, LaunchStep)
        self.assertTrue(step.programmatic_stream_serialization)
        self.assertEqual(step.args[13].fields[3].value.const, 2)
        self.assertEqual(m.status.words, 4)
        self.assertTrue(os.path.isfile(m.kernels["fused_m8"].cubin_path))

    def test_manifest_file_path_works_too(self):
        self.assertEqual(load_manifest(FILE).file, FILE)

    def test_range_for(self):
        m = load_manifest(FIXTURE)
        for T in range(1, 9):
            self.assertIs(m.range_for(T), m.forward[0])
        for T in (9, 10, 33, 64):
            self.assertIs(m.range_for(T), m.forward[1])
        for T in (0, -1, 65, 1.0, "3"):
            with self.subTest(T=T):
                with self.assertRaises(ValueError):
                    m.range_for(T)

    def test_mutations_fail_with_their_json_path(self):
        base = fixture_data()
        for name, path, value, where, words in MUTATIONS:
            with self.subTest(name):
                data = copy.deepcopy(base)
                setp(data, path, value)
                if where is None:
                    parse_manifest(data, FILE)
                    continue
                with self.assertRaises(ManifestError) as cm:
                    parse_manifest(data, FILE)
                e = cm.exception
                self.assertEqual(e.path, where, str(e))
                self.assertEqual(e.file, FILE)
                self.assertIn(words, e.expected, str(e))
                self.assertTrue(str(e).startswith(f"{FILE}: {where}: "), str(e))
                self.assertIsInstance(e, ValueError)

    def test_shared_expert_needs_its_weights(self):
        data = fixture_data()
        data["layer"]["sharedIntermediate"] = 128
        with self.assertRaises(ManifestError) as cm:
            parse_manifest(data, FILE)
        self.assertEqual(cm.exception.path, "weights.shared_w13")
        for name, shape in (("shared_w13", [256, 256]), ("shared_w13_scale", [2, 2]), ("shared_w2", [256, 128]),
                            ("shared_w2_scale", [2, 1])):
            data["weights"][name] = {"dtype": "float32" if "scale" in name else "float8_e4m3fn", "shape": shape}
        m = parse_manifest(data, FILE)
        self.assertIn("shared_w2_scale", m.weights)

    def test_file_level_errors(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(ManifestError) as cm:
                load_manifest(d)
            self.assertEqual(cm.exception.path, "<file>")
            p = os.path.join(d, "manifest.json")
            with open(p, "w") as f:
                f.write('{"format": "megamoe-export", "format": "x"}')
            with self.assertRaises(ManifestError) as cm:
                load_manifest(p)
            self.assertEqual(cm.exception.path, "<json>")
            self.assertIn("duplicate", cm.exception.expected)
            with open(p, "w") as f:
                f.write("{not json")
            with self.assertRaises(ManifestError) as cm:
                load_manifest(d)
            self.assertEqual(cm.exception.path, "<json>")

    def test_quick_check_still_checks_range_ends(self):
        data = fixture_data()
        setp(data, F1 + ["args", 2, "value"], {"op": "sub", "args": ["T", 2]})
        with self.assertRaises(ManifestError):
            parse_manifest(data, FILE, check_all_tokens=False)


if __name__ == "__main__":
    unittest.main()
