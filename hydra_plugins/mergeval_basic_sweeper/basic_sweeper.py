"""Hydra's basic sweeper, with ``hydra.sweeper.params`` read as mergeval reads its command line.

A mapping field's keys are the user's to choose (``benchmark.fewshot``, ``eval.gen_kwargs``): on the command line
``benchmark.fewshot.mmlu=0,5`` is opened to Hydra's ``++`` (set, or add) by ``mergeval.run.config.open_mappings``,
because Hydra composes the schema in struct mode, which refuses a key a mapping does not have yet. An experiment
sweeping the same key in ``hydra.sweeper.params`` must work alike; Hydra's basic sweeper has no hook for it, so this
plugin is that sweeper with its params opened in ``setup`` and nothing else changed.

It takes the place of Hydra's ``hydra/sweeper=basic`` in mergeval's own commands only: the option is stored
under that name when this module is scanned and the process has registered mergeval's config schema
(``mergeval.run.config.register_configs``), so other Hydra applications in the same environment keep Hydra's,
and an experiment's ``override /hydra/sweeper: ...`` (staged, Optuna's) still chooses another sweeper.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside sys.modules, where
# dataclasses cannot resolve string annotations.
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class MergevalBasicSweeperConf:
    """``hydra.sweeper.*``: Hydra's basic sweeper's fields."""

    _target_: str = "hydra_plugins.mergeval_basic_sweeper.basic_sweeper.MergevalBasicSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None


class MergevalBasicSweeper(BasicSweeper):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from mergeval.run.config import open_key, sweep_sections

        sections = sweep_sections(config)
        self.params = {open_key(str(key), sections): value for key, value in (self.params or {}).items()}
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)


def _in_a_mergeval_command() -> bool:
    store: Any = ConfigStore.instance().repo
    return "run_schema.yaml" in store


if _in_a_mergeval_command():
    ConfigStore.instance().store(
        group="hydra/sweeper", name="basic", node=MergevalBasicSweeperConf, provider="mergeval"
    )
