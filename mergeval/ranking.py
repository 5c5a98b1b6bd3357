"""Validation scores that rank experts before a merge (CMM's curriculum).

Each expert is evaluated with mergeval's own evaluator on the validation split
of the benchmark's tasks (held-out items disjoint from the test items, see
``eval/tasks.py``); evaluations are reused through the results store like any
other. The score is the expert's mean validation accuracy over all tasks
(``rank_by=mean``, the paper's single aggregated score) or its accuracy on its
own task (``rank_by=own_task``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig

from mergeval.errors import UserError


def expert_score(accuracies: dict[str, float], rank_by: str, own_task: str | None, where: str) -> float:
    """mean_t acc_t (rank_by=mean) or acc_{own task} (rank_by=own_task)."""
    if rank_by == "mean":
        return sum(accuracies.values()) / len(accuracies)
    if own_task is None:
        raise UserError(where, "rank_by=own_task needs each expert's task", "set the expert's task or rank_by=mean")
    return accuracies[own_task]


def rank_experts(cfg: DictConfig, method_cfg, models, cache: Path):
    """Fill method_cfg.validation_scores from validation evaluations; returns (new cfg, details for result.json)."""
    import torch
    from transformers import AutoTokenizer

    from mergeval.app import eval_settings, open_store
    from mergeval.eval.harness import Harness
    from mergeval.eval.tasks import task_digest, write_tasks
    from mergeval.models.checkpoint import load_model

    tasks = list(cfg.benchmark.tasks)
    task_dir = write_tasks(tasks, cfg.benchmark.n_items, cache, split="validation",
                           n_validation=method_cfg.validation_items)
    digests = {t: task_digest(task_dir, t) for t in tasks}
    settings = {**eval_settings(cfg), "limit": None}  # validation always uses its whole split
    store = open_store(cfg, cache)
    harness, tokenizer = None, None
    scores, per_task = [], {}
    for info in models:
        if info.role == "base":
            continue
        got = None if cfg.eval.force else store.get_scores(info.fingerprint, digests, settings)
        if got is None:
            print(f"mergeval: ranking: evaluating {info.role} on the validation split", flush=True)
            harness = harness or Harness.for_run(cfg, task_dir, tasks, None)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(info.path)
            model = load_model(Path(info.path), None, getattr(torch, cfg.eval.dtype)).to(cfg.eval.device)
            got = {t: {"acc": s.acc, "stderr": s.stderr, "n": s.n} for t, s in harness.score(model, tokenizer).items()}
            store.put_scores(info.fingerprint, digests, settings, got)
            del model
        per_task[info.role] = got
        scores.append(expert_score({t: got[t]["acc"] for t in tasks}, method_cfg.rank_by, info.task,
                                   f"modelset.experts.{info.role}.task"))
    details = {"validation_items": method_cfg.validation_items, "validation_digests": digests,
               "validation_scores": dict(zip([m.role for m in models if m.role != "base"], scores)),
               "validation_per_task": per_task}
    return dataclasses.replace(method_cfg, validation_scores=scores), details
