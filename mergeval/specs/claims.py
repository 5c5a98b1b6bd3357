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
      stderr_margin: 2                     # optional, >= 0, in combined standard errors

Operands:

- a number: ``0.8``
- a published cell: ``{table: T, row: R, col: C}`` (the value as printed)
- a run score: ``{score: {task: T, role: R}}``: ``scores[T][R].acc`` of a result.json
  (a fraction), with its stderr
- a run metric: ``{metric: M, role: R}``: a metric of the spec's ``metrics``
  (see ``runs.py``; ``role`` defaults to ``merged``), or an aggregate of the
  run: ``macro_gain``, ``macro_og`` (in the run's ``metric.scale``),
  ``normalized_mean`` or ``normalized.<task>`` (no ``role``)

A run operand may add ``where`` (overriding the claim's; keys in ``runs.py``)
and ``over_runs: min | max | mean | range | std``, which reduces the operand
over every matching run (``range`` and ``std`` need two or more runs; a
reduced value has no stderr).

Which runs: run operands without ``over_runs`` are evaluated run by run. When
they all select the same runs, the claim is checked once per matching run, the
operands paired within the run; otherwise each must match exactly one run.

Repetition: ``for_each: expert`` checks the claim for every expert of the run
that names its own task, binding ``{expert}`` (its role) and ``{task}`` (its
task) in the operands' strings; ``for_each: {var: [a, b]}`` repeats it for
each listed value of ``{var}``.

Verdict, with l, r the operand values, se = sqrt(se_l^2 + se_r^2) (published
cells and numbers have no stderr), k = stderr_margin, t = tolerance:

    >  / <  : pass iff  d >  k*se - t     where d = l - r  (for <: d = r - l)
    >= / <= : pass iff  d >= k*se - t
    ==      : pass iff  |l - r| <= t + k*se

so the stderr margin makes an inequality stricter ("beats by more than k
stderrs") and the tolerance makes it lenient. A claim whose runs are not there
(no ``--run``, no matching run, a missing score, an undefined aggregate) is
"not run", with the reason.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mergeval.errors import UserError
from mergeval.specs.runs import Measured, NotRun, Run, RunMetric, matches
from mergeval.specs.tables import Table, cell

OPS = (">", ">=", "<", "<=", "==")
REDUCTIONS = ("min", "max", "mean", "range", "std")
AGGREGATES = ("macro_gain", "macro_og", "normalized_mean")  # plus normalized.<task>
_CLAIM_KEYS = {"id", "says", "tags", "where", "for_each", "left", "op", "right", "tolerance", "stderr_margin"}
_ID = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Operand:
    kind: str  # number | cell | score | metric
    number: float | None = None
    ref: tuple[str, str, str] | None = None  # (table, row, col)
    task: str = ""
    role: str = ""
    metric: str = ""
    where: dict | None = None
    over_runs: str | None = None

    @property
    def uses_runs(self) -> bool:
        return self.kind in ("score", "metric")


@dataclass(frozen=True)
class Claim:
    id: str
    says: str
    left: Operand
    op: str
    right: Operand
    tags: tuple[str, ...] = ()
    where: dict = field(default_factory=dict)
    for_each: Any = None  # None | "expert" | {var: [values]}
    tolerance: float = 0.0
    stderr_margin: float = 0.0

    @property
    def uses_runs(self) -> bool:
        return self.left.uses_runs or self.right.uses_runs


@dataclass(frozen=True)
class ClaimResult:
    id: str  # the claim's id, with its repetition (run, expert, variable) in brackets
    says: str
    status: str  # pass | fail | not run
    op: str
    left: Measured | None = None
    right: Measured | None = None
    detail: str = ""
    uses_runs: bool = False


# ---------------------------------------------------------------- verdict

def compare(left: Measured, op: str, right: Measured, tolerance: float = 0.0,
            stderr_margin: float = 0.0) -> tuple[bool, str]:
    """The verdict of one relation (formula in the module docstring) and a short explanation."""
    se = math.hypot(left.stderr, right.stderr)
    if op == "==":
        allowed = tolerance + stderr_margin * se
        diff = abs(left.value - right.value)
        return diff <= allowed, f"|l - r| = {diff:.4g}, allowed {allowed:.4g}"
    d = left.value - right.value if op in (">", ">=") else right.value - left.value
    need = stderr_margin * se - tolerance
    ok = d > need if op in (">", "<") else d >= need
    sym = ">" if op in (">", "<") else ">="
    gap = "l - r" if op in (">", ">=") else "r - l"
    margin = f" ({stderr_margin:g} x se {se:.3g})" if stderr_margin and se else ""
    return ok, f"{gap} = {d:+.4g}, needs {sym} {need:+.4g}{margin}"


# ---------------------------------------------------------------- parsing

def parse_claims(raw: Any, field: str, tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]) -> list[Claim]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise UserError(field, "must be a list of claims", "see mergeval/specs/claims.py")
    claims, seen = [], set()
    for i, body in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(body, Mapping):
            raise UserError(where, "must be a mapping", "see mergeval/specs/claims.py")
        where = f"{field}.{body.get('id', i)}"
        unknown = set(body) - _CLAIM_KEYS
        missing = {"id", "says", "left", "op", "right"} - set(body)
        if unknown or missing:
            raise UserError(where, f"missing keys {sorted(missing)}, unknown keys {sorted(unknown)}",
                            f"a claim has {sorted(_CLAIM_KEYS)}")
        cid = str(body["id"])
        if not _ID.fullmatch(cid) or cid in seen:
            raise UserError(f"{where}.id", f"'{cid}' is not a new identifier",
                            "use a unique name of letters, digits, _")
        seen.add(cid)
        if body["op"] not in OPS:
            raise UserError(f"{where}.op", f"unknown relation {body['op']!r}", f"use one of {' '.join(OPS)}")
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
        for_each = _for_each(body.get("for_each"), f"{where}.for_each")
        left = _operand(body["left"], f"{where}.left", tables, metrics)
        right = _operand(body["right"], f"{where}.right", tables, metrics)
        claim = Claim(cid, str(body["says"]), left, body["op"], right, tuple(tags), claim_where, for_each,
                      numbers["tolerance"], numbers["stderr_margin"])
        _check_templates(claim, where)
        _check_pairing(claim, where)
        _check_expanded_cells(claim, where, tables)
        claims.append(claim)
    return claims


def _where(raw: Any, field: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise UserError(field, "must map config keys to values",
                        "write e.g. {method: ties, method.lambda_: [0.5, 1.0]}")
    return dict(raw)


def _for_each(raw: Any, field: str):
    if raw is None or raw == "expert":
        return raw
    if isinstance(raw, Mapping) and raw and all(isinstance(v, list) and v for v in raw.values()):
        return {str(k): list(v) for k, v in raw.items()}
    raise UserError(field, f"{raw!r} is not a repetition", "use for_each: expert, or {var: [value, ..]}")


def _operand(raw: Any, field: str, tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]) -> Operand:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return Operand("number", number=float(raw))
    if not isinstance(raw, Mapping):
        raise UserError(field, f"{raw!r} is not an operand",
                        "give a number, {table, row, col}, {score: ..} or {metric: ..}")
    keys = set(raw)
    if keys == {"table", "row", "col"}:
        ref = (str(raw["table"]), str(raw["row"]), str(raw["col"]))
        if "{" not in "".join(ref):  # templated references are checked when expanded
            cell(tables, ref, field)
        return Operand("cell", ref=ref)
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
            raise UserError(f"{field}.metric", f"unknown metric '{name}'",
                            f"use one of the spec's metrics {sorted(metrics)} or {', '.join(AGGREGATES)}, "
                            "normalized.<task>")
        if "role" in raw and name not in metrics:
            raise UserError(f"{field}.role", f"'{name}' is an aggregate of the merged model: it takes no role",
                            "drop role, or define a spec metric")
        return Operand("metric", metric=name, role=str(raw.get("role", "merged")), where=where, over_runs=over)
    raise UserError(field, f"unknown operand keys {sorted(keys)}",
                    "give a number, {table, row, col}, {score: {task, role}} or {metric: M} (+ where, over_runs)")


def _strings(claim: Claim) -> list[str]:
    out = []
    for op in (claim.left, claim.right):
        out += [s for s in (*(op.ref or ()), op.task, op.role, op.metric) if s]
        for where in (op.where, claim.where):
            out += [v for v in (where or {}).values() if isinstance(v, str)]
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
            raise UserError(field, f"'{text}' uses an unbound or malformed {{variable}} ({err})",
                            "bind it with for_each, or remove the braces") from None


def _check_expanded_cells(claim: Claim, field: str, tables: Mapping[str, Table]) -> None:
    if not isinstance(claim.for_each, Mapping):
        return
    for values in itertools.product(*claim.for_each.values()):
        binding = dict(zip(claim.for_each, values))
        for op in (claim.left, claim.right):
            if op.kind == "cell":
                cell(tables, tuple(str(_fill(s, binding)) for s in op.ref), field)


def _effective_where(op: Operand, claim: Claim) -> dict:
    return op.where if op.where is not None else claim.where


def _per_run(claim: Claim) -> list[Operand]:
    return [op for op in (claim.left, claim.right) if op.uses_runs and op.over_runs is None]


def _check_pairing(claim: Claim, field: str) -> None:
    if claim.for_each != "expert":
        return
    per_run = _per_run(claim)
    if not per_run:
        raise UserError(f"{field}.for_each", "expert repetition needs an operand read run by run",
                        "drop over_runs from one operand, or drop for_each")
    if any(_effective_where(op, claim) != _effective_where(per_run[0], claim) for op in per_run):
        raise UserError(f"{field}.for_each", "expert repetition needs its run operands to select the same runs",
                        "give both operands the same where (or put it on the claim)")


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
    return Measured(float(node))


def _reduce(how: str, values: list[float]) -> float:
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "mean":
        return math.fsum(values) / len(values)
    if how == "range":
        return max(values) - min(values)
    return statistics.stdev(values)


def _select(runs: list[Run], where: dict) -> list[Run]:
    return [r for r in runs if matches(r, where)]


def _describe(where: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in where.items()) + "}" if where else "{}"


def _operand_value(op: Operand, claim: Claim, run: Run | None, runs: list[Run], binding: Mapping[str, Any],
                   tables: Mapping[str, Table], metrics: Mapping[str, RunMetric]) -> Measured:
    if op.kind == "number":
        return Measured(op.number)
    if op.kind == "cell":
        ref = tuple(str(_fill(s, binding)) for s in op.ref)
        printed = cell(tables, ref, f"claims.{claim.id}")
        return Measured(printed.value, text=printed.text)
    where = _bind_where(_effective_where(op, claim), binding)
    if op.over_runs is None:
        if run is None:
            raise RuntimeError(f"claim {claim.id}: a per-run operand reached evaluation without its run")
        return _value_in_run(op, run, binding, metrics)
    chosen = _select(runs, where)
    need = 2 if op.over_runs in ("range", "std") else 1
    if len(chosen) < need:
        raise NotRun(f"{op.over_runs} over runs {_describe(where)} needs {need}+ runs, {len(chosen)} match")
    return Measured(_reduce(op.over_runs, [_value_in_run(op, r, binding, metrics).value for r in chosen]))


def evaluate_claim(claim: Claim, runs: list[Run] | None, tables: Mapping[str, Table],
                   metrics: Mapping[str, RunMetric]) -> list[ClaimResult]:
    """Every repetition of one claim; ``runs=None`` means no run results were given."""
    results = []
    static = claim.for_each if isinstance(claim.for_each, Mapping) else {}
    names = list(static)
    for values in itertools.product(*static.values()) if static else [()]:
        binding = dict(zip(names, values))
        tag = "".join(f"[{v}]" for v in values)
        if not claim.uses_runs:
            results.append(_judge(claim, claim.id + tag, None, [], binding, tables, metrics))
        elif runs is None:
            results.append(ClaimResult(claim.id + tag, claim.says, "not run", claim.op,
                                       detail="no run results given (--run)", uses_runs=True))
        else:
            results += _over_instances(claim, tag, runs, binding, tables, metrics)
    return results


def _over_instances(claim, tag, runs, binding, tables, metrics) -> list[ClaimResult]:
    per_run = _per_run(claim)
    wheres = [_bind_where(_effective_where(op, claim), binding) for op in per_run]
    if not per_run:
        instances: list[Run | None] = [None]
    elif all(w == wheres[0] for w in wheres):
        instances = _select(runs, wheres[0])
        if not instances:
            return [ClaimResult(claim.id + tag, claim.says, "not run", claim.op, uses_runs=True,
                                detail=f"no run matches {_describe(wheres[0])}")]
    else:  # operands reading different runs: each must name exactly one
        for w in wheres:
            n = len(_select(runs, w))
            if n != 1:
                return [ClaimResult(claim.id + tag, claim.says, "not run", claim.op, uses_runs=True,
                                    detail=f"{n} runs match {_describe(w)}; an operand without over_runs needs 1")]
        instances = [None]
    results = []
    for run in instances:
        suffix = tag + (f"[{run.short}]" if run is not None and len(instances) > 1 else "")
        if claim.for_each == "expert":
            experts = run.experts() if run is not None else []
            if not experts:
                results.append(ClaimResult(claim.id + suffix, claim.says, "not run", claim.op, uses_runs=True,
                                           detail="the run has no expert with its own task"))
            for role, task in experts:
                results.append(_judge(claim, f"{claim.id}{suffix}[{role}]", run, runs,
                                      dict(binding, expert=role, task=task), tables, metrics))
        else:
            results.append(_judge(claim, claim.id + suffix, run, runs, binding, tables, metrics))
    return results


def _judge(claim, cid, run, runs, binding, tables, metrics) -> ClaimResult:
    try:
        lone = {id(op): _select(runs, _bind_where(_effective_where(op, claim), binding))[0]
                for op in _per_run(claim) if run is None}
        left = _operand_value(claim.left, claim, lone.get(id(claim.left), run), runs, binding, tables, metrics)
        right = _operand_value(claim.right, claim, lone.get(id(claim.right), run), runs, binding, tables, metrics)
    except NotRun as reason:
        return ClaimResult(cid, claim.says, "not run", claim.op, detail=str(reason), uses_runs=claim.uses_runs)
    ok, detail = compare(left, claim.op, right, claim.tolerance, claim.stderr_margin)
    return ClaimResult(cid, claim.says, "pass" if ok else "fail", claim.op, left, right, detail, claim.uses_runs)
