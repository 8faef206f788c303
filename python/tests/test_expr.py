import unittest

from megamoe_torch.expr import ExprError, compile_expr, evaluate


class ExprTest(unittest.TestCase):
    def test_numbers_and_t(self):
        self.assertEqual(evaluate(7, 100), 7)
        self.assertEqual(evaluate("T", 100), 100)
        self.assertEqual(compile_expr(7).const, 7)
        self.assertIsNone(compile_expr("T").const)

    def test_ops(self):
        cases = [
            ({"op": "add", "args": ["T", 3, 4]}, 10, 17),
            ({"op": "sub", "args": ["T", 3]}, 10, 7),
            ({"op": "sub", "args": [100, "T", 1]}, 10, 89),
            ({"op": "mul", "args": ["T", 6]}, 7, 42),
            ({"op": "ceil_div", "args": ["T", 8]}, 1, 1),
            ({"op": "ceil_div", "args": ["T", 8]}, 8, 1),
            ({"op": "ceil_div", "args": ["T", 8]}, 9, 2),
            ({"op": "ceil_div", "args": [{"op": "sub", "args": [0, "T"]}, 8]}, 9, -1),
            ({"op": "min", "args": ["T", 32]}, 100, 32),
            ({"op": "max", "args": ["T", 32, 40]}, 100, 100),
            ({"op": "add", "args": ["T"]}, 5, 5),
        ]
        for node, T, want in cases:
            with self.subTest(node=node, T=T):
                self.assertEqual(evaluate(node, T), want)

    def test_nested(self):
        e = compile_expr({"op": "mul", "args": [2, {"op": "ceil_div", "args": [{"op": "mul", "args": ["T", 6]}, 32]}]})
        self.assertEqual([e(T) for T in (1, 5, 6, 64)], [2, 2, 4, 24])
        self.assertTrue(e.depends_on_t)

    def test_constant_folding(self):
        e = compile_expr({"op": "mul", "args": [{"op": "ceil_div", "args": [4096, 128]}, 3]})
        self.assertEqual(e.const, 96)
        self.assertFalse(e.depends_on_t)

    def test_bad_expressions_name_their_place(self):
        cases = [
            ({"op": "pow", "args": [1, 2]}, ".op"),
            ({"op": "add"}, ".args"),
            ({"args": [1]}, ".op"),
            ({"op": "ceil_div", "args": ["T", 2, 3]}, ".args"),
            ({"op": "ceil_div", "args": ["T"]}, ".args"),
            ({"op": "sub", "args": ["T"]}, ".args"),
            ({"op": "add", "args": [1, {"op": "mul", "args": ["t", 2]}]}, ".args[1].args[0]"),
            ({"op": "add", "args": [1.5, 2]}, ".args[0]"),
            ({"op": "add", "args": [True, 2]}, ".args[0]"),
            ({"op": "add", "args": [1, 2], "note": "x"}, ".note"),
            ({"op": "ceil_div", "args": [4, 0]}, ""),
            ("N", ""),
            (None, ""),
            ([1, 2], ""),
        ]
        for node, path in cases:
            with self.subTest(node=node):
                with self.assertRaises(ExprError) as cm:
                    compile_expr(node)
                self.assertEqual(cm.exception.path, path)

    def test_division_by_zero_at_call(self):
        e = compile_expr({"op": "ceil_div", "args": [8, {"op": "sub", "args": ["T", 1]}]})
        self.assertEqual(e(3), 4)
        with self.assertRaises(ArithmeticError):
            e(1)


if __name__ == "__main__":
    unittest.main()
