"""Derivations of published table cells, built from mergeval's metric functions.

A derivation in a spec is a mapping with exactly one of these keys; its inputs
are cell references (see ``tables.py``), ``r``, ``r_i`` below:

- ``expr: "(9*ChemBench + 200*MolInst + DROP + GSM8K) / 13"``  a plain formula (``expr.py``); its
                                            names are the row's columns (in ``derived``), the column's rows
                                            (in ``derived_rows``), or bound by ``with: {name: r}``
- ``mean: [r_1, ..]``                       plain mean (``group_mean`` with one group)
- ``group_mean: {groups: {g: [r, ..]}, scale: {g: s}, weighting: tasks|equal|given, weights: {g: w}}``
                                            ``metrics.groups.group_mean``: rescale each group, then
                                            average, weighted by task count, equally, or by ``weights``
- ``normalized: {merged: r, base: r, expert: r}``   ``(merged - base) / (expert - base)``
- ``normalized_mean: {merged: [..], base: [..], expert: [..]}``  mean of the pairwise normalized scores
- ``macro_gain`` / ``macro_og: {merged: [..], constituents: [[..], ..], scale: fraction|percent}``

Every kind but ``expr`` is monotone in each input separately, so
``numbers.corner_range`` bounds it exactly under the inputs' rounding; ``expr``
is bounded by interval arithmetic (exact when each name occurs once).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergeval.core.errors import UserError
from mergeval.metrics.aggregates import macro_gain, macro_og, mean_normalized_score, normalized_score
from mergeval.metrics.groups import group_mean
from mergeval.verify.expr import evaluate, parse_expr
from mergeval.verify.numbers import Interval, corner_range

KINDS = ("expr", "mean", "group_mean", "normalized", "normalized_mean", "macro_gain", "macro_og")
Ref = tuple[str, str, str]  # (table, row, column)


@dataclass(frozen=True)
class Formula:
    kind: str
    refs: list[Ref]  # the inputs, in the order ``fn`` takes their values
    fn: Callable[[Sequence[float]], float | None]
    bounds: Callable[[Sequence[Interval]], Interval] | None = None  # default: corner_range of fn
    text: str = ""  # how the report shows it (the expression), else the kind

    def range(self, boxes: Sequence[Interval]) -> Interval:
        """[lo, hi] of the derivation over the inputs' intervals (ValueError where it is undefined)."""
        return self.bounds(boxes) if self.bounds else corner_range(self.fn, boxes)


def parse_formula(raw: Any, field: str, resolve: Callable[[Any, str], Ref]) -> Formula:
    """A Formula from its YAML mapping; ``resolve(raw_ref, field)`` turns a written reference into a Ref.

    Raises UserError naming ``field`` for an unknown kind, a missing or extra
    key, a malformed reference, or inputs the metric function rejects.
    """
    kinds = [k for k in raw if k in KINDS] if isinstance(raw, Mapping) else []
    if len(kinds) != 1 or set(raw) - {kinds[0], "with"} or ("with" in raw and kinds[0] != "expr"):
        raise UserError(
            field,
            f"a derivation needs exactly one of {', '.join(KINDS)} (and with: only beside expr)",
            'write e.g. {mean: [colA, colB]} or {expr: "(a + 2*b) / 3"}',
        )
    kind, body = kinds[0], raw[kinds[0]]
    if kind == "expr":
        return _expr(body, raw.get("with"), f"{field}.expr", resolve)
    field = f"{field}.{kind}"
    formula = _BUILDERS[kind](body, field, resolve)
    try:  # a dry run on neutral inputs catches what the metric function itself rejects
        formula.fn([float(i % 7 + 1) for i in range(len(formula.refs))])
    except ValueError as err:
        raise UserError(field, str(err), "fix the derivation's inputs") from None
    return Formula(kind, formula.refs, formula.fn, text=kind)


def _expr(text: Any, bindings: Any, field: str, resolve) -> Formula:
    """An expression whose names are bound by ``with`` or else resolved as bare names (a column of the row)."""
    if not isinstance(text, str) and not isinstance(text, (int, float)):
        raise UserError(field, f"{text!r} is not an expression", 'write e.g. expr: "(a + 2*b) / 3"')
    try:
        expr = parse_expr(str(text))
    except ValueError as err:
        raise UserError(field, str(err), "write arithmetic over names, e.g. (9*a + `ARC-C`) / 10") from None
    if bindings is not None and not isinstance(bindings, Mapping):
        raise UserError(f"{field}.with", "must map names to cell references", "write with: {b: [base, Avg]}")
    bindings = {str(k): v for k, v in (bindings or {}).items()}
    unused = set(bindings) - set(expr.names)
    if unused:
        raise UserError(
            f"{field}.with",
            f"binds {sorted(unused)}, which {text!r} does not use",
            "remove them or use them in the expression",
        )
    refs = [resolve(bindings[n], f"{field}.with.{n}") if n in bindings else resolve(n, field) for n in expr.names]

    def bounds(boxes: Sequence[Interval]) -> Interval:
        return evaluate(expr, dict(zip(expr.names, boxes)))

    def fn(xs: Sequence[float]) -> float:
        return bounds([(x, x) for x in xs])[0]

    return Formula("expr", refs, fn, bounds, str(text))


def _refs(raw: Any, field: str, resolve) -> list[Ref]:
    if not isinstance(raw, list) or not raw:
        raise UserError(field, "needs a non-empty list of cell references", "write e.g. [colA, colB]")
    return [resolve(r, f"{field}[{i}]") for i, r in enumerate(raw)]


def _keys(body: Any, field: str, required: set[str], optional: Collection[str] = frozenset()) -> Mapping:
    if not isinstance(body, Mapping):
        raise UserError(field, "must be a mapping", f"give the keys {sorted(required)}")
    missing, extra = required - set(body), set(body) - required - set(optional)
    if missing or extra:
        raise UserError(
            field,
            f"missing keys {sorted(missing)}, unknown keys {sorted(extra)}",
            f"use the keys {sorted(required)} (optional: {sorted(optional)})",
        )
    return body


def _mean(body, field, resolve) -> Formula:
    refs = _refs(body, field, resolve)
    keys = [str(i) for i in range(len(refs))]
    return Formula("mean", refs, lambda xs: group_mean(dict(zip(keys, xs)), {"mean": keys}))


def _group_mean(body, field, resolve) -> Formula:
    body = _keys(body, field, {"groups"}, {"scale", "weighting", "weights"})
    groups = body["groups"]
    if not isinstance(groups, Mapping) or not groups:
        raise UserError(
            f"{field}.groups",
            "needs a non-empty mapping group -> cell references",
            "write e.g. {groups: {a: [colA], b: [colB]}}",
        )
    refs: list[Ref] = []
    keyed: dict[str, list[str]] = {}
    for g, group_refs in groups.items():
        start = len(refs)
        refs += _refs(group_refs, f"{field}.groups.{g}", resolve)
        keyed[str(g)] = [str(i) for i in range(start, len(refs))]
    scale, weighting, weights = body.get("scale"), body.get("weighting", "tasks"), body.get("weights")
    for name, value in (("scale", scale), ("weights", weights)):
        if value is not None and not isinstance(value, Mapping):
            raise UserError(f"{field}.{name}", "must map group names to numbers", f"write e.g. {{{name}: {{a: 1}}}}")

    def fn(xs):
        return group_mean({str(i): x for i, x in enumerate(xs)}, keyed, scale, weighting, weights)

    return Formula("group_mean", refs, fn)


def _normalized(body, field, resolve) -> Formula:
    body = _keys(body, field, {"merged", "base", "expert"})
    refs = [resolve(body[k], f"{field}.{k}") for k in ("merged", "base", "expert")]
    return Formula("normalized", refs, lambda xs: normalized_score(xs[0], xs[1], xs[2]))


def _normalized_mean(body, field, resolve) -> Formula:
    body = _keys(body, field, {"merged", "base", "expert"})
    parts = [_refs(body[k], f"{field}.{k}", resolve) for k in ("merged", "base", "expert")]
    n = len(parts[0])
    if any(len(p) != n for p in parts):
        raise UserError(field, "merged, base and expert need the same number of cells", "align them pairwise")

    def fn(xs):
        return mean_normalized_score(normalized_score(xs[i], xs[n + i], xs[2 * n + i]) for i in range(n))

    return Formula("normalized_mean", parts[0] + parts[1] + parts[2], fn)


def _macro(kind: str, metric):
    def build(body, field, resolve) -> Formula:
        body = _keys(body, field, {"merged", "constituents"}, {"scale"})
        merged = _refs(body["merged"], f"{field}.merged", resolve)
        if not isinstance(body["constituents"], list) or not body["constituents"]:
            raise UserError(
                f"{field}.constituents", "needs a list of lists of cell references", "write e.g. [[a1, a2], [b1, b2]]"
            )
        constituents = [_refs(c, f"{field}.constituents[{i}]", resolve) for i, c in enumerate(body["constituents"])]
        scale = body.get("scale", "fraction")
        sizes = [len(merged)] + [len(c) for c in constituents]

        def fn(xs):
            cut, start = [], 0
            for size in sizes:
                cut.append(list(xs[start : start + size]))
                start += size
            return metric(cut[0], cut[1:], scale=scale)

        return Formula(kind, merged + [r for c in constituents for r in c], fn)

    return build


_BUILDERS = {
    "mean": _mean,
    "group_mean": _group_mean,
    "normalized": _normalized,
    "normalized_mean": _normalized_mean,
    "macro_gain": _macro("macro_gain", macro_gain),
    "macro_og": _macro("macro_og", macro_og),
}
