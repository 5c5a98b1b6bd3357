"""The claim language: relations between published numbers and run results.

A claim (one item of a spec's ``claims`` list)::

    - id: cmm_beats_ta                     # unique; letters, digits, _
      says: CMM's overall score is above TA's      # the paper's statement, in words
      tags: [ci]                           # optional: select claims with --tag
      where: {modelset: cmm_chem}          # optional: default run selection for the operands
      for_each: expert                     # optional: see "Repetition"
      left:  {where: {method: cmm}, metric: overall}
      op: ">"                              # >  >=  <  <=  ==
      right: {where: {method: task_arithmetic}, metric: overall}
      tolerance: 0.5                       # optional, >= 0, lenient, in the operands' units
      stderr_margin: 2                     # optional, >= 0, in (paired) standard errors of l - r
      requires: [experts_learn]            # optional: preconditions (see "Untestable")

Operands:

- a number: ``0.8``
- a published cell: ``{table: T, row: R, col: C}`` (the value as printed, known to its rounding interval)
- the largest / smallest cell of a line: ``{max: {table: T, col: C, except: [R]}}``,
  ``{min: {table: T, row: R}}`` (``quantified.py``)
- a run score: ``{score: {task: T, role: R}}``: ``scores[T][R].acc`` of a result.json
  (a fraction), with its stderr
- a run metric: ``{metric: M, role: R}``: a metric of the spec's ``metrics``
  (see ``runs.py``; ``role`` defaults to ``merged``), or an aggregate of the
  run: ``macro_gain``, ``macro_og`` (in the run's ``metric.scale``, with the stderr that follows from
  the task stderrs: ``Run.aggregate_stderr``),
  ``normalized_mean`` or ``normalized.<task>`` (no ``role``)

A run operand may add ``where`` (overriding the claim's; keys in ``runs.py``)
and ``over_runs: min | max | mean | range | std``, which reduces the operand
over every matching run (``range`` and ``std`` need two or more runs). A
reduced value keeps a stderr where one follows from the runs' own: ``min`` /
``max`` the chosen run's, ``range`` = max - min that of a difference,
sqrt(se_max^2 + se_min^2), ``mean`` sqrt(sum se_i^2) / n (runs scored
independently); ``std`` has none.

Which runs: run operands without ``over_runs`` are evaluated run by run. When
they all select the same runs, the claim is checked once per matching run, the
operands paired within the run; otherwise each must match exactly one run.

Instead of left/op/right a claim can rank a line of a table (``quantified.py``)::

    argmax: {table: T, col: Avg}     is: CMM       # CMM has the highest Avg of all rows
    argmin: {table: T, col: Avg}     is: Base
    rank: {table: T, col: Overall}   first: CMM   last: TA    # (best: low when lower is better)

Repetition: ``for_each: expert`` checks the claim for every expert of the run
that names its own task, binding ``{expert}`` (its role) and ``{task}`` (its
task) in the operands' strings; ``for_each: {var: [a, b]}`` repeats it for
each listed value of ``{var}``; ``for_each: {var: {rows: T, except: [..]}}``
(or ``columns: T``) for every row (column) of table T as it stands.

Verdict, with l, r the operand values, se the standard error of l - r,
k = stderr_margin, t = tolerance. Two run values are compared paired: se is
taken item by item over the outcomes both were computed from (models scored on
the same items; metrics/paired.py), which is what lets a small benchmark tell
two similar models apart; where outcomes are not kept it is sqrt(se_l^2 +
se_r^2), and against a published cell or a number it is the run value's own:

    >  / <  : pass iff  d >  k*se - t     where d = l - r  (for <: d = r - l)
    >= / <= : pass iff  d >= k*se - t
    ==      : pass iff  |l - r| <= t + k*se

so the stderr margin makes an inequality stricter ("beats by more than k
stderrs") and the tolerance makes it lenient. A published cell is known only
to its rounding interval, so d is known only to [d_lo, d_hi] (for >: l_lo -
r_hi .. l_hi - r_lo). The verdict is "pass" when the relation holds for every
d there, "fail" when it holds for none, and "undetermined" (by rounding) when
it holds for some: the printed numbers cannot settle it. A claim whose runs
are not there (no ``--run``, no matching run, a missing score, an undefined
aggregate) is "not run", with the reason.

Untestable: a finding about merges means something only where its
preconditions hold (each expert learned its skill; there is forgetting to
measure). A claim lists them by id under ``requires``; a result of it is
"untestable" unless every result of each required claim for the same
repetition (the same values of the variables both bind) passes, at its own
stated margin: its result on the same run where it was checked on that run,
else its results wherever they were (a precondition on a sweep's experts is
checked on one of its runs). Its detail names the
precondition that did not hold. Required claims are evaluated with the claims
that need them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mergeval.core.errors import UserError
from mergeval.metrics.paired import paired_stderr, total
from mergeval.verify.numbers import show_interval
from mergeval.verify.quantified import Line, extreme, members, parse_line, quantifier_values, rank_verdict
from mergeval.verify.runs import Measured, NotRun, Run, RunMetric, matches
from mergeval.verify.tables import Table, cell_interval, find_cell, match_name, name_text

OPS = (">", ">=", "<", "<=", "==")
REDUCTIONS = ("min", "max", "mean", "range", "std")
AGGREGATES = ("macro_gain", "macro_og", "normalized_mean")  # plus normalized.<task>
_CLAIM_KEYS = {
    "id",
    "says",
    "tags",
    "where",
    "for_each",
    "left",
    "op",
    "right",
    "tolerance",
    "stderr_margin",
    "requires",
    "argmax",
    "argmin",
    "is",
    "rank",
    "first",
    "last",
    "best",
}
_RANK_FORMS = {"argmax": {"is"}, "argmin": {"is"}, "rank": {"first", "last", "best"}}
_ID = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Operand:
    kind: str  # number | cell | max | min | score | metric
    number: float | None = None
    ref: tuple[str, str, str] | None = None  # (table, row, col)
    line: Line | None = None  # for max | min
    task: str = ""
    role: str = ""
    metric: str = ""
    where: dict | None = None
    over_runs: str | None = None

    @property
    def uses_runs(self) -> bool:
        return self.kind in ("score", "metric")


@dataclass(frozen=True)
class Rank:
    """A ranking claim: ``who`` holds ``place`` (first | last) in ``line``; ``best`` high: larger is better."""

    line: Line
    places: tuple[tuple[str, str], ...]  # (place, who)
    best: str = "high"


@dataclass(frozen=True)
class Claim:
    id: str
    says: str
    left: Operand | None
    op: str
    right: Operand | None
    tags: tuple[str, ...] = ()
    where: dict = field(default_factory=dict)
    for_each: Any = None  # None | "expert" | {var: [values]}
    tolerance: float = 0.0
    stderr_margin: float = 0.0
    rank: Rank | None = None  # a ranking claim has no left/op/right
    requires: tuple[str, ...] = ()  # preconditions: ids of claims that must pass (module docstring)

    @property
    def operands(self) -> list[Operand]:
        return [op for op in (self.left, self.right) if op is not None]

    @property
    def uses_runs(self) -> bool:
        return any(op.uses_runs for op in self.operands)


@dataclass(frozen=True)
class ClaimResult:
    id: str  # the claim's id, with its repetition (run, expert, variable) in brackets
    says: str
    status: str  # pass | fail | undetermined | untestable | not run
    op: str
    left: Measured | None = None
    right: Measured | None = None
    detail: str = ""
    uses_runs: bool = False
    margin: float | None = None  # stderrs from the verdict's threshold (see stderr_units); None: no stderr
    claim: str = ""  # the claim's own id (``id`` adds the repetition)
    run: str | None = None  # the run's path where the result reads one run
    binding: tuple = ()  # the repetition's (variable, value) pairs
    own_margin: float | None = None  # untestable: the margin the claim itself measured (``margin`` is then the
    # precondition's)


# ---------------------------------------------------------------- verdict


def stderr_units(
    left: Measured, op: str, right: Measured, tolerance: float = 0.0, stderr_margin: float = 0.0
) -> float | None:
    """How far a relation on run scores is from its verdict's threshold, in combined stderrs ``se``.

    For ``>``/``>=`` (``<``/``<=`` mirror it, d = r - l): ``(d - need) / se`` with d = l - r and
    need = k*se - t, i.e. ``(d + t) / se - k``; for ``==``: ``(t + k*se - |l - r|) / se``. Positive on the
    pass side, negative on the fail side; a result within 1 of 0 would flip with a one-stderr change in the
    scores, which is why CI enforces only recorded verdicts at least 1 away (verify/recorded.py). None when
    neither operand has a stderr (published cells, numbers): such a verdict does not move with sampling.
    """
    se = combined_stderr(left, right)
    if se == 0:
        return None
    if op == "==":
        return (tolerance + stderr_margin * se - abs(left.value - right.value)) / se
    d = left.value - right.value if op in (">", ">=") else right.value - left.value
    return (d + tolerance) / se - stderr_margin


def combined_stderr(left: Measured, right: Measured) -> float:
    """se of l - r: paired item by item where both are run values (metrics/paired.py), else
    sqrt(se_l^2 + se_r^2) (a published cell or a number has none)."""
    if left.form is not None and right.form is not None:
        return paired_stderr(left.form - right.form)
    return math.hypot(left.stderr, right.stderr)


def compare(
    left: Measured, op: str, right: Measured, tolerance: float = 0.0, stderr_margin: float = 0.0
) -> tuple[str, str]:
    """The verdict of one relation (pass | fail | undetermined; formula in the module docstring) and why."""
    se = combined_stderr(left, right)
    (l_lo, l_hi), (r_lo, r_hi) = left.bounds, right.bounds
    if op == "==":
        allowed = tolerance + stderr_margin * se
        d_lo, d_hi = l_lo - r_hi, l_hi - r_lo
        far = max(abs(d_lo), abs(d_hi))
        near = 0.0 if d_lo <= 0.0 <= d_hi else min(abs(d_lo), abs(d_hi))
        slack = 1e-12 * max(1.0, abs(left.value), abs(right.value))  # float rounding in d_lo, d_hi
        status = "pass" if far <= allowed + slack else "fail" if near > allowed + slack else "undetermined"
        return status, f"|l - r| = {abs(left.value - right.value):.4g}{_within(d_lo, d_hi)}, allowed {allowed:.4g}"
    if op in (">", ">="):
        d, d_lo, d_hi = left.value - right.value, l_lo - r_hi, l_hi - r_lo
    else:
        d, d_lo, d_hi = right.value - left.value, r_lo - l_hi, r_hi - l_lo
    need = stderr_margin * se - tolerance
    if op in (">", "<"):
        status = "pass" if d_lo > need else "fail" if d_hi <= need else "undetermined"
    else:
        status = "pass" if d_lo >= need else "fail" if d_hi < need else "undetermined"
    sym = ">" if op in (">", "<") else ">="
    gap = "l - r" if op in (">", ">=") else "r - l"
    forms = [f for f in (left.form, right.form) if f is not None]
    kind = "paired se" if forms and (forms[0] if len(forms) == 1 else forms[0] - forms[1]).paired else "se"
    margin = f" ({stderr_margin:g} x {kind} {se:.3g})" if stderr_margin and se else ""
    return status, f"{gap} = {d:+.4g}{_within(d_lo, d_hi)}, needs {sym} {need:+.4g}{margin}"


def _within(lo: float, hi: float) -> str:
    return f" (rounding allows {show_interval(lo, hi, signed=True, digits=4)})" if hi > lo else ""


# ---------------------------------------------------------------- parsing


def parse_claims(raw: Any, field: str, tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]) -> list[Claim]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise UserError(field, "must be a list of claims", "see mergeval/verify/claims.py")
    claims, seen = [], set()
    for i, body in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(body, Mapping):
            raise UserError(where, "must be a mapping", "see docs/specs.md")
        where = f"{field}.{body.get('id', i)}"
        cid = str(body.get("id"))
        if "id" not in body or not _ID.fullmatch(cid) or cid in seen:
            raise UserError(
                f"{where}.id", f"'{cid}' is not a new identifier", "use a unique name of letters, digits, _"
            )
        seen.add(cid)
        claims.append(_parse_claim(body, where, tables, metrics))
    for claim in claims:
        for need in claim.requires:
            if need not in seen or need == claim.id:
                raise UserError(
                    f"{field}.{claim.id}.requires",
                    f"'{need}' is not another claim of this spec",
                    f"name claims of the spec ({', '.join(sorted(seen - {claim.id}))[:200]})",
                )
    _order(claims, field)
    return claims


def _order(claims: list[Claim], field: str) -> list[str]:
    """Claim ids with every claim after the claims it requires; a cycle is a UserError."""
    by_id, done, out = {c.id: c for c in claims}, set(), []

    def visit(cid: str, path: tuple[str, ...]) -> None:
        if cid in done:
            return
        if cid in path:
            raise UserError(
                f"{field}.{cid}.requires",
                f"requires itself through {' -> '.join((*path, cid))}",
                "a precondition cannot depend on the claim it guards",
            )
        for need in by_id[cid].requires:
            visit(need, (*path, cid))
        done.add(cid)
        out.append(cid)

    for claim in claims:
        visit(claim.id, ())
    return out


def _parse_claim(body: Mapping, where: str, tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]) -> Claim:
    forms = [k for k in _RANK_FORMS if k in body]
    relation = {"left", "op", "right"}
    allowed = {"id", "says", "tags", "where", "for_each", "requires"} | (
        {forms[0], *_RANK_FORMS[forms[0]]} if len(forms) == 1 else relation | {"tolerance", "stderr_margin"}
    )
    unknown = set(body) - allowed
    missing = ({"says"} | (set() if forms else relation)) - set(body)
    if unknown or missing or len(forms) > 1:
        raise UserError(
            where,
            f"missing keys {sorted(missing)}, keys that do not belong {sorted(unknown)}",
            "a claim has id, says and either left, op, right (+ tolerance, stderr_margin) or one of "
            "argmax/argmin (+ is) or rank (+ first, last, best); optional: tags, where, for_each, "
            "requires",
        )
    numbers = {}
    for key in ("tolerance", "stderr_margin"):
        value = body.get(key, 0.0)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value >= 0):
            raise UserError(f"{where}.{key}", f"must be a number >= 0, got {value!r}", f"set {key}: 0 or more")
        numbers[key] = float(value)
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise UserError(f"{where}.tags", "must be a list of names", "write tags: [ci]")
    claim_where = _where(body.get("where"), f"{where}.where")
    for_each = _for_each(body.get("for_each"), f"{where}.for_each", tables)
    requires = body.get("requires") or []
    if not isinstance(requires, list) or not all(isinstance(r, str) and _ID.fullmatch(r) for r in requires):
        raise UserError(f"{where}.requires", "must be a list of claim ids", "write requires: [experts_learn]")
    common = dict(
        id=str(body["id"]),
        says=str(body["says"]),
        tags=tuple(tags),
        where=claim_where,
        for_each=for_each,
        requires=tuple(requires),
    )
    if forms:
        claim = Claim(left=None, op=forms[0], right=None, rank=_rank(forms[0], body, where), **common)
    else:
        if body["op"] not in OPS:
            raise UserError(f"{where}.op", f"unknown relation {body['op']!r}", f"use one of {' '.join(OPS)}")
        left = _operand(body["left"], f"{where}.left", tables, metrics)
        right = _operand(body["right"], f"{where}.right", tables, metrics)
        claim = Claim(
            left=left,
            op=body["op"],
            right=right,
            tolerance=numbers["tolerance"],
            stderr_margin=numbers["stderr_margin"],
            **common,
        )
    _check_templates(claim, where)
    _check_pairing(claim, where)
    _check_expanded_cells(claim, where, tables)
    return claim


def _rank(form: str, body: Mapping, field: str) -> Rank:
    line = parse_line(body[form], f"{field}.{form}")
    if form == "rank":
        places = tuple((p, _name(body[p])) for p in ("first", "last") if p in body)
        best = body.get("best", "high")
        if not places or best not in ("high", "low"):
            raise UserError(
                field,
                "rank needs first: NAME and/or last: NAME (best: high or low)",
                "write rank: {table: T, col: C}, first: CMM, last: TA",
            )
        return Rank(line, places, best)
    if "is" not in body:
        raise UserError(f"{field}.is", f"{form} needs is: NAME", f"write {form}: {{table: T, col: C}}, is: CMM")
    return Rank(line, (("first" if form == "argmax" else "last", _name(body["is"])),))


def _name(raw: Any) -> str:
    text = name_text(raw)
    return text if text is not None else str(raw)


def _where(raw: Any, field: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise UserError(
            field, "must map config keys to values", "write e.g. {method: ties, method.lambda_: [0.5, 1.0]}"
        )
    return dict(raw)


def _for_each(raw: Any, field: str, tables: Mapping[str, Table]):
    """None | "expert" | {var: [values]}, a table quantifier expanded to the table's names as it stands."""
    if raw is None or raw == "expert":
        return raw
    if isinstance(raw, Mapping) and raw:
        out = {}
        for var, values in raw.items():
            names = quantifier_values(values, tables, f"{field}.{var}")
            out[str(var)] = names if names is not None else values
        if all(isinstance(v, list) and v for v in out.values()):
            return out
    raise UserError(
        field,
        f"{raw!r} is not a repetition",
        "use for_each: expert, {var: [value, ..]} or {var: {rows: TABLE, except: [..]}}",
    )


def _operand(raw: Any, field: str, tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]) -> Operand:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return Operand("number", number=float(raw))
    if not isinstance(raw, Mapping):
        raise UserError(
            field,
            f"{raw!r} is not an operand",
            "give a number, {table, row, col}, {max: ..}, {min: ..}, {score: ..} or {metric: ..}",
        )
    keys = set(raw)
    if keys == {"table", "row", "col"}:
        ref = (str(raw["table"]), _name(raw["row"]), _name(raw["col"]))
        if "{" not in "".join(ref):  # templated references are checked when expanded
            ref = find_cell(tables, ref, field)[0]
        return Operand("cell", ref=ref)
    if keys in ({"max"}, {"min"}):
        how = next(iter(keys))
        return Operand(how, line=parse_line(raw[how], f"{field}.{how}"))
    run_keys = {"where", "over_runs"}
    over = raw.get("over_runs")
    if over is not None and over not in REDUCTIONS:
        raise UserError(f"{field}.over_runs", f"unknown reduction {over!r}", f"use one of {', '.join(REDUCTIONS)}")
    where = _where(raw.get("where"), f"{field}.where") if "where" in raw else None
    if "score" in keys and not keys - run_keys - {"score"}:
        score = raw["score"]
        if not isinstance(score, Mapping) or set(score) != {"task", "role"}:
            raise UserError(f"{field}.score", "needs exactly task and role", "write {score: {task: T, role: base}}")
        return Operand("score", task=str(score["task"]), role=str(score["role"]), where=where, over_runs=over)
    if "metric" in keys and not keys - run_keys - {"metric", "role"}:
        name = str(raw["metric"])
        known = name in metrics or name in AGGREGATES or name.startswith("normalized.")
        if not known:
            raise UserError(
                f"{field}.metric",
                f"unknown metric '{name}'",
                f"use one of the spec's metrics {sorted(metrics)} or {', '.join(AGGREGATES)}, normalized.<task>",
            )
        if "role" in raw and name not in metrics:
            raise UserError(
                f"{field}.role",
                f"'{name}' is an aggregate of the merged model: it takes no role",
                "drop role, or define a spec metric",
            )
        return Operand("metric", metric=name, role=str(raw.get("role", "merged")), where=where, over_runs=over)
    raise UserError(
        field,
        f"unknown operand keys {sorted(keys)}",
        "give a number, {table, row, col}, {max: LINE}, {min: LINE}, {score: {task, role}} or "
        "{metric: M} (+ where, over_runs)",
    )


def _strings(claim: Claim) -> list[str]:
    out = [v for v in claim.where.values() if isinstance(v, str)]
    if claim.rank is not None:
        out += claim.rank.line.strings() + [who for _, who in claim.rank.places]
    for op in claim.operands:
        out += [s for s in (*(op.ref or ()), op.task, op.role, op.metric, *(op.line.strings() if op.line else ())) if s]
        out += [v for v in (op.where or {}).values() if isinstance(v, str)]
    return out


def _variables(claim: Claim) -> dict[str, str]:
    if claim.for_each == "expert":
        return {"expert": "x", "task": "x"}
    return {k: "x" for k in (claim.for_each or {})}


def _check_templates(claim: Claim, field: str) -> None:
    for text in _strings(claim):
        try:
            text.format_map(_variables(claim))
        except (KeyError, ValueError, IndexError) as err:
            raise UserError(
                field,
                f"'{text}' uses an unbound or malformed {{variable}} ({err})",
                "bind it with for_each, or remove the braces",
            ) from None


def _check_expanded_cells(claim: Claim, field: str, tables: Mapping[str, Table]) -> None:
    """Every table reference of every static repetition names real cells (a typo fails at load)."""
    static = claim.for_each if isinstance(claim.for_each, Mapping) else {}
    if claim.for_each == "expert":  # bound only by a run's experts
        return
    for values in itertools.product(*static.values()) if static else [()]:
        binding = dict(zip(static, values))

        def filled(s: str, binding: Mapping[str, Any] = binding) -> str:
            return str(_fill(s, binding))

        for op in claim.operands:
            if op.kind == "cell":
                assert op.ref is not None, "a cell operand has its reference"
                find_cell(tables, tuple(str(_fill(s, binding)) for s in op.ref), field)
            elif op.line is not None:
                members(op.line.fill(filled), tables, f"{field}.{op.kind}")
        if claim.rank is not None:
            _rank_members(claim, claim.rank, binding, tables, field)


def _rank_members(claim: Claim, rank: Rank, binding: Mapping[str, Any], tables: Mapping[str, Table], field: str):
    """The ranked line's cells and the (place, who) to check, names matched; UserError for an unknown who."""
    cells = members(rank.line.fill(lambda s: str(_fill(s, binding))), tables, f"{field}.{claim.op}")
    places = []
    for place, who in rank.places:
        name = match_name([c[0] for c in cells], str(_fill(who, binding)))
        if name is None:
            key = "is" if claim.op != "rank" else place
            raise UserError(
                f"{field}.{key}",
                f"{who!r} is not in {rank.line.describe()}",
                f"use one of {[c[0] for c in cells]} (rows of derived_rows and columns of derived are "
                "summaries, not ranked)",
            )
        places.append((place, name))
    return cells, places


def _effective_where(op: Operand, claim: Claim) -> dict:
    return op.where if op.where is not None else claim.where


def _per_run(claim: Claim) -> list[Operand]:
    return [op for op in claim.operands if op.uses_runs and op.over_runs is None]


def _check_pairing(claim: Claim, field: str) -> None:
    if claim.for_each != "expert":
        return
    per_run = _per_run(claim)
    if not per_run:
        raise UserError(
            f"{field}.for_each",
            "expert repetition needs an operand read run by run",
            "drop over_runs from one operand, or drop for_each",
        )
    if any(_effective_where(op, claim) != _effective_where(per_run[0], claim) for op in per_run):
        raise UserError(
            f"{field}.for_each",
            "expert repetition needs its run operands to select the same runs",
            "give both operands the same where (or put it on the claim)",
        )


# ---------------------------------------------------------------- evaluation


def _fill(value: Any, binding: Mapping[str, Any]) -> Any:
    """Substitute {variables}; a string that is exactly one "{var}" takes the bound value itself (a number stays one)."""
    if not isinstance(value, str):
        return value
    whole = re.fullmatch(r"\{(\w+)\}", value)
    if whole and whole.group(1) in binding:
        return binding[whole.group(1)]
    return value.format_map(binding)


def _bind_where(where: dict, binding: Mapping[str, Any]) -> dict:
    return {k: _fill(v, binding) for k, v in where.items()}


def _value_in_run(op: Operand, run: Run, binding: Mapping[str, Any], metrics: Mapping[str, RunMetric]) -> Measured:
    if op.kind == "score":
        return run.score(str(_fill(op.task, binding)), str(_fill(op.role, binding)))
    name = str(_fill(op.metric, binding))
    if name in metrics:
        return metrics[name].measure(run, str(_fill(op.role, binding)))
    node: Any = run.aggregates
    for part in name.split(".", 1) if name.startswith("normalized.") else [name]:
        if not isinstance(node, Mapping) or part not in node:
            raise NotRun(f"{run.label} has no aggregate '{name}'")
        node = node[part]
    if node is None or isinstance(node, bool) or not isinstance(node, (int, float)):
        raise NotRun(f"{run.label}: aggregate '{name}' is undefined ({node!r})")
    form = run.aggregate_form(name)  # macro_gain / macro_og: a combination of the task scores
    return Measured(float(node)) if form is None else Measured.linear(float(node), form)


def _reduce(how: str, measured: list[Measured]) -> Measured:
    """One value over runs, with the stderr that follows from the runs' own (module docstring)."""
    values = [m.value for m in measured]
    low = min(measured, key=lambda m: m.value)
    high = max(measured, key=lambda m: m.value)
    forms = [m.form for m in measured if m.form is not None]
    if how in ("min", "max"):
        return low if how == "min" else high
    if how == "std":
        return Measured(statistics.stdev(values))
    value = math.fsum(values) / len(values) if how == "mean" else high.value - low.value
    if len(forms) < len(measured):  # no combination to pair: the runs taken as scored independently
        se = (
            math.sqrt(math.fsum(m.stderr**2 for m in measured)) / len(values)
            if how == "mean"
            else math.hypot(high.stderr, low.stderr)
        )
        return Measured(value, se)
    return Measured.linear(value, total(forms) * (1.0 / len(forms)) if how == "mean" else high.run_form - low.run_form)


def _select(runs: list[Run], where: dict) -> list[Run]:
    return [r for r in runs if matches(r, where)]


def _describe(where: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in where.items()) + "}" if where else "{}"


def _operand_value(
    op: Operand,
    claim: Claim,
    run: Run | None,
    runs: list[Run],
    binding: Mapping[str, Any],
    tables: Mapping[str, Table],
    metrics: Mapping[str, RunMetric],
) -> Measured:
    if op.kind == "number":
        assert op.number is not None, "a number operand has its value"
        return Measured(op.number)
    if op.kind == "cell":
        assert op.ref is not None, "a cell operand has its reference"
        ref, printed = find_cell(tables, tuple(str(_fill(s, binding)) for s in op.ref), f"claims.{claim.id}")
        lo, hi = cell_interval(tables, ref)
        return Measured(printed.value, text=printed.text, lo=lo, hi=hi)
    if op.kind in ("max", "min"):
        assert op.line is not None, "a max or min operand has its line"
        return extreme(op.kind, members(op.line.fill(lambda s: str(_fill(s, binding))), tables, f"claims.{claim.id}"))
    where = _bind_where(_effective_where(op, claim), binding)
    if op.over_runs is None:
        if run is None:
            raise RuntimeError(f"claim {claim.id}: a per-run operand reached evaluation without its run")
        return _value_in_run(op, run, binding, metrics)
    chosen = _select(runs, where)
    need = 2 if op.over_runs in ("range", "std") else 1
    if len(chosen) < need:
        raise NotRun(f"{op.over_runs} over runs {_describe(where)} needs {need}+ runs, {len(chosen)} match")
    return _reduce(op.over_runs, [_value_in_run(op, r, binding, metrics) for r in chosen])


def label(cid: str, parts: list[str]) -> str:
    """A result's name: the claim id, then its repetition readably: ``best_avg (model=[0.4,0.7], run 0: ties)``."""
    return f"{cid} ({', '.join(parts)})" if parts else cid


def _show(value: Any) -> str:
    text = name_text(value)
    return text if text is not None else str(value)


def evaluate_claims(
    claims: list[Claim],
    selected: list[Claim],
    runs: list[Run] | None,
    tables: Mapping[str, Table],
    metrics: Mapping[str, RunMetric],
) -> list[ClaimResult]:
    """The results of the ``selected`` claims and of every claim they require (in the spec's order), each made
    "untestable" where a precondition does not hold (module docstring)."""
    by_id = {c.id: c for c in claims}
    wanted: set[str] = set()
    stack = [c.id for c in selected]
    while stack:
        cid = stack.pop()
        if cid not in wanted:
            wanted.add(cid)
            stack += by_id[cid].requires
    got: dict[str, list[ClaimResult]] = {}
    for cid in _order([c for c in claims if c.id in wanted], "claims"):  # preconditions first
        got[cid] = [_gate(r, by_id[cid], got) for r in evaluate_claim(by_id[cid], runs, tables, metrics)]
    return [r for c in claims if c.id in wanted for r in got[c.id]]


def _gate(result: ClaimResult, claim: Claim, got: Mapping[str, list[ClaimResult]]) -> ClaimResult:
    """``result``, or "untestable" when a result of a required claim on its run and repetition does not pass.
    Its margin is then the precondition's (how far that is from holding), so a record enforces it as firmly."""
    if result.status == "not run" or not claim.requires:
        return result
    for need in claim.requires:
        mine = dict(result.binding)
        related = [p for p in got[need] if all(mine.get(k, v) == v for k, v in p.binding)]
        # on the same run where the precondition was checked on it; else wherever it was (the experts of a
        # sweep are the same in all its runs, and a precondition on them is checked on one)
        here = [p for p in related if p.run is not None and p.run == result.run]
        related = here or related
        failing = [p for p in related if p.status != "pass"]
        if not related or failing:
            why = (
                f"precondition {need} has no result here"
                if not related
                else f"precondition {failing[0].id} is {failing[0].status}"
                + (f" ({failing[0].margin:+.2f} se)" if failing[0].margin is not None else "")
            )
            return dataclasses.replace(
                result,
                status="untestable",
                detail=f"{why}; as measured: {result.status}, {result.detail}",
                margin=failing[0].margin if failing else None,
                own_margin=result.margin,
            )
    return result


def evaluate_claim(
    claim: Claim, runs: list[Run] | None, tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]
) -> list[ClaimResult]:
    """Every repetition of one claim; ``runs=None`` means no run results were given."""
    results = []
    static = claim.for_each if isinstance(claim.for_each, Mapping) else {}
    names = list(static)
    for values in itertools.product(*static.values()) if static else [()]:
        binding = dict(zip(names, values))
        parts = [f"{k}={_show(v)}" for k, v in binding.items()]
        if claim.rank is not None:
            results += _judge_rank(claim, parts, binding, tables)
        elif not claim.uses_runs:
            results.append(_judge(claim, label(claim.id, parts), None, [], binding, tables, metrics))
        elif runs is None:
            results.append(
                ClaimResult(
                    label(claim.id, parts),
                    claim.says,
                    "not run",
                    claim.op,
                    detail="no run results given (--run)",
                    uses_runs=True,
                )
            )
        else:
            results += _over_instances(claim, parts, runs, binding, tables, metrics)
    return results


def _over_instances(claim, parts, runs, binding, tables, metrics) -> list[ClaimResult]:
    per_run = _per_run(claim)
    wheres = [_bind_where(_effective_where(op, claim), binding) for op in per_run]
    if not per_run:
        instances: Sequence[Run | None] = [None]
    elif all(w == wheres[0] for w in wheres):
        instances = _select(runs, wheres[0])
        if not instances:
            return [
                ClaimResult(
                    label(claim.id, parts),
                    claim.says,
                    "not run",
                    claim.op,
                    uses_runs=True,
                    detail=f"no run matches {_describe(wheres[0])}",
                )
            ]
    else:  # operands reading different runs: each must name exactly one
        for w in wheres:
            n = len(_select(runs, w))
            if n != 1:
                return [
                    ClaimResult(
                        label(claim.id, parts),
                        claim.says,
                        "not run",
                        claim.op,
                        uses_runs=True,
                        detail=f"{n} runs match {_describe(w)}; an operand without over_runs needs 1",
                    )
                ]
        instances = [None]
    results = []
    for run in instances:
        here = parts + ([run.short] if run is not None and len(instances) > 1 else [])
        if claim.for_each == "expert":
            experts = run.experts() if run is not None else []
            if not experts:
                results.append(
                    ClaimResult(
                        label(claim.id, here),
                        claim.says,
                        "not run",
                        claim.op,
                        uses_runs=True,
                        detail="the run has no expert with its own task",
                    )
                )
            for role, task in experts:
                results.append(
                    _judge(
                        claim,
                        label(claim.id, here + [f"expert={role}"]),
                        run,
                        runs,
                        dict(binding, expert=role, task=task),
                        tables,
                        metrics,
                    )
                )
        else:
            results.append(_judge(claim, label(claim.id, here), run, runs, binding, tables, metrics))
    return results


def _judge(claim, cid, run, runs, binding, tables, metrics) -> ClaimResult:
    try:
        lone = {
            id(op): _select(runs, _bind_where(_effective_where(op, claim), binding))[0]
            for op in _per_run(claim)
            if run is None
        }
        left = _operand_value(claim.left, claim, lone.get(id(claim.left), run), runs, binding, tables, metrics)
        right = _operand_value(claim.right, claim, lone.get(id(claim.right), run), runs, binding, tables, metrics)
    except NotRun as reason:
        return ClaimResult(
            cid, claim.says, "not run", claim.op, detail=str(reason), uses_runs=claim.uses_runs, claim=claim.id
        )
    status, detail = compare(left, claim.op, right, claim.tolerance, claim.stderr_margin)
    return ClaimResult(
        cid,
        claim.says,
        status,
        claim.op,
        left,
        right,
        detail,
        claim.uses_runs,
        stderr_units(left, claim.op, right, claim.tolerance, claim.stderr_margin),
        claim=claim.id,
        run=None if run is None else run.path,
        binding=tuple((k, str(v)) for k, v in binding.items() if k != "task"),
    )


def _judge_rank(
    claim: Claim, parts: list[str], binding: Mapping[str, Any], tables: Mapping[str, Table]
) -> list[ClaimResult]:
    """One result per stated place: the named row (column) is first / last of the line (quantified.rank_verdict)."""
    assert claim.rank is not None, "a ranking claim"
    cells, places = _rank_members(claim, claim.rank, binding, tables, f"claims.{claim.id}")
    results = []
    for place, who in places:
        status, detail, mine, rival = rank_verdict(cells, who, place, claim.rank.best)
        here = parts + ([f"{place}={who}"] if len(places) > 1 else [])
        results.append(
            ClaimResult(label(claim.id, here), claim.says, status, f"{place} of {len(cells)}, vs", mine, rival, detail)
        )
    return results
