"""Hydra's basic sweeper, with the sweep an experiment lists in ``hydra.sweeper.params`` read as the command line is.

A free mapping's keys are the user's (``benchmark.fewshot.<task>``, ``eval.gen_kwargs.<key>``,
``metric.weights.<group>``...), but Hydra composes in struct mode, where a key the mapping does not have yet is
refused ("no such field"). On the command line mergeval writes such overrides as Hydra's ``++`` (set or add:
``mergeval.config.open_mappings``); this sweeper does the same for the overrides it builds from
``hydra.sweeper.params``, so an experiment can sweep ``benchmark.fewshot.mmlu: 0,5`` as the command line can.
Everything else is Hydra's basic sweeper (the cartesian product, batches, the launcher). mergeval's config
selects it (``conf/config.yaml``); ``hydra/sweeper=basic`` selects Hydra's own.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside sys.modules, where
# dataclasses cannot resolve string annotations.
from dataclasses import dataclass

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore


@dataclass
class MergevalBasicSweeperConf:
    """``hydra.sweeper.*``: the fields of Hydra's basic sweeper."""

    _target_: str = "hydra_plugins.mergeval_basic_sweeper.basic_sweeper.MergevalBasicSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="mergeval_basic", node=MergevalBasicSweeperConf,
                             provider="mergeval")


class MergevalBasicSweeper(BasicSweeper):
    def _parse_config(self) -> list[str]:
        from mergeval.config import open_mappings

        return open_mappings(super()._parse_config())
