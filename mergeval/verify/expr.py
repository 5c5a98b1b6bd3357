"""Plain formulas: a small, safe arithmetic language over named cells, evaluated on intervals.

An expression is Python-like arithmetic::

    (9*ChemBench + 200*MolInst + DROP + GSM8K) / 13
    mean(NC, RS, TP) - `GPT-4 avg`
    100 * (merged - base) / (expert - base)

- numbers, names, ``+ - * /``, unary ``-``/``+``, parentheses;
- functions ``mean(..)``, ``sum(..)``, ``min(..)``, ``max(..)``, ``abs(x)``;
- a name that is not a Python identifier (``ARC-C``, ``Overall Average``,
  ``0.50``) is written in backquotes: `` `ARC-C` ``.

Nothing else parses: the text goes through ``ast.parse`` and every node must
be on a whitelist (no attribute access, no calls but the five above, no
``eval``), so a spec cannot run code.

Evaluation is interval arithmetic: each name stands for an interval [lo, hi]
(a printed cell's rounding interval) and each operation returns the interval
of all its results:

    [a, b] + [c, d] = [a + c, b + d]          [a, b] - [c, d] = [a - d, b - c]
    [a, b] * [c, d] = [min, max of ac, ad, bc, bd]
    [a, b] / [c, d] = [a, b] * [1/d, 1/c]     undefined when 0 is in [c, d]

The result contains every value the formula can take on the box of inputs;
when each name occurs once in the expression (every weighted sum or mean, the
normalized score written with a repeated name excepted) it is exactly that
range. With a name repeated it may be wider (the check is then looser, never
wrong). A point value is the same evaluation on zero-width intervals.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mergeval.verify.numbers import Interval, show_interval

_QUOTED = re.compile(r"`([^`]+)`")
_PLACEHOLDER = "_q{}_"


@dataclass(frozen=True)
class Expr:
    text: str
    tree: ast.expr
    names: tuple[str, ...]  # in order of first appearance, as written (backquotes removed)
    placeholders: Mapping[str, str]  # identifier in the tree -> the name it stands for


def parse_expr(text: str) -> Expr:
    """Parse and whitelist an expression; ValueError with a one-clause reason otherwise."""
    quoted: dict[str, str] = {}

    def hide(match: re.Match) -> str:
        key = _PLACEHOLDER.format(len(quoted))
        quoted[key] = match.group(1)
        return key

    source = _QUOTED.sub(hide, text)
    if "`" in source:
        raise ValueError(f"unbalanced backquote in {text!r}")
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"{text!r} is not an arithmetic expression") from None
    names: list[str] = []
    for node in ast.walk(tree):
        _allowed(node, text)
        if isinstance(node, ast.Name) and not _is_function(node, tree):
            name = quoted.get(node.id, node.id)
            if name not in names:
                names.append(name)
    return Expr(text, tree, tuple(names), quoted)


_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_FUNCTIONS = ("mean", "sum", "min", "max", "abs")


def _allowed(node: ast.AST, text: str) -> None:
    ok = isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Name, ast.Load, ast.Call, *_BINOPS, ast.USub, ast.UAdd)) or (
        isinstance(node, ast.Constant) and type(node.value) in (int, float)
    )
    if isinstance(node, ast.BinOp) and not isinstance(node.op, _BINOPS):
        ok = False
    if isinstance(node, ast.Call):
        ok = (
            isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
            and bool(node.args)
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and (node.func.id != "abs" or len(node.args) == 1)
        )
    if not ok:
        what = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
        raise ValueError(
            f"'{what}' is not allowed in {text!r} (numbers, names, + - * /, parentheses and "
            f"{', '.join(_FUNCTIONS)}(..) only; quote other names in backquotes)"
        )


def _is_function(name: ast.Name, tree: ast.expr) -> bool:
    return any(isinstance(n, ast.Call) and n.func is name for n in ast.walk(tree))


def evaluate(expr: Expr, env: Mapping[str, Interval]) -> Interval:
    """The interval of ``expr`` with each name bound to an interval (module docstring).

    Raises ValueError when a division's denominator interval contains 0.
    """

    def ev(node: ast.expr) -> Interval:
        if isinstance(node, ast.Constant):
            assert isinstance(node.value, (int, float)), "_allowed admits numbers only"
            return float(node.value), float(node.value)
        if isinstance(node, ast.Name):
            return env[expr.placeholders.get(node.id, node.id)]
        if isinstance(node, ast.UnaryOp):
            lo, hi = ev(node.operand)
            return (-hi, -lo) if isinstance(node.op, ast.USub) else (lo, hi)
        if isinstance(node, ast.BinOp):
            return _BINARY[type(node.op)](ev(node.left), ev(node.right), node)
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), "_allowed admits no other node"
        args = [ev(a) for a in node.args]
        return _CALLS[node.func.id](args)

    return ev(expr.tree)


def _mul(a: Interval, b: Interval, _node=None) -> Interval:
    products = [x * y for x in a for y in b]
    return min(products), max(products)


def _div(a: Interval, b: Interval, node: ast.BinOp) -> Interval:
    if b[0] <= 0.0 <= b[1]:
        raise ValueError(
            f"'{ast.unparse(node.right)}' can be 0 within its inputs' rounding "
            f"({show_interval(*b)}): the division is undefined"
        )
    return _mul(a, (1.0 / b[1], 1.0 / b[0]))


def _abs(args: list[Interval]) -> Interval:
    ((lo, hi),) = args
    if lo >= 0:
        return lo, hi
    if hi <= 0:
        return -hi, -lo
    return 0.0, max(-lo, hi)


def _sum(args: list[Interval]) -> Interval:
    return math.fsum(a[0] for a in args), math.fsum(a[1] for a in args)


def _mean(args: list[Interval]) -> Interval:
    lo, hi = _sum(args)
    return lo / len(args), hi / len(args)


_BINARY: dict[type, Callable[[Interval, Interval, ast.BinOp], Interval]] = {
    ast.Add: lambda a, b, _: (a[0] + b[0], a[1] + b[1]),
    ast.Sub: lambda a, b, _: (a[0] - b[1], a[1] - b[0]),
    ast.Mult: _mul,
    ast.Div: _div,
}
_CALLS: dict[str, Callable[[list[Interval]], Interval]] = {
    "sum": _sum,
    "mean": _mean,
    "min": lambda args: (min(a[0] for a in args), min(a[1] for a in args)),
    "max": lambda args: (max(a[0] for a in args), max(a[1] for a in args)),
    "abs": _abs,
}
