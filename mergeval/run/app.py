"""One run: resolve the modelset, merge in memory, evaluate every model, score, record.

The flow goes one way: config -> models -> merge -> evaluate -> metrics -> record.
Every check a user can fail (method hyperparameters, task names, task data,
model paths, shapes) runs before any tensor is merged, and nothing is written
to the job directory until the run has its results. This module only
sequences the steps; each step lives in the module of its layer.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mergeval.core import gpus
from mergeval.core.errors import UserError
from mergeval.core.outcome import MERGED, ModelInfo, Outcome, result_text
from mergeval.core.paths import atomic_write_text, cache_root
from mergeval.core.plain import plain_dict
from mergeval.core.provenance import git_commit, hardware, package_versions
from mergeval.core.runtime import (
    Laps,
    apply_offline,
    peak_device_memory,
    quiet_transformers,
    release_memory,
    reset_device_memory_peak,
)
from mergeval.eval import samples
from mergeval.eval.settings import eval_settings
from mergeval.models.checkpoint import load_tensors, load_tokenizer
from mergeval.models.zoo.resolve import evaluation_tokenizer, resolve_models
from mergeval.results.store import merge_key, open_store, record_models
from mergeval.run import mergekit_config
from mergeval.run.checks import check_rows, model_slices, validate
from mergeval.run.config import RunConfig, typed
from mergeval.run.merging import merge_device
from mergeval.run.ranking import prepare_method
from mergeval.run.resume import config_hash
from mergeval.run.scoring import REUSED, Scoring
from mergeval.run.summary import aggregable, aggregate


def check_job_dir(cfg: DictConfig, out_dir: Path) -> None:
    """A job directory named twice (``hydra.run.dir=DIR``) must not lose another run's result.json: the same
    configuration again (a rerun, a resumed sweep) replaces its own, another configuration is refused."""
    from mergeval.run.resume import in_multirun

    path = out_dir / "result.json"
    if not path.exists():
        return
    try:
        earlier = json.loads(path.read_text())
        same = config_hash(OmegaConf.create(earlier["config"])) == config_hash(cfg)
        what = f"run {earlier['run_id'][:8]}, method {earlier['config']['method']['name']}"
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, or not a result of ours: not ours to replace
        same, what = False, "unreadable"
    if not same:
        field = "hydra.sweep.dir" if in_multirun() else "hydra.run.dir"
        raise UserError(
            field,
            f"'{out_dir}' already holds the result.json of another configuration ({what})",
            "choose a new directory (by default each run gets its own) or remove that result.json",
        )


def _check_truncation(policy: str, base_dir: Path, expert_dirs: dict[str, Path]) -> None:
    """A run evaluates its merge in the base's architecture: vocab_policy=truncate fits it only when no expert has
    fewer vocabulary rows than the base (experts padded beyond the base: the shared rows are merged)."""
    from mergeval.models.checkpoint import read_config, vocab_size

    if policy != "truncate":
        return
    base = vocab_size(read_config(base_dir, "modelset.base"))
    for name, path in expert_dirs.items():
        theirs = vocab_size(read_config(path, f"modelset.experts.{name}"))
        if base is not None and theirs is not None and theirs < base:
            raise UserError(
                "vocab_policy",
                f"truncate cuts the merge to expert {name}'s {theirs} vocabulary rows, "
                f"fewer than the base's {base}, so it cannot be evaluated in the base's architecture",
                "use vocab_policy=union (the base's rows for the tokens it lacks), or python -m "
                "mergeval.merge to write the truncated merge",
            )


def _merge_tokens(
    cfg: RunConfig, method, method_cfg, base_dir: Path, expert_dirs: dict[str, Path], models: list, out_dir: Path
) -> Path:
    """The merge with the vocabularies aligned by token (tokenizer_source), written to ``<job dir>/merged_model``
    with its tokenizer: it cannot stream into a model of the base's vocabulary."""
    from mergeval.run.merging import write_merge

    target = out_dir / "merged_model"
    if target.exists():
        import shutil

        shutil.rmtree(target)  # a rerun of this job's configuration (resume): the merge is made again
    return write_merge(cfg, method, method_cfg, base_dir, expert_dirs, models, target)


def run(cfg: DictConfig, out_dir: Path) -> Outcome:
    """One run, recorded in the results store: ``running`` from here, then ``failed`` on any error (a user's
    mistake, a fault, a bug), ``interrupted`` on Ctrl-C or SIGTERM, or ``finished`` by ``write_result``. A
    killed process leaves it ``running`` until a later process on this host proves it gone (store.py)."""
    apply_offline(cfg.offline)
    store = open_store(cfg, cache_root(cfg.cache_dir))
    run_id, versions, git = uuid.uuid4().hex, package_versions(), git_commit()
    store.start_run(
        run_id,
        experiment=cfg.modelset.name,
        method=cfg.method.name,
        config=plain_dict(cfg, resolve=True),
        versions=versions,
        git=git,
        job_dir=str(out_dir),
        config_hash=config_hash(cfg),
    )  # a resumed sweep finds it by this
    reset_device_memory_peak(cfg.eval.device)
    try:
        outcome = _execute(cfg, out_dir, store)
    except BaseException as err:
        _record_end(store, run_id, err, release=True)
        raise
    outcome.device_memory = peak_device_memory(cfg.eval.device)
    outcome.run_id, outcome.versions, outcome.git, outcome.hardware = run_id, versions, git, hardware()
    return outcome


def _execute(composed: DictConfig, out_dir: Path, store) -> Outcome:
    import torch

    from mergeval.eval.suite import build_suite
    from mergeval.merge.memory import merge_live
    from mergeval.models.checkpoint import load_model
    from mergeval.models.fingerprint import fingerprint, fingerprint_state_dict, model_identity

    quiet_transformers(composed.verbose)
    lap = Laps()
    timings = lap.timings

    method, method_cfg = validate(composed)
    cfg = typed(composed)  # checked and completed: the schema's dataclasses from here on
    cache = cache_root(cfg.cache_dir)
    suite = build_suite(cfg.benchmark, cfg.eval, cache)  # loads every task's data: missing data fails here
    check_rows(cfg, suite.rows)
    tasks = suite.names
    lap("load_tasks")
    base_dir, expert_dirs, models = resolve_models(cfg, cache)
    _check_truncation(cfg.vocab_policy, base_dir, expert_dirs)
    if cfg.tokenizer_source and cfg.metric.similarity:
        raise UserError(
            "metric.similarity",
            "compares the models' tensors row by row, and tokenizer_source gives the merge other vocabulary rows",
            "drop metric.similarity, or tokenizer_source",
        )
    lap("resolve_models")
    tokenizer = None  # loaded before the first merge or evaluation, so a damaged one fails before minutes of
    # either; a run whose merge and scores all come from the store never loads it (nor imports what it needs)
    method_cfg, merge_info = prepare_method(cfg, method, method_cfg, models, base_dir, cache, can_evaluate=True)
    if "validation_scores" in merge_info:
        lap("rank_experts")

    digests, metrics = suite.digests, {t: r.metric for t, r in suite.rows.items()}
    settings = suite.per_task(eval_settings(cfg))  # each task keyed by what can change its scores
    inputs = [m.fingerprint for m in models]  # base first, then the experts in modelset order
    options: dict[str, Any] = {"vocab_policy": cfg.vocab_policy}  # changes the output beyond the method config
    tokens = cfg.tokenizer_source  # vocabularies aligned by token: each model has its own tokenizer
    if tokens:
        options["tokenizer_source"] = tokens
    slices = model_slices(cfg)
    if slices:  # a frankenmerge: its layers (only when there are slices, so other merges keep their keys)
        options["slices"] = [[[s.model, s.start, s.end] for s in sources] for sources in slices]
    merging_on = merge_device(cfg)  # merge.device (the evaluation's by default)
    if gpus.kind(gpus.compute_device(merging_on)) != "cpu":  # reductions round otherwise there: its own merge
        options["merge_device"] = gpus.kind(merging_on)
    key = merge_key(inputs, method_cfg, cfg.seed, options)
    # similarity needs the merged tensors, which a merge reused from the store does not have
    fresh = cfg.eval.force or cfg.save_merged or cfg.metric.similarity
    done = None if fresh else store.evaluated_merge(key, digests, settings, metrics)
    merged_model = None
    merged: Mapping[str, torch.Tensor] | None = None
    if done:  # merged and scored before with these inputs, method config and seed: do neither again
        models.append(ModelInfo(MERGED, f"{method.name}", done, merge="reused from the results store"))
    elif tokens:  # another vocabulary: streamed to disk (merged_model), loaded with its own tokenizer
        target = _merge_tokens(cfg, method, method_cfg, base_dir, expert_dirs, models, out_dir)
        merged_model = load_model(target, None, getattr(torch, cfg.eval.dtype), "tokenizer_source")
        merged = dict(merged_model.state_dict())
        weights = fingerprint(target, None, "tokenizer_source")
        models.append(
            ModelInfo(
                MERGED,
                f"{method.name}",
                model_identity(weights, target),
                merge="this run",
                weights=weights,
                path=str(target),
            )
        )
    else:  # streamed into a live model: one model in memory, whatever the number of experts
        tokenizer = load_tokenizer(base_dir)
        merged_model, merged = merge_live(
            method,
            method_cfg,
            base_dir,
            expert_dirs,
            cfg.seed,
            cfg.vocab_policy,
            dtype=getattr(torch, cfg.eval.dtype),
            slices=slices,
            device=merging_on,
        )
        weights = fingerprint_state_dict(merged)  # evaluated in the base's architecture, with its tokenizer
        models.append(
            ModelInfo(MERGED, f"{method.name}", model_identity(weights, base_dir), merge="this run", weights=weights)
        )
        store.put_merge(key, inputs, method_cfg, cfg.seed, models[-1].fingerprint, options)
    if not done:
        merge_info["device"] = gpus.compute_device(merging_on)  # the device that merged (result.json's merge)
    record_models(store, models)
    lap("merge")
    similarity_stats = None
    if cfg.metric.similarity:  # parameter-space statistics of the task vectors (opt-in: SVDs, every model loaded)
        from mergeval.metrics.composed import similarity

        experts = {name: load_tensors(p) for name, p in expert_dirs.items()}
        similarity_stats = similarity(load_tensors(base_dir), experts, merged)
        lap("similarity")
    if cfg.save_merged and not tokens:  # written before evaluation casts the model to eval.dtype (card included)
        from mergeval.merge import save_merged
        from mergeval.merge.card import merge_config

        target = out_dir / "merged_model"
        save_merged(
            merged,
            base_dir,
            target,
            method,
            {"config": merge_config(cfg), "inputs": [vars(m) for m in models[:-1]]},
            out_dtype=cfg.out_dtype,
            slices=slices,
            model_dirs={"base": base_dir, **expert_dirs},
        )
        models[-1].path = str(target)
        lap("save_merged")
    # From here the live model holds the merge: once eval.dtype or eval.device gives it new tensors, this
    # name would keep the old ones alive through its evaluation (a whole CPU copy of the model on a GPU run).
    merged = None

    dtype = getattr(torch, cfg.eval.dtype)
    scoring = Scoring(cfg, suite, store, cache, settings=settings, tokenizer=tokenizer, tokenizer_dir=base_dir)
    scores: dict[str, dict[str, dict]] = {t: {} for t in tasks}
    items: dict[str, dict[str, dict]] = {}  # task -> role -> per-item outcomes (Outcome.items)
    # The merge first, so it is released before each constituent is loaded: one model in memory at a time.
    live = {MERGED: merged_model} if merged_model is not None else {}  # taken by its evaluation, or dropped
    merged_model = None
    for number, info in enumerate([models[-1], *models[:-1]], start=1):

        def load(info=info):
            if info.role == MERGED:
                assert MERGED in live, "a merge evaluated here is one this run made"
                model = live.pop(MERGED).to(dtype)
            else:
                label = "modelset.base" if info.role == "base" else f"modelset.experts.{info.role}"
                model = load_model(info.directory(), None, dtype, label).to(dtype)
            return model.to(gpus.select(cfg.eval.device)).eval()  # a parallel sweep's job: its own GPU

        def own_tokenizer(info=info):  # tokenizer_source: each model its own (resolve.evaluation_tokenizer)
            return load_tokenizer(
                info.directory() if info.role == MERGED else evaluation_tokenizer(info.directory(), base_dir, tokens)
            )

        # Each task is evaluated once per model and settings, whatever other tasks the run has; parallel sweep
        # jobs wait for the one evaluating a shared constituent.
        got = scoring.scores(
            info.fingerprint,
            load,
            label=f"mergeval: [{number}/{len(models)}] {info.role}",
            name=info.role,
            tokenizer=own_tokenizer if tokens else None,
            claim=True,
        )
        info.evaluated = got.evaluated
        live.clear()  # the merge is released before the constituents are loaded
        if got.evaluated != REUSED or info.role == MERGED:  # a model was built or released (gc.collect is not free)
            release_memory()
        for task in tasks:
            score = dict(got.scores[task])
            if score.pop("items", None) is not None:
                items.setdefault(task, {})[info.role] = got.scores[task]["items"]
            scores[task][info.role] = score
    lap("evaluate")

    rows = {
        t: {
            "metric": r.metric,
            "higher_is_better": r.higher_is_better,
            "output_type": r.output_type,
            "entry": r.entry,
            "counted": r.counted,
        }
        for t, r in suite.rows.items()
    }
    counted, excluded = aggregable(scores, rows, tasks)
    aggregates = aggregate(scores, counted, models, cfg.metric)
    aggregates["excluded"] = excluded
    if cfg.metric.calibration or cfg.metric.consistency:  # both from the per-choice log-likelihoods kept
        from mergeval.metrics.composed import calibration, consistency

        logged = {m.role: samples.read_tasks(store.samples_paths(m.fingerprint, digests, settings)) for m in models}
        if cfg.metric.calibration:
            aggregates["calibration"] = calibration(logged)
        if cfg.metric.consistency:  # the same items asked in two formats
            aggregates["consistency"] = consistency(logged, [list(pair) for pair in cfg.metric.consistency])
    if similarity_stats is not None:
        aggregates["similarity"] = similarity_stats
    if cfg.save_merged:  # the saved merge's model card gains the evaluation table
        from mergeval.merge.card import add_evaluation

        add_evaluation(models[-1].directory() / "README.md", scores, [m.role for m in models])
    return Outcome(
        models,
        tasks,
        scores,
        aggregates,
        digests,
        timings,
        merge_info,
        rows=rows,
        task_settings=dict(settings.tasks),
        items=items,
    )


def write_result(cfg: DictConfig, outcome: Outcome, out_dir: Path) -> Path:
    """result.json in the job directory (atomic), then the run's row in the results store marked finished.

    If either step fails the run is marked failed and no result.json is left behind.
    """
    store = open_store(cfg, cache_root(cfg.cache_dir))
    models = [vars(m) for m in outcome.models]
    result = {
        "run_id": outcome.run_id,
        "status": "finished",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": plain_dict(cfg, resolve=True),
        "seeds": {"run": cfg.seed, "train": cfg.modelset.train.seed, "eval_data": 0},
        "models": models,
        "tasks": outcome.tasks,
        "task_digests": outcome.task_digests,
        # what keys each task's scores in the results store beside the config (eval/settings.py, PerTask)
        "task_settings": outcome.task_settings,
        "rows": outcome.rows,
        "scores": outcome.scores,
        "aggregates": outcome.aggregates,
        "merge": outcome.merge_info,
        "timings_s": outcome.timings,
        "versions": outcome.versions,
        # scores are bit-identical only where these agree (README: "Precision follows the hardware")
        "hardware": outcome.hardware,
        "git": outcome.git,
        "device_memory": outcome.device_memory,  # peak GPU memory (eval.device=cuda); null on the CPU
        # task -> role -> {"ids", "values"}: each item's outcome, for paired comparisons (metrics/paired.py)
        "items": outcome.items,
    }
    path = out_dir / "result.json"
    try:
        atomic_write_text(path, result_text(result))  # outcome.py
        mergekit_config.write_for_run(out_dir / "mergekit.yaml", cfg, outcome.models)  # when mergekit can express it
        store.finish_run(
            outcome.run_id,
            result_path=str(path),
            aggregates=outcome.aggregates,
            timings=outcome.timings,
            models=models,
            scores=outcome.scores,
        )
    except BaseException as err:
        path.unlink(missing_ok=True)
        _record_end(store, outcome.run_id, err, timings=outcome.timings)
        raise
    return path


def _record_end(store, run_id: str, err: BaseException, timings=None, release: bool = False) -> None:
    """Mark the run interrupted (Ctrl-C, SIGTERM) or failed, and drop its claims. If the store itself is what
    failed (damaged, read-only, full) this is skipped: the original error is the one to report, and a run left
    ``running`` is reaped by the next process that opens the store."""
    try:
        if release:
            store.release_claims()
        if isinstance(err, KeyboardInterrupt):
            # str(): Ctrl-C's KeyboardInterrupt prints as '' (SIGTERM's as "SIGTERM")
            store.interrupt_run(run_id, f"interrupted by {str(err) or 'Ctrl-C'}", timings)
        else:
            store.fail_run(run_id, f"{type(err).__name__}: {err}", timings)
    except (UserError, OSError):
        pass
