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
from mergeval.eval.tasks import check_tasks, task_digest, write_tasks
from mergeval.methods import get_method
from mergeval.metrics.aggregates import band, macro_gain, macro_og, mean_normalized_score, normalized_score
from mergeval.models.checkpoint import check_compatible, load_tensors
from mergeval.models.fingerprint import fingerprint
from mergeval.models.sources import resolve_source
from mergeval.paths import atomic_dir, atomic_write_text, cache_root
from mergeval.provenance import git_commit, package_versions
from mergeval.zoo.domains import DOMAINS

MERGED = "merged"


@dataclass
class ModelInfo:
    role: str  # "base", an expert's name, or "merged"
    source: str
    fingerprint: str
    path: str | None = None
    task: str | None = None  # the expert's own task
    evaluated: str | None = None  # "this run" or "reused from the results store"


@dataclass
class Outcome:
    models: list[ModelInfo]
    tasks: list[str]
    scores: dict[str, dict[str, dict[str, float]]]  # task -> model role -> {acc, stderr, n}
    aggregates: dict
    task_digests: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)


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
    method.validate(method_cfg, len(experts))
    if cfg.benchmark.limit is not None and cfg.benchmark.limit < 1:
        raise UserError("benchmark.limit", f"must be positive, got {cfg.benchmark.limit}", "set it to null or >= 1")
    if cfg.metric.scale not in ("percent", "fraction"):
        raise UserError("metric.scale", f"unknown scale '{cfg.metric.scale}'", "use percent or fraction")
    if cfg.eval.batch_size < 1:
        raise UserError("eval.batch_size", f"must be positive, got {cfg.eval.batch_size}", "set e.g. eval.batch_size=32")
    if cfg.eval.dtype not in ("float32", "bfloat16", "float16"):
        raise UserError("eval.dtype", f"unknown dtype '{cfg.eval.dtype}'", "use float32, bfloat16 or float16")
    return method, method_cfg


def run(cfg: DictConfig, out_dir: Path) -> Outcome:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from mergeval.engine import merge_tensors
    from mergeval.eval.harness import Harness
    from mergeval.models.checkpoint import load_model
    from mergeval.models.fingerprint import fingerprint_state_dict
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 3)
        clock = now

    method, method_cfg = validate(cfg)
    cache = cache_root(cfg.cache_dir)
    tasks = list(cfg.benchmark.tasks)
    task_dir = write_tasks(tasks, cfg.benchmark.n_items, cache)

    base_dir, expert_dirs, models = resolve_models(cfg, cache)
    lap("resolve_models")

    base_tensors = load_tensors(base_dir)
    merged = merge_tensors(method, method_cfg, base_tensors, [load_tensors(p) for p in expert_dirs.values()],
                           cfg.seed)
    models.append(ModelInfo(MERGED, f"{method.name}", fingerprint_state_dict(merged)))
    lap("merge")

    digests = {t: task_digest(task_dir, t) for t in tasks}
    settings = eval_settings(cfg)
    store = open_store(cfg, cache)
    harness = None
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    dtype = getattr(torch, cfg.eval.dtype)
    scores: dict[str, dict[str, dict[str, float]]] = {t: {} for t in tasks}
    for info in models:
        got = None if cfg.eval.force else store.get_scores(info.fingerprint, digests, settings)
        info.evaluated = "reused from the results store" if got else "this run"
        if got is None:
            print(f"mergeval: evaluating {info.role} on {len(tasks)} tasks", flush=True)
            harness = harness or Harness(task_dir, tasks, cfg.eval.batch_size, cfg.benchmark.limit,
                                         cfg.benchmark.num_fewshot)
            path = base_dir if info.role == MERGED else Path(info.path)
            model = load_model(path, merged if info.role == MERGED else None, dtype).to(cfg.eval.device)
            got = {t: {"acc": s.acc, "stderr": s.stderr, "n": s.n} for t, s in harness.score(model, tokenizer).items()}
            store.put_scores(info.fingerprint, digests, settings, got)
            del model
        for task in tasks:
            scores[task][info.role] = got[task]
    lap("evaluate")

    aggregates = aggregate(scores, tasks, models, cfg.metric.scale)
    if cfg.save_merged:
        target = out_dir / "merged_model"
        model = load_model(base_dir, merged, torch.float32)
        with atomic_dir(target) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        models[-1].path = str(target)
        lap("save_merged")
    return Outcome(models, tasks, scores, aggregates, digests, timings)


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
    check_compatible(base_dir, given)  # before spending minutes on building experts
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
    check_compatible(base_dir, expert_dirs)
    return base_dir, expert_dirs, models


def eval_settings(cfg: DictConfig) -> dict:
    """Everything besides model and task data that can change a score (part of the store's key)."""
    from importlib.metadata import version

    return {"limit": cfg.benchmark.limit, "num_fewshot": cfg.benchmark.num_fewshot, "dtype": cfg.eval.dtype,
            "batch_size": cfg.eval.batch_size, "device": cfg.eval.device, "lm_eval": version("lm_eval")}


def open_store(cfg: DictConfig, cache: Path):
    from mergeval.store import Store

    return Store(Path(cfg.store).expanduser() if cfg.store else cache / "results.sqlite")


def aggregate(scores: dict[str, dict[str, dict[str, float]]], tasks: list[str], models: list[ModelInfo],
              scale: str) -> dict:
    """Macro-Gain / Macro-OG over all tasks (constituents = the experts) and normalized scores per expert task."""
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
    }


def write_result(cfg: DictConfig, outcome: Outcome, out_dir: Path) -> Path:
    """result.json in the job directory (atomic), then the run's row in the results store."""
    run_id = uuid.uuid4().hex
    result = {
        "run_id": run_id,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "seeds": {"run": cfg.seed, "train": cfg.modelset.train.seed, "eval_data": 0},
        "models": [vars(m) for m in outcome.models],
        "tasks": outcome.tasks,
        "task_digests": outcome.task_digests,
        "scores": outcome.scores,
        "aggregates": outcome.aggregates,
        "timings_s": outcome.timings,
        "versions": package_versions(),
        "git": git_commit(),
    }
    path = out_dir / "result.json"
    atomic_write_text(path, json.dumps(result, indent=2))
    open_store(cfg, cache_root(cfg.cache_dir)).record_run(run_id, path, cfg.modelset.name, cfg.method.name,
                                                         result["config"], outcome.aggregates)
    return path
