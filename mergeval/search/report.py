"""A search's terminal summary and its ``search.json`` (written atomically into the job directory)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mergeval.core.paths import atomic_write_text
from mergeval.search.monitor import signed
from mergeval.search.run import SearchOutcome
from mergeval.search.space import describe


def _scores_line(scores: dict | None, tasks: list[str] | None = None) -> str:
    """Each task's score, in the benchmark's task order (a score read back from the store may come in another)."""
    if not scores:
        return "-"
    order = [t for t in (tasks or []) if t in scores] + [t for t in scores if t not in (tasks or [])]
    return "  ".join(f"{t.removeprefix('mergeval_')} {scores[t]['value']:.3f}" for t in order)


def lines(outcome: SearchOutcome) -> list[str]:
    """The summary: trials, the best recipe against the default on the validation split, the test split apart,
    and the cost against scoring every trial in full."""
    o, cost = outcome, outcome.cost
    out = [
        f"study '{o.study}': {cost['trials']} trials ({cost['complete']} complete, "
        f"{cost['pruned_at_stage1']} pruned at stage 1, {cost['pruned_at_stage2']} at stage 2), "
        f"objective {o.objective}"
    ]
    out.append(f"validation split ({o.validation_items} items per task, disjoint from the test items):")
    out.append(
        f"  default          {o.objective} {signed(o.baseline.completed_value())}   {_scores_line(o.baseline.scores, o.tasks)}"
    )
    if o.best is None:
        out.append("  no trial completed: nothing to report on the test split")
    else:
        label = f"best (trial #{o.best_number})"
        out.append(
            f"  {label:<16} {o.objective} {signed(o.best.completed_value())}   {_scores_line(o.best.scores, o.tasks)}"
        )
        out.append(
            f"  best recipe: {describe(o.best.params)}"
            + (" (the seeded default: no sampled trial beat it)" if o.best_is_default else "")
        )
        if o.run_command:
            out.append(f"  as a run (result.json, the results store; stored evaluations are reused): {o.run_command}")
    if o.test:
        out.append("test split (scored once, after tuning):")
        for label in ("default", "best"):
            t = o.test[label]
            out.append(f"  {label:<16} {o.objective} {signed(t['objective'])}   {_scores_line(t['scores'], o.tasks)}")
    staged, full = cost["staged"], cost["full"]
    if cost["fraction_of_full"] is not None:
        fraction = cost["fraction_of_full"]
        verdict = (
            f"{1 - fraction:.0%} saved"
            if fraction <= 1
            else f"{fraction - 1:.0%} more (stage 1's perplexities come on top of every trial that is not pruned)"
        )
        out.append(
            f"cost: {staged['forward_passes']:,} forward passes ({staged['examples']:,} examples) staged, "
            f"against {full['forward_passes']:,} ({full['examples']:,}) scoring every trial on the whole "
            f"validation split: {fraction:.0%}, {verdict}"
        )
    return out


def render(outcome: SearchOutcome) -> None:
    print("\n".join(lines(outcome)), flush=True)


def as_json(cfg: DictConfig, outcome: SearchOutcome) -> dict:
    data = dataclasses.asdict(outcome)
    data["config"] = OmegaConf.to_container(cfg, resolve=True)
    return data


def write(cfg: DictConfig, outcome: SearchOutcome, out_dir: Path) -> Path:
    path = out_dir / "search.json"
    atomic_write_text(path, json.dumps(as_json(cfg, outcome), indent=2, default=_plain) + "\n")
    return path


def _plain(value):
    """JSON for what dataclasses.asdict leaves (infinite floats become strings; json handles nan/inf itself)."""
    return str(value)
