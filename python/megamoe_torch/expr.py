"""Expressions of the export format (docs/export.md, "Values"), evaluated without ``eval``.

An expression is an integer, the string ``"T"`` (the call's token count) or
``{"op": name, "args": [expr, ...]}`` with name one of add, sub, mul, ceil_div, min, max. ``compile_expr``
checks the whole tree once (at manifest load) and returns an :class:`Expr` whose ``evaluate(T)`` only
does arithmetic; an expression without ``"T"`` is folded to its constant.
"""

from __future__ import annotations

from typing import Callable, Optional

# op name -> (fewest args, most args or None); see docs/export.md "Values".
OPS = {
    "add": (1, None),
    "sub": (2, None),
    "mul": (1, None),
    "ceil_div": (2, 2),
    "min": (1, None),
    "max": (1, None),
}


class ExprError(ValueError):
    """An expression that is not well-formed; ``path`` is relative to the expression's root ("" for the
    root itself, ``.args[1]`` for its second argument), ``expected`` what was expected there."""

    def __init__(self, path: str, expected: str):
        self.path = path
        self.expected = expected
        super().__init__(f"{path or '<expr>'}: {expected}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ceil_div(a: int, b: int) -> int:
    if b <= 0:
        raise ArithmeticError(f"ceil_div by {b} (the divisor must be positive)")
    return -((-a) // b)


def _fold(op: str, values):
    if op == "add":
        return sum(values)
    if op == "mul":
        r = 1
        for v in values:
            r *= v
        return r
    if op == "sub":
        r = values[0]
        for v in values[1:]:
            r -= v
        return r
    if op == "min":
        return min(values)
    if op == "max":
        return max(values)
    if op == "ceil_div":
        return _ceil_div(values[0], values[1])
    raise AssertionError(op)


class Expr:
    """A checked expression. ``const`` is its value when it does not depend on T, else None."""

    __slots__ = ("const", "_fn", "source")

    def __init__(self, const: Optional[int], fn: Callable[[int], int], source):
        self.const = const
        self._fn = fn
        self.source = source

    @property
    def depends_on_t(self) -> bool:
        return self.const is None

    def evaluate(self, T: int) -> int:
        return self._fn(T)

    def __call__(self, T: int) -> int:
        return self._fn(T)

    def __repr__(self) -> str:
        return f"Expr({self.source!r})"


def _compile(node, path: str) -> Expr:
    if _is_int(node):
        v = node
        return Expr(v, lambda T, v=v: v, node)
    if node == "T":
        return Expr(None, lambda T: T, node)
    if isinstance(node, str):
        raise ExprError(path, f'an integer, "T" or an {{"op", "args"}} object, got the string {node!r}')
    if isinstance(node, float):
        raise ExprError(path, f"an integer, got the non-integer number {node!r}")
    if not isinstance(node, dict):
        raise ExprError(path, f'an integer, "T" or an {{"op", "args"}} object, got {type(node).__name__}')
    extra = sorted(set(node) - {"op", "args"})
    if extra:
        raise ExprError(f"{path}.{extra[0]}", 'no key other than "op" and "args"')
    if "op" not in node:
        raise ExprError(f"{path}.op", f"one of {', '.join(OPS)} (missing)")
    op = node["op"]
    if op not in OPS:
        raise ExprError(f"{path}.op", f"one of {', '.join(OPS)}, got {op!r}")
    args = node.get("args")
    if not isinstance(args, list):
        raise ExprError(f"{path}.args", "a list of expressions")
    lo, hi = OPS[op]
    if len(args) < lo or (hi is not None and len(args) > hi):
        want = f"exactly {lo}" if lo == hi else f"at least {lo}"
        raise ExprError(f"{path}.args", f"{op} takes {want} argument(s), got {len(args)}")
    parts = [_compile(a, f"{path}.args[{i}]") for i, a in enumerate(args)]
    if all(p.const is not None for p in parts):
        try:
            v = _fold(op, [p.const for p in parts])
        except ArithmeticError as e:
            raise ExprError(path, str(e)) from None
        return Expr(v, lambda T, v=v: v, node)
    fns = [p._fn for p in parts]
    if op == "ceil_div":
        a, b = fns

        def fn(T, a=a, b=b):
            return _ceil_div(a(T), b(T))
    elif len(fns) == 2:
        a, b = fns
        fn = {
            "add": lambda T: a(T) + b(T),
            "sub": lambda T: a(T) - b(T),
            "mul": lambda T: a(T) * b(T),
            "min": lambda T: min(a(T), b(T)),
            "max": lambda T: max(a(T), b(T)),
        }[op]
    else:
        def fn(T, op=op, fns=fns):
            return _fold(op, [f(T) for f in fns])
    return Expr(None, fn, node)


def compile_expr(node) -> Expr:
    """Check ``node`` and return its :class:`Expr`; raises :class:`ExprError` naming the sub-path."""
    return _compile(node, "")


def evaluate(node, T: int) -> int:
    """Convenience: compile and evaluate once."""
    return compile_expr(node).evaluate(T)
