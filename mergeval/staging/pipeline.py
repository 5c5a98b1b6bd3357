"""Run a staged sweep: perplexity on every candidate, a fraction of the benchmark on the best, all of it on the finalists.

Flow (every user-fixable check runs before any model is loaded):

1. validate the run config and build every candidate's method config;
   draw the held-out text; resolve the base and the experts;
2. stage 1: the base and each candidate (merged in memory) score the
   held-out answers; candidates are ranked by mean log-perplexity ratio to the
   base; if every candidate degrades past ``degrade_threshold``, stop;
3. the constituents' full benchmark scores (from the results store when known);
4. stage 2: items ``[0, L)`` of every task on the best ``stage1_keep``, with
   ``L = ceil(stage2_fraction · N)``; ranked by mean accuracy;
5. stage 3: items ``[L, N)`` on the best ``stage3_keep``, combined with their
   stage-2 items into full-benchmark scores; the best is the pick;
6. with ``staged.full=true``: the full benchmark on every candidate, and
   whether its best is the staged pick.

One candidate is in memory at a time: it is re-merged for each stage it
reaches (deterministic, seconds) rather than holding every merge. Every
benchmark evaluation goes through the results store, keyed by the model's
fingerprint, the task digests and the settings including the item selection,
so a full evaluation here is the same entry ``python -m mergeval`` reads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mergeval.app import MERGED, ModelInfo, aggregate, eval_settings, open_store, resolve_models, validate
from mergeval.eval.tasks import task_digest, write_tasks
from mergeval.metrics.perplexity import degradation, mean_log_ratio, perplexity
from mergeval.paths import cache_root
from mergeval.staging.cost import Cost, cost_table
from mergeval.staging.heldout import heldout_items
from mergeval.staging.nll import Spent, answer_sequences, token_nlls
from mergeval.staging.plan import Candidate, Plan, make_plan, stage2_limit
from mergeval.staging.selection import best_first, combine, mean_accuracy, promote

THIS_RUN, REUSED = "this run", "reused from the results store"


@dataclass
class CandidateResult:
    label: str
    method: str
    params: dict
    config: dict
    fingerprint: str = ""
    perplexity: dict[str, float] = field(default_factory=dict)  # task -> perplexity of the held-out answers
    log_ratio: float = math.inf  # mean over tasks of ln(PPL / PPL_base): the stage-1 key
    degradation: float = math.inf  # exp(log_ratio) - 1
    degraded: bool = False
    stage2: dict | None = None  # task -> {acc, stderr, n} on items [0, L)
    stage3: dict | None = None  # task -> {acc, stderr, n} on all N items (stage 2's plus [L, N))
    aggregates: dict | None = None  # Macro-Gain, Macro-OG, normalized scores of a finalist
    full: dict | None = None  # task -> {acc, stderr, n}: the full benchmark run directly (staged.full=true)
    evaluated: dict[str, str] = field(default_factory=dict)  # stage -> this run | reused from the results store

    def mean(self, stage: str) -> float | None:
        scores = getattr(self, stage)
        return None if scores is None else mean_accuracy(scores)


@dataclass
class StagedOutcome:
    tasks: list[str]
    task_digests: dict[str, str]
    constituents: list[ModelInfo]
    constituent_scores: dict[str, dict[str, dict]]  # task -> role -> {acc, stderr, n}
    heldout: dict[str, dict]  # task -> {texts, answer_tokens}
    base_perplexity: dict[str, float]
    candidates: list[CandidateResult]
    n_full: int  # items per task in the full benchmark
    stage2_items: int  # L
    stage2: list[str] = field(default_factory=list)  # labels promoted to stage 2, best first
    stage3: list[str] = field(default_factory=list)  # finalists, best first
    pick: str | None = None
    early_stop: str | None = None
    cost: dict[str, Cost] = field(default_factory=dict)
    ran: dict[str, int] = field(default_factory=dict)  # forward passes actually run in this job, per stage
    comparison: dict | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def result(self, label: str) -> CandidateResult:
        return next(c for c in self.candidates if c.label == label)


class Bench:
    """The benchmark side of a sweep: one harness per item selection, results-store reuse, requests run."""

    def __init__(self, cfg: DictConfig, task_dir: Path, tasks: list[str], digests: dict[str, str], store, tokenizer):
        self.cfg, self.task_dir, self.tasks, self.digests = cfg, task_dir, tasks, digests
        self.store, self.tokenizer = store, tokenizer
        self.settings = eval_settings(cfg)
        self.harnesses: dict[int | None, object] = {}

    def _harness(self, limit: int | None):
        from mergeval.eval.harness import Harness

        if limit not in self.harnesses:
            self.harnesses[limit] = Harness(self.task_dir, self.tasks, self.cfg.eval.batch_size, limit,
                                            self.cfg.benchmark.num_fewshot)
        return self.harnesses[limit]

    def scores(self, fingerprint: str, make_model, items: tuple[int, int] | None = None) -> tuple[dict, str, int]:
        """(task -> {acc, stderr, n}, where it came from, requests run) for the full benchmark, or items [lo, hi).

        ``items=(0, L)`` is the same selection as ``benchmark.limit=L`` and shares its store key.
        """
        if items is None:
            settings, limit, samples = self.settings, self.cfg.benchmark.limit, None
        elif items[0] == 0:
            settings, limit, samples = dict(self.settings, limit=items[1]), items[1], None
        else:
            settings, limit = dict(self.settings, limit=None, items=list(items)), None
            samples = {t: list(range(*items)) for t in self.tasks}
        got = None if self.cfg.eval.force else self.store.get_scores(fingerprint, self.digests, settings)
        if got is not None:
            return got, REUSED, 0
        harness = self._harness(limit)
        model = make_model()
        got = {t: {"acc": s.acc, "stderr": s.stderr, "n": s.n}
               for t, s in harness.score(model, self.tokenizer, samples=samples).items()}
        self.store.put_scores(fingerprint, self.digests, settings, got)
        return got, THIS_RUN, sum(harness.requests.values())


def _choices(task_dir: Path, tasks: list[str], n: int) -> dict[str, list[int]]:
    """Answer choices per item of the first ``n`` items of each task, read from the files lm-eval reads."""
    out = {}
    for task in tasks:
        lines = (task_dir / f"{task}.jsonl").read_text().splitlines()[:n]
        out[task] = [len(json.loads(line)["choices"]) for line in lines]
    return out


def _finite_or_inf(x: float) -> float:
    """A non-finite score (a merge whose logits overflow) ranks as infinitely perplexed."""
    return x if math.isfinite(x) else math.inf


def prepare(cfg: DictConfig) -> Plan:
    """Every check that needs no model: the run config (its ``method`` is unused) and the sweep's plan."""
    validate(cfg)
    return make_plan(cfg.staged, len(cfg.modelset.experts))


def run_staged(cfg: DictConfig) -> StagedOutcome:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from mergeval.engine import merge_tensors
    from mergeval.models.checkpoint import load_model, load_tensors
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

    plan = prepare(cfg)
    cache = cache_root(cfg.cache_dir)
    tasks = list(cfg.benchmark.tasks)
    n_items = cfg.benchmark.n_items
    n_full = min(n_items, cfg.benchmark.limit) if cfg.benchmark.limit is not None else n_items
    n_stage2 = stage2_limit(plan.stage2_fraction, n_full)
    trained = {e.domain for e in cfg.modelset.experts.values() if e.domain is not None}
    heldout = heldout_items(tasks, plan.heldout_items, n_items, trained, cfg.modelset.train)
    task_dir = write_tasks(tasks, n_items, cache)
    base_dir, expert_dirs, models = resolve_models(cfg, cache)
    lap("resolve_models")

    dtype, device = getattr(torch, cfg.eval.dtype), cfg.eval.device
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    sequences = {t: answer_sequences(tokenizer, items) for t, items in heldout.items()}
    base_tensors = load_tensors(base_dir)
    expert_tensors = [load_tensors(p) for p in expert_dirs.values()]

    def merged(cand: Candidate) -> dict:
        return merge_tensors(cand.method, cand.config, base_tensors, expert_tensors, cfg.seed, progress=False,
                             vocab_policy=cfg.vocab_policy)

    def as_model(tensors: dict | None):
        return load_model(base_dir, tensors, dtype).to(device)

    spent = Spent()

    def perplexities(model) -> dict[str, float]:
        return {t: _finite_or_inf(perplexity(token_nlls(model, seqs, cfg.eval.batch_size, pad_id, device, spent)))
                for t, seqs in sequences.items()}

    digests = {t: task_digest(task_dir, t) for t in tasks}
    outcome = StagedOutcome(
        tasks, digests, models, {t: {} for t in tasks},
        {t: {"texts": len(s), "answer_tokens": sum(len(ids) - start for ids, start in s)} for t, s in sequences.items()},
        {}, [], n_full, n_stage2, timings=timings)

    # Stage 1: perplexity of the held-out answers, every candidate and the base (the reference).
    print(f"mergeval: stage 1: perplexity of {len(plan.candidates)} candidates and the base on "
          f"{sum(len(s) for s in sequences.values())} held-out texts", flush=True)
    outcome.base_perplexity = perplexities(as_model(None))
    for cand in plan.candidates:
        tensors = merged(cand)
        res = CandidateResult(cand.label, cand.method.name, cand.params,
                              OmegaConf.to_container(OmegaConf.structured(cand.config)),
                              fingerprint_state_dict(tensors))
        res.perplexity = perplexities(as_model(tensors))
        del tensors
        res.log_ratio = _finite_or_inf(mean_log_ratio(res.perplexity, outcome.base_perplexity))
        res.degradation = _finite_or_inf(degradation(res.perplexity, outcome.base_perplexity))
        res.degraded = not res.degradation <= plan.degrade_threshold
        outcome.candidates.append(res)
        print(f"  {cand.label}: perplexity x{res.degradation + 1:.3g} of the base (geometric mean over tasks)",
              flush=True)
    outcome.ran["stage1"] = spent.forward_passes
    lap("stage1")

    labels = [c.label for c in outcome.candidates]
    degraded = frozenset(c.label for c in outcome.candidates if c.degraded)
    if len(degraded) == len(labels):
        outcome.early_stop = (f"every candidate's held-out perplexity is more than {plan.degrade_threshold:.0%} "
                              "above the base's (geometric mean over tasks); stopped before any benchmark: "
                              "reconsider the experts or the methods before spending more")
    else:
        outcome.stage2 = promote({c.label: c.log_ratio for c in outcome.candidates}, labels, plan.stage1_keep,
                                 higher_is_better=False, excluded=degraded)
    if outcome.early_stop is None or plan.full:
        bench = Bench(cfg, task_dir, tasks, digests, open_store(cfg, cache), tokenizer)
        _constituents(bench, outcome, dtype, device)
        lap("constituents")
    if outcome.early_stop is None:
        _stage2_and_3(bench, outcome, plan, lambda c: as_model(merged(c)))
        lap("stages_2_3")
    if plan.full:
        _full(bench, outcome, plan, lambda c: as_model(merged(c)))
        lap("full")
    choices = _choices(task_dir, tasks, n_full)
    outcome.cost = cost_table(len(labels), {t: len(s) for t, s in sequences.items()}, choices, n_full, n_stage2,
                              len(outcome.stage2), len(outcome.stage3))
    return outcome


def _constituents(bench: Bench, outcome: StagedOutcome, dtype, device) -> None:
    """The base's and experts' full benchmark scores (once per fingerprint and settings, via the store)."""
    from mergeval.models.checkpoint import load_model

    for info in outcome.constituents:
        path = Path(info.path)

        def make():
            print(f"mergeval: evaluating {info.role} on {len(outcome.tasks)} tasks", flush=True)
            return load_model(path, None, dtype).to(device)

        got, info.evaluated, _ = bench.scores(info.fingerprint, make)
        for task in outcome.tasks:
            outcome.constituent_scores[task][info.role] = got[task]


def _stage2_and_3(bench: Bench, outcome: StagedOutcome, plan: Plan, model_of) -> None:
    by_label = {c.label: c for c in plan.candidates}
    n2, n = outcome.stage2_items, outcome.n_full
    print(f"mergeval: stage 2: {len(outcome.stage2)} candidates on items [0, {n2}) of each task", flush=True)
    outcome.ran["stage2"] = 0
    for label in outcome.stage2:
        res = outcome.result(label)
        res.stage2, res.evaluated["stage2"], ran = bench.scores(res.fingerprint, lambda: model_of(by_label[label]),
                                                                (0, n2))
        outcome.ran["stage2"] += ran
    keys = {label: outcome.result(label).mean("stage2") for label in outcome.stage2}
    outcome.stage3 = promote(keys, outcome.stage2, plan.stage3_keep, higher_is_better=True)
    print(f"mergeval: stage 3: {len(outcome.stage3)} candidates on items [{n2}, {n}) of each task", flush=True)
    outcome.ran["stage3"] = 0
    for label in outcome.stage3:
        res = outcome.result(label)
        if n2 < n:
            rest, res.evaluated["stage3"], ran = bench.scores(res.fingerprint, lambda: model_of(by_label[label]),
                                                              (n2, n))
            outcome.ran["stage3"] += ran
            res.stage3 = {t: combine(res.stage2[t], rest[t]) for t in outcome.tasks}
        else:  # stage 2 already covered every item
            res.stage3 = res.stage2
        scores = {t: dict(outcome.constituent_scores[t], **{MERGED: res.stage3[t]}) for t in outcome.tasks}
        res.aggregates = aggregate(scores, outcome.tasks, outcome.constituents, bench.cfg.metric.scale)
    outcome.stage3 = best_first({label: outcome.result(label).mean("stage3") for label in outcome.stage3},
                                outcome.stage3, higher_is_better=True)
    outcome.pick = outcome.stage3[0]


def full_evaluation(bench: Bench, candidates: list[Candidate], fingerprints: dict[str, str], model_of) -> dict:
    """The full benchmark on every candidate: label -> (task -> {acc, stderr, n}, where it came from, requests run)."""
    out = {}
    for cand in candidates:
        print(f"mergeval: full benchmark on {cand.label}", flush=True)
        out[cand.label] = bench.scores(fingerprints[cand.label], lambda: model_of(cand))
    return out


def compare(staged_pick: str | None, full_means: dict[str, float], order: list[str]) -> dict:
    """Whether full evaluation's best candidate is the staged pick, and the accuracy the staged pick gives up.

    ``regret = max mean accuracy (full) - the staged pick's full mean accuracy`` (0 when
    the staged pick ties the best); ties in the full ranking keep the sweep's order.
    """
    full_pick = best_first(full_means, order, higher_is_better=True)[0]
    regret = None if staged_pick is None else full_means[full_pick] - full_means[staged_pick]
    return {"full_pick": full_pick, "staged_pick": staged_pick, "same_pick": staged_pick == full_pick,
            "regret": regret}


def _full(bench: Bench, outcome: StagedOutcome, plan: Plan, model_of) -> None:
    fingerprints = {c.label: c.fingerprint for c in outcome.candidates}
    done = full_evaluation(bench, plan.candidates, fingerprints, model_of)
    outcome.ran["full"] = 0
    for label, (scores, evaluated, ran) in done.items():
        res = outcome.result(label)
        res.full, res.evaluated["full"] = scores, evaluated
        outcome.ran["full"] += ran
    means = {c.label: c.mean("full") for c in outcome.candidates}
    outcome.comparison = compare(outcome.pick, means, [c.label for c in outcome.candidates])

