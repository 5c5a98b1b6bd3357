"""A Hydra sweeper that evaluates a ``-m`` sweep's merges in stages instead of running every job in full.

    python -m mergeval -m hydra/sweeper=staged method=task_arithmetic,ties method.lambda_=0.5,1.0,1.5,2.0

Each job of the sweep (expanded as Hydra's basic sweeper does, ``hydra.sweeper.params``
first, then the command line) is one candidate merge of a staged sweep
(mergeval/staged/pipeline.py): perplexity on held-out text for every candidate,
part of the benchmark for the best ``staged.stage1_keep``, all of it for the best
``staged.stage3_keep``. The stage sizes are the ``staged.*`` fields. The result is
``staged.json`` in the sweep directory (what ``python -m mergeval.staged`` writes),
and every benchmark evaluation lands in the results store as a normal run's does.
Only the method may vary between jobs (mergeval/staged/from_sweep.py).

No launcher is used: the candidates are merged one at a time in this process.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside sys.modules, where
# dataclasses cannot resolve string annotations.
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class StagedSweeperConf:
    """``hydra.sweeper.*`` of ``hydra/sweeper=staged``; the stage sizes are the run config's ``staged.*``."""

    _target_: str = "hydra_plugins.mergeval_staged_sweeper.staged_sweeper.StagedSweeper"
    # the sweep as overrides, e.g. {method.lambda_: "0.5,1.0"} (as Hydra's basic sweeper's params)
    params: dict[str, str] | None = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/sweeper", name="staged", node=StagedSweeperConf, provider="mergeval")


class StagedSweeper(Sweeper):
    def __init__(self, params: dict[str, str] | None = None) -> None:
        self.params = dict(params or {})
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def sweep(self, arguments: list[str]) -> Any:
        from mergeval.core.errors import UserError
        from mergeval.run.cli import failing_cleanly
        from mergeval.run.rerun import run_command
        from mergeval.run.sweep_check import expand, job_label, swept_positions
        from mergeval.staged import report
        from mergeval.staged.from_sweep import SWEEPER, staged_config
        from mergeval.staged.pipeline import run_staged

        assert self.config is not None and self.hydra_context is not None
        out_dir = Path(self.config.hydra.sweep.dir)
        with failing_cleanly(out_dir):
            jobs = expand(list(arguments), {str(k): str(v) for k, v in self.params.items()})
            if jobs is None:
                raise UserError(
                    SWEEPER,
                    "cannot expand this sweep (a parse error, or a range or glob sweep)",
                    "list each swept value, e.g. method.lambda_=0.5,1.0,1.5",
                )
            swept = swept_positions(jobs)
            labels = [job_label(job, swept) or "the only job" for job in jobs]
            configs = []
            for job in jobs:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
                with open_dict(cfg):
                    del cfg["hydra"]
                configs.append(cfg)
            cfg = staged_config(configs, labels)
            log.info(f"staged sweep of {len(jobs)} candidates -> {out_dir}")
            outcome = run_staged(cfg)
            if outcome.pick is not None:  # the picked job's own overrides compose the very config it merged
                picked = [c.label for c in outcome.candidates].index(outcome.pick)
                outcome.pick_command = run_command(list(jobs[picked]), ("staged",), {})
            report.render(outcome, title=f"staged sweep · {cfg.modelset.name} · {cfg.benchmark.name}")
            out_dir.mkdir(parents=True, exist_ok=True)
            written = report.write(cfg, outcome, out_dir)
            OmegaConf.save(self.config, out_dir / "multirun.yaml")  # as Hydra's basic sweeper leaves it
        print(f"staged: {written}")
        return outcome
