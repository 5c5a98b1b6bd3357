"""What a sweep report shows, computed from result.json dicts: pure functions, no I/O, no plotting.

A *result* is the dict a run writes as result.json (or rebuilt from the
results store): ``config``, ``models`` (role, fingerprint, task), ``tasks``,
``scores`` (task -> role -> {acc, stderr, n}) and ``aggregates``. The merged
model's role is ``merged``; every other non-base role is an expert.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TypeGuard

from mergeval.core.errors import UserError
from mergeval.metrics.tradeoff import pareto_front, synergy_area
from mergeval.core.outcome import MERGED, score_metric, score_text, score_value
from mergeval.results.store import STATUSES, Store

BASE = "base"
PREFERRED_PARAMS = ("lambda_", "density")  # the hyperparameters a sweep most often varies


def short(task: str) -> str:
    """A task's display name: mergeval's generated tasks without their common prefix."""
    return task.removeprefix("mergeval_")


def method_name(result: dict) -> str:
    return result["config"]["method"]["name"]


def method_params(result: dict) -> dict:
    """The method's set hyperparameters (its name, null and empty values left out)."""
    return {k: v for k, v in result["config"]["method"].items() if k != "name" and v not in (None, [], {})}


def filter_results(results: list[dict], experiment: str | None = None, method: str | None = None,
                   since: float | None = None, benchmark: str | None = None) -> list[dict]:
    """The results of this modelset, method and benchmark, started at or after ``since`` (epoch seconds)."""
    def keep(r: dict) -> bool:
        created = datetime.fromisoformat(r["created"])
        created = created if created.tzinfo else created.replace(tzinfo=timezone.utc)
        return ((experiment is None or r["config"]["modelset"]["name"] == experiment)
                and (method is None or method_name(r) == method)
                and (benchmark is None or r["config"]["benchmark"]["name"] == benchmark)
                and (since is None or created.timestamp() >= since))
    return [r for r in results if keep(r)]


def varying_params(results: list[dict]) -> dict[str, list[str]]:
    """Per method, the hyperparameters that take more than one value among its runs (unset counts as a value)."""
    by_method: dict[str, list[dict]] = {}
    for r in results:
        by_method.setdefault(method_name(r), []).append(method_params(r))
    out = {}
    for m, runs in by_method.items():
        keys = sorted({k for params in runs for k in params})
        out[m] = [k for k in keys if len({repr(params.get(k)) for params in runs}) > 1]
    return out


def run_label(result: dict, varying: dict[str, list[str]], leave_out: str | None = None) -> str:
    """The method name and the values of its varying hyperparameters, e.g. ``ties density=0.3``."""
    params = method_params(result)
    words = [f"{k}={params[k]}" for k in varying.get(method_name(result), []) if k != leave_out and k in params]
    return " ".join([method_name(result), *words])


def expert_roles(result: dict) -> list[str]:
    return [m["role"] for m in result["models"] if m["role"] not in (BASE, MERGED)]


def own_tasks(result: dict) -> dict[str, str]:
    """Expert role -> its own task, for the experts that name one."""
    return {m["role"]: m["task"] for m in result["models"] if m["role"] not in (BASE, MERGED) and m.get("task")}


def constituents(results: list[dict]) -> dict[str, dict]:
    """Base and experts shared by all runs: role -> {fingerprint, task, scores}.

    Raises UserError when the runs compare different constituents (other
    models, or the same models scored under other settings): their merged
    points would not be comparable on one plot.
    """
    first = _constituents_of(results[0])
    key = _comparable(first)
    for r in results[1:]:
        if _comparable(_constituents_of(r)) != key:
            raise UserError("runs", f"run {r['run_id'][:8]} has other base/expert models or scores than run "
                            f"{results[0]['run_id'][:8]}", "report one modelset and one set of evaluation settings "
                            "at a time (e.g. one sweep directory, or --experiment)")
    return first


def _constituents_of(r: dict) -> dict[str, dict]:
    roles = [BASE, *expert_roles(r)]
    tasks = own_tasks(r)
    fps = {m["role"]: m["fingerprint"] for m in r["models"]}
    return {role: {"fingerprint": fps[role], "task": tasks.get(role),
                   "scores": {t: r["scores"][t][role] for t in r["tasks"]}} for role in roles}


def comparable_with_newest(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the runs, oldest first, whose base and experts and their scores are the newest run's; the others).

    A whole store mixes modelsets and evaluation settings (a sweep with benchmark.limit): a report of it keeps
    what can share one plot with the latest run, rather than refusing every run."""
    if not results:
        return [], []
    key = _comparable(_constituents_of(results[-1]))
    same = [_comparable(_constituents_of(r)) == key for r in results]
    return [r for r, s in zip(results, same) if s], [r for r, s in zip(results, same) if not s]


def _comparable(cons: dict[str, dict]) -> dict:
    return {role: (c["fingerprint"], sorted((t, score_value(s)) for t, s in c["scores"].items())) for role, c in cons.items()}


def common_tasks(results: list[dict]) -> list[str]:
    """Tasks every run evaluated, in the first run's order."""
    return [t for t in results[0]["tasks"] if all(t in r["scores"] for r in results)]


def resolve_task(name: str, tasks: list[str], flag: str = "--tasks") -> str:
    """A task by full or short name."""
    for t in tasks:
        if name in (t, short(t)):
            return t
    raise UserError(flag, f"no task '{name}' in every run", f"choose from {', '.join(short(t) for t in tasks)}")


def pareto_tasks(results: list[dict], requested: list[str] | None) -> tuple[str, str] | str:
    """The two tasks of the trade-off plot: the requested ones, else the two experts' own tasks.

    Returns a reason (str) instead when no pair is requested and the runs do
    not have exactly two expert tasks.
    """
    tasks = common_tasks(results)
    if requested:
        if len(requested) != 2:
            raise UserError("--tasks", f"needs exactly two tasks, got {len(requested)}", "pass --tasks TASK_X TASK_Y")
        x, y = (resolve_task(t, tasks) for t in requested)
        if x == y:
            raise UserError("--tasks", "the two tasks are the same", "pass two different tasks")
        return x, y
    owned = [t for t in dict.fromkeys(own_tasks(results[0]).values()) if t in tasks]
    if len(owned) != 2:
        return (f"the experts have {len(owned)} own task(s), the trade-off plot needs two; "
                "pass --tasks TASK_X TASK_Y")
    return owned[0], owned[1]


@dataclass
class Pareto:
    """The two-task trade-off: merged points, their front, the constituents and the synergy area."""

    task_x: str
    task_y: str
    labels: list[str]
    points: list[tuple[float, float]]
    front: list[int]  # indices into points, sorted by x
    references: dict[str, tuple[float, float]]  # base and expert roles -> their point
    diagonal: tuple[str, str] | None  # the experts owning task_x and task_y, when both exist
    area: float | None
    area_note: str = ""  # why the area is undefined
    run_ids: list[str] = field(default_factory=list)
    metrics: tuple[str, str] = ("acc,none", "acc,none")  # what task_x and task_y report


def metric_names(results: list[dict], tasks: list[str]) -> dict[str, str]:
    """task -> the metric its scores report (``acc,none`` for result.json files from before per-task metrics)."""
    return {t: score_metric(results[0]["scores"][t][MERGED]) for t in tasks}


def pareto(results: list[dict], task_x: str, task_y: str, labels: list[str]) -> Pareto:
    """Each run's merged (task_x, task_y) accuracy, the Pareto front of those points, and the synergy
    area between the front and the diagonal from the task_x expert to the task_y expert (tradeoff.py)."""
    cons = constituents(results)
    points = [(score_value(r["scores"][task_x][MERGED]), score_value(r["scores"][task_y][MERGED])) for r in results]
    refs = {role: (score_value(c["scores"][task_x]), score_value(c["scores"][task_y])) for role, c in cons.items()}
    owner = {c["task"]: role for role, c in cons.items() if c["task"]}
    diagonal, area, note = None, None, ""
    if task_x in owner and task_y in owner:
        diagonal = (owner[task_x], owner[task_y])
        try:
            area = synergy_area(points, refs[diagonal[0]], refs[diagonal[1]])
        except ValueError:
            note = (f"undefined: {diagonal[0]} and {diagonal[1]} do not trade off on these tasks "
                    "(each must beat the other on its own task)")
    else:
        note = "undefined: no expert owns " + " and ".join(short(t) for t in (task_x, task_y) if t not in owner)
    metrics = metric_names(results, [task_x, task_y])
    return Pareto(task_x, task_y, labels, points, pareto_front(points), refs, diagonal, area, note,
                  [r["run_id"] for r in results], (metrics[task_x], metrics[task_y]))


def _numeric(value) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sweep_param(results: list[dict], requested: str | None) -> str | None:
    """The hyperparameter for the score-vs-parameter plot.

    The requested one (it must be numeric in some run); else the numeric
    hyperparameter that varies across runs, preferring lambda_ then density;
    else None: a parameter with one value (a sweep over methods at lambda_ 1)
    would put every point at one x.
    """
    values: dict[str, set[float]] = {}
    for r in results:
        for k, v in method_params(r).items():
            if _numeric(v):
                values.setdefault(k, set()).add(float(v))
    if requested is not None:
        if requested not in values:
            raise UserError("--param", f"no run sets a numeric method.{requested}",
                            f"choose from {', '.join(sorted(values)) or '(none)'}")
        return requested
    rank = {k: (0 if len(vs) > 1 else 1, PREFERRED_PARAMS.index(k) if k in PREFERRED_PARAMS else 2, k)
            for k, vs in values.items()}
    best = min(rank, key=lambda k: rank[k], default=None)
    return None if best is None or rank[best][0] == 1 else best


Series = dict[str, dict[str, list[tuple[float, float, float]]]]  # line label -> task -> [(value, acc, stderr)]


def param_series(results: list[dict], param: str, tasks: list[str]) -> Series:
    """Merged accuracy +- stderr versus ``param``, one line per method (and its other varying hyperparameters).

    Runs that do not set ``param`` are left out; a value seen twice on one line keeps the later run.
    """
    varying = varying_params(results)
    lines: dict[str, dict[str, dict[float, tuple[float, float]]]] = {}
    for r in results:
        value = method_params(r).get(param)
        if not _numeric(value):
            continue
        line = lines.setdefault(run_label(r, varying, leave_out=param), {t: {} for t in tasks})
        for t in tasks:
            s = r["scores"][t][MERGED]
            line[t][float(value)] = (score_value(s), s["stderr"])
    return {label: {t: [(x, *by_x[x]) for x in sorted(by_x)] for t, by_x in per.items()}
            for label, per in lines.items()}


def normalized_by_method(results: list[dict]) -> tuple[list[str], dict[str, dict[str, float | None]]]:
    """Per method, its best run's normalized score per expert task: (tasks, {label: {task: score}}).

    normalized = (merged - base) / (expert - base) per expert task, as each
    run's aggregates hold it (None where expert = base). The best run is the
    one with the highest mean normalized score (undefined counts lowest); its
    label names the hyperparameters that vary among the method's runs.
    """
    varying = varying_params(results)
    tasks = list(dict.fromkeys(t for r in results for t in r["aggregates"].get("normalized", {})))
    best: dict[str, dict] = {}
    for r in results:
        m, mean = method_name(r), r["aggregates"].get("normalized_mean")
        held = best.get(m)
        held_mean = None if held is None else held["aggregates"].get("normalized_mean")
        if held is None or (mean is not None and (held_mean is None or mean > held_mean)):
            best[m] = r
    return tasks, {run_label(r, varying): {t: r["aggregates"]["normalized"].get(t) for t in tasks}
                   for r in best.values()}


def run_rows(results: list[dict], tasks: list[str]) -> list[dict]:
    """One row per run for the tables: label, merged score +- stderr per task, aggregates."""
    varying = varying_params(results)
    rows = []
    for r in results:
        agg = r["aggregates"]
        rows.append({"run": r["run_id"][:8], "label": run_label(r, varying),
                     **{short(t): _score_text(r["scores"][t][MERGED]) for t in tasks},
                     "Macro-Gain": _aggregate_text(agg["macro_gain"], agg.get("scale")),
                     "Macro-OG": _aggregate_text(agg["macro_og"], agg.get("scale")),
                     "normalized": "-" if agg.get("normalized_mean") is None else
                     f"{agg['normalized_mean']:.2f} ({agg.get('normalized_band', '')})"})
    return rows


def constituent_rows(cons: dict[str, dict], tasks: list[str]) -> list[dict]:
    return [{"model": role, "fingerprint": c["fingerprint"][:12], "own task": short(c["task"]) if c["task"] else "-",
             **{short(t): _score_text(c["scores"][t]) for t in tasks}} for role, c in cons.items()]


def _score_text(score: dict) -> str:
    return score_text(score)


def _aggregate_text(value: float, scale: str | None) -> str:
    return f"{value:+.2f} pts" if scale == "percent" else f"{value:+.4f}"


# The run filters that python -m mergeval.results and python -m mergeval.report share.

def benchmark_of(run: dict) -> str | None:
    return ((run["config"] or {}).get("benchmark") or {}).get("name")


def parse_since(text: str) -> float:
    """An ISO date or date-time (UTC unless it names a zone) as epoch seconds."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError as err:
        raise UserError("--since", f"'{text}' is not an ISO date or date-time", "use e.g. 2026-11-30 or "
                        "2026-11-30T08:00") from err
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def add_filters(parser: argparse.ArgumentParser, status: bool = True) -> None:
    """The run filters shared with ``python -m mergeval.report`` (which reports finished runs only)."""
    parser.add_argument("--experiment", help="only runs of this modelset (the experiment column)")
    parser.add_argument("--benchmark", help="only runs on this benchmark (its name: quickstart, "
                        "quickstart_registry, ...)")
    parser.add_argument("--method", help="only runs of this merge method")
    if status:
        parser.add_argument("--status", choices=STATUSES, help="only runs in this state")
    parser.add_argument("--since", help="only runs started at or after this ISO date/time (UTC)")


def filtered_runs(store: Store, args: argparse.Namespace) -> list[dict]:
    since = None if args.since is None else parse_since(args.since)
    runs = store.runs(args.experiment, args.method, getattr(args, "status", None), since)
    return runs if args.benchmark is None else [r for r in runs if benchmark_of(r) == args.benchmark]
