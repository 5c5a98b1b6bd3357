"""staged.json and the terminal tables of a staged sweep."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from mergeval.core.paths import atomic_write_text
from mergeval.core.provenance import git_commit, package_versions
from mergeval.staged.cost import as_json
from mergeval.staged.pipeline import StagedOutcome


def _jsonable(x):
    """Non-finite floats (a broken merge's perplexity) as strings: strict JSON has no Infinity or NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def to_json(cfg: DictConfig, outcome: StagedOutcome) -> dict:
    candidates = []
    for c in outcome.candidates:
        row = asdict(c)
        row.update(stage2_mean_acc=c.mean("stage2"), stage3_mean_acc=c.mean("stage3"), full_mean_acc=c.mean("full"))
        candidates.append(row)
    return _jsonable(
        {
            "run_id": uuid.uuid4().hex,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": OmegaConf.to_container(cfg, resolve=True),
            "seeds": {"merge": cfg.seed, "train": cfg.modelset.train.seed, "eval_data": 0, "heldout_data": 0},
            "tasks": outcome.tasks,
            "task_digests": outcome.task_digests,
            "items_per_task": {"full": outcome.n_full, "stage2": outcome.stage2_items},
            "heldout": outcome.heldout,
            "constituents": [vars(m) for m in outcome.constituents],
            "constituent_scores": outcome.constituent_scores,
            "reference_perplexity": outcome.reference,
            "candidates": candidates,
            "stage2": outcome.stage2,
            "stage3": outcome.stage3,
            "pick": outcome.pick,
            "pick_command": outcome.pick_command,
            "early_stop": outcome.early_stop,
            "cost": as_json(outcome.cost),
            "forward_passes_run_in_this_job": outcome.ran,
            "full_comparison": outcome.comparison,
            "timings_s": outcome.timings,
            "merges": outcome.merges,
            "versions": package_versions(),
            "git": git_commit(),
        }
    )


def write(cfg: DictConfig, outcome: StagedOutcome, out_dir: Path) -> Path:
    path = out_dir / "staged.json"
    atomic_write_text(path, json.dumps(to_json(cfg, outcome), indent=2))
    return path


def _acc(mean: float | None) -> str:
    return "-" if mean is None else f"{mean:.3f}"


def render(outcome: StagedOutcome, title: str, console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 160)
    table = Table(title=title, title_justify="left")
    n2, n = outcome.stage2_items, outcome.n_full
    for name in ("candidate", "PPL / experts", f"stage 2 acc ({n2} items)", f"stage 3 acc ({n} items)"):
        table.add_column(name, justify="left" if name == "candidate" else "right", no_wrap=True)
    has_full = any(c.full is not None for c in outcome.candidates)
    if has_full:
        table.add_column("full acc", justify="right", no_wrap=True)
    table.add_column("Macro-Gain", justify="right", no_wrap=True)
    for c in outcome.candidates:
        r = c.degradation + 1
        ratio = "inf" if not math.isfinite(r) else f"{r:.3f}" if r < 1000 else f"{r:.2e}"
        if c.degraded:
            ratio += " (degraded)"
        gain = "-" if c.aggregates is None else f"{c.aggregates['macro_gain']:+.2f}"
        row = (
            [
                c.label + ("  ← pick" if c.label == outcome.pick else ""),
                ratio,
                _acc(c.mean("stage2")),
                _acc(c.mean("stage3")),
            ]
            + ([_acc(c.mean("full"))] if has_full else [])
            + [gain]
        )
        table.add_row(*[f"[bold]{v}[/bold]" if c.label == outcome.pick else v for v in row])
    console.print(table)
    console.print(
        "[dim]PPL / experts: held-out answer perplexity over each expert's on its own task, geometric "
        "mean over the experts' tasks; acc: mean over all tasks[/dim]"
    )

    full = outcome.cost["full"]
    costs = Table(
        title="evaluation cost (candidates; the constituents' own evaluation is the same either way)",
        title_justify="left",
    )
    for name in ("stage", "models", "examples", "forward passes", "of full"):
        costs.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    counts = {
        "stage1": len(outcome.candidates),
        "stage2": len(outcome.stage2),
        "stage3": len(outcome.stage3),
        "staged": None,
        "full": len(outcome.candidates),
    }
    names = {
        "stage1": "1 perplexity (+ experts)",
        "stage2": f"2 items [0, {n2})",
        "stage3": f"3 items [{n2}, {n})",
        "staged": "staged total",
        "full": "full, every candidate",
    }
    for key, label in names.items():
        cost = outcome.cost[key]
        share = f"{cost.forward_passes / full.forward_passes:.1%}" if full.forward_passes else "-"
        costs.add_row(
            label,
            "" if counts[key] is None else str(counts[key]),
            f"{cost.examples:,}",
            f"{cost.forward_passes:,}",
            share,
        )
    console.print(costs)

    if outcome.early_stop:
        console.print(f"[bold yellow]early stop:[/bold yellow] {outcome.early_stop}")
    elif outcome.pick is not None:
        pick = outcome.result(outcome.pick)
        agg = pick.aggregates
        assert agg is not None, "the pick is a finalist"
        mean = agg["normalized_mean"]
        console.print(
            f"pick: [bold]{pick.label}[/bold]   mean acc {pick.scored_mean('stage3'):.3f}   "
            f"Macro-Gain {agg['macro_gain']:+.2f}   normalized "
            f"{'undefined' if mean is None else f'{mean:.2f}'} ({agg['normalized_band']})"
        )
        if outcome.pick_command:
            console.print(
                f"as a run (result.json, the results store; stored evaluations are reused): {outcome.pick_command}",
                soft_wrap=True,
                highlight=False,
            )
    if outcome.comparison:
        cmp = outcome.comparison
        verdict = "the same pick" if cmp["same_pick"] else "a different pick"
        regret = "" if cmp["regret"] is None else f" (the staged pick gives up {cmp['regret']:.3f} mean acc)"
        console.print(f"full evaluation of every candidate picks {cmp['full_pick']}: {verdict}{regret}")
