"""A model's scores on a suite: reused from the results store, or evaluated here and stored.

The one evaluation step of every path that scores models: a run (its merge and constituents), the experts'
ranking on the validation split (run/ranking.py), a staged sweep's stages and a search's trials. Whichever path
evaluates a task, it is stored under the same key (model fingerprint, task digest, settings: eval/settings.py)
with the task's chosen metric read back, its per-item outcomes, and the per-choice log-likelihoods kept beside the
store (eval/samples.py) for the calibration and consistency metrics; so any path reuses what another evaluated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergeval.core.runtime import library_bars
from mergeval.eval import samples
from mergeval.eval.settings import PerTask, eval_settings
from mergeval.results.store import settings_hash

THIS_RUN = "this run"
REUSED = "reused from the results store"
PARTLY = "partly reused from the results store"


@dataclass
class ModelScores:
    scores: dict[str, dict]  # task -> {metric, value, stderr, n, items...}, every task of the Scoring
    evaluated: str  # THIS_RUN, REUSED or PARTLY
    requests: int = 0  # requests run here (cost accounting)


class Scoring:
    """Scores of models on ``suite``'s ``tasks`` (default: all of its rows) under the run config's evaluation
    settings, through ``store``.

    ``limit``: the first N items of each task (default ``benchmark.limit``); ``tokenizer``: the one every model is
    evaluated with, or None to load it from ``tokenizer_dir`` the first time a model is evaluated (a run whose
    scores all come from the store never loads it)."""

    def __init__(
        self,
        cfg,
        suite,
        store,
        cache: Path,
        *,
        tasks: list[str] | None = None,
        limit: int | None | str = "benchmark",
        settings: PerTask | None = None,
        tokenizer: Any = None,
        tokenizer_dir: Path | None = None,
    ):
        self.cfg, self.suite, self.store, self.cache = cfg, suite, store, cache
        self.tasks = list(suite.names if tasks is None else tasks)
        self.digests = {t: suite.digests[t] for t in self.tasks}
        self.metrics = {t: suite.rows[t].metric for t in self.tasks}
        self.limit: int | None = cfg.benchmark.limit if isinstance(limit, str) else limit
        self.settings = settings if settings is not None else suite.per_task(eval_settings(cfg))
        self._tokenizer, self._tokenizer_dir = tokenizer, tokenizer_dir
        self._harnesses: dict[tuple, Any] = {}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from mergeval.models.checkpoint import load_tokenizer

            assert self._tokenizer_dir is not None, "a Scoring without a tokenizer names the directory of one"
            self._tokenizer = load_tokenizer(self._tokenizer_dir)
        return self._tokenizer

    def harness(self, limit: int | None, entries: list[str]):
        """One harness per item selection and set of entries (building one reads the tasks' documents)."""
        from mergeval.eval.harness import Harness

        key = (limit, tuple(entries))
        if key not in self._harnesses:
            self._harnesses[key] = Harness.for_run(self.cfg, self.suite, entries, limit)
        return self._harnesses[key]

    def selection(self, items: tuple[int, int] | None) -> tuple[PerTask, int | None, dict[str, list[int]] | None]:
        """(settings, limit, samples) for every item (``limit``), or items [lo, hi) of each task: ``(0, L)`` is the
        same selection as ``benchmark.limit=L`` and shares its store key."""
        if items is None:
            return self.settings, self.limit, None
        if items[0] == 0:
            return self.settings.replace(limit=items[1]), items[1], None
        return self.settings.replace(limit=None, items=list(items)), None, {t: list(range(*items)) for t in self.tasks}

    def stored(self, fingerprint: str, items: tuple[int, int] | None = None) -> dict[str, dict]:
        """The tasks' scores stored for this model (any subset of the tasks; none under eval.force)."""
        if self.cfg.eval.force:
            return {}
        settings, _, _ = self.selection(items)
        return self.store.stored_scores(fingerprint, self.digests, settings, self.metrics)

    def scores(
        self,
        fingerprint: str,
        load: Callable[..., Any],
        *,
        items: tuple[int, int] | None = None,
        label: str | None = None,
        name: str | None = None,
        tokenizer: Callable[[], Any] | None = None,
        claim: bool = False,
    ) -> ModelScores:
        """Every task's scores for the model ``fingerprint``: those stored are reused, the entries with a task
        missing are evaluated on ``load()`` (called only then; the model is released on return) and stored.

        ``label``: the progress lines' prefix (none printed without it); ``name``: the model as the
        line while waiting for another job names it; ``tokenizer``: loads this model's own (only when it is
        evaluated), instead of the Scoring's; ``claim``: parallel sweep jobs share constituents, so the first to ask claims the missing
        tasks and the others wait for its scores (``Store.claim_or_scores``; the claim ends when the scores are
        stored, or with ``store.release_claims()`` when the caller fails)."""
        settings, limit, picked = self.selection(items)
        if self.cfg.eval.force:
            got: dict[str, dict] = {}
        elif claim:
            got = self.store.claim_or_scores(
                fingerprint,
                self.digests,
                settings,
                lambda: print(f"mergeval: waiting for another job evaluating {name or fingerprint[:12]}", flush=True),
                metrics=self.metrics,
            )
        else:
            got = self.store.stored_scores(fingerprint, self.digests, settings, self.metrics)
        # the entries with a task not stored (a task whose own settings changed, one added to the benchmark); a
        # group entry is evaluated whole
        entries = [
            e for e in self.suite.entries if any(t in self.digests and t not in got for t in self.suite.rows_of([e]))
        ]
        if not entries:
            return ModelScores({t: got[t] for t in self.tasks}, REUSED)
        harness = self.harness(limit, entries)
        if picked is not None:
            picked = {t: rows for t, rows in picked.items() if t in harness.task_dict["tasks"]}
        if label:
            print(f"{label}: evaluating on {len(entries)} of {len(self.suite.entries)} tasks", flush=True)
        began = time.perf_counter()
        model = load()
        with library_bars(self.cfg.verbose):
            result = harness.score(model, tokenizer() if tokenizer is not None else self.tokenizer, samples=picked)
        del model
        requests = sum(harness.requests.values())
        if label:
            print(f"{label}: {requests} requests in {time.perf_counter() - began:.1f} s", flush=True)
        evaluated = {t: self.suite.digests[t] for t in result}
        kept = samples.write(
            samples.path_for(self.cache, fingerprint, settings_hash(settings.run), evaluated), harness.samples
        )
        self.store.put_scores(
            fingerprint, evaluated, settings, {t: s.stored() for t, s in result.items()}, samples_path=str(kept)
        )
        fresh = {**got, **{t: s.as_dict() for t, s in result.items()}}
        return ModelScores({t: fresh[t] for t in self.tasks}, PARTLY if got else THIS_RUN, requests)
