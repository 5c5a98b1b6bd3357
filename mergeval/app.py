"""One run: resolve the modelset, merge in memory, evaluate every model, score, record.

The flow goes one way: config -> models -> merge -> evaluate -> metrics -> record.
Every check a user can fail (method hyperparameters, task names, model paths,
shapes) runs before any tensor is merged, and nothing is written to the job
directory until the run has its results.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mergeval.errors import UserError
from mergeval.eval.harness import BACKENDS
from mergeval.eval.tasks import check_tasks, task_digest, write_tasks
from mergeval.methods import get_method
from mergeval.metrics.composed import check_metric_config
from mergeval.metrics.aggregates import band, macro_gain, macro_og, mean_normalized_score, normalized_score
from mergeval.models.checkpoint import check_compatible, check_vocab_policy, load_tensors
from mergeval.models.fingerprint import fingerprint
from mergeval.models.sources import resolve_source
from mergeval.paths import atomic_write_text, cache_root
from mergeval.provenance import git_commit, package_versions
from mergeval.eval import samples
from mergeval.store import merge_key, settings_hash
from mergeval.zoo.domains import DOMAINS

MERGED = "merged"


@dataclass
class ModelInfo:
    role: str  # "base", an expert's name, or "merged"
    source: str
    fingerprint: str
    path: str | None = None
    task: str | None = None  # the expert's own task
    evaluated: str | None = None  # "this run", "reused from the results store" or "partly reused ..." (some tasks)
    merge: str | None = None  # merged model only: "this run" or "reused from the results store" (not redone)


@dataclass
class Outcome:
    models: list[ModelInfo]
    tasks: list[str]
    scores: dict[str, dict[str, dict[str, float]]]  # task -> model role -> {acc, stderr, n}
    aggregates: dict
    task_digests: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    merge_info: dict = field(default_factory=dict)  # what the method decided (e.g. CMM's order)
    run_id: str = ""  # the run's row in the results store (set by run())
    versions: dict = field(default_factory=dict)
    git: dict = field(default_factory=dict)


class Laps:
    """Wall time of each step of a run in seconds (result.json's ``timings_s``): ``lap(name)`` closes a step."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._clock, 3)
        self._clock = now


def quiet_transformers() -> None:
    """No per-model progress bars or warnings from transformers inside a run's output."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def validate(cfg: DictConfig):
    """All config checks that need no model: returns the method and its typed config."""
    method = get_method(cfg.method.name)
    method_cfg = OmegaConf.to_object(cfg.method)
    check_tasks(list(cfg.benchmark.tasks), cfg.benchmark.n_items)
    experts = cfg.modelset.experts
    if not experts:
        raise UserError("modelset.experts", "no experts to merge", "list at least one expert in the modelset")
    for name, expert in experts.items():
        if (expert.source is None) == (expert.domain is None):
            raise UserError(f"modelset.experts.{name}", "needs exactly one of source or domain",
                            "set source (a model) or domain (fine-tune the base on generated data)")
        if expert.domain is not None and expert.domain not in DOMAINS:
            raise UserError(f"modelset.experts.{name}.domain", f"unknown training domain '{expert.domain}'",
                            f"choose one of: {', '.join(sorted(DOMAINS))}")
        if expert.task is not None and expert.task not in cfg.benchmark.tasks:
            raise UserError(f"modelset.experts.{name}.task", f"'{expert.task}' is not in benchmark.tasks",
                            f"use one of {list(cfg.benchmark.tasks)} or null")
    if method.name == "pipeline":  # stages refer to experts by their modelset names
        method_cfg.expert_names = list(experts)
    method.validate(method_cfg, len(experts))
    if method.name == "cmm" and method_cfg.order != "given" and method_cfg.validation_scores is None:
        check_tasks(list(cfg.benchmark.tasks), cfg.benchmark.n_items, method_cfg.validation_items)
    if cfg.benchmark.limit is not None and cfg.benchmark.limit < 1:
        raise UserError("benchmark.limit", f"must be positive, got {cfg.benchmark.limit}", "set it to null or >= 1")
    if cfg.metric.scale not in ("percent", "fraction"):
        raise UserError("metric.scale", f"unknown scale '{cfg.metric.scale}'", "use percent or fraction")
    if cfg.eval.batch_size < 1:
        raise UserError("eval.batch_size", f"must be positive, got {cfg.eval.batch_size}", "set e.g. eval.batch_size=32")
    check_metric_config(cfg.metric, list(cfg.benchmark.tasks))
    if cfg.eval.backend not in BACKENDS:
        raise UserError("eval.backend", f"unknown backend '{cfg.eval.backend}'", f"use one of {', '.join(BACKENDS)}")
    if cfg.eval.dtype not in ("float32", "bfloat16", "float16"):
        raise UserError("eval.dtype", f"unknown dtype '{cfg.eval.dtype}'", "use float32, bfloat16 or float16")
    check_vocab_policy(cfg.vocab_policy)
    return method, method_cfg


def run(cfg: DictConfig, out_dir: Path) -> Outcome:
    """One run, recorded in the results store: ``running`` from here, then ``failed`` on any error (a user's
    mistake, a bug, Ctrl-C) or ``finished`` by ``write_result``. A killed process leaves it ``running``."""
    store = open_store(cfg, cache_root(cfg.cache_dir))
    run_id, versions, git = uuid.uuid4().hex, package_versions(), git_commit()
    store.start_run(run_id, experiment=cfg.modelset.name, method=cfg.method.name,
                    config=OmegaConf.to_container(cfg, resolve=True), versions=versions, git=git,
                    job_dir=str(out_dir))
    try:
        outcome = _execute(cfg, out_dir, store)
    except BaseException as err:
        store.release_claims()
        store.fail_run(run_id, f"{type(err).__name__}: {err}")
        raise
    outcome.run_id, outcome.versions, outcome.git = run_id, versions, git
    return outcome


def _execute(cfg: DictConfig, out_dir: Path, store) -> Outcome:
    import torch
    from transformers import AutoTokenizer

    from mergeval.engine import merge_tensors
    from mergeval.eval.harness import Harness
    from mergeval.models.checkpoint import load_model
    from mergeval.models.fingerprint import fingerprint_state_dict
    quiet_transformers()
    lap = Laps()
    timings = lap.timings

    method, method_cfg = validate(cfg)
    cache = cache_root(cfg.cache_dir)
    tasks = list(cfg.benchmark.tasks)
    task_dir = write_tasks(tasks, cfg.benchmark.n_items, cache)

    if cfg.vocab_policy == "truncate":  # the merge would not fit the base's architecture we evaluate it in
        raise UserError("vocab_policy", "truncate changes the vocabulary size, so the merge cannot be evaluated "
                        "in the base's architecture", "use vocab_policy=union, or python -m mergeval.merge to "
                        "write the truncated merge")
    base_dir, expert_dirs, models = resolve_models(cfg, cache)
    lap("resolve_models")
    method_cfg, merge_info = prepare_method(cfg, method, method_cfg, models, base_dir, cache, can_evaluate=True)
    if "validation_scores" in merge_info:
        lap("rank_experts")

    digests = {t: task_digest(task_dir, t) for t in tasks}
    settings = eval_settings(cfg)
    inputs = [m.fingerprint for m in models]  # base first, then the experts in modelset order
    options = {"vocab_policy": cfg.get("vocab_policy")}  # changes the output beyond the method config
    key = merge_key(inputs, method_cfg, cfg.seed, options)
    done = None if cfg.eval.force or cfg.save_merged else store.evaluated_merge(key, digests, settings)
    if done:  # merged and scored before with these inputs, method config and seed: do neither again
        merged = None
        models.append(ModelInfo(MERGED, f"{method.name}", done, merge="reused from the results store"))
    else:
        base_tensors = load_tensors(base_dir)
        merged = merge_tensors(method, method_cfg, base_tensors, [load_tensors(p) for p in expert_dirs.values()],
                               cfg.seed, vocab_policy=cfg.vocab_policy)
        models.append(ModelInfo(MERGED, f"{method.name}", fingerprint_state_dict(merged), merge="this run"))
        store.put_merge(key, inputs, method_cfg, cfg.seed, models[-1].fingerprint, options)
    record_models(store, models)
    lap("merge")

    harnesses: dict[tuple[str, ...], Harness] = {}  # one per set of tasks to evaluate (usually all of them)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    dtype = getattr(torch, cfg.eval.dtype)
    scores: dict[str, dict[str, dict[str, float]]] = {t: {} for t in tasks}
    for info in models:
        # Each task is evaluated once per model and settings, whatever other tasks the run has; parallel
        # sweep jobs wait for the one evaluating a shared constituent.
        got = {} if cfg.eval.force else store.claim_or_scores(
            info.fingerprint, digests, settings,
            lambda: print(f"mergeval: waiting for another job evaluating {info.role}", flush=True))
        missing = [t for t in tasks if t not in got]
        info.evaluated = ("reused from the results store" if not missing else "this run" if not got
                          else "partly reused from the results store")
        if missing:
            print(f"mergeval: evaluating {info.role} on {len(missing)} tasks", flush=True)
            if tuple(missing) not in harnesses:
                harnesses[tuple(missing)] = Harness.for_run(cfg, task_dir, missing, cfg.benchmark.limit)
            harness = harnesses[tuple(missing)]
            path = base_dir if info.role == MERGED else Path(info.path)
            model = load_model(path, merged if info.role == MERGED else None, dtype).to(cfg.eval.device)
            fresh = {t: {"acc": s.acc, "stderr": s.stderr, "n": s.n} for t, s in harness.score(model, tokenizer).items()}
            evaluated = {t: digests[t] for t in missing}
            kept = samples.write(samples.path_for(cache, info.fingerprint, settings_hash(settings), evaluated),
                                 harness.samples)
            store.put_scores(info.fingerprint, evaluated, settings, fresh, samples_path=str(kept))
            got = {**got, **fresh}
            del model
        for task in tasks:
            scores[task][info.role] = got[task]
    lap("evaluate")

    aggregates = aggregate(scores, tasks, models, cfg.metric)
    if cfg.metric.calibration or cfg.metric.consistency:  # both from the per-choice log-likelihoods kept
        from mergeval.metrics.composed import calibration, consistency

        kept = {m.role: samples.read_tasks(store.samples_paths(m.fingerprint, digests, settings)) for m in models}
        if cfg.metric.calibration:
            aggregates["calibration"] = calibration(kept)
        if cfg.metric.consistency:  # the same items asked in two formats
            aggregates["consistency"] = consistency(kept, [list(pair) for pair in cfg.metric.consistency])
    if cfg.metric.similarity:  # parameter-space statistics of the task vectors (SVDs: opt-in)
        from mergeval.metrics.composed import similarity

        experts = {name: load_tensors(p) for name, p in expert_dirs.items()}
        aggregates["similarity"] = similarity(load_tensors(base_dir), experts, merged)
        lap("similarity")
    if cfg.save_merged:  # the merge kept in memory, written with the streaming writer (model card included)
        from mergeval.engine import save_merged
        from mergeval.engine.card import merge_config

        target = out_dir / "merged_model"
        save_merged(merged, base_dir, target, method.name,
                    {"config": merge_config(cfg), "inputs": [vars(m) for m in models[:-1]]})
        models[-1].path = str(target)
        lap("save_merged")
    return Outcome(models, tasks, scores, aggregates, digests, timings, merge_info)


def resolve_models(cfg: DictConfig, cache: Path) -> tuple[Path, dict[str, Path], list[ModelInfo]]:
    """The base's directory, each expert's directory (zoo experts built here) and their ModelInfo rows.

    Given models are checked for shape compatibility before any expert is fine-tuned
    (cheap checks before minutes of work).
    """
    from mergeval.zoo.experts import expert_dir

    fp_cache = cache / "fingerprints.json"
    given = {name: resolve_source(e.source, f"modelset.experts.{name}.source", cache, cfg.offline)
             for name, e in cfg.modelset.experts.items() if e.source is not None}
    base_dir = resolve_source(cfg.modelset.base, "modelset.base", cache, cfg.offline)
    check_compatible(base_dir, given, cfg.vocab_policy)  # before spending minutes on building experts
    models = [ModelInfo("base", cfg.modelset.base, fingerprint(base_dir, fp_cache), str(base_dir))]
    expert_dirs: dict[str, Path] = {}
    for name, expert in cfg.modelset.experts.items():
        if name in given:
            path, source = given[name], expert.source
        else:
            path = expert_dir(base_dir, models[0].fingerprint, expert.domain, cfg.modelset.train, cache,
                              f"modelset.experts.{name}.domain")
            source = f"finetune:{expert.domain}"
        expert_dirs[name] = path
        models.append(ModelInfo(name, source, fingerprint(path, fp_cache), str(path), expert.task))
    check_compatible(base_dir, expert_dirs, cfg.vocab_policy)
    return base_dir, expert_dirs, models


def prepare_method(cfg: DictConfig, method, method_cfg, models: list[ModelInfo], base_dir: Path, cache: Path,
                   can_evaluate: bool):
    """What a method needs from the models before merging: hierarchical's head counts (the base's config.json),
    CMM's validation ranking (evaluations; refused when the caller cannot evaluate). Returns (cfg, merge_info)."""
    if method.name == "hierarchical":
        from mergeval.methods.hierarchical import fill_head_counts
        from mergeval.models.checkpoint import read_config

        method_cfg = fill_head_counts(method_cfg, read_config(base_dir))
    merge_info = merge_details(method.name, method_cfg, models)
    if "needs_ranking" in merge_info:
        if not can_evaluate:
            refuse_ranking(method, method_cfg)
        from mergeval.ranking import rank_experts

        method_cfg, ranking = rank_experts(cfg, method_cfg, models, cache)
        merge_info = {**merge_details(method.name, method_cfg, models), **ranking}
    return method_cfg, merge_info


def refuse_ranking(method, method_cfg) -> None:
    """For callers that cannot evaluate (merge-only): a method that must rank experts first is an error."""
    if "needs_ranking" in merge_details(method.name, method_cfg, []):
        raise UserError("method.order", "ranking the experts needs an evaluation, which a merge-only run does not "
                        "do", "give method.validation_scores, set method.order=given, or run python -m mergeval")


def merge_details(method_name: str, method_cfg, models: list[ModelInfo]) -> dict:
    """What a method decided beyond its config (CMM: the merge order and coefficients), for result.json."""
    if method_name != "cmm":
        return {}
    from mergeval.methods.curriculum import merge_order, schedule

    names = [m.role for m in models if m.role != "base"]
    if method_cfg.order != "given" and method_cfg.validation_scores is None:
        return {"needs_ranking": True}
    order = merge_order(method_cfg.order, method_cfg.validation_scores, len(names))
    coeffs = schedule(method_cfg.schedule, method_cfg.start, method_cfg.end, len(names))
    return {"order": [names[i] for i in order], "coefficients": coeffs}


def eval_settings(cfg: DictConfig) -> dict:
    """Everything besides model and task data that can change a score (part of the store's key)."""
    from importlib.metadata import version

    settings = {"limit": cfg.benchmark.limit, "num_fewshot": cfg.benchmark.num_fewshot, "dtype": cfg.eval.dtype,
                "batch_size": cfg.eval.batch_size, "device": cfg.eval.device, "lm_eval": version("lm_eval")}
    if cfg.eval.backend != "hflm":  # evaluations stored before backends existed were HFLM's: keep their key
        settings["backend"] = cfg.eval.backend
    return settings


def open_store(cfg: DictConfig, cache: Path):
    """The results store at ``store.path``, default ``<cache>/results.sqlite``."""
    from mergeval.store import Store

    return Store(Path(cfg.store.path).expanduser() if cfg.store.path else cache / "results.sqlite")


def record_models(store, models: list[ModelInfo]) -> None:
    """Each constituent's fingerprint, source and architecture (from its config.json) in the store's models table."""
    from mergeval.store import architecture_of

    for info in models:
        try:  # the in-memory merge has the base's architecture
            source_dir = Path(info.path or models[0].path)
            arch = architecture_of(json.loads((source_dir / "config.json").read_text()))
        except (OSError, TypeError, ValueError):  # no path or no readable config.json: the row keeps no architecture
            arch = None
        store.put_model(info.fingerprint, info.source, arch, info.path)


def aggregate(scores: dict[str, dict[str, dict[str, float]]], tasks: list[str], models: list[ModelInfo],
              metric) -> dict:
    """Macro-Gain / Macro-OG over all tasks (constituents = the experts), normalized scores per expert task,
    and what the metric group adds (group means per role, forgetting; see metrics/composed.py)."""
    from mergeval.metrics.composed import forgetting_of_merge, group_scores

    if isinstance(metric, str):  # a bare scale: no groups, no forgetting
        from mergeval.config import MetricConfig

        metric = MetricConfig(scale=metric)
    scale = metric.scale
    experts = [m for m in models if m.role not in ("base", MERGED)]
    merged = [scores[t][MERGED]["acc"] for t in tasks]
    constituents = [[scores[t][e.role]["acc"] for t in tasks] for e in experts]
    normalized = {}
    for e in experts:
        if e.task is not None:
            s = scores[e.task]
            normalized[e.task] = normalized_score(s[MERGED]["acc"], s["base"]["acc"], s[e.role]["acc"])
    mean = mean_normalized_score(normalized.values())
    return {
        "scale": scale,
        "macro_gain": macro_gain(merged, constituents, scale=scale),
        "macro_og": macro_og(merged, constituents, scale=scale),
        "normalized": normalized,
        "normalized_mean": mean,
        "normalized_band": band(mean),
        "groups": group_scores(scores, [m.role for m in models], metric),
        "forgetting": forgetting_of_merge(scores, metric, MERGED),
    }


def write_result(cfg: DictConfig, outcome: Outcome, out_dir: Path) -> Path:
    """result.json in the job directory (atomic), then the run's row in the results store marked finished.

    If either step fails the run is marked failed and no result.json is left behind.
    """
    store = open_store(cfg, cache_root(cfg.cache_dir))
    result = {
        "run_id": outcome.run_id,
        "status": "finished",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "seeds": {"run": cfg.seed, "train": cfg.modelset.train.seed, "eval_data": 0},
        "models": [vars(m) for m in outcome.models],
        "tasks": outcome.tasks,
        "task_digests": outcome.task_digests,
        "scores": outcome.scores,
        "aggregates": outcome.aggregates,
        "merge": outcome.merge_info,
        "timings_s": outcome.timings,
        "versions": outcome.versions,
        "git": outcome.git,
    }
    path = out_dir / "result.json"
    try:
        atomic_write_text(path, json.dumps(result, indent=2))
        store.finish_run(outcome.run_id, result_path=str(path), aggregates=outcome.aggregates,
                         timings=outcome.timings, models=result["models"], scores=outcome.scores)
    except BaseException as err:
        path.unlink(missing_ok=True)
        store.fail_run(outcome.run_id, f"{type(err).__name__}: {err}", outcome.timings)
        raise
    return path
