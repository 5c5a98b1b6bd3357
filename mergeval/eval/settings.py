"""Everything besides model and task data that can change a score: part of the results store's key.

A run has one set of settings (``eval_settings``); each task is stored under the part of them that can change
its own scores (``task_settings``): the few-shot count it is evaluated with, whatever field set it, and the
generation kwargs only where the task generates. So a task evaluated by one run is reused by another that
differs only where that task cannot tell (``benchmark.num_fewshot: null`` against 0 for a task whose own count
is 0; ``eval.gen_kwargs`` for a log-likelihood task).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mergeval.core.gpus import kind

# The implementation version of the shared-prefix scorer (eval/scorer.py): raise it whenever its scores for the
# same model, items and settings change, so scores it stored before are not reused (merges carry theirs:
# MergeMethod.version). Kept here, not in scorer.py, so the key is known without importing torch and lm-eval.
SHARED_PREFIX_VERSION = 1


def eval_settings(cfg) -> dict:
    """The settings of an evaluation. Keys added after the first release appear only when set away from their
    defaults, so evaluations stored before they existed keep their key (and stay reusable)."""
    from importlib.metadata import version

    # the device's kind (cuda, not cuda:2): a parallel sweep's jobs, each on a GPU of its own, share evaluations
    # (one stored before under a named index, eval.device=cuda:1, is not matched again and is redone once)
    settings = {
        "limit": cfg.benchmark.limit,
        "num_fewshot": cfg.benchmark.num_fewshot,
        "dtype": cfg.eval.dtype,
        "batch_size": cfg.eval.batch_size,
        "device": kind(cfg.eval.device),
        "lm_eval": version("lm_eval"),
    }
    if cfg.eval.backend != "hflm":  # evaluations stored before backends existed were HFLM's: keep their key
        settings["backend"] = cfg.eval.backend
    if cfg.eval.backend == "shared_prefix" and SHARED_PREFIX_VERSION > 1:  # version 1 keeps the keys it had
        settings["scorer_version"] = SHARED_PREFIX_VERSION
    optional = {
        "fewshot": dict(cfg.benchmark.fewshot or {}),
        "apply_chat_template": bool(cfg.eval.apply_chat_template),
        "system_instruction": cfg.eval.system_instruction,
        "fewshot_as_multiturn": bool(cfg.eval.fewshot_as_multiturn),
        "gen_kwargs": dict(cfg.eval.gen_kwargs or {}),
        "allow_code_execution": cfg.eval.allow_code_execution,
    }
    settings.update({k: v for k, v in optional.items() if v})
    return settings


def task_settings(settings: Mapping, num_fewshot, generates: bool) -> dict:
    """One task's settings: the run's ``settings`` with ``num_fewshot`` the count the task is evaluated with
    (an int; a group's: its members' counts, one int where they agree), ``fewshot`` (the per-entry counts)
    dropped, as that count already says what it did, and ``gen_kwargs`` kept only when the task ``generates``.

    Where nothing is replaced the result equals the run's settings, so the task's key is the one it had before
    per-task keys (a run with ``benchmark.num_fewshot: 0`` and no generation kwargs keeps every key)."""
    out = {k: v for k, v in settings.items() if k not in ("fewshot", "gen_kwargs")}
    out["num_fewshot"] = num_fewshot
    if generates and settings.get("gen_kwargs"):
        out["gen_kwargs"] = settings["gen_kwargs"]
    return out


@dataclass(frozen=True)
class PerTask:
    """The store key's settings of each task of a run: ``run`` (eval_settings) and, per task, what sets its
    own part (``{"num_fewshot": n, "generates": bool}``, Suite.per_task; result.json's ``task_settings``).

    A task not in ``tasks`` is keyed by the run's settings. The store reads each task under its own settings
    first, then under the run's: how every evaluation was keyed before per-task keys. That reuse
    is exact: a row keyed by the run's very settings was either evaluated with all of them, or written under
    a task's own settings equal to them, which for the same task digest means the same count and kwargs (with
    no per-entry ``fewshot`` and an int ``num_fewshot`` in the run, the count follows from that number and the
    task's YAML, which the digest covers)."""

    run: Mapping
    tasks: Mapping[str, Mapping] = field(default_factory=dict)

    def of(self, task: str) -> dict:
        own = self.tasks.get(task)
        return dict(self.run) if own is None else task_settings(self.run, own["num_fewshot"], own["generates"])

    def replace(self, **changes) -> PerTask:
        """The same tasks with run settings changed (a stage's ``limit``, its ``items``)."""
        return PerTask({**self.run, **changes}, self.tasks)
