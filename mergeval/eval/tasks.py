"""The tasks mergeval generates, written as lm-eval YAML + JSONL with absolute paths.

Each task is a multiple-choice set scored by log-likelihood (``acc``). The
prompt is rendered in Python (``zoo.finetune.prompt``) and stored per item, so
training and evaluation cannot drift apart. Files live in
``<cache>/tasks/<hash>/``, where the hash covers the items: different data is
a different directory, never an overwrite.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from mergeval.errors import UserError
from mergeval.paths import atomic_dir
from mergeval.zoo.domains import Item, eval_items
from mergeval.zoo.experts import EVAL_POOL
from mergeval.zoo.finetune import prompt

PREFIX = "mergeval_"


def _general(n: int) -> list[Item]:
    from mergeval.zoo.general import general_items

    return general_items(0, n)


GENERATED: dict[str, Callable[[int], list[Item]]] = {
    "mergeval_chem_count": lambda n: eval_items("chem_count", n),
    "mergeval_unit_convert": lambda n: eval_items("unit_convert", n),
    "mergeval_general_facts": _general,
}

_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""


def check_tasks(names: list[str], n_items: int) -> None:
    """Fail on an unknown task name or an item count outside what the generators hold out."""
    if not names:
        raise UserError("benchmark.tasks", "no tasks", f"list some of: {', '.join(sorted(GENERATED))}")
    unknown = [n for n in names if n not in GENERATED]
    if unknown:
        raise UserError("benchmark.tasks", f"unknown generated task(s) {unknown}",
                        f"choose from: {', '.join(sorted(GENERATED))}")
    if not 1 <= n_items <= EVAL_POOL:
        raise UserError("benchmark.n_items", f"must be in [1, {EVAL_POOL}], got {n_items}",
                        "set e.g. benchmark.n_items=200")


def write_tasks(names: list[str], n_items: int, cache: Path) -> Path:
    """Write every generated task in ``names``; returns the directory to give lm-eval as include_path."""
    check_tasks(names, n_items)
    rows = {name: [dict(item, prompt=prompt(item["question"])) for item in GENERATED[name](n_items)]
            for name in names}
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    target = cache / "tasks" / digest
    if not target.exists():
        with atomic_dir(target) as tmp:
            for name, items in rows.items():
                (tmp / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
                data = target / f"{name}.jsonl"  # absolute path of the final location
                (tmp / f"{name}.yaml").write_text(_YAML.format(name=name, data=json.dumps(str(data))))
    return target


def task_digest(task_dir: Path, name: str) -> str:
    """Hash of a task's YAML and data: identifies exactly what was evaluated."""
    h = hashlib.sha256()
    for suffix in (".yaml", ".jsonl"):
        h.update((task_dir / f"{name}{suffix}").read_bytes())
    return h.hexdigest()[:16]
