"""Per-item log-likelihoods of an evaluation, kept beside its scores for calibration metrics.

For every multiple-choice item lm-eval scores, we keep the log-likelihood of
each choice and the gold index (JSON lines: ``{"task", "doc_id", "lls",
"gold"}``), one file per evaluation under ``<cache>/samples/``. The results
store records the file's path with the scores, so a reused evaluation keeps its
samples, and calibration (ECE) can be computed for any stored evaluation
without running the model again.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from mergeval.core.paths import atomic_write_text


def collect(loaded_tasks: dict, tasks: list[str]) -> dict[str, list[dict]]:
    """task -> [{doc_id, lls (per choice, in choice order), gold}] from lm-eval's scored instances."""
    out: dict[str, list[dict]] = {}
    for task in tasks:
        obj = loaded_tasks[task]
        by_doc: dict[int, dict[int, float]] = defaultdict(dict)
        docs = {}
        for inst in obj.instances:
            by_doc[inst.doc_id][inst.idx] = float(inst.filtered_resps["none"][0])
            docs[inst.doc_id] = inst.doc
        out[task] = [
            {"doc_id": d, "lls": [lls[i] for i in sorted(lls)], "gold": gold_index(obj, docs[d])}
            for d, lls in sorted(by_doc.items())
        ]
    return out


def gold_index(task, doc) -> int:
    """The index of the right choice, as lm-eval reads ``doc_to_target``: an index, a digit string, or the
    text of one of the choices (e.g. the letter "C" of a lettered task)."""
    target = task.doc_to_target(doc)
    if isinstance(target, str) and not target.strip().isdigit():
        return list(task.doc_to_choice(doc)).index(target)
    return int(target)


def write(path: Path, samples: dict[str, list[dict]]) -> Path:
    lines = (json.dumps({"task": task, **row}) for task, rows in samples.items() for row in rows)
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path


def read(path: str | Path | None) -> dict[str, list[dict]] | None:
    """The samples of a stored evaluation, or None when it has none (older evaluations) or the file is gone."""
    if path is None or not Path(path).is_file():
        return None
    out: dict[str, list[dict]] = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        out[row.pop("task")].append(row)
    return dict(out)


def read_tasks(paths: dict[str, str | None]) -> dict[str, list[dict]] | None:
    """task -> its samples, each task read from its own evaluation's file (``Store.samples_paths``);
    None when any task has none (stored without samples, or the file is gone)."""
    out: dict[str, list[dict]] = {}
    files: dict[str | None, dict[str, list[dict]] | None] = {}
    for task, path in paths.items():
        if path not in files:
            files[path] = read(path)
        samples = files[path]
        if samples is None or task not in samples:
            return None
        out[task] = samples[task]
    return out


def path_for(cache: Path, fingerprint: str, settings_key: str, digests: dict[str, str]) -> Path:
    tasks_key = "-".join(sorted(digests.values()))[:64]
    return cache / "samples" / fingerprint[:32] / f"{settings_key}-{tasks_key}.jsonl"
