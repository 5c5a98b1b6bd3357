"""Calibration examples from an lm-eval task's own train or validation split, never the split it is scored on.

A task is loaded as a benchmark would load it (``eval/suite.py``: the
registry, ``benchmark.include_path``, and ``benchmark.data`` when it points
the task at local files), and its documents go through the task's own
``process_docs``, ``doc_to_text``, ``doc_to_choice`` and ``doc_to_target``. An
example is ``{"context": doc_to_text(doc), "continuation": target_delimiter +
answer}`` with the answer the gold choice (multiple choice) or the target text
(generation), zero-shot. The split a task is scored on (its ``test_split``, or
its ``validation_split`` when it has no test split, as hellaswag) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from mergeval.core.errors import UserError

_SUITES: dict = {}


def registry_examples(task_name: str, split: str, n: int, bench, eval_cfg, cache: Path, field: str) -> list[dict]:
    """The first ``n`` documents of ``task_name``'s ``split`` (train | validation) as context/continuation."""
    from mergeval.eval.suite import build_suite

    data = dict(bench.data or {})
    one = OmegaConf.create(
        {
            "name": "calibration",
            "tasks": [task_name],
            "include_path": list(bench.include_path),
            "metrics": {},
            "num_fewshot": None,
            "fewshot": {},
            "n_items": bench.n_items,
            "limit": None,
            "data": {task_name: data[task_name]} if task_name in data else {},
        }
    )
    key = (json.dumps(OmegaConf.to_container(one), sort_keys=True), str(cache))
    if key not in _SUITES:  # loaded once per process (each expert, each sweep job)
        try:
            _SUITES[key] = build_suite(one, eval_cfg, cache)
        except UserError as err:
            raise UserError(f"{field}.task", err.problem, err.fix) from None
    suite = _SUITES[key]
    if task_name not in suite.loaded["tasks"]:
        raise UserError(f"{field}.task", f"{task_name} is a group, not one task", "name one of its tasks")
    task = suite.task(task_name)
    config = task.config
    scored = config.test_split or config.validation_split
    wanted = config.training_split if split == "train" else config.validation_split
    if wanted is None:
        raise UserError(
            f"{field}.split",
            f"{task_name} has no {split} split",
            f"set {field}.split={'validation' if split == 'train' else 'train'}",
        )
    if wanted == scored:
        raise UserError(
            f"{field}.split",
            f"{task_name} is scored on its {split} split ('{wanted}'): calibration "
            "never uses the items a model is scored on",
            f"set {field}.split=train",
        )
    examples: list[dict] = []
    for doc in task.training_docs() if split == "train" else task.validation_docs():
        if len(examples) == n:
            break
        examples.append(_render(task, doc, field, task_name))
    if len(examples) < n:
        raise UserError(
            f"{field}.n",
            f"{task_name}'s {split} split holds {len(examples)} documents, fewer than {n}",
            f"set {field}.n={len(examples)} or less",
        )
    return examples


def _render(task, doc, field: str, task_name: str) -> dict:
    kind = task.config.output_type
    context = task.doc_to_text(doc)
    target = task.doc_to_target(doc)
    if kind == "multiple_choice":
        choices = task.doc_to_choice(doc)
        answer = choices[choices.index(target) if isinstance(target, str) else int(target)]
    elif kind == "generate_until":
        answer = target
    else:
        raise UserError(
            f"{field}.task",
            f"{task_name} is a {kind} task, which has no answer to calibrate on",
            "name a multiple_choice or generate_until task",
        )
    return {"context": str(context), "continuation": task.config.target_delimiter + str(answer)}
