"""lm-eval's TaskManager with its registry index kept on disk.

Building a ``TaskManager`` parses every YAML under ``lm_eval/tasks`` (over ten
thousand files): seconds of work paid by every run, check and sweep job that
names a registry task, before any model is touched.
The parsed index of that one directory is pickled into the cache
(``<cache>/lm_eval_index/``) under a key made of lm-eval's version, the
directory and the size and modification time of every YAML in it, so an
upgraded or edited registry is indexed again; loading it is far cheaper.
The user's own directories (``benchmark.include_path``, mergeval's generated
tasks) are small and always parsed afresh. The result is the index lm-eval
builds itself: directories are merged in the same order, later names shadowing
earlier ones (a test compares the two).

The cache holds a pickle, so it is trusted as the rest of the cache is (the
cache directory is the user's own). Where lm-eval's internals differ from the
version this was written for (no ``TaskIndex`` in ``lm_eval.tasks.manager``),
the plain ``TaskManager`` is used.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from pathlib import Path

_SWAP = threading.Lock()  # the index class is swapped module-wide while one manager is built
_LOADED: dict[Path, dict] = {}  # the registry's index once loaded in this process (a sweep's jobs, data overrides)


def task_manager(include_path: list[str] | None, include_defaults: bool, cache: Path | None):
    """``lm_eval.tasks.TaskManager(include_path=..., include_defaults=...)``, its registry index from ``cache``."""
    from lm_eval.tasks import TaskManager

    try:
        from lm_eval.tasks import manager as module
        from lm_eval.tasks._index import TaskIndex
    except ImportError:
        module = None
    if cache is None or not include_defaults or getattr(module, "TaskIndex", None) is not TaskIndex:
        return TaskManager(include_path=include_path, include_defaults=include_defaults)
    registry, index_cache = Path(module.__file__).parent, cache  # index_cache: a Path (for the class below)

    class CachedIndex(TaskIndex):
        @staticmethod
        def build(paths, *, resolve_includes=True):
            index: dict = {}
            for root in paths:  # the same merge as TaskIndex.build: later directories shadow earlier names
                if Path(root) == registry and resolve_includes:
                    index.update(_registry_index(registry, index_cache))
                else:
                    index.update(TaskIndex.build([root], resolve_includes=resolve_includes))
            return index

    with _SWAP:
        module.TaskIndex = CachedIndex
        try:
            return TaskManager(include_path=include_path, include_defaults=True)
        finally:
            module.TaskIndex = TaskIndex


def _registry_index(registry: Path, cache: Path) -> dict:
    """The registry's index: from this process's memory, else the cache, else built (and cached)."""
    if registry not in _LOADED:
        _LOADED[registry] = _load_or_build(registry, cache)
    return _LOADED[registry]


def _load_or_build(registry: Path, cache: Path) -> dict:
    from lm_eval.tasks._index import TaskIndex

    from mergeval.core.paths import atomic_write_bytes

    path = cache / "lm_eval_index" / f"{_registry_key(registry)}.pickle"
    try:
        return pickle.loads(path.read_bytes())
    except Exception:  # not built yet, or damaged: indexed again and (re)written below
        pass
    index = TaskIndex.build([registry])
    try:
        atomic_write_bytes(path, pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:  # a read-only or full cache costs the next run the same seconds, nothing else
        pass
    return index


def _registry_key(registry: Path) -> str:
    """lm-eval's version, the directory, and (path, size, mtime) of every YAML under it (a stat each, no parse)."""
    import lm_eval

    digest = hashlib.sha256(f"{getattr(lm_eval, '__version__', '?')}\0{registry}\0".encode())
    for parent, _, files in sorted(os.walk(registry)):
        for name in sorted(f for f in files if f.endswith((".yaml", ".yml"))):
            stat = os.stat(os.path.join(parent, name))
            digest.update(f"{os.path.relpath(parent, registry)}/{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]
