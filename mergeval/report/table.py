"""The terminal table of a run: accuracy +- stderr per task and model, then the aggregates."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mergeval.app import MERGED, Outcome


def _cell(score: dict[str, float], bold: bool = False) -> str:
    text = f"{score['acc']:.3f} ± {score['stderr']:.3f}"
    return f"[bold]{text}[/bold]" if bold else text


def render(outcome: Outcome, title: str, console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 160)
    roles = [m.role for m in outcome.models]
    own = {m.task: m.role for m in outcome.models if m.task}
    table = Table(title=title, title_justify="left")
    table.add_column("task (acc ± stderr)", no_wrap=True)
    for role in roles:
        table.add_column(role, justify="right", no_wrap=True)
    table.add_column("normalized", justify="right", no_wrap=True)
    norm = outcome.aggregates["normalized"]
    for task in outcome.tasks:
        row = [_cell(outcome.scores[task][r], bold=own.get(task) == r) for r in roles]
        value = norm.get(task)
        table.add_row(task.removeprefix("mergeval_"), *row, "-" if task not in norm else ("undefined" if value is None else f"{value:.2f}"))
    console.print(table)
    agg = outcome.aggregates
    unit = " pts" if agg["scale"] == "percent" else ""
    mean = agg["normalized_mean"]
    console.print(f"Macro-Gain {agg['macro_gain']:+.2f}{unit}   Macro-OG {agg['macro_og']:+.2f}{unit}   "
                  f"normalized (mean over expert tasks) "
                  f"{'undefined' if mean is None else f'{mean:.2f}'} ({agg['normalized_band']})")
    console.print(f"[dim]bold: each expert on its own task; normalized = ({MERGED} - base) / (expert - base)[/dim]")
    reused = [m.role for m in outcome.models if m.evaluated != "this run"]
    if reused:
        console.print(f"[dim]scores reused from the results store: {', '.join(reused)} "
                      "(eval.force=true re-evaluates)[/dim]")
