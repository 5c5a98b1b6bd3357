"""The Optuna study of a search: kept in the results store's database, so a search resumes where it stopped.

Optuna's own tables (``studies``, ``trials``, ...) live beside the store's
(``runs``, ``evaluations``, ...) in the same SQLite file, or in the same server
database when ``store.url`` names one. A study is named by what it searches
(method, modelset, benchmark, objective, space, validation items, evaluation
settings) unless ``search.study`` names it; rerunning the same search loads
it and runs only the trials still missing. A trial left ``RUNNING`` by a
process that is provably gone (``mergeval.core.proc``) is marked ``FAIL`` first,
and failed trials do not count towards ``search.n_trials``.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.trial import TrialState

from mergeval.core import proc
from mergeval.core.errors import UserError
from mergeval.core.plain import plain_dict
from mergeval.search.schema import OBJECTIVES, PRUNERS, SAMPLERS, SearchRunConfig
from mergeval.staged.nll import NLL_VERSION

DONE_STATES = ("COMPLETE", "PRUNED")  # trials that count towards search.n_trials


def storage_url(cfg: SearchRunConfig, cache: Path) -> str:
    """SQLAlchemy URL of the results store's database, SQLite file or server (opening the store creates or
    migrates it first)."""
    from mergeval.results.store import open_store

    return open_store(cfg, cache).sqlalchemy_url()


def study_name(cfg: SearchRunConfig, space_digest: str, settings: dict) -> str:
    """``search.study``, or ``<method>-<modelset>-<benchmark>-<objective>-<hash of the rest>``."""
    if cfg.search.study:
        return str(cfg.search.study)
    s = cfg.search
    identity = {
        "space": space_digest,
        "validation_items": s.validation_items,
        "settings": settings,
        "heldout_nll_version": NLL_VERSION,
        "tasks": list(cfg.benchmark.tasks),
        "n_items": cfg.benchmark.n_items,
        "seed": cfg.seed,
        "sampler": s.sampler,
        "method": plain_dict(cfg.method, resolve=True),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{cfg.method.name}-{cfg.modelset.name}-{cfg.benchmark.name}-{s.objective}-{digest}"


def check_search(s) -> None:
    """The ``search`` section's own values (the space is checked by ``space.parse_space``)."""
    checks = [
        ("objective", s.objective in OBJECTIVES, f"use one of: {', '.join(OBJECTIVES)}"),
        ("sampler", s.sampler in SAMPLERS, f"use one of: {', '.join(SAMPLERS)}"),
        ("pruner", s.pruner in PRUNERS, f"use one of: {', '.join(PRUNERS)}"),
        ("n_trials", s.n_trials >= 1, "set e.g. search.n_trials=50"),
        ("random_trials", s.random_trials >= 1, "set e.g. search.random_trials=10"),
        ("validation_items", s.validation_items >= 2, "set e.g. search.validation_items=100"),
        ("heldout_items", s.heldout_items >= 1, "set e.g. search.heldout_items=32"),
        ("stage2_fraction", 0 < s.stage2_fraction < 1, "set e.g. search.stage2_fraction=0.25"),
        ("keep_percent", 0 < s.keep_percent <= 100, "set e.g. search.keep_percent=50"),
        ("prune_at", set(s.prune_at) <= {1, 2}, "list stages 1 and/or 2, e.g. search.prune_at=[2]"),
        ("startup_trials", s.startup_trials >= 1, "set e.g. search.startup_trials=5"),
        ("degrade_threshold", s.degrade_threshold > 0, "set e.g. search.degrade_threshold=1.0"),
    ]
    for key, ok, fix in checks:
        if not ok:
            raise UserError(f"search.{key}", f"invalid value {s[key]!r}", fix)


def sampler(s, offset: int = 0):
    """TPE (multivariate: lambda and the weights act together), CMA-ES or random, seeded with ``seed + offset``.

    A resumed study passes its number of trials as ``offset``: a sampler seeded as
    in the first process would draw that process's random points again.
    """
    seed = s.seed + offset
    if s.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.random_trials, multivariate=True)
    if s.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401  (Optuna's CMA-ES sampler needs it)
        except ImportError:
            raise UserError(
                "search.sampler", "cmaes needs the cmaes package", "pip install 'mergeval[cluster]'"
            ) from None
        return optuna.samplers.CmaEsSampler(
            seed=seed, n_startup_trials=s.random_trials, warn_independent_sampling=False
        )
    return optuna.samplers.RandomSampler(seed=seed)


@contextmanager
def opened_study(cfg: SearchRunConfig, cache: Path, name: str, space_digest: str):
    """Inside the block: (the study ``name``, created or loaded, maximised; the numbers of its trials found
    orphaned and failed). A study that searched another space or objective is refused. The storage's
    connections are closed when the block ends."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = cfg.search
    pruner = (
        StagePruner(s.keep_percent, s.startup_trials, s.prune_at)
        if s.pruner == "stages"
        else optuna.pruners.NopPruner()
    )
    storage = optuna.storages.RDBStorage(storage_url(cfg, cache))
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            direction="maximize",
            sampler=sampler(cfg.search),
            pruner=pruner,
            load_if_exists=True,
        )
        study.sampler = sampler(cfg.search, offset=len(study.trials))
        identity = {"space": space_digest, "objective": cfg.search.objective}
        known = study.user_attrs.get("identity")
        if known is None:
            study.set_user_attr("identity", identity)
        elif known != identity:
            raise UserError(
                "search.study",
                f"study '{name}' searched {known}, this search {identity}",
                "name another study with search.study=..., or search what it searched",
            )
        yield study, fail_orphans(study, storage)
    finally:
        # The storage's pooled connections, closed: while one stays open, SQLite cannot fold its write-ahead log
        # into the store's file, so a store copied without its "-wal" file lacked the search's trials (and every
        # record written meanwhile) after the command had ended.
        storage.remove_session()
        storage.engine.dispose()


def fail_orphans(study, storage) -> list[int]:
    """Mark ``FAIL`` every running trial whose process (host, pid, start time; the trial's ``owner``) is provably
    gone, and return their numbers."""
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get("owner")
        if owner and proc.gone(owner[0], owner[1], owner[2]):
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            failed.append(t.number)
    return failed


def done_trials(study) -> list:
    return study.get_trials(deepcopy=False, states=tuple(getattr(TrialState, s) for s in DONE_STATES))


def sampled_trials(study) -> list:
    """The finished trials the sampler drew (the seeded default is not one: it costs nothing and is not counted
    in ``search.n_trials``)."""
    return [t for t in done_trials(study) if not t.user_attrs.get("default")]


def seed_default(
    study, distributions: dict, params: dict, value: float, stage_values: dict[int, float], attrs: dict
) -> bool:
    """Add the default recipe, already scored, as a complete trial (once per study), so the sampler starts from
    what it must beat and the pruner ranks against it; False when the study holds it already."""
    if any(t.user_attrs.get("default") for t in study.get_trials(deepcopy=False)):
        return False
    study.add_trial(
        optuna.trial.create_trial(
            params=params,
            distributions=distributions,
            value=value,
            intermediate_values=stage_values,
            user_attrs={**attrs, "default": True},
        )
    )
    return True


class StagePruner(optuna.pruners.BasePruner):
    """Prune a trial at a stage unless its value there is in the top ``keep_percent``% of all trials' at that stage.

    Step 0 is stage 1 (minus the mean log-perplexity ratio), step 1 stage 2
    (mean accuracy on the first validation items). Unlike Optuna's percentile
    and median pruners, which compare a trial's best value over *all* its steps,
    a trial is compared only at the step it just reported, since each stage has
    its own measure. The population is every trial that reported that step
    (completed, pruned or running, this one included), as a staged sweep ranks
    all of a stage's candidates; no trial is pruned before ``startup_trials``
    trials have completed. A trial is kept when ``v >= P_(100 - keep_percent)``,
    the percentile of the population's values (linear interpolation). Only the
    stages in ``prune_at`` rank (``[2]``: stage 1's perplexity, which sees only the
    experts' own tasks, prunes nothing by rank; its degradation threshold still does).
    """

    def __init__(self, keep_percent: float, startup_trials: int, prune_at=(1, 2)):
        self.keep_percent, self.startup_trials, self.prune_at = keep_percent, startup_trials, set(prune_at)

    def prune(self, study, trial) -> bool:
        import numpy as np

        step = trial.last_step
        if step is None or step + 1 not in self.prune_at:
            return False
        trials = study.get_trials(deepcopy=False)
        if sum(t.state == TrialState.COMPLETE for t in trials) < self.startup_trials:
            return False
        values = [
            t.intermediate_values[step]
            for t in trials
            if step in t.intermediate_values
            and t.state != TrialState.FAIL
            and math.isfinite(t.intermediate_values[step])
        ]
        value = trial.intermediate_values[step]
        if not math.isfinite(value):
            return True
        return bool(value < np.percentile(values, 100 - self.keep_percent))
