"""A Hydra launcher that runs a sweep's jobs as Ray tasks, on a local Ray instance or a running cluster.

Why not hydra-ray-launcher 1.2.2: it does run a local sweep on Ray 2.60, but it
pins ``cloudpickle<3`` while joblib 1.6 (Hydra's joblib launcher, mergeval's
local default) needs ``cloudpickle>=3``, so both cannot be installed together;
it also pulls ``ray[default]`` and boto3 (its AWS autoscaler launcher), over
120 MB more than Ray itself. This launcher is Hydra's documented Launcher
interface on plain ``ray``: each job is one task that composes its config,
runs it with Hydra's ``run_job`` (its own job directory, logging, outputs) and
returns Hydra's ``JobReturn``.

What the basic launcher gives is kept: a job that ends with ``sys.exit(code)``
(mergeval's one-line errors, exit 2) does not take the Ray worker down (Ray
would report a crashed worker and retry the task); its code is carried back
and the sweep exits with it once every job has ended. Tasks are never retried
(a run is recorded once). Ctrl-C or SIGTERM in the sweep cancels the jobs:
running ones get a KeyboardInterrupt, so they are recorded as interrupted.
``gpus_per_job`` is each task's ``num_gpus``: Ray places the jobs and makes only
their GPUs visible to them (``eval.device=auto`` evaluates there); a value no
node can serve is one line (``check_gpus_per_job``), not a sweep that waits
forever.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside sys.modules, where
# dataclasses cannot resolve string annotations.
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)
CANCEL_WAIT_S = 60  # how long an interrupted sweep waits for its cancelled jobs to record themselves


@dataclass
class RayLauncherConf:
    """``hydra.launcher.*`` of ``hydra/launcher=ray`` (mergeval's preset sets the common ones)."""

    _target_: str = "hydra_plugins.mergeval_ray_launcher.ray_launcher.RayLauncher"
    # a running cluster to join ("auto", "ray://head:10001"); null starts a local instance for the sweep
    address: str | None = None
    # a local instance's resources (null: what the machine has); ignored when joining a cluster
    num_cpus: int | None = None
    num_gpus: int | None = None
    # what each job reserves: Ray runs as many jobs at once as the resources allow
    cpus_per_job: float = 1.0
    gpus_per_job: float = 0.0
    include_dashboard: bool = False
    # Ray's runtime_env for the jobs, e.g. {env_vars: {MERGEVAL_CACHE: /shared/cache}}
    runtime_env: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/launcher", name="mergeval_ray", node=RayLauncherConf, provider="mergeval")


@dataclass
class _Exited:
    """A job that called ``sys.exit``: its code, carried back instead of the worker dying."""

    code: int


def _job_exit_code(err: SystemExit) -> int:
    return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)


def _cancelled(signum, frame) -> None:
    raise KeyboardInterrupt("the sweep's cancel (Ctrl-C or SIGTERM)")  # the run's note: "interrupted by ..."


def _execute_job(
    idx: int,
    overrides: Sequence[str],
    hydra_context: HydraContext,
    config: DictConfig,
    task_function: TaskFunction,
    singleton_state: dict[Any, Any],
    cwd: str,
) -> JobReturn | _Exited:
    """One job inside a Ray worker: the sweep's working directory where it exists (relative job directories
    and paths mean what they meant in the sweep's process), Hydra's globals as in the parent, the job's
    config, Hydra's ``run_job``."""
    if os.path.isdir(cwd):
        os.chdir(cwd)
    if threading.current_thread() is threading.main_thread():
        # ray.cancel interrupts a running task as a SIGINT would: a worker started from a sweep that runs in
        # the background inherits SIGINT ignored, and then the cancelled job would run on to its end.
        signal.signal(signal.SIGINT, _cancelled)
    setup_globals()
    Singleton.set_state(singleton_state)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)
    try:
        return run_job(
            hydra_context=hydra_context,
            config=sweep_config,
            task_function=task_function,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    except SystemExit as err:
        return _Exited(_job_exit_code(err))


class RayLauncher(Launcher):
    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        cpus_per_job: float = 1.0,
        gpus_per_job: float = 0.0,
        include_dashboard: bool = False,
        runtime_env: dict[str, Any] | None = None,
    ) -> None:
        self.address, self.num_cpus, self.num_gpus = address, num_cpus, num_gpus
        self.cpus_per_job, self.gpus_per_job = cpus_per_job, gpus_per_job
        self.include_dashboard = include_dashboard
        self.runtime_env = (
            OmegaConf.to_container(runtime_env) if isinstance(runtime_env, DictConfig) else dict(runtime_env or {})
        )
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _init_ray(self) -> bool:
        """Start or join Ray unless this process already has; True if this launcher did (and so shuts it down)."""
        import ray

        if ray.is_initialized():
            return False
        local = self.address is None
        num_gpus = self.num_gpus
        if local and num_gpus is None:  # a simulated node (mergeval/core/gpus.py, a testing aid) has its GPUs in Ray
            from mergeval.core.gpus import simulated

            num_gpus = simulated()
        if not sys.stdout.isatty():  # jobs' lines reach a log file or a pipe: no colour codes in their prefix
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(
            address=self.address,
            num_cpus=self.num_cpus if local else None,
            num_gpus=num_gpus if local else None,
            include_dashboard=self.include_dashboard,
            runtime_env=self.runtime_env or None,
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
        # Ray's core worker installs a SIGTERM handler that aborts the process; the sweep's own (mergeval: like
        # Ctrl-C) comes back, so SIGTERM cancels the jobs as Ctrl-C does.
        signal.signal(signal.SIGTERM, sigterm)
        return True

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import ray

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            f"Ray launcher is launching {len(job_overrides)} jobs ({self.cpus_per_job} CPUs, "
            f"{self.gpus_per_job} GPUs each), sweep output dir: {sweep_dir}"
        )
        for idx, overrides in enumerate(job_overrides):
            log.info(f"\t#{initial_job_idx + idx} : {' '.join(filter_overrides(overrides))}")
        check_gpus_per_job(self.gpus_per_job, self.num_gpus if self.address is None else None)
        started = self._init_ray()
        try:
            if self.gpus_per_job > 0:  # a task no node can place would wait forever
                check_gpus_per_job(self.gpus_per_job, _most_gpus_on_a_node(), cluster=self.address is not None)
            # max_retries=0: a job whose worker died is reported, not run (and recorded) a second time
            task = ray.remote(_execute_job).options(
                num_cpus=self.cpus_per_job, num_gpus=self.gpus_per_job, max_retries=0, name="mergeval job"
            )  # its lines' prefix
            state = Singleton.get_state()
            refs = [
                task.remote(
                    initial_job_idx + idx,
                    list(overrides),
                    self.hydra_context,
                    self.config,
                    self.task_function,
                    state,
                    os.getcwd(),
                )
                for idx, overrides in enumerate(job_overrides)
            ]
            try:
                pending = refs
                while pending:  # short waits, so Ctrl-C / SIGTERM reach Python between them (not after a job)
                    _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
                results = ray.get(refs)
            except KeyboardInterrupt:
                for ref in refs:  # running jobs get a KeyboardInterrupt: recorded interrupted, temporary files gone
                    ray.cancel(ref)
                ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)  # let them clean up before shutdown
                raise
        finally:
            if started:
                ray.shutdown()
        return _returns(results, job_overrides)


def check_gpus_per_job(gpus_per_job: float, available: float | None, cluster: bool = False) -> None:
    """One line for a ``gpus_per_job`` Ray cannot place: negative, or more than the local instance's GPUs
    (``available``; None: not known yet). On a cluster, more than any node has now is only a warning: an
    autoscaler may add such a node."""
    from mergeval.core.errors import UserError

    if gpus_per_job < 0:
        raise UserError(
            "hydra.launcher.gpus_per_job",
            f"must be 0 or more, got {gpus_per_job}",
            "set 0 (CPU only) or the GPUs each job needs, e.g. 1",
        )
    if available is None or gpus_per_job <= available:
        return
    if cluster:
        log.warning(
            f"hydra.launcher.gpus_per_job={gpus_per_job}, but no node of the cluster has more than "
            f"{available:g} GPUs now: the jobs wait until the cluster has such a node"
        )
        return
    raise UserError(
        "hydra.launcher.gpus_per_job",
        f"{gpus_per_job:g} GPUs per job, but the local Ray instance has {available:g}",
        f"set hydra.launcher.gpus_per_job to at most {available:g} (0: CPU only), "
        "or run on a machine with more GPUs (hydra.launcher.num_gpus, CUDA_VISIBLE_DEVICES)",
    )


def _most_gpus_on_a_node() -> float:
    import ray

    return max((float(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0.0)


def _returns(results: list[JobReturn | _Exited], job_overrides: Sequence[Sequence[str]]) -> list[JobReturn]:
    """Hydra's JobReturns, once every job has ended; the first job that exited with a non-zero code ends the
    sweep with that code, as it would have ended the basic launcher's process."""
    codes = [r.code for r in results if isinstance(r, _Exited) and r.code != 0]
    if codes:
        raise SystemExit(codes[0])
    return [
        r if isinstance(r, JobReturn) else JobReturn(overrides=list(o), status=JobStatus.COMPLETED)
        for r, o in zip(results, job_overrides)
    ]
