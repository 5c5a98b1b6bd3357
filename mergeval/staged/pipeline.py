"""Run a staged sweep: perplexity on every candidate, part of the benchmark on the best, all of it on the finalists.

Flow (every user-fixable check runs before any model is loaded):

1. validate the run config and build every candidate's method config;
   draw the held-out text; resolve the base and the experts;
2. stage 1: each candidate (merged in memory) scores the held-out answers of
   the experts' own tasks; candidates are ranked by their mean log-perplexity
   ratio to the experts (each on its own task); if every candidate degrades
   past ``degrade_threshold``, stop before any benchmark;
3. the constituents' full benchmark scores (from the results store when known);
4. stage 2: items ``[0, L)`` of every task on the best ``stage1_keep``, with
   ``L = ceil(stage2_fraction · N)``; ranked by mean accuracy over all tasks
   (equal accuracies keep their stage-1 order: a few items often tie);
5. stage 3: items ``[L, N)`` on the best ``stage3_keep``, combined with their
   stage-2 items into full-benchmark scores; the best is the pick;
6. with ``staged.full=true``: the full benchmark on every candidate, and
   whether its best is the staged pick.

One candidate is merged into the live model at a time. A candidate that
reaches stage 2 keeps its weights in host memory from stage 1 on where
``staged.keep_memory`` allows (``mergeval/staged/kept.py``), and is merged
again (deterministic: the same bits) where it does not. Every
benchmark evaluation goes through the results store, keyed by the model's
fingerprint, the task digests and the settings including the item selection,
so a full evaluation here is the same entry ``python -m mergeval`` reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from mergeval.core.errors import UserError
from mergeval.core.outcome import MERGED, ModelInfo
from mergeval.core.paths import cache_root
from mergeval.core.plain import plain_dict
from mergeval.core.runtime import Laps, apply_offline, quiet_transformers
from mergeval.eval.suite import build_suite
from mergeval.eval.tasks import GENERATED
from mergeval.metrics.perplexity import degradation, mean_log_ratio, perplexity
from mergeval.models.zoo.resolve import resolve_models
from mergeval.results.store import open_store
from mergeval.run.checks import refuse_slices, validate
from mergeval.run.config import RunCfg, typed
from mergeval.run.scoring import Scoring
from mergeval.run.summary import aggregate
from mergeval.staged.cost import Cost, cost_table
from mergeval.staged.heldout import heldout_items
from mergeval.staged.kept import KeptMerges, available_memory
from mergeval.staged.nll import Spent, answer_sequences, token_nlls
from mergeval.staged.plan import Candidate, Plan, make_plan, stage2_limit
from mergeval.staged.selection import best_first, combine, mean_accuracy, promote

if TYPE_CHECKING:
    import torch


CONSTITUENTS_IN_MEMORY = 0.5  # share of the free memory the base's and experts' tensors may take (else read lazily)


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

    def scored_mean(self, stage: str) -> float:
        """``mean`` of a stage this candidate was scored in."""
        value = self.mean(stage)
        assert value is not None, f"{self.label} has no {stage} scores"
        return value


@dataclass
class StagedOutcome:
    tasks: list[str]
    task_digests: dict[str, str]
    constituents: list[ModelInfo]
    constituent_scores: dict[str, dict[str, dict]]  # task -> role -> {acc, stderr, n}
    heldout: dict[str, dict]  # stage-1 task -> {texts, answer_tokens}
    reference: dict[str, dict]  # stage-1 task -> {model: the expert whose task it is, perplexity}
    candidates: list[CandidateResult]
    n_full: int  # items per task in the full benchmark
    stage2_items: int  # L
    stage2: list[str] = field(default_factory=list)  # labels promoted to stage 2, best first
    stage3: list[str] = field(default_factory=list)  # finalists, best first
    pick: str | None = None
    pick_command: str | None = None  # the pick as a plain run (mergeval/run/rerun.py; set by the command line)
    early_stop: str | None = None
    cost: dict[str, Cost] = field(default_factory=dict)
    ran: dict[str, int] = field(default_factory=dict)  # forward passes actually run in this job, per stage
    comparison: dict | None = None
    timings: dict[str, float] = field(default_factory=dict)
    merges: dict = field(default_factory=dict)  # merges run, candidates kept between stages, their bytes, ...

    def result(self, label: str) -> CandidateResult:
        return next(c for c in self.candidates if c.label == label)


def choices_per_item(task_dir: Path, tasks: list[str], n: int) -> dict[str, list[int]]:
    """Answer choices per item of the first ``n`` items of each task, read from the files lm-eval reads."""
    out = {}
    for task in tasks:
        lines = (task_dir / f"{task}.jsonl").read_text().splitlines()[:n]
        out[task] = [len(json.loads(line)["choices"]) for line in lines]
    return out


def _finite_or_inf(x: float) -> float:
    """A non-finite score (a merge whose logits overflow) ranks as infinitely perplexed."""
    return x if math.isfinite(x) else math.inf


def stage1_tasks(cfg: RunCfg) -> dict[str, list[str]]:
    """The tasks stage 1 scores: each expert's own task (benchmark order), with the experts it belongs to.

    Only the experts' tasks: the guide ranks by perplexity on each task's held-out
    domain text. General-knowledge text is left to the benchmark stages: the
    quickstart measured its answer perplexity swinging a hundredfold between
    merges of equal general accuracy (answer format, not knowledge), which
    drowned the domain signal when it was part of the ranking key.
    """
    owners: dict[str, list[str]] = {}
    for task in cfg.benchmark.tasks:
        roles = [name for name, e in cfg.modelset.experts.items() if e.task == task]
        if roles:
            owners[task] = roles
    if not owners:
        raise UserError(
            "modelset.experts",
            "staged evaluation ranks by perplexity on the experts' own tasks, and no expert names one",
            "set modelset.experts.<name>.task",
        )
    return owners


def prepare(cfg: DictConfig) -> Plan:
    """Every check that needs no model: the run config (its ``method`` is unused) and the sweep's plan."""
    validate(cfg)
    if cfg.get("tokenizer_source"):
        raise UserError(
            "tokenizer_source",
            "staged evaluation merges in memory in the base's vocabulary",
            "merge different tokenizers with python -m mergeval or python -m mergeval.merge",
        )
    refuse_slices(cfg, "staged evaluation")
    other = [t for t in cfg.benchmark.tasks if t not in GENERATED]
    if other:
        raise UserError(
            "benchmark.tasks",
            f"staged evaluation splits mergeval's generated tasks into stages; {other[0]} is not one",
            "run registry tasks with python -m mergeval",
        )
    plan = make_plan(cfg.staged, list(cfg.modelset.experts))
    stage1_tasks(cfg)
    return plan


class Models:
    """The sweep's models: the constituents' tensors, and each candidate merged on demand into one live model.

    One candidate is in the live model at a time; ``kept`` holds promoted
    candidates' weights between stages (kept.py). The live model is built once and then
    reloaded in place (a copy of the tensors, far cheaper than a ``from_pretrained``):
    every merge carries the same tensor names, so each load overwrites exactly
    what the previous one wrote, and the copy into the eval dtype rounds as a
    fresh load does.
    """

    def __init__(self, cfg: RunCfg, base_dir: Path, expert_dirs: dict[str, Path], dtype):
        from mergeval.merge.reader import CheckpointReader, MemorySource
        from mergeval.models.checkpoint import load_tensors
        from mergeval.models.fingerprint import safetensors_files

        self.cfg, self.base_dir, self.expert_dirs, self.dtype = cfg, base_dir, expert_dirs, dtype
        labelled = {"modelset.base": base_dir, **{f"modelset.experts.{k}": p for k, p in expert_dirs.items()}}
        size = sum(f.stat().st_size for d in labelled.values() for f in safetensors_files(d))
        # The constituents are read once into memory where they fit comfortably: each merge then reads no file.
        # Where they do not (a paper's 8B models: 16 GB each in bfloat16), each merge reads its inputs a tensor
        # or a row block at a time from the files (the page cache's copies), holding only the merge itself.
        self.in_memory = size <= CONSTITUENTS_IN_MEMORY * available_memory()
        self.sources = [
            MemorySource(load_tensors(d, label), label, d) if self.in_memory else CheckpointReader(d, label)
            for label, d in labelled.items()
        ]
        self._live: torch.nn.Module | None = None
        self._names: list[str] = []  # the tensor names every merge carries
        self.kept = KeptMerges(0, 0)
        self.merges_run = 0
        self.prepared: dict = {}  # what every merge of these sources can share (TIES' cuts per density: run_plan)

    def merged(self, cand: Candidate) -> dict:
        from mergeval.merge.memory import merge_sources

        self.merges_run += 1
        return merge_sources(
            cand.method,
            cand.config,
            self.sources[0],
            self.sources[1:],
            self.cfg.seed,
            vocab_policy=self.cfg.vocab_policy,
            prepared=self.prepared,
        )

    def identity(self, tensors: dict) -> str:
        """The identity of a merge held in ``tensors`` (models.fingerprint.model_identity): it is evaluated in the
        base's architecture with the base's tokenizer, as a run evaluates its merge."""
        from mergeval.models.fingerprint import fingerprint_state_dict, model_identity

        return model_identity(fingerprint_state_dict(tensors), self.base_dir)

    def live(self, tensors: dict):
        from mergeval.models.checkpoint import load_model

        if self._live is None:
            self._live = load_model(self.base_dir, tensors, self.dtype).to(self.cfg.eval.device)
        else:
            self._live.load_state_dict(tensors, strict=False)
        self._names = list(tensors)
        return self._live

    def candidate(self, cand: Candidate):
        """The live model holding ``cand``: its kept weights if stage 1 kept them, else merged again."""
        weights = self.kept.get(cand.label)
        return self.live(weights if weights is not None else self.merged(cand))

    def keep(self, label: str, key: float) -> None:
        """Offer the live model's current weights (the candidate ``label`` just loaded) to ``kept``."""
        assert self._live is not None, "the candidate was just loaded into the live model"
        state = self._live.state_dict()
        size = sum(state[k].numel() * state[k].element_size() for k in self._names)
        self.kept.offer(label, key, size, lambda: {k: state[k].detach().to("cpu", copy=True) for k in self._names})

    def saved(self, path: Path):
        from mergeval.models.checkpoint import load_model

        return load_model(path, None, self.dtype).to(self.cfg.eval.device)


@dataclass
class HeldOut:
    """Stage 1's scorer: the tokenized held-out answers per task, and the forward passes spent on them."""

    sequences: dict[str, list[tuple[list[int], int]]]
    batch_size: int
    pad_id: int
    device: str
    spent: Spent = field(default_factory=Spent)

    def perplexities(self, model, only: list[str] | None = None) -> dict[str, float]:
        return {
            t: _finite_or_inf(
                perplexity(token_nlls(model, seqs, self.batch_size, self.pad_id, self.device, self.spent))
            )
            for t, seqs in self.sequences.items()
            if only is None or t in only
        }


def run_staged(composed: DictConfig) -> StagedOutcome:
    import torch
    from transformers import AutoTokenizer

    quiet_transformers(composed.verbose)
    apply_offline(composed.offline)
    lap = Laps()
    timings = lap.timings

    plan = prepare(composed)
    cfg = typed(composed)  # checked and completed: the schema's dataclasses from here on
    cache = cache_root(cfg.cache_dir)
    tasks = list(cfg.benchmark.tasks)
    n_items = cfg.benchmark.n_items
    n_full = min(n_items, cfg.benchmark.limit) if cfg.benchmark.limit is not None else n_items
    owners = stage1_tasks(cfg)
    trained = {e.domain for e in cfg.modelset.experts.values() if e.domain is not None}
    heldout = heldout_items(list(owners), plan.heldout_items, n_items, trained, cfg.modelset.train)
    suite = build_suite(cfg.benchmark, cfg.eval, cache)  # staged runs hold only generated tasks (prepare)
    task_dir = suite.generated_dir
    assert task_dir is not None, "a staged sweep's tasks are generated ones (prepare)"
    base_dir, expert_dirs, constituents = resolve_models(cfg, cache)
    lap("resolve_models")
    _prepare(cfg, plan, base_dir, constituents, cache)

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    scorer = HeldOut(
        {t: answer_sequences(tokenizer, items) for t, items in heldout.items()},
        cfg.eval.batch_size,
        pad_id,
        cfg.eval.device,
    )
    models = Models(cfg, base_dir, expert_dirs, getattr(torch, cfg.eval.dtype))
    digests = suite.digests
    outcome = StagedOutcome(
        tasks,
        digests,
        constituents,
        {t: {} for t in tasks},
        {
            t: {"texts": len(s), "answer_tokens": sum(len(ids) - start for ids, start in s)}
            for t, s in scorer.sequences.items()
        },
        {},
        [],
        n_full,
        stage2_limit(plan.stage2_fraction, n_full),
        timings=timings,
    )

    models.kept = KeptMerges(plan.stage1_keep, int(plan.keep_memory * available_memory()))
    _stage1(outcome, plan, owners, models, scorer)
    models.kept.retain(outcome.stage2)
    outcome.merges["kept_between_stages"] = len(models.kept)
    lap("stage1")
    if outcome.early_stop is None or plan.full:
        bench = Scoring(cfg, suite, open_store(cfg, cache), cache, tasks=tasks, tokenizer=tokenizer)
        _constituents(bench, outcome, models)
        lap("constituents")
    if outcome.early_stop is None:
        _stage2_and_3(bench, outcome, plan, models.candidate)
        lap("stages_2_3")
    if plan.full:
        _full(bench, outcome, plan, models.candidate)
        lap("full")
    outcome.merges.update(
        merged=models.merges_run, constituents_in_memory=models.in_memory, kept_bytes_peak=models.kept.peak_bytes
    )
    models.kept.retain([])
    texts = {t: len(s) for t, s in scorer.sequences.items()}
    outcome.cost = cost_table(
        len(outcome.candidates),
        texts,
        sum(texts[t] * len(r) for t, r in owners.items()),
        choices_per_item(task_dir, tasks, n_full),
        n_full,
        outcome.stage2_items,
        len(outcome.stage2),
        len(outcome.stage3),
    )
    return outcome


def _prepare(cfg: RunCfg, plan: Plan, base_dir: Path, constituents, cache: Path) -> None:
    """Each candidate gets what its method needs from the models as a run's method does (``ranking.prepare_method``:
    head counts, calibration statistics, magnitude cuts, CMM's ranking of the experts on the validation split; each
    computed once per model and data, then reused)."""
    import dataclasses

    from mergeval.run.ranking import prepare_method

    for i, cand in enumerate(plan.candidates):
        config, _ = prepare_method(cfg, cand.method, cand.config, constituents, base_dir, cache, can_evaluate=True)
        plan.candidates[i] = dataclasses.replace(cand, config=config)


def _stage1(outcome: StagedOutcome, plan: Plan, owners: dict[str, list[str]], models: Models, scorer: HeldOut) -> None:
    """Perplexity of every candidate on the experts' held-out answers; the early stop, or stage 2's candidates.

    The reference for each task is its expert (the best, if several share it):
    the source models the guide's early stop compares with. It does not change
    the ranking (see :func:`mergeval.metrics.perplexity.mean_log_ratio`).
    """
    print(
        f"mergeval: stage 1: perplexity of {len(plan.candidates)} candidates on "
        f"{sum(len(s) for s in scorer.sequences.values())} held-out texts of {', '.join(owners)}",
        flush=True,
    )
    outcome.reference = reference_perplexities(models, owners, scorer)
    reference = {t: r["perplexity"] for t, r in outcome.reference.items()}
    for cand in plan.candidates:
        tensors = models.merged(cand)
        res = CandidateResult(
            cand.label,
            cand.method.name,
            cand.params,
            plain_dict(OmegaConf.structured(cand.config)),
            models.identity(tensors),
        )
        res.perplexity = scorer.perplexities(models.live(tensors))
        del tensors
        res.log_ratio = _finite_or_inf(mean_log_ratio(res.perplexity, reference))
        res.degradation = _finite_or_inf(degradation(res.perplexity, reference))
        res.degraded = not res.degradation <= plan.degrade_threshold
        if not res.degraded:  # a degraded candidate is never promoted
            models.keep(cand.label, res.log_ratio)
        outcome.candidates.append(res)
        print(
            f"  {cand.label}: perplexity x{res.degradation + 1:.3g} of the experts' (geometric mean over tasks)",
            flush=True,
        )
    outcome.ran["stage1"] = scorer.spent.forward_passes
    labels = [c.label for c in outcome.candidates]
    degraded = frozenset(c.label for c in outcome.candidates if c.degraded)
    if len(degraded) == len(labels):
        outcome.early_stop = (
            f"every candidate's held-out perplexity is more than {plan.degrade_threshold:.0%} "
            "above the experts' on their own tasks (geometric mean over tasks); stopped before "
            "any benchmark: reconsider whether these experts merge well, or the methods"
        )
    else:
        outcome.stage2 = promote(
            {c.label: c.log_ratio for c in outcome.candidates},
            labels,
            plan.stage1_keep,
            higher_is_better=False,
            excluded=degraded,
        )


def reference_perplexities(models: Models, owners: dict[str, list[str]], scorer: HeldOut) -> dict[str, dict]:
    """Stage 1's reference: per task, the perplexity of its expert on the held-out answers (the best expert's when
    several share the task), as ``{task: {model: role, perplexity}}``."""
    reference: dict[str, dict] = {}
    for role, path in models.expert_dirs.items():
        own = [t for t, roles in owners.items() if role in roles]
        if own:
            for task, ppl in scorer.perplexities(models.saved(path), own).items():
                if task not in reference or ppl < reference[task]["perplexity"]:
                    reference[task] = {"model": role, "perplexity": ppl}
    return reference


def constituent_scores(bench: Scoring, constituents: list[ModelInfo], models: Models) -> dict[str, dict[str, dict]]:
    """The base's and experts' scores on ``bench`` as ``{task: {role: {value, stderr, n}}}`` (once per fingerprint
    and settings, via the store); each ModelInfo's ``evaluated`` says whether this call ran it."""
    scores: dict[str, dict[str, dict]] = {t: {} for t in bench.tasks}
    for info in constituents:
        model_dir = info.directory()

        def load(path=model_dir, role=info.role):
            print(f"mergeval: evaluating {role} on {len(bench.tasks)} tasks", flush=True)
            return models.saved(path)

        got = bench.scores(info.fingerprint, load)
        info.evaluated = got.evaluated
        for task in bench.tasks:
            scores[task][info.role] = got.scores[task]
    return scores


def _constituents(bench: Scoring, outcome: StagedOutcome, models: Models) -> None:
    """The base's and experts' full benchmark scores (once per fingerprint and settings, via the store)."""
    for task, by_role in constituent_scores(bench, outcome.constituents, models).items():
        outcome.constituent_scores[task].update(by_role)


def _stage2_and_3(bench: Scoring, outcome: StagedOutcome, plan: Plan, model_of) -> None:
    by_label = {c.label: c for c in plan.candidates}
    n2, n = outcome.stage2_items, outcome.n_full
    kept = outcome.merges.get("kept_between_stages", 0)
    print(
        f"mergeval: stage 2: {len(outcome.stage2)} candidates on items [0, {n2}) of each task"
        + (f" ({kept} kept in memory since stage 1, not merged again)" if kept else ""),
        flush=True,
    )
    outcome.ran["stage2"] = 0
    for label in outcome.stage2:
        res = outcome.result(label)
        got = bench.scores(res.fingerprint, lambda c=by_label[label]: model_of(c), items=(0, n2))
        res.stage2, res.evaluated["stage2"] = got.scores, got.evaluated
        outcome.ran["stage2"] += got.requests
    keys = {label: outcome.result(label).scored_mean("stage2") for label in outcome.stage2}
    outcome.stage3 = promote(keys, outcome.stage2, plan.stage3_keep, higher_is_better=True)
    print(f"mergeval: stage 3: {len(outcome.stage3)} candidates on items [{n2}, {n}) of each task", flush=True)
    outcome.ran["stage3"] = 0
    for label in outcome.stage3:
        res = outcome.result(label)
        stage2 = res.stage2
        assert stage2 is not None, "a stage 3 candidate was promoted from stage 2"
        if n2 < n:
            got = bench.scores(res.fingerprint, lambda c=by_label[label]: model_of(c), items=(n2, n))
            res.evaluated["stage3"] = got.evaluated
            outcome.ran["stage3"] += got.requests
            stage3 = {t: combine(stage2[t], got.scores[t]) for t in outcome.tasks}
        else:  # stage 2 already covered every item
            stage3 = stage2
        res.stage3 = stage3
        scores = {t: dict(outcome.constituent_scores[t], **{MERGED: stage3[t]}) for t in outcome.tasks}
        res.aggregates = aggregate(scores, outcome.tasks, outcome.constituents, bench.cfg.metric.scale)
    outcome.stage3 = best_first(
        {label: outcome.result(label).scored_mean("stage3") for label in outcome.stage3},
        outcome.stage3,
        higher_is_better=True,
    )
    outcome.pick = outcome.stage3[0]


def full_evaluation(bench: Scoring, candidates: list[Candidate], fingerprints: dict[str, str], model_of) -> dict:
    """The full benchmark on every candidate: label -> its ``ModelScores`` (task -> {acc, stderr, n}, where it came from,
    requests run)."""
    out = {}
    for cand in candidates:
        print(f"mergeval: full benchmark on {cand.label}", flush=True)
        out[cand.label] = bench.scores(fingerprints[cand.label], lambda c=cand: model_of(c))
    return out


def compare(staged_pick: str | None, full_means: dict[str, float], order: list[str]) -> dict:
    """Whether full evaluation's best candidate is the staged pick, and the accuracy the staged pick gives up.

    ``regret = max mean accuracy (full) - the staged pick's full mean accuracy`` (0 when
    the staged pick ties the best); ties in the full ranking keep the sweep's order.
    """
    full_pick = best_first(full_means, order, higher_is_better=True)[0]
    regret = None if staged_pick is None else full_means[full_pick] - full_means[staged_pick]
    return {"full_pick": full_pick, "staged_pick": staged_pick, "same_pick": staged_pick == full_pick, "regret": regret}


def _full(bench: Scoring, outcome: StagedOutcome, plan: Plan, model_of) -> None:
    fingerprints = {c.label: c.fingerprint for c in outcome.candidates}
    done = full_evaluation(bench, plan.candidates, fingerprints, model_of)
    outcome.ran["full"] = 0
    for label, got in done.items():
        res = outcome.result(label)
        res.full, res.evaluated["full"] = got.scores, got.evaluated
        outcome.ran["full"] += got.requests
    means = {c.label: c.scored_mean("full") for c in outcome.candidates}
    outcome.comparison = compare(outcome.pick, means, [c.label for c in outcome.candidates])
