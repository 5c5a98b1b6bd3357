"""One recipe scored on the validation split in stages, pruned when it falls behind; what that cost.

A trial's recipe is merged in memory (``staged.pipeline.Models``) and goes
through the stages of ``mergeval/staged``, each reported to Optuna as one step:

- step 0, stage 1: perplexity of held-out answers of the experts' own tasks
  (``staged.heldout``: items outside every task's evaluation pool and the
  experts' training items); value ``-mean_t ln(PPL_t / PPL_expert(t))``.
  A recipe whose perplexity degrades past ``search.degrade_threshold`` is
  pruned here whatever the pruner says (the staged sweep's early stop);
- step 1, stage 2: validation items ``[0, L)`` of every task,
  ``L = ceil(stage2_fraction * V)``; value: mean accuracy over the tasks (the
  merged model's term of Macro-Gain / Macro-OG, comparable without the constituents);
- stage 3: the remaining validation items ``[L, V)``, combined with stage 2's
  into scores on all ``V`` items, and the objective (``search.objective``) over them.

Every evaluation goes through the results store (``run/scoring.py``),
keyed by the merge's fingerprint, the *validation* task digests and the item
selection, so a recipe seen before (a repeated trial, a resumed study) costs
a lookup. Costs are counted from the data as ``staged.cost`` counts them:
one forward pass per held-out text and per answer choice of an item.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.outcome import MERGED, ModelInfo
from mergeval.core.plain import plain_dict
from mergeval.methods import MergeMethod
from mergeval.metrics.perplexity import degradation, mean_log_ratio
from mergeval.run.ranking import prepare_method
from mergeval.run.scoring import Scoring
from mergeval.run.summary import aggregate
from mergeval.search.schema import SearchRunConfig
from mergeval.staged.cost import Cost, benchmark_cost, perplexity_cost
from mergeval.staged.pipeline import HeldOut, Models
from mergeval.staged.plan import Candidate, typed_config
from mergeval.staged.selection import combine, mean_accuracy

COMPLETE, PRUNED = "COMPLETE", "PRUNED"


@dataclass
class Stages:
    """What every trial's evaluation shares, built once per search."""

    cfg: SearchRunConfig
    method: MergeMethod
    n_experts: int
    models: Models
    constituents: list[ModelInfo]
    scorer: HeldOut  # stage 1
    reference: dict[str, float]  # task -> its expert's held-out perplexity
    validation: Scoring  # the validation split's tasks (no test item is ever in it)
    constituent_scores: dict[str, dict[str, dict]]  # validation: task -> role -> {value, stderr, n}
    choices: dict[str, list[int]]  # validation: task -> answer choices per item
    n_items: int  # V
    n_stage2: int  # L
    cache: Path
    base_dir: Path

    def full_cost(self) -> Cost:
        """Scoring one recipe on every validation item: what each trial would cost without stages."""
        return benchmark_cost(self.choices, 0, self.n_items)


@dataclass
class Scored:
    """One recipe's way through the stages."""

    params: dict
    config: dict  # the method config merged (after the method's own preparation)
    fingerprint: str = ""
    state: str = COMPLETE
    reason: str = ""  # why it was pruned
    stage: int = 0  # the last stage it reached (1-3)
    perplexity: dict[str, float] = field(default_factory=dict)
    log_ratio: float = math.inf
    degradation: float = math.inf
    stage2: float | None = None  # mean accuracy on items [0, L)
    scores: dict | None = None  # validation, all V items: task -> {value, stderr, n}
    aggregates: dict | None = None
    value: float | None = None  # the objective on the validation split
    cost: Cost = field(default_factory=Cost)  # what the procedure needed (store reuse or not)
    ran: int = 0  # forward passes actually run in this process (benchmark requests + perplexity texts)
    seconds: float = 0.0

    def completed_value(self) -> float:
        """``value`` of a recipe that went through every stage (not pruned)."""
        assert self.value is not None, f"a recipe {self.state} at stage {self.stage} has no objective value"
        return self.value


def recipe_config(stages: Stages, overrides: dict):
    """The run's method config with a trial's fields set, validated, then prepared as a run prepares it
    (CMM's expert ranking on the validation split, head counts, calibration statistics)."""
    config = typed_config("search.space", stages.method, overrides, stages.n_experts, stages.cfg.method)
    config, _ = prepare_method(
        stages.cfg, stages.method, config, stages.constituents, stages.base_dir, stages.cache, can_evaluate=True
    )
    return config


def objective(
    kind: str, scores: dict, constituent_scores: dict, constituents: list[ModelInfo], metric
) -> tuple[float | None, dict]:
    """(the objective's value, the aggregates) of a merge's scores (task -> {value, ...}) against the constituents'
    on the same items.

    mean_accuracy = (1/T) sum_t acc_t(merged); macro_gain, macro_og and normalized (the mean normalized score
    over the expert tasks) as ``summary.aggregate`` computes them for a run. normalized is None (undefined) where
    no expert beats the base on its own task.
    """
    tasks = list(scores)
    table = {t: {**constituent_scores[t], MERGED: scores[t]} for t in tasks}
    aggregates = aggregate(table, tasks, constituents, metric)
    value = {
        "mean_accuracy": mean_accuracy(scores),
        "macro_gain": aggregates["macro_gain"],
        "macro_og": aggregates["macro_og"],
        "normalized": aggregates["normalized_mean"],
    }[kind]
    return value, aggregates


def defined_objective(kind: str, value: float | None) -> float:
    """The objective's value on the validation split, which the search maximizes: refused with one line where it
    is undefined (normalized, when no expert beats the base on its own task there: the same for every recipe,
    as only the constituents' scores decide it)."""
    if value is None:
        raise UserError(
            "search.objective",
            f"{kind} is undefined on the validation split: no expert beats the base on its own task there",
            "choose search.objective=macro_gain, macro_og or mean_accuracy",
        )
    return value


def score(stages: Stages, params: dict, overrides: dict, trial=None) -> Scored:
    """Score one recipe stage by stage; with an Optuna ``trial``, report each stage and stop when it is pruned
    (``state=PRUNED``); without one (the method's default), every stage runs."""
    started = time.perf_counter()
    s = stages.cfg.search
    config = recipe_config(stages, overrides)
    out = Scored(params, _plain(config))
    tensors = stages.models.merged(Candidate("trial", stages.method, config, params, "search"))
    out.fingerprint = stages.models.identity(tensors)
    model = stages.models.live(tensors)
    del tensors

    spent_before = stages.scorer.spent.forward_passes
    out.perplexity = stages.scorer.perplexities(model)
    out.ran += stages.scorer.spent.forward_passes - spent_before
    out.cost += perplexity_cost({t: len(q) for t, q in stages.scorer.sequences.items()})
    out.log_ratio = _finite(mean_log_ratio(out.perplexity, stages.reference))
    out.degradation = _finite(degradation(out.perplexity, stages.reference))
    out.stage = 1

    def halt(step: int, value: float, why: str) -> bool:
        """Report ``value`` at ``step``; True (and the trial marked pruned) when it stops here."""
        if trial is None:
            return False
        trial.report(value, step)
        if why or trial.should_prune():
            out.state, out.reason = PRUNED, why or f"stage {step + 1}: behind the top {s.keep_percent:g}%"
            return True
        return False

    degraded = not out.degradation <= s.degrade_threshold
    why = (
        f"stage 1: perplexity x{out.degradation + 1:.3g} of the experts' (threshold x{s.degrade_threshold + 1:g})"
        if degraded and s.pruner != "none"
        else ""
    )
    if halt(0, stage1_value(out), why):
        return _done(out, started)

    got = stages.validation.scores(out.fingerprint, lambda: model, items=(0, stages.n_stage2))
    first = got.scores
    out.ran += got.requests
    out.cost += benchmark_cost(stages.choices, 0, stages.n_stage2)
    out.stage2, out.stage = mean_accuracy(first), 2
    if halt(1, out.stage2, ""):
        return _done(out, started)

    got = stages.validation.scores(out.fingerprint, lambda: model, items=(stages.n_stage2, stages.n_items))
    rest = got.scores
    out.ran += got.requests
    out.cost += benchmark_cost(stages.choices, stages.n_stage2, stages.n_items)
    out.scores = {t: combine(first[t], rest[t]) for t in stages.validation.tasks}
    value, out.aggregates = objective(
        s.objective, out.scores, stages.constituent_scores, stages.constituents, stages.cfg.metric
    )
    out.value = defined_objective(s.objective, value)
    out.stage = 3
    return _done(out, started)


def stage1_value(res: Scored) -> float:
    """What stage 1 reports to Optuna: minus the mean log-perplexity ratio (higher is better; -1e9 if infinite)."""
    return -res.log_ratio if math.isfinite(res.log_ratio) else -1e9


def _done(out: Scored, started: float) -> Scored:
    out.seconds = time.perf_counter() - started
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _plain(config) -> dict:
    from omegaconf import OmegaConf

    return plain_dict(OmegaConf.structured(config))
