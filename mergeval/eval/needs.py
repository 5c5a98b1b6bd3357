"""What a benchmark needs before it can run, read from lm-eval's task index without loading any data.

For each ``benchmark.tasks`` entry: its leaf tasks (groups and tags expanded
through the index) and each leaf's data source: mergeval's generated data,
local files (``benchmark.data``), or a Hugging Face data set (``dataset_path``
and ``dataset_name``), with whether the local caches hold it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import dir_size
from mergeval.eval.tasks import GENERATED


@dataclass(frozen=True)
class DataNeed:
    entry: str  # the benchmark.tasks name
    task: str  # a leaf task
    source: str  # "generated", "local files", or the hub data set "path[/name]"
    present: bool
    where: str  # a path, or what is missing
    size: int | None  # bytes, when present and known
    fetch: str | None  # the command that fetches it, when missing
    unsafe_code: bool = False  # the task executes generated code (needs eval.allow_code_execution)


def data_needs(bench, include_dirs: list[Path], cache: Path | None = None) -> list[DataNeed]:
    """One DataNeed per leaf task of every entry (UserError for a name no index knows)."""
    from mergeval.eval.task_index import task_manager

    names = [t for t in bench.tasks if t not in GENERATED]
    manager = task_manager([str(p) for p in include_dirs] or None, include_defaults=bool(names), cache=cache)
    index = manager.task_index
    out = []
    for entry in bench.tasks:
        if entry in GENERATED:
            out.append(DataNeed(entry, entry, "generated", True, "written by mergeval", None, None))
            continue
        if entry not in index:
            raise UserError(
                "benchmark.tasks",
                f"unknown task '{entry}'",
                "see `lm_eval ls tasks`, or add its directory to benchmark.include_path",
            )
        for leaf in _leaves(entry, index):
            out.append(_need(entry, leaf, index[leaf].cfg or {}, bench))
    return out


def _leaves(name: str, index, seen: frozenset = frozenset()) -> list[str]:
    entry = index.get(name)
    if entry is None or name in seen:
        return []
    kind = entry.kind.name
    if kind in ("TASK", "PY_TASK"):
        return [name]
    members = (
        sorted(entry.tags)
        if kind == "TAG"
        else [m if isinstance(m, str) else m.get("task") for m in (entry.cfg or {}).get("task", [])]
    )
    return [leaf for m in members if m for leaf in _leaves(m, index, seen | {name})]


def _need(entry: str, task: str, cfg: dict, bench) -> DataNeed:
    unsafe = bool(cfg.get("unsafe_code"))
    override = (bench.data or {}).get(task) or (bench.data or {}).get(entry)
    if override:
        from mergeval.eval.suite import SHIPPED, SHIPPED_PREFIX

        paths = [
            SHIPPED / f.removeprefix(SHIPPED_PREFIX) if f.startswith(SHIPPED_PREFIX) else Path(f).expanduser()
            for f in override.values()
        ]
        missing = [str(p) for p in paths if not p.is_file()]
        return DataNeed(
            entry,
            task,
            "local files",
            not missing,
            missing[0] if missing else str(paths[0].parent),
            None if missing else sum(p.stat().st_size for p in paths),
            None if not missing else "give existing files in benchmark.data",
            unsafe,
        )
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    if not path:
        return DataNeed(entry, task, "defined in code", True, "the task builds its own data", None, None, unsafe)
    if Path(str(path)).expanduser().is_dir():
        local = Path(str(path)).expanduser()
        return DataNeed(entry, task, str(path), True, str(local), dir_size(local), None, unsafe)
    label = f"{path}/{name}" if name else str(path)
    found = _cached_dataset(str(path))
    if (cfg.get("dataset_kwargs") or {}).get("data_files"):  # files picked from the repository: fetch all of it
        fetch = f"hf download --repo-type dataset {path}"
    else:
        fetch = f"python -c \"import datasets; datasets.load_dataset('{path}'{', ' + repr(name) if name else ''})\""
    return DataNeed(
        entry,
        task,
        label,
        found is not None,
        str(found) if found else "not in the local caches",
        dir_size(found) if found else None,
        None if found else fetch,
        unsafe,
    )


def _cached_dataset(repo: str) -> Path | None:
    """The local copy of hub data set ``repo``: the hub cache's snapshot or the datasets library's own cache."""
    from huggingface_hub.constants import HF_HUB_CACHE

    hub = Path(HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}"
    if hub.is_dir() and any((hub / "snapshots").glob("*")):
        return hub
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", Path.home() / ".cache" / "huggingface" / "datasets"))
    own = datasets_cache / repo.replace("/", "___")
    return own if own.is_dir() else None
