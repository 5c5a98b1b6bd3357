"""lm-eval-harness on models held in memory.

``HFLM(pretrained=<model object>)`` wraps a live model, so a merge is scored
without being written to disk. lm-eval's own request cache is never used: it is
keyed without the model and would hand one checkpoint's answers to another.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class TaskScore:
    acc: float
    stderr: float
    n: int


class Harness:
    """One lm-eval task index for a run; ``score`` evaluates one model on all tasks."""

    def __init__(self, task_dir: Path, tasks: list[str], batch_size: int, limit: int | None, num_fewshot: int):
        from lm_eval.tasks import TaskManager

        for name in ("lm-eval", "lm_eval"):
            logging.getLogger(name).setLevel(logging.ERROR)
        self.tasks, self.batch_size, self.limit, self.num_fewshot = tasks, batch_size, limit, num_fewshot
        self.manager = TaskManager(include_path=str(task_dir), include_defaults=False)

    def score(self, model, tokenizer) -> dict[str, TaskScore]:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size)
        out = simple_evaluate(model=lm, tasks=self.tasks, task_manager=self.manager, num_fewshot=self.num_fewshot,
                              limit=self.limit, use_cache=None, log_samples=False, verbosity="ERROR")
        scores = {}
        for task in self.tasks:
            res = out["results"][task]
            scores[task] = TaskScore(float(res["acc,none"]), float(res["acc_stderr,none"]),
                                     int(out["n-samples"][task]["effective"]))
        return scores
