"""What a method needs from the models before it merges: head counts, validation scores that rank experts
(CMM's curriculum), calibration statistics (fisher, regmean: mergeval/merge/expert_statistics.py) and localize_stitch's
magnitude cuts.

Each expert is evaluated with mergeval's own evaluator on the validation split
of the benchmark's tasks (held-out items disjoint from the test items, see
``eval/tasks.py``); evaluations are reused through the results store like any
other. The score is the expert's mean validation accuracy over all tasks
(``rank_by=mean``, the paper's single aggregated score) or its accuracy on its
own task (``rank_by=own_task``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.outcome import ModelInfo
from mergeval.run.config import RunCfg


def prepare_method(
    cfg: RunCfg, method, method_cfg, models: list[ModelInfo], base_dir: Path, cache: Path, can_evaluate: bool
):
    """What a method needs from the models before merging: hierarchical's head counts (the base's config.json),
    CMM's validation ranking (evaluations; refused when the caller cannot evaluate). Returns (cfg, merge_info)."""
    needs = method.needs
    if needs.head_counts:
        from mergeval.methods.hierarchical import fill_head_counts
        from mergeval.models.checkpoint import read_config

        method_cfg = fill_head_counts(method_cfg, read_config(base_dir))
    merge_info = merge_details(method.name, method_cfg, models)
    if needs.magnitude_cuts and getattr(method_cfg, "scope", "model") == "model" and method_cfg.thresholds is None:
        from mergeval.merge.expert_statistics import fill_thresholds

        method_cfg, details = fill_thresholds(method_cfg, base_dir, models, cache)
        merge_info = {**merge_info, **details}
    if needs.statistics and method_cfg.statistics is None:  # each expert's, computed once and cached
        from mergeval.merge.expert_statistics import fill_statistics

        method_cfg, details = fill_statistics(cfg, method.name, needs.statistics, method_cfg, models, cache, base_dir)
        merge_info = {**merge_info, **details}
    if "needs_ranking" in merge_info:
        if not can_evaluate:
            refuse_ranking(method, method_cfg)
        method_cfg, ranking = rank_experts(cfg, method_cfg, models, cache)
        merge_info = {**merge_details(method.name, method_cfg, models), **ranking}
    return method_cfg, merge_info


def refuse_ranking(method, method_cfg) -> None:
    """For callers that cannot evaluate (merge-only): a config whose ranking is pending is an error."""
    ranking = method.needs.ranking
    if ranking is not None and ranking.pending(method_cfg):
        raise UserError(
            "method.order",
            "ranking the experts needs an evaluation, which a merge-only run does not do",
            f"{ranking.fix()}, or run python -m mergeval",
        )


def merge_details(method_name: str, method_cfg, models: list[ModelInfo]) -> dict:
    """What a method decided beyond its config, for result.json: its registered ``details`` over the experts'
    names (CMM: the merge order and coefficients); ``{"needs_ranking": True}`` while its ranking is pending."""
    from mergeval.methods import get_method

    method = get_method(method_name)
    if method.needs.ranking_pending(method_cfg):
        return {"needs_ranking": True}
    if method.details is None:
        return {}
    return method.details(method_cfg, [m.role for m in models if m.role != "base"])


def expert_score(accuracies: dict[str, float], rank_by: str, own_task: str | None, where: str) -> float:
    """mean_t acc_t (rank_by=mean) or acc_{own task} (rank_by=own_task)."""
    if rank_by == "mean":
        return sum(accuracies.values()) / len(accuracies)
    if own_task is None:
        raise UserError(where, "rank_by=own_task needs each expert's task", "set the expert's task or rank_by=mean")
    return accuracies[own_task]


def score_stderr(stderrs: dict[str, float | None], rank_by: str, own_task: str | None) -> float | None:
    """The stderr of ``expert_score``: sqrt(sum_t se_t^2) / T for the mean over T tasks (tasks independent),
    se_{own task} for rank_by=own_task; None where a task reports none."""
    if rank_by == "own_task":
        assert own_task is not None, "expert_score refuses rank_by=own_task without the expert's task"
        return stderrs[own_task]
    known = [se for se in stderrs.values() if se is not None]
    if len(known) < len(stderrs):
        return None
    return math.sqrt(sum(se * se for se in known)) / len(stderrs)


def near_ties(names: list[str], scores: list[float], stderrs: list[float | None]) -> list[dict]:
    """Neighbours in the ranking whose scores differ by less than one combined stderr,
    |s_a - s_b| < sqrt(se_a^2 + se_b^2): the validation data do not settle their order (another machine, seed
    or sample of items may swap them, and with them the whole curriculum). Ascending order, ties by position
    as ``curriculum.merge_order``; each entry names the pair, both scores and the gap in stderrs."""
    ranked = sorted(range(len(names)), key=lambda i: (scores[i], i))
    out = []
    for a, b in zip(ranked, ranked[1:]):
        se_a, se_b = stderrs[a], stderrs[b]
        if se_a is None or se_b is None:  # no stderr: nothing to compare the gap with
            continue
        se = math.hypot(se_a, se_b)
        gap = scores[b] - scores[a]
        if gap < se or se == 0 and gap == 0:
            out.append(
                {
                    "experts": [names[a], names[b]],
                    "scores": [scores[a], scores[b]],
                    "gap_in_stderrs": None if se == 0 else gap / se,
                }
            )
    return out


def rank_experts(cfg: RunCfg, method_cfg, models, cache: Path):
    """Fill method_cfg.validation_scores from validation evaluations; returns (new cfg, details for result.json)."""
    import torch

    from mergeval.eval.settings import eval_settings
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model
    from mergeval.results.store import open_store
    from mergeval.run.scoring import Scoring

    suite = build_suite(cfg.benchmark, cfg.eval, cache, split="validation", n_validation=method_cfg.validation_items)
    tasks = suite.counted()
    # validation always uses its whole split; each expert is evaluated with the base's tokenizer, as a run evaluates
    # every model (part of each model's identity: resolve.py)
    scoring = Scoring(
        cfg,
        suite,
        open_store(cfg, cache),
        cache,
        tasks=tasks,
        limit=None,
        settings=suite.per_task({**eval_settings(cfg), "limit": None}),
        tokenizer_dir=Path(models[0].path),
    )
    scores, stderrs, per_task = [], [], {}
    for info in models:
        if info.role == "base":
            continue

        def load(info=info):
            print(f"mergeval: ranking: evaluating {info.role} on the validation split", flush=True)
            return load_model(Path(info.path), None, getattr(torch, cfg.eval.dtype)).to(cfg.eval.device)

        got = scoring.scores(info.fingerprint, load).scores
        per_task[info.role] = got
        scores.append(
            expert_score(
                {t: got[t]["value"] for t in tasks}, method_cfg.rank_by, info.task, f"modelset.experts.{info.role}.task"
            )
        )
        stderrs.append(score_stderr({t: got[t]["stderr"] for t in tasks}, method_cfg.rank_by, info.task))
    names = [m.role for m in models if m.role != "base"]
    ties = near_ties(names, scores, stderrs)
    for tie in ties:
        (a, b), (sa, sb) = tie["experts"], tie["scores"]
        apart = "no" if tie["gap_in_stderrs"] is None else f"{tie['gap_in_stderrs']:.2f}"
        print(
            f"mergeval: ranking: {a} and {b} are {apart} stderr apart on the validation split ({sa:.3f}, "
            f"{sb:.3f}): the data do not settle their order; more method.validation_items would",
            flush=True,
        )
    details = {
        "validation_items": method_cfg.validation_items,
        "validation_digests": scoring.digests,
        "validation_scores": dict(zip(names, scores)),
        "validation_stderrs": dict(zip(names, stderrs)),
        "validation_near_ties": ties,
        "validation_per_task": per_task,
    }
    return dataclasses.replace(method_cfg, validation_scores=scores), details
