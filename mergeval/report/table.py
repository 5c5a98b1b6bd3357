"""The terminal table of a run: each task's metric (value +- stderr) per model, then the aggregates."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mergeval.core.outcome import MERGED, Outcome, fixed, score_metric, score_text, score_value


def _cell(score: dict, bold: bool = False) -> str:
    text = score_text(score)
    return f"[bold]{text}[/bold]" if bold else text


def render(outcome: Outcome, title: str, console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 160)
    roles = [m.role for m in outcome.models]
    own = [(m.task, m.role) for m in outcome.models if m.task]  # two experts may name one task
    table = Table(title=title, title_justify="left")
    table.add_column("task", no_wrap=True)
    table.add_column("metric", no_wrap=True)
    for role in roles:
        table.add_column(role, justify="right", no_wrap=True)
    table.add_column("normalized", justify="right", no_wrap=True)
    norm = outcome.aggregates["normalized"]
    excluded = outcome.aggregates.get("excluded") or {}
    for task in outcome.tasks:
        row = [_cell(outcome.scores[task][r], bold=(task, r) in own) for r in roles]
        value = norm.get(task)
        shown = "-" if task not in norm else ("undefined" if value is None else fixed(value))
        info = outcome.rows.get(task, {})
        label = task.removeprefix("mergeval_") if info.get("entry", task) == task else f"  {task}"
        metric = score_metric(outcome.scores[task][roles[0]])
        marks = ("" if info.get("higher_is_better", True) else " ↓") + ("" if task not in excluded else " *")
        table.add_row(label, metric + marks, *row, shown)
    console.print(table)
    agg = outcome.aggregates
    unit = " pts" if agg["scale"] == "percent" else ""
    mean, left_out = agg["normalized_mean"], agg.get("normalized_not_counted") or []
    over = "expert tasks" if not left_out else f"{len(norm) - len(left_out)} of {len(norm)} expert tasks"
    console.print(f"Macro-Gain {agg['macro_gain']:+.2f}{unit}   Macro-OG {agg['macro_og']:+.2f}{unit}   "
                  f"normalized (mean over {over}) "
                  f"{'undefined' if mean is None else fixed(mean)} ({agg['normalized_band']})")
    for line in _unlearned(outcome):  # one line however narrow the console: logs and greps keep it whole
        console.print(f"[yellow]{line}[/yellow]", soft_wrap=True)
    if outcome.merge_info.get("order"):
        console.print(curriculum_line(outcome.merge_info))
    if agg.get("groups"):
        console.print("group means  " + "   ".join(
            f"{role} {value:.3f}" if value is not None else f"{role} -" for role, value in agg["groups"].items()))
    if agg.get("forgetting"):
        console.print(f"forgetting (base - merged on general tasks) {agg['forgetting']['mean']:+.3f}")
    for pair, stats in (agg.get("similarity") or {}).items():
        o = stats["overall"]
        cos = "undefined" if o["cosine"] is None else f"{o['cosine']:.3f}"
        sar = "-" if o.get("sar_a_in_b") is None else f"{o['sar_a_in_b']:.3f}"
        console.print(f"task vectors {pair}: cosine {cos}   sign conflict {o['sign_conflict']:.3f}   SAR {sar}")
    for role, per_task in (agg.get("calibration") or {}).items():
        cells = "   ".join(f"{t.removeprefix('mergeval_')} {v:.3f}" for t, v in per_task.items()) if per_task else \
            "no kept samples (eval.force=true re-evaluates)"
        console.print(f"calibration error (ECE) {role}: {cells}")
    if agg.get("consistency"):
        console.print(_consistency_table(agg["consistency"]))
    # bold shows only where the console styles text; in a log or a pipe the line names the cells instead
    marked = "bold: each expert on its own task" if console.color_system else "each expert's own task: " + ", ".join(
        f"{role} on {task.removeprefix('mergeval_')}" for task, role in own)
    console.print(f"[dim]{marked + '; ' if own else ''}normalized = ({MERGED} - base) / (expert - base)[/dim]")
    for task, why in excluded.items():
        console.print(f"[dim]* {task}: {why}[/dim]")
    if any(info.get("entry", t) != t for t, info in outcome.rows.items()):
        console.print("[dim]indented: members of a group, shown; the aggregates count the group once[/dim]")
    reused = [m.role + (" (some tasks)" if (m.evaluated or "").startswith("partly") else "")
              for m in outcome.models if m.evaluated != "this run"]
    if reused:
        console.print(f"[dim]scores reused from the results store: {', '.join(reused)} "
                      "(eval.force=true re-evaluates)[/dim]")
    if any(m.role == MERGED and m.merge == "reused from the results store" for m in outcome.models):
        console.print("[dim]merge not redone: the store holds its output for these inputs, method config and "
                      "seed[/dim]")


def _unlearned(outcome: Outcome) -> list[str]:
    """A warning per expert that does not beat the base on its own task: its normalized score divides by a
    gain that is not there, so the number says nothing about the merge."""
    out = []
    for m in outcome.models:
        if m.task and m.task in outcome.aggregates["normalized"]:
            own, base = score_value(outcome.scores[m.task][m.role]), score_value(outcome.scores[m.task]["base"])
            if own <= base:
                out.append(f"{m.role} does not beat the base on its own task {m.task} ({own:.3f} vs {base:.3f}): "
                           "its normalized score is meaningless and not in the mean; train the expert longer or "
                           "check its task")
    return out


def curriculum_line(info: dict) -> str:
    """What CMM decided: the merge order with each step's coefficient, and the validation scores that ranked."""
    steps = " -> ".join(f"{name} ({c:.2f})" for name, c in zip(info["order"], info.get("coefficients", [])))
    scores = info.get("validation_scores")
    ranked = "" if not scores else "   validation scores: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
    return f"curriculum: {steps}{ranked}"


def _consistency_table(per_role: dict) -> Table:
    """One row per model and format pair: how often its answers agree, its accuracy in each format, right in both."""
    table = Table(title="answer consistency: the same items asked in two formats", title_justify="left")
    for name in ("model", "first format", "second format", "agreement", "acc first", "acc second", "right in both",
                 "n"):
        table.add_column(name, justify="left" if "format" in name or name == "model" else "right", no_wrap=True)
    for role, pairs in per_role.items():
        if pairs is None:  # an evaluation stored before mergeval kept per-choice log-likelihoods
            table.add_row(role, "no kept samples (eval.force=true re-evaluates)", *[""] * 6, end_section=True)
            continue
        for i, s in enumerate(pairs.values()):
            (first, acc_first), (second, acc_second) = s["acc"].items()
            table.add_row(role if i == 0 else "", first.removeprefix("mergeval_"), second.removeprefix("mergeval_"),
                          f"{s['agreement']:.3f}", f"{acc_first:.3f}", f"{acc_second:.3f}", f"{s['both_correct']:.3f}",
                          str(s["n"]), end_section=i == len(pairs) - 1)
    return table
