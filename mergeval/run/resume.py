"""Resumable sweeps: a job's configuration hash, and skipping a configuration the store has finished.

Every run is recorded with ``config_hash(cfg)``. A job of a multirun (``-m``)
whose configuration the results store holds as ``finished`` is skipped: it
prints so, shows the earlier run's table and copies its result.json into its
own job directory (so a report over the new sweep directory sees every job),
and adds no row to the store. A sweep killed at any point and run again thus
ends with each configuration finished exactly once. ``sweep.resume=false``
(or ``eval.force=true``, which redoes merges and evaluations) runs it again.
A single run (no ``-m``) is never skipped: asking for one run is asking for it.
A configuration that a live process of this machine is running (a worker of a
sweep whose launching process was killed alone finishes its job) is skipped
too, so it is not recorded twice; run the sweep again once that has ended.

The hash is sha256 over the job's resolved config as canonical JSON, less what
cannot change its results (``IGNORED``), plus the versions of the packages
that compute them (``RESULT_PACKAGES``: an upgraded torch or lm-eval re-runs
the sweep). A ``mergekit`` file counts by its content, not its path. Model and
data paths count as written: a checkpoint replaced in place under the same
path is the same configuration, so re-run such a sweep with
``sweep.resume=false``. The hardware is not part of it either: a configuration
finished on one node type is not redone on another, nor one finished on a
node's GPU 2 (``eval.device=cuda:2``) on its GPU 0: ``eval.device`` counts by
its kind (``cuda``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mergeval.core.gpus import kind
from mergeval.core.outcome import ModelInfo, Outcome
from mergeval.core.plain import plain_dict

# Fields of the run config that do not change what a run computes, and why; dots reach into a group.
IGNORED = {
    "store": "where the run is recorded, not what it computes",
    "sweep": "how a sweep resumes and reports progress",
    "cache_dir": "where models, data and statistics are cached; each cached item is keyed by its content",
    "offline": "whether hub ids may be downloaded: the same model either way, or the run fails",
    "verbose": "what is printed",
    "output": "python -m mergeval.merge's output directory, unused by a run",
    "staged": "python -m mergeval.staged's sweep, unused by a run",
    "eval.force": "redoes merges and evaluations with the same results (and a forced job is never skipped)",
}
# The launcher, job and sweep directories, timestamps and Hydra's own settings live under ``hydra``, which a
# job's config does not contain.
RESULT_PACKAGES = ("mergeval", "torch", "transformers", "lm_eval")


def hashed_config(cfg: DictConfig) -> dict:
    """What ``config_hash`` hashes: the resolved config less ``IGNORED``, a mergekit file by its content, the
    versions of ``RESULT_PACKAGES`` and the method's implementation version when above 1."""
    config = plain_dict(cfg, resolve=True)
    for dotted in IGNORED:
        *parents, leaf = dotted.split(".")
        node: Any = config
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    if isinstance(config.get("eval"), dict) and isinstance(config["eval"].get("device"), str):
        # which of a node's GPUs ran it (a parallel sweep's job claims one: run/devices.py) is not part of it
        config["eval"]["device"] = kind(config["eval"]["device"])
    if isinstance(config.get("merge"), dict):
        # which GPU merged is not part of it either; merging on the CPU is what every run did before merge.device,
        # so such a config keeps its hash
        device = kind(str(config["merge"].get("device") or "cpu"))
        if device in ("cpu", "auto"):
            config.pop("merge")
        else:
            config["merge"]["device"] = device
    if config.get("mergekit"):
        path = Path(config["mergekit"]).expanduser()
        config["mergekit"] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else str(path)
        # the file gives the method and the modelset whole (mergekit_multi.apply replaces both): by its content
        # alone, the hash is the same before and after a job applies it
        config.pop("method", None)
        config.pop("modelset", None)
    config["_versions"] = dict(_result_versions())
    from mergeval.results.store import method_version

    # mergeval's package version does not move with its code: a method whose output changed raises its own
    # implementation version, and a finished run of the earlier implementation must not stand for this one
    version = method_version((config.get("method") or {}).get("name"))
    if version > 1:
        config["_versions"]["method_implementation"] = version
    return config


@functools.cache
def _result_versions() -> dict[str, str | None]:
    """The installed versions of ``RESULT_PACKAGES`` (read once: a sweep's process hashes every job)."""
    from mergeval.core.provenance import package_versions

    versions = package_versions()
    return {name: versions.get(name) for name in RESULT_PACKAGES}


def config_hash(cfg: DictConfig) -> str:
    """sha256 (hex, first 32 digits) of ``hashed_config(cfg)`` as canonical JSON (sorted keys)."""
    text = json.dumps(hashed_config(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def in_multirun() -> bool:
    """Whether this process runs a job of a multirun (any launcher sets Hydra's mode for its jobs)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def resumable(cfg: DictConfig) -> bool:
    """Whether this job may be skipped: a multirun job, ``sweep.resume`` on, ``eval.force`` off."""
    return in_multirun() and cfg.sweep.resume and not cfg.eval.force


def running_here(store, config_hash: str) -> dict | None:
    """A run of this configuration still running in a live process of this machine: a worker of a sweep whose
    launching process was killed goes on with its job (joblib's workers do), and a second run of it would
    record the configuration twice. Processes of other machines cannot be proven alive, so they never count."""
    from mergeval.core import proc

    host, me, _ = proc.me()
    for run in store.runs(status="running"):
        if (
            run.get("config_hash") == config_hash
            and run.get("host") == host
            and run.get("pid") != me
            and not proc.gone(run["host"], run["pid"], run.get("pid_start"))
        ):
            return run
    return None


def adopt(run: dict, out_dir: Path) -> dict | None:
    """A skipped job's report: one line saying which run finished its configuration, and that run's result.json
    copied into this job's directory (with ``resumed_from``), returned to be shown. None (and the line says
    so) when that file is gone: its scores are still in the store."""
    print(
        f"mergeval: skipped: this configuration finished before as run {run['run_id']} ({run['job_dir']}); "
        "sweep.resume=false runs it again",
        flush=True,
    )
    source = Path(run["result_path"])
    try:
        result = json.loads(source.read_text())
    except (OSError, ValueError):
        print(
            f"mergeval: its result.json ({source}) is gone or unreadable; the store keeps its scores "
            f"(python -m mergeval.results)",
            file=sys.stderr,
            flush=True,
        )
        return None
    from mergeval.core.outcome import result_text
    from mergeval.core.paths import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    result["resumed_from"] = {"run_id": run["run_id"], "result": str(source)}
    atomic_write_text(out_dir / "result.json", result_text(result))
    return result


def skip(cfg: DictConfig, out_dir: Path, title: str) -> bool:
    """At the start of a job: False to run it; True when it is skipped (``resumable``, and its configuration
    finished before or is ``running_here``). A finished one's table is shown under ``title`` and its
    result.json copied into ``out_dir``."""
    from mergeval.core.paths import cache_root
    from mergeval.report.table import render
    from mergeval.results.store import open_store

    if not resumable(cfg):
        return False
    store, wanted = open_store(cfg, cache_root(cfg.cache_dir)), config_hash(cfg)
    run = store.finished_run(wanted)
    if run is None:
        live = running_here(store, wanted)
        if live is not None:
            print(
                f"mergeval: skipped: this configuration is being run by process {live['pid']} on this machine "
                f"(a job of an earlier sweep, {live['job_dir']}); run the sweep again once it has ended",
                flush=True,
            )
        return live is not None
    result = adopt(run, out_dir)
    if result is not None:
        render(
            Outcome(
                [ModelInfo(**m) for m in result["models"]],
                result["tasks"],
                result["scores"],
                result["aggregates"],
                result["task_digests"],
                merge_info=result.get("merge", {}),
                rows=result.get("rows", {}),
            ),
            title=title,
        )
        print(f"result: {out_dir / 'result.json'} (copied from {run['result_path']})", flush=True)
    return True
