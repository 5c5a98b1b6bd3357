"""Run results (``result.json``) as claims see them: selection, scores, metrics.

- ``load_runs``: result.json files, or directories searched for them (a sweep's
  ``multirun/<date>/<time>/``).
- ``matches``: a run against a ``where`` mapping. Keys are dotted paths into the
  run's ``config`` (``method.lambda_``, ``benchmark.n_items``), plus shorthands
  ``method`` / ``modelset`` / ``benchmark`` (their ``name``) and ``n_experts``
  (the number of experts merged). A list value matches any of its items;
  numbers compare with a relative tolerance of 1e-9.
- ``RunMetric``: a spec's own metric over one role's task scores, built from
  mergeval's metric functions, with its stderr propagated from the tasks'
  (tasks taken as independent):

  ``group_mean: {groups: {g: [task, ..]}, scale: {g: s}, weighting, weights}``
      ``metrics.groups.group_mean`` of the role's accuracies;
      stderr = sqrt(sum_t (c_t * se_t)^2) with c_t its (constant) weight on task t.
  ``mean: {tasks: [..] | null, scale: s}``
      the same with one group; ``tasks: null`` means every task of the run.
  ``forgetting: {tasks: [..] | null, scale: s}``
      ``metrics.groups.forgetting`` mean drop from base to the role;
      ``tasks: null`` means the run's tasks that are no expert's own task;
      stderr = s * sqrt(sum_t (se_base,t^2 + se_role,t^2)) / T.

Every value a run gives is linear in its task scores, and carries that
combination (``Measured.form``, metrics/paired.py) over the run's per-item
outcomes (result.json ``items``): a claim that compares two of them takes the
standard error of their difference item by item, so models scored on the same
items are compared paired. The stderrs above are each value's own (the
independent-task formulas are what ``paired_stderr`` gives for one value).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergeval.core.errors import UserError
from mergeval.core.outcome import score_value
from mergeval.core.paths import result_files_below
from mergeval.metrics.groups import forgetting, group_mean
from mergeval.metrics.paired import Linear, Outcomes, paired_stderr, total

NON_EXPERT_ROLES = ("base", "merged")
_SHORTHANDS = {"method": ("method", "name"), "modelset": ("modelset", "name"), "benchmark": ("benchmark", "name")}


class NotRun(Exception):
    """A claim that these runs cannot evaluate (no matching run, a missing score); the message says why."""


@dataclass(frozen=True)
class Measured:
    """A value a claim compares: a run's (with its stderr) or a published cell's (with its rounding interval)."""

    value: float
    stderr: float = 0.0
    text: str | None = None  # a published cell's value as printed
    lo: float | None = None  # the interval the true value lies in; None = exactly value
    hi: float | None = None
    # a run value's linear combination of per-item outcomes (module docstring); None: a published cell, a number
    form: Linear | None = field(default=None, compare=False)

    @classmethod
    def linear(cls, value: float, form: Linear) -> Measured:
        return cls(value, paired_stderr(form), form=form)

    @property
    def run_form(self) -> Linear:
        """``form`` of a run's value (``Run.score``, a run metric): a published cell or a number has none."""
        assert self.form is not None, "a run's value is a combination of its items"
        return self.form

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.value if self.lo is None else self.lo, self.value if self.hi is None else self.hi)


@dataclass
class Run:
    path: str
    config: dict
    scores: dict
    models: list
    aggregates: dict
    index: int = 0  # position among the runs given, for short references in reports
    items: dict = field(default_factory=dict)  # task -> role -> {"ids", "values"} (result.json ``items``)

    @property
    def short(self) -> str:
        return f"run {self.index}: {self.config.get('method', {}).get('name', '?')}"

    @property
    def label(self) -> str:
        """The method and its scalar hyperparameters, e.g. ``ties(lambda_=0.5, density=0.5)``."""
        method = self.config.get("method", {})
        params = ", ".join(f"{k}={v}" for k, v in method.items() if k != "name" and isinstance(v, (int, float, str)))
        return f"{method.get('name', '?')}({params})"

    def experts(self) -> list[tuple[str, str]]:
        """(role, own task) of every expert that names its own task."""
        return [
            (m["role"], m["task"])
            for m in self.models
            if m.get("role") not in NON_EXPERT_ROLES and m.get("task") is not None
        ]

    def score(self, task: str, role: str) -> Measured:
        try:
            s = self.scores[task][role]
        except KeyError:
            raise NotRun(f"{self.label} has no score for role '{role}' on task '{task}'") from None
        stderr = float(s.get("stderr") or 0.0)
        kept = (self.items.get(task) or {}).get(role) or {}
        outcomes = Outcomes(task, stderr, tuple(kept.get("ids", ())), tuple(kept.get("values", ())))
        # the run's own stderr stands, the items only pair it with others (they agree: s(x)/sqrt(n))
        # keyed by this run object (two runs may share a path in tests; their outcomes pair by item ids anyway)
        return Measured(float(score_value(s)), stderr, form=Linear.of((id(self), role, task), outcomes))

    def aggregate_form(self, name: str) -> Linear | None:
        """``macro_gain`` / ``macro_og`` as a combination of task scores; None for any other aggregate.

        Both are linear in the scores of the T aggregated tasks (the run's tasks but ``excluded``), with the
        merge's weight c/T on each task (c = 100 for scale percent, else 1). Macro-Gain's constituents weigh
        -c/(N T) each; Macro-OG's best constituent (argmax of the task averages, held fixed) weighs -c/T. With
        independent scores: se = (c/T) sqrt(sum_t se_merged,t^2 + sum_i w_i^2 sum_t se_i,t^2), w_i = 1/N or 1;
        paired, the items of each task are combined first (metrics/paired.py).
        """
        agg = self.aggregates
        if name not in ("macro_gain", "macro_og") or not agg.get("constituents"):
            return None
        tasks = [t for t in self.scores if t not in (agg.get("excluded") or {})]
        factor = (100.0 if agg.get("scale") == "percent" else 1.0) / len(tasks)
        roles = list(agg["constituents"])
        if name == "macro_og":
            roles = [max(roles, key=lambda r: sum(self.score(t, r).value for t in tasks))]
        weight = 1.0 / len(roles)
        merged = total([self.score(t, "merged").run_form for t in tasks])
        constituents = total([self.score(t, r).run_form for r in roles for t in tasks])
        return (merged - constituents * weight) * factor

    def aggregate_stderr(self, name: str) -> float:
        """The stderr of ``macro_gain`` / ``macro_og`` (``aggregate_form``), 0 for any other aggregate."""
        form = self.aggregate_form(name)
        return 0.0 if form is None else paired_stderr(form)


def load_runs(paths: list[str]) -> list[Run]:
    """Every result.json named, or found under a named directory (in job order); UserError if unusable."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = result_files_below(path)
            if not found:
                raise UserError("--run", f"no result.json under {given}", "give a run's result.json or its directory")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UserError("--run", f"{given} does not exist", "give a run's result.json or a directory of runs")
    runs = [_load_run(f) for f in files]
    for i, run in enumerate(runs):
        run.index = i
    return runs


def _load_run(path: Path) -> Run:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(
            "--run",
            f"{path} is not readable JSON ({err.__class__.__name__})",
            "give a result.json written by python -m mergeval",
        ) from None
    missing = [k for k in ("config", "scores", "models", "aggregates") if not isinstance(data, dict) or k not in data]
    if missing:
        raise UserError(
            "--run",
            f"{path} is not a mergeval result.json (no {', '.join(missing)})",
            "give a result.json written by python -m mergeval",
        )
    items = data.get("items") if isinstance(data.get("items"), dict) else {}
    return Run(str(path), data["config"], data["scores"], data["models"], data["aggregates"], items=items)


def config_value(run: Run, key: str) -> Any:
    """The value of a where-key in a run (KeyError if the run has none)."""
    if key == "n_experts":
        return len(run.config["modelset"]["experts"])
    node: Any = run.config
    for part in _SHORTHANDS.get(key, tuple(key.split("."))):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def _same(a: Any, b: Any) -> bool:
    numbers = [x for x in (a, b) if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if len(numbers) == 2:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def matches(run: Run, where: Mapping[str, Any]) -> bool:
    for key, wanted in where.items():
        try:
            have = config_value(run, key)
        except KeyError:
            return False
        options = wanted if isinstance(wanted, list) else [wanted]
        if not any(_same(have, w) for w in options):
            return False
    return True


@dataclass(frozen=True)
class RunMetric:
    name: str
    kind: str  # group_mean | mean | forgetting
    body: dict

    def measure(self, run: Run, role: str) -> Measured:
        if self.kind == "forgetting":
            return self._forgetting(run, role)
        if self.kind == "mean":
            tasks = self.body.get("tasks") or list(run.scores)
            groups: dict = {"all": tasks}
            scale: dict | None = {"all": self.body.get("scale", 1.0)}
            weighting, weights = "tasks", None
        else:
            groups, scale = self.body["groups"], self.body.get("scale")
            weighting, weights = self.body.get("weighting", "tasks"), self.body.get("weights")
        tasks = [t for g in groups.values() for t in g]
        got = {t: run.score(t, role) for t in tasks}

        def f(values: Mapping[str, float]) -> float:
            return group_mean(values, groups, scale, weighting, weights)

        acc = {t: m.value for t, m in got.items()}
        value = f(acc)
        # group_mean is linear in the scores: its weight on task t is f(e_t) - f(0)
        zero = f(dict.fromkeys(tasks, 0.0))
        weight = {t: f({u: float(u == t) for u in tasks}) - zero for t in tasks}
        return Measured.linear(value, total([got[t].run_form * weight[t] for t in dict.fromkeys(tasks)]))

    def _forgetting(self, run: Run, role: str) -> Measured:
        own = {task for _, task in run.experts()}
        tasks = self.body.get("tasks") or [t for t in run.scores if t not in own]
        if not tasks:
            raise NotRun(f"{self.label(run)}: no general tasks (every task is an expert's own)")
        base = {t: run.score(t, "base") for t in tasks}
        other = {t: run.score(t, role) for t in tasks}
        scale = float(self.body.get("scale", 1.0))
        drop = forgetting({t: m.value for t, m in base.items()}, {t: m.value for t, m in other.items()})["mean"]
        form = total([base[t].run_form - other[t].run_form for t in base]) * (scale / len(base))
        return Measured.linear(scale * drop, form)

    def label(self, run: Run) -> str:
        return f"metric {self.name} on {run.label}"


_METRIC_KEYS = {
    "group_mean": ({"groups"}, {"scale", "weighting", "weights"}),
    "mean": (set(), {"tasks", "scale"}),
    "forgetting": (set(), {"tasks", "scale"}),
}


def parse_metrics(raw: Any, field: str) -> dict[str, RunMetric]:
    """A spec's ``metrics`` mapping: name -> {kind: body} (kinds in the module docstring)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise UserError(field, "must map metric names to definitions", "write {overall: {group_mean: {..}}}")
    out = {}
    for name, definition in raw.items():
        where = f"{field}.{name}"
        if not isinstance(definition, Mapping) or len(definition) != 1 or next(iter(definition)) not in _METRIC_KEYS:
            raise UserError(where, f"needs exactly one of {sorted(_METRIC_KEYS)}", "write e.g. {mean: {tasks: null}}")
        kind, body = next(iter(definition.items()))
        body = body or {}
        required, optional = _METRIC_KEYS[kind]
        if not isinstance(body, Mapping) or not required <= set(body) or set(body) - required - optional:
            raise UserError(
                f"{where}.{kind}",
                f"keys: required {sorted(required)}, optional {sorted(optional)}",
                "fix the metric's keys",
            )
        tasks = body.get("tasks")
        if tasks is not None and (not isinstance(tasks, list) or not tasks):
            raise UserError(
                f"{where}.{kind}.tasks",
                "must be a non-empty list of task names or null",
                "list the tasks, or null for the default",
            )
        if kind == "group_mean":
            groups = body["groups"]
            if not isinstance(groups, Mapping) or not all(isinstance(v, list) for v in groups.values()):
                raise UserError(
                    f"{where}.group_mean.groups",
                    "must map group names to lists of tasks",
                    "write {groups: {a: [task1, task2]}}",
                )
            try:  # group_mean's own checks, on a dry run
                group_mean(
                    {t: 0.5 for g in groups.values() for t in g},
                    groups,
                    body.get("scale"),
                    body.get("weighting", "tasks"),
                    body.get("weights"),
                )
            except ValueError as err:
                raise UserError(f"{where}.group_mean", str(err), "fix the metric definition") from None
        out[str(name)] = RunMetric(str(name), kind, dict(body))
    return out
