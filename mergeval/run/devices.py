"""The GPU a job of a parallel sweep evaluates on (``hydra/launcher=parallel``: one job per GPU on one node).

Such a job whose ``eval.device`` resolves to ``cuda`` (the default ``auto`` on a
GPU machine, or ``cuda`` given) on a machine with more than one GPU claims one
for its length (``mergeval/core/gpus.py``) and runs with ``eval.device=cuda:K``:
result.json and the store's run record name that device. The store's evaluation
keys and the sweep's configuration hashes keep only ``cuda``, so a constituent
evaluated by the job on one GPU is reused by the job on another (the store's
claims make the others wait for it) and a resumed sweep finds every finished job.

Everything else is left as it was: a run outside a sweep, a sweep of another
launcher (Ray places its jobs itself: each sees the GPUs Ray gave it), a named
device (``cuda:1``, ``cpu``), a machine with one GPU or none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig

from mergeval.core import gpus

JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"


def parallel_job() -> int | None:
    """This job's number when it is a job of a sweep that Hydra's joblib launcher runs, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN or hydra.launcher.get("_target_") != JOBLIB:
        return None
    return int(hydra.job.num or 0)


@contextmanager
def job_device(cfg: DictConfig) -> Iterator[str | None]:
    """Around a job's work: on a parallel sweep's job that would run on ``cuda`` with several GPUs here, a
    device claimed for the job (``cfg.eval.device`` set to it, released at the end however the job ends) and
    one line saying which; yields the device claimed, or None (nothing changed)."""
    job = parallel_job()
    if job is None or cfg.eval.device not in ("auto", "cuda"):
        yield None
        return
    n = gpus.count()
    if n < 2:
        yield None
        return
    held = gpus.claim(n, preferred=job, holder={"job": job})
    try:
        cfg.eval.device = held.device
        shared = (
            f", shared with {held.shared_with} other job{'s' * (held.shared_with > 1)} (more jobs at once "
            f"than the {n} GPUs: hydra.launcher.n_jobs)"
            if held.shared_with
            else ""
        )
        simulated = " (simulated: computing on the CPU)" if gpus.simulated() is not None else ""
        print(f"mergeval: job {job} evaluates on {held.device} of {n}{shared}{simulated}", flush=True)
        yield held.device
    finally:
        held.release()
