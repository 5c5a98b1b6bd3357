"""The tasks mergeval generates, written as lm-eval YAML + JSONL with absolute paths.

Each task is a multiple-choice set scored by log-likelihood (``acc``). The
prompt is rendered in Python and stored per item, so training and evaluation
cannot drift apart. Files live in ``<cache>/tasks/<hash>/``, where the hash
covers the items: different data is a different directory, never an overwrite.

Every generated task comes in two formats over the same items (same order,
same gold index), so a model's answers can be compared across formats
(``metric.consistency``):

- cloze, ``X``: the training prompt (``zoo.finetune.prompt``); the choices
  are the answer texts themselves (continuation ``" 12 atoms"``);
- lettered, ``X_mc``: the question, then the choices as ``A. ...``,
  ``B. ...``, then ``Answer:`` (``lettered_prompt``); the choices are the
  letters (continuation ``" A"``).

Each generated task has a fixed pool of held-out items (never trained on).
The test split is a prefix of the pool and the validation split (used to rank
experts, e.g. by CMM) is taken from its end, so the two never share an item
as long as ``n_items + n_validation <= pool size`` (checked).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir, atomic_write_text
from mergeval.models.zoo.domains import DOMAINS, Item, eval_items
from mergeval.models.zoo.experts import EVAL_POOL
from mergeval.models.zoo.finetune import prompt

PREFIX = "mergeval_"


def _general(n: int) -> list[Item]:
    from mergeval.models.zoo.general import general_items

    return general_items(0, n)


def _domain(domain: str) -> Callable[[int], list[Item]]:
    return lambda n: eval_items(domain, n)


# One task per expert domain (mergeval_<domain>), plus general knowledge.
_CLOZE: dict[str, Callable[[int], list[Item]]] = {
    **{PREFIX + domain: _domain(domain) for domain in DOMAINS},
    "mergeval_general_facts": _general,
}
LETTERED = "_mc"  # suffix of the lettered multiple-choice format of a cloze task
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

GENERATED: dict[str, Callable[[int], list[Item]]] = {**_CLOZE, **{n + LETTERED: gen for n, gen in _CLOZE.items()}}


def items_of(name: str) -> str:
    """The cloze task whose items ``name`` asks: itself, or the task a lettered ``X_mc`` reformats."""
    cloze = name.removesuffix(LETTERED)
    return cloze if name.endswith(LETTERED) and cloze in _CLOZE else name


def same_items(a: str, b: str) -> bool:
    """Whether two generated tasks ask the same items (the same task in two formats, or one task twice)."""
    return a in GENERATED and b in GENERATED and items_of(a) == items_of(b)


# Held-out items per task: the domains' evaluation pool, or every general question there is.
_CLOZE_POOL = {**{PREFIX + domain: EVAL_POOL for domain in DOMAINS}, "mergeval_general_facts": 351}
POOL = {name: _CLOZE_POOL[items_of(name)] for name in GENERATED}


def lettered_prompt(item: Item) -> str:
    """The lettered multiple-choice prompt: the question, one ``X. choice`` line per choice, ``Answer:``.

    The scored continuation is then ``" A"``, ``" B"`` ... (lm-eval puts a space between prompt and choice).
    """
    if len(item["choices"]) > len(LETTERS):
        raise ValueError(f"{len(item['choices'])} choices, more than the {len(LETTERS)} letters")
    options = "".join(f"{letter}. {choice}\n" for letter, choice in zip(LETTERS, item["choices"]))
    return f"Question: {item['question']}\n{options}Answer:"


def _row(name: str, item: Item) -> dict:
    """One JSONL row of task ``name``: the item, its rendered prompt and (lettered format) its letters."""
    if items_of(name) != name:
        return dict(item, prompt=lettered_prompt(item), letters=list(LETTERS[: len(item["choices"])]))
    # The cloze row is exactly what it was before the lettered format existed: its bytes make the task
    # digest, the key of every stored evaluation.
    return dict(item, prompt=prompt(item["question"]))


_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  cache_dir: {hf_cache}
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{{choices}}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""


def datasets_cache(cache: Path) -> Path:
    """Where the datasets library keeps what it builds from mergeval's local files: under the run's cache
    directory, never ~/.cache/huggingface (hub data sets keep the user's Hugging Face cache)."""
    return cache / "hf_datasets"


def check_tasks(names: list[str], n_items: int, n_validation: int = 0) -> None:
    """Fail on an unknown task name or item counts outside what the generators hold out."""
    if not names:
        raise UserError("benchmark.tasks", "no tasks", f"list some of: {', '.join(sorted(GENERATED))}")
    unknown = [n for n in names if n not in GENERATED]
    if unknown:
        raise UserError(
            "benchmark.tasks", f"unknown generated task(s) {unknown}", f"choose from: {', '.join(sorted(GENERATED))}"
        )
    if not 1 <= n_items <= EVAL_POOL:
        raise UserError(
            "benchmark.n_items", f"must be in [1, {EVAL_POOL}], got {n_items}", "set e.g. benchmark.n_items=200"
        )
    for name in names:
        if n_items + n_validation > POOL[name]:
            field = "benchmark.n_items" if n_validation == 0 else "method.validation_items"
            raise UserError(
                field,
                f"{name} holds {POOL[name]} items, fewer than {n_items} test + {n_validation} validation",
                "lower benchmark.n_items or method.validation_items",
            )


def task_items(name: str, n_items: int, split: str = "test", n_validation: int = 0) -> list[Item]:
    """The test split (first n_items of the pool) or the validation split (its last n_validation)."""
    if split == "test":
        return GENERATED[name](n_items)
    return GENERATED[name](POOL[name])[POOL[name] - n_validation :]


def write_tasks(names: list[str], n_items: int, cache: Path, split: str = "test", n_validation: int = 0) -> Path:
    """Write every generated task in ``names``; returns the directory to give lm-eval as include_path.

    ``split="validation"`` writes the same task names over the validation items instead.
    """
    check_tasks(names, n_items, n_validation)
    rows = {name: [_row(name, item) for item in task_items(name, n_items, split, n_validation)] for name in names}
    # The directory is named by the items and the YAML layout (2: datasets' cache_dir under the run's cache),
    # so a directory written by an older layout is not reused; task_digest, the store's key, is unchanged.
    digest = hashlib.sha256(json.dumps({"rows": rows, "layout": 2}, sort_keys=True).encode()).hexdigest()[:16]
    target = cache / "tasks" / digest
    if not target.exists():
        with atomic_dir(target) as tmp:
            for name, items in rows.items():
                (tmp / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
                (tmp / f"{name}.yaml").write_text(_task_yaml(name, target, cache))
    else:  # a cache copied or moved elsewhere: its YAMLs still name the old place's files
        for name in rows:
            yaml = _task_yaml(name, target, cache)
            if (target / f"{name}.yaml").read_text() != yaml:
                atomic_write_text(target / f"{name}.yaml", yaml)  # the same digest (task_digest drops the place)
    return target


def _task_yaml(name: str, target: Path, cache: Path) -> str:
    """The lm-eval YAML of generated task ``name`` whose data lies in ``target`` (absolute paths)."""
    choices = "choices" if items_of(name) == name else "letters"  # what the model is asked to say
    return _YAML.format(
        name=name,
        data=json.dumps(str(target / f"{name}.jsonl")),
        choices=choices,
        hf_cache=json.dumps(str(datasets_cache(cache))),
    )


def task_digest(task_dir: Path, name: str) -> str:
    """Hash of a task's YAML and data: identifies exactly what was evaluated."""
    h = hashlib.sha256()
    # The YAML names its data by absolute path; hash it without the directory so the same task
    # written into another cache directory keeps its digest (and its stored evaluations).
    # Where the datasets library caches is no part of what is evaluated: that line is left out (digests of
    # tasks written before it existed stay the same).
    yaml = "".join(
        line
        for line in (task_dir / f"{name}.yaml").read_text().splitlines(keepends=True)
        if not line.startswith("  cache_dir: ")
    )
    h.update(yaml.replace(str(task_dir), "<task_dir>").encode())
    h.update((task_dir / f"{name}.jsonl").read_bytes())
    return h.hexdigest()[:16]
