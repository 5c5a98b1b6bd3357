"""The whole search: check everything, tune on the validation split, then score the best on the test split.

Order (every user-fixable check runs before any model is loaded):

1. the run config, the ``search`` section and the space; the Optuna study
   opened (or resumed) in the results store's database;
2. the held-out text of stage 1, the validation split's tasks, the models;
   the experts' held-out perplexities and the constituents' validation scores
   (once, through the store);
3. the method's default recipe (the run's ``method`` as composed) scored on
   the validation split: the baseline the search must beat;
4. trials until the study holds ``search.n_trials`` finished ones (complete
   or pruned), each scored in stages (``trials.score``) and told to Optuna;
5. only then, with ``search.test=true``: the test split's tasks are built and
   the best recipe, the default and the constituents are scored on them.

No test item is loaded before step 5: tuning sees only the validation split
and held-out text outside every task's evaluation pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

from mergeval.core import proc
from mergeval.core.errors import UserError
from mergeval.core.plain import plain_dict
from mergeval.eval.tasks import GENERATED, check_tasks
from mergeval.methods import MergeMethod, get_method
from mergeval.run.checks import refuse_slices, validate
from mergeval.run.config import typed
from mergeval.run.scoring import Scoring
from mergeval.search import study as studies
from mergeval.search.monitor import Progress, signed
from mergeval.search.schema import SearchRunConfig
from mergeval.search.space import Space, describe, parse_space
from mergeval.search.trials import COMPLETE, PRUNED, Scored, Stages, objective, score, stage1_value
from mergeval.staged.cost import Cost
from mergeval.staged.plan import stage2_limit


@dataclass
class SearchOutcome:
    study: str
    objective: str
    method: str
    n_trials: int
    tasks: list[str]
    validation_items: int
    stage2_items: int
    baseline: Scored  # the method's default recipe on the validation split
    trials: list[dict] = field(default_factory=list)  # every finished sampled trial of the study, in order
    best: Scored | None = None  # the best complete trial, re-read on the validation split
    best_number: int | None = None
    best_is_default: bool = False  # the best trial is the seeded default (no sampled recipe beat it)
    best_fields: dict = field(default_factory=dict)  # the method fields the best recipe sets (Space.overrides)
    run_command: str | None = None  # the best recipe as a plain run (mergeval/run/rerun.py; set by the command line)
    test: dict | None = None  # {"best"|"default": {scores, aggregates, fingerprint}, "constituents": ...}
    cost: dict = field(default_factory=dict)
    resumed: int = 0  # finished trials the study held before this process
    orphans: list[int] = field(default_factory=list)
    timings: dict = field(default_factory=dict)


def prepare(cfg: DictConfig) -> tuple[MergeMethod, Space]:
    """Every check that needs no model: the run config, the search section, the space. Returns (method, space)."""
    validate(cfg, SearchRunConfig)
    refuse_slices(cfg, "a search")
    s = cfg.search
    studies.check_search(s)
    other = [t for t in cfg.benchmark.tasks if t not in GENERATED]
    if other:
        raise UserError(
            "benchmark.tasks",
            f"a search tunes on the validation split of mergeval's generated tasks; {other[0]} has none",
            "search on generated tasks (mergeval_*)",
        )
    method = get_method(cfg.method.name)
    if s.method is not None and s.method != method.name:
        raise UserError(
            "search.method",
            f"the space is written for {s.method}, the run merges with {method.name}",
            f"add method={s.method}, or pick the search preset of {method.name}",
        )
    try:
        check_tasks(list(cfg.benchmark.tasks), cfg.benchmark.n_items, s.validation_items)
    except UserError as err:
        if err.field != "method.validation_items":
            raise
        raise UserError(
            "search.validation_items", err.problem, "lower search.validation_items or benchmark.n_items"
        ) from None
    n_experts = len(cfg.modelset.experts)
    return method, parse_space(plain_dict(s.space, resolve=True), method, cfg.method, n_experts)


def run_search(composed: DictConfig) -> SearchOutcome:
    import torch
    from transformers import AutoTokenizer

    from mergeval.core.paths import cache_root
    from mergeval.core.runtime import Laps, apply_offline, quiet_transformers
    from mergeval.eval.settings import eval_settings
    from mergeval.eval.suite import build_suite
    from mergeval.models.zoo.resolve import resolve_models
    from mergeval.results.store import open_store
    from mergeval.staged.heldout import heldout_items
    from mergeval.staged.nll import answer_sequences
    from mergeval.staged.pipeline import (
        HeldOut,
        Models,
        choices_per_item,
        constituent_scores,
        reference_perplexities,
        stage1_tasks,
    )

    quiet_transformers(composed.verbose)
    apply_offline(composed.offline)
    lap = Laps()
    method, space = prepare(composed)
    cfg = cast(SearchRunConfig, typed(composed))  # checked and completed: the schema's dataclasses from here on
    s, cache = cfg.search, cache_root(cfg.cache_dir)
    validation_cfg = _validation_config(cfg)
    name = studies.study_name(cfg, space.digest(), eval_settings(validation_cfg))
    with studies.opened_study(cfg, cache, name, space.digest()) as (study, orphans):
        lap("checks")

        tasks, n_val = list(cfg.benchmark.tasks), s.validation_items
        owners = stage1_tasks(cfg)
        trained = {e.domain for e in cfg.modelset.experts.values() if e.domain is not None}
        heldout = heldout_items(list(owners), s.heldout_items, cfg.benchmark.n_items, trained, cfg.modelset.train)
        suite = build_suite(cfg.benchmark, cfg.eval, cache, split="validation", n_validation=n_val)
        task_dir = suite.generated_dir
        assert task_dir is not None, "a search's tasks are generated ones (its validation split)"
        base_dir, expert_dirs, constituents = resolve_models(cfg, cache)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        scorer = HeldOut(
            {t: answer_sequences(tokenizer, items) for t, items in heldout.items()},
            cfg.eval.batch_size,
            pad_id,
            cfg.eval.device,
        )
        models = Models(cfg, base_dir, expert_dirs, getattr(torch, cfg.eval.dtype))
        lap("models")
        reference = {t: r["perplexity"] for t, r in reference_perplexities(models, owners, scorer).items()}
        store = open_store(cfg, cache)
        validation = Scoring(validation_cfg, suite, store, cache, tasks=tasks, tokenizer=tokenizer)
        stages = Stages(
            cfg,
            method,
            len(expert_dirs),
            models,
            constituents,
            scorer,
            reference,
            validation,
            constituent_scores(validation, constituents, models),
            choices_per_item(task_dir, tasks, n_val),
            n_val,
            min(n_val - 1, stage2_limit(s.stage2_fraction, n_val)),
            cache,
            base_dir,
        )
        reference_cost = sum(len(scorer.sequences[t]) * len(roles) for t, roles in owners.items())
        lap("constituents")

        print(
            f"search: scoring the default recipe ({describe(_searched(cfg, space))}) on the validation split",
            flush=True,
        )
        baseline = score(stages, {}, {})
        outcome = SearchOutcome(
            name, s.objective, method.name, s.n_trials, tasks, n_val, stages.n_stage2, baseline, orphans=orphans
        )
        print(f"search: default {s.objective} {signed(baseline.completed_value())} on the validation split", flush=True)
        if s.start_from_default:
            _seed_default(study, space, baseline)
        lap("baseline")
        _tune(study, space, stages, outcome)
        lap("trials")
        _best(study, space, stages, outcome)
        outcome.cost = _cost(study, stages, reference_cost)
        if s.test and outcome.best is not None:
            outcome.test = _test(cfg, cache, store, tokenizer, models, stages, outcome)
            lap("test")
        outcome.timings = lap.timings
        return outcome


def _validation_config(cfg: SearchRunConfig) -> SearchRunConfig:
    """The run config as the validation split is scored: every validation item (``benchmark.limit`` applies to the
    test split only), as CMM's expert ranking scores it (their stored evaluations are shared)."""
    return dataclasses.replace(cfg, benchmark=dataclasses.replace(cfg.benchmark, limit=None))


def _searched(cfg: SearchRunConfig, space: Space) -> dict:
    """The default recipe's values of the searched fields."""
    method = OmegaConf.structured(cfg.method)
    return {e.key: OmegaConf.select(method, e.key) for e in space.entries}


def _seed_default(study, space: Space, baseline: Scored) -> None:
    """The default recipe as the study's first (free) trial, where the space can express it."""
    params = space.default_params(baseline.config)
    if params is None:
        print("search: the default recipe lies outside search.space; the sampler starts without it", flush=True)
        return
    stage_values = {0: stage1_value(baseline)}
    if baseline.stage2 is not None:
        stage_values[1] = baseline.stage2
    attrs = {**_attrs(baseline), "cost": dataclasses.asdict(Cost()), "ran": 0}
    if studies.seed_default(study, space.distributions(), params, baseline.completed_value(), stage_values, attrs):
        print(f"search: the default ({describe(params)}) seeded as a trial the sampler starts from", flush=True)


def _tune(study, space: Space, stages: Stages, outcome: SearchOutcome) -> None:
    from optuna.trial import TrialState

    s = stages.cfg.search
    done = len(studies.sampled_trials(study))
    outcome.resumed = done
    if done:
        print(
            f"search: resuming study '{outcome.study}' with {done} finished trial(s)"
            + (f"; trial(s) {outcome.orphans} of a process that is gone marked failed" if outcome.orphans else ""),
            flush=True,
        )
    progress = Progress(s.n_trials, done)
    for _ in range(max(0, s.n_trials - done)):
        trial = study.ask(space.distributions())
        trial.set_user_attr("owner", list(proc.me()))
        try:
            res = score(stages, trial.params, space.overrides(trial.params), trial)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        for key, value in _attrs(res).items():
            trial.set_user_attr(key, value)
        if res.state == PRUNED:
            study.tell(trial, state=TrialState.PRUNED)
            ended = f"pruned at {res.reason}"
        else:
            study.tell(trial, res.value)
            ended = f"{s.objective} {signed(res.completed_value())}"
        print(
            progress.line(
                trial.number, f"{ended} ({res.seconds:.1f} s; {describe(trial.params)})", _best_line(study, s.objective)
            ),
            flush=True,
        )
    outcome.trials = [_trial_row(t) for t in studies.sampled_trials(study)]


def _attrs(res: Scored) -> dict:
    """What a trial keeps in the study besides its value: enough for a resumed search's report and cost."""
    return {
        "stage": res.stage,
        "reason": res.reason,
        "fingerprint": res.fingerprint,
        "seconds": res.seconds,
        "log_ratio": res.log_ratio if res.log_ratio != float("inf") else None,
        "stage2": res.stage2,
        "cost": dataclasses.asdict(res.cost),
        "ran": res.ran,
    }


def _trial_row(t) -> dict:
    return {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params, **t.user_attrs}


def _best_line(study, objective_name: str) -> str:
    try:
        best = study.best_trial
    except ValueError:
        return "(none complete yet)"
    return f"#{best.number} {objective_name} {signed(best.value)}"


def _best(study, space: Space, stages: Stages, outcome: SearchOutcome) -> None:
    """The best complete trial, its validation scores re-read (from the store: nothing is re-evaluated)."""
    try:
        best = study.best_trial
    except ValueError:
        return
    outcome.best_number = best.number
    outcome.best_is_default = bool(best.user_attrs.get("default"))
    outcome.best_fields = space.overrides(best.params)
    outcome.best = score(stages, best.params, outcome.best_fields)


def _cost(study, stages: Stages, reference_texts: int) -> dict:
    """The trials' staged cost next to scoring every finished trial on the whole validation split."""
    trials = studies.sampled_trials(study)
    staged = Cost(reference_texts, reference_texts)
    for t in trials:
        staged = staged + Cost(**t.user_attrs.get("cost", {}))
    full = stages.full_cost() * len(trials)
    by_stage = {
        f"pruned_at_stage{k}": sum(t.state.name == PRUNED and t.user_attrs.get("stage") == k for t in trials)
        for k in (1, 2)
    }
    return {
        "trials": len(trials),
        "complete": sum(t.state.name == COMPLETE for t in trials),
        **by_stage,
        "staged": dataclasses.asdict(staged),
        "full": dataclasses.asdict(full),
        "fraction_of_full": staged.forward_passes / full.forward_passes if full.forward_passes else None,
        "ran_forward_passes": sum(t.user_attrs.get("ran", 0) for t in trials),
    }


def _test(cfg: SearchRunConfig, cache: Path, store, tokenizer, models, stages: Stages, outcome: SearchOutcome) -> dict:
    """The best recipe and the default on the test split, with the constituents, as ``python -m mergeval`` scores
    them (the same store keys: a default already run is not evaluated again)."""
    from mergeval.eval.suite import build_suite
    from mergeval.staged.pipeline import constituent_scores

    print("search: tuning done; scoring the best recipe and the default on the test split", flush=True)
    suite = build_suite(cfg.benchmark, cfg.eval, cache)
    bench = Scoring(cfg, suite, store, cache, tasks=list(cfg.benchmark.tasks), tokenizer=tokenizer)
    constituents = constituent_scores(bench, stages.constituents, models)
    out: dict[str, dict] = {"constituents": constituents}
    assert outcome.best is not None, "the test split scores the best recipe"
    for label, recipe in (("default", outcome.baseline), ("best", outcome.best)):

        def make_model(config=recipe.config, label=label):
            from mergeval.staged.plan import Candidate

            typed = OmegaConf.to_object(OmegaConf.merge(stages.method.config, config))
            return models.candidate(Candidate(label, stages.method, typed, {}, "search"))

        got = bench.scores(recipe.fingerprint, make_model)
        scores, where = got.scores, got.evaluated
        value, aggregates = objective(cfg.search.objective, scores, constituents, stages.constituents, cfg.metric)
        out[label] = {
            "fingerprint": recipe.fingerprint,
            "scores": scores,
            "evaluated": where,
            "aggregates": aggregates,
            "objective": value,
        }
    return out
