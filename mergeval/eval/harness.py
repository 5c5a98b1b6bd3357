"""lm-eval-harness on models held in memory.

``HFLM(pretrained=<model object>)`` wraps a live model, so a merge is scored
without being written to disk. By default the model is wrapped in
``SharedPrefixLM`` (eval/scorer.py), an HFLM that runs each question's context
once for all its choices; ``eval.backend=hflm`` uses lm-eval's HFLM as is. The
tasks are loaded once per run and reused for every model. lm-eval's own request cache is never used: it is keyed
without the model and would hand one checkpoint's answers to another.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mergeval.eval.samples import collect

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FEWSHOT_SEED = 1234  # lm-eval's default few-shot sampling seed, fixed so runs are comparable


@dataclass(frozen=True)
class TaskScore:
    acc: float
    stderr: float
    n: int


BACKENDS = ("shared_prefix", "hflm")  # eval.backend: mergeval/eval/scorer.py, or lm-eval's own HFLM


class Harness:
    """The run's lm-eval tasks; ``score`` evaluates one model on all of them."""

    @classmethod
    def for_run(cls, cfg, task_dir: Path, tasks: list[str], limit: int | None) -> Harness:
        """The harness a run's config asks for (eval.batch_size, eval.backend, benchmark.num_fewshot)."""
        return cls(task_dir, tasks, cfg.eval.batch_size, limit, cfg.benchmark.num_fewshot, cfg.eval.backend)

    def __init__(self, task_dir: Path, tasks: list[str], batch_size: int, limit: int | None, num_fewshot: int,
                 backend: str = "shared_prefix"):
        import datasets
        from lm_eval.tasks import TaskManager

        datasets.disable_progress_bars()
        for name in ("lm-eval", "lm_eval"):
            logging.getLogger(name).setLevel(logging.ERROR)
        self.tasks, self.batch_size, self.limit, self.backend = tasks, batch_size, limit, backend
        self.loaded = TaskManager(include_path=str(task_dir), include_defaults=False).load(tasks)
        for task in self.loaded["tasks"].values():
            task.set_config(key="num_fewshot", value=num_fewshot)
            task.set_fewshot_seed(seed=FEWSHOT_SEED)

    def score(self, model, tokenizer, samples: dict[str, list[int]] | None = None) -> dict[str, TaskScore]:
        """Scores per task. ``samples`` (task -> item indices; needs ``limit=None``) scores only those
        items. Afterwards ``self.requests`` holds the log-likelihood requests run per task (cost accounting)
        and ``self.samples`` each item's per-choice log-likelihoods and gold index (eval/samples.py)."""
        from lm_eval.evaluator import evaluate
        from lm_eval.models.huggingface import HFLM

        from mergeval.eval.scorer import SharedPrefixLM

        lm = (SharedPrefixLM if self.backend == "shared_prefix" else HFLM)(
            pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size)
        out = evaluate(lm=lm, task_dict=self.loaded, limit=self.limit, samples=samples, log_samples=False,
                       verbosity="ERROR")
        self.requests = {task: len(self.loaded["tasks"][task].instances) for task in self.tasks}
        self.samples = collect(self.loaded["tasks"], self.tasks)  # per-choice log-likelihoods, for calibration
        return {task: TaskScore(float(out["results"][task]["acc,none"]), float(out["results"][task]["acc_stderr,none"]),
                                int(out["n-samples"][task]["effective"]))
                for task in self.tasks}
