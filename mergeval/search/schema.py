"""The ``search`` section (``conf/search/*.yaml``) and the schema of ``python -m mergeval.search``'s config.

``conf/search_run.yaml`` composes the run config of ``python -m mergeval``
(``config``), then this schema, then a search preset, so every run override
(``+experiment=``, ``method=``, ``eval.*``) works unchanged and a misspelt
``search.*`` key fails at compose time. The schema comes after ``config``
because OmegaConf merges only a subclass onto a structured config; it sets no
value of the run config (``tests/search/test_search.py`` checks the two compose alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from mergeval.run.config import RunConfig, register_configs

OBJECTIVES = ("macro_gain", "macro_og", "mean_accuracy", "normalized")
SAMPLERS = ("tpe", "cmaes", "random")
PRUNERS = ("stages", "none")


@dataclass
class SearchConfig:
    """What to tune, against what, and how (see the README's "Searching for a recipe")."""

    method: str | None = None  # the method the space is written for (checked against the run's method.name)
    space: dict[str, Any] = field(default_factory=dict)  # method field -> {low, high, log, step, per_expert, depth}
    objective: str = "macro_gain"  # macro_gain | macro_og | mean_accuracy | normalized, on the validation split
    n_trials: int = 50  # trials of the study in all (a resumed study runs only the missing ones)
    sampler: str = "tpe"  # tpe | cmaes | random
    random_trials: int = 10  # the sampler's first trials drawn at random (TPE's and CMA-ES's startup)
    seed: int = 0  # the sampler's seed
    study: str | None = None  # the study's name in the store database; null: derived from the search's setup
    validation_items: int = 100  # items per task in the validation split (the end of each task's held-out pool)
    heldout_items: int = 32  # stage 1: held-out answers per expert task whose perplexity is scored
    stage2_fraction: float = 0.25  # stage 2: the share of the validation items scored before the rest
    pruner: str = "stages"  # stages: prune a trial behind at stage 1 or 2 | none: score every trial in full
    keep_percent: float = 50.0  # a trial goes on when it is in the top keep_percent% at its stage
    prune_at: list[int] = field(default_factory=lambda: [1, 2])  # the stages whose ranking may prune (1, 2)
    startup_trials: int = 5  # trials completed before any is pruned
    degrade_threshold: float = 1.0  # pruned at stage 1 when its held-out perplexity exceeds the experts' by this
    start_from_default: bool = True  # the default recipe, already scored, seeds the study as a free trial
    test: bool = True  # after tuning, score the best recipe and the method's default on the test split


@dataclass
class SearchRunConfig(RunConfig):
    search: SearchConfig = field(default_factory=SearchConfig)


def register_search_configs() -> None:
    register_configs()
    ConfigStore.instance().store(name="search_run_schema", node=SearchRunConfig)
