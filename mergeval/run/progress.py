"""A sweep's progress, printed by the sweep's own process whatever the launcher.

Jobs run in this process (basic launcher), in worker processes (joblib, Ray) or
on other nodes (Slurm), but each records itself in the results store when it
finishes, found by its configuration hash (mergeval/run/resume.py). So the process
that launched the sweep composes every job's config once (as sweep_check does),
and a thread reads the store every ``sweep.poll_s`` seconds, printing a line
whenever more jobs have finished:

    mergeval: sweep 5/12 done (2 finished before) · best macro_gain +4.17 (method=ties, method.lambda_=1.0) · about 1m10s left

- done: jobs whose configuration the store holds as finished (skipped ones
  included: they finished before the sweep started);
- best: the highest (``sweep.minimize``: lowest) ``sweep.best`` aggregate among
  them, with the job's swept values;
- time left: remaining / rate, the rate being the jobs finished since the sweep
  started over the time since then (parallel workers are in it; skipped jobs
  are not, they cost nothing).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class SweepJob:
    label: str  # the job's swept overrides, e.g. "method=ties, method.lambda_=1.0"
    config_hash: str


@dataclass
class Tally:
    """What the store says of a sweep's jobs at one moment."""

    done: int = 0
    before: int = 0  # of done: finished before the sweep started
    best: tuple[float, str] | None = None  # (value, label)
    seen: set[str] = field(default_factory=set)


def aggregate_value(aggregates: dict, dotted: str) -> float | None:
    """``aggregates[a][b]`` for ``a.b``; None when a key is missing or the value is not a number."""
    node = aggregates
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def duration(seconds: float) -> str:
    """``45 s``, ``3m05s``, ``2h10m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class SweepProgress:
    """Reads the store for the sweep's jobs and prints a line whenever more have finished (``start``/``stop``)."""

    def __init__(
        self,
        jobs: list[SweepJob],
        store,
        best: str = "macro_gain",
        minimize: bool = False,
        poll_s: float = 2.0,
        resumed: bool = True,
        out=None,
    ):
        self.jobs, self.store, self.best, self.minimize, self.poll_s = jobs, store, best, minimize, poll_s
        self.resumed = resumed  # False (sweep.resume=false, eval.force=true): runs finished before do not count
        self.out = out or sys.stdout
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mergeval-sweep-progress", daemon=True)
        self._lock = threading.Lock()  # the thread's line and the final one are never written at once
        self._printed_done = -1  # the count in the last line that was written out (not merely attempted)

    def tally(self) -> Tally:
        tally = Tally()
        for job in self.jobs:
            run = self.store.finished_run(job.config_hash)
            if run is None or (not self.resumed and run["finished"] < self.started):
                continue
            tally.done += 1
            tally.seen.add(job.config_hash)
            if run["finished"] < self.started:
                tally.before += 1
            value = aggregate_value(run.get("aggregates") or {}, self.best)
            if value is not None and (
                tally.best is None or (value < tally.best[0] if self.minimize else value > tally.best[0])
            ):
                tally.best = (value, job.label)
        return tally

    def line(self, tally: Tally, now: float | None = None) -> str:
        total = len(self.jobs)
        parts = [f"sweep {tally.done}/{total} done" + (f" ({tally.before} finished before)" if tally.before else "")]
        if tally.best is not None:
            parts.append(f"best {self.best} {tally.best[0]:+.2f} ({tally.best[1]})")
        ran = tally.done - tally.before
        if tally.done == total:
            parts.append(f"took {duration((now or time.time()) - self.started)}")
        elif ran > 0:
            rate = ran / ((now or time.time()) - self.started)
            parts.append(f"about {duration((total - tally.done) / rate)} left")
        return "mergeval: " + " · ".join(parts)

    def report(self) -> None:
        """Print a line if more jobs have finished since the last line that was printed. A line whose write
        failed does not count as printed, so the final report still writes where the sweep ended."""
        with self._lock:
            tally = self.tally()
            if tally.done != self._printed_done:
                print(self.line(tally), file=self.out, flush=True)
                self._printed_done = tally.done

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.report()
            except Exception as err:  # noqa: BLE001  progress must never take the sweep down
                print(f"mergeval: sweep progress stopped: {err}", file=sys.stderr, flush=True)
                return

    def start(self) -> SweepProgress:
        self.report()  # before any job: how many finished before (a resumed sweep skips those)
        self._thread.start()
        return self

    def stop(self, final: bool) -> None:
        """Stop reading; ``final``: the sweep ended normally, so print where it ended (unless just printed).
        Not final (interrupted): jobs whose worker processes the launcher killed are marked interrupted now."""
        self._stop.set()
        self._thread.join()
        if final:
            self.report()
            return
        # joblib's launcher kills its workers when the sweep is interrupted, before their jobs can record it:
        # their runs stayed ``running`` until some later command found the processes gone
        # (the store's own error, if any, is reported by the next command that opens it)
        with contextlib.suppress(Exception):
            self.store.reap_dead_runs(found_by="its interrupted sweep")


def watch(argv: list[str]) -> SweepProgress | None:
    """The progress of the multirun in ``argv``, started; None when there is nothing to watch: the sweep
    cannot be expanded here (another sweeper, a glob, config flags), ``sweep.progress=false``, or its jobs
    use different results stores."""
    from hydra import compose, initialize_config_module

    from mergeval.core.paths import cache_root
    from mergeval.results.store import open_store
    from mergeval.run.resume import config_hash
    from mergeval.run.sweep_check import COMPOSED, job_label, jobs_of, swept_positions

    expanded = jobs_of(argv)
    if not expanded:
        return None
    swept = swept_positions(expanded)
    missing = [job for job in expanded if tuple(job) not in COMPOSED]  # check_sweep composed the others
    if missing:
        with initialize_config_module("mergeval.run.conf", version_base="1.3"):
            COMPOSED.update({tuple(job): compose("config", overrides=job) for job in missing})
    configs = [COMPOSED[tuple(job)] for job in expanded]
    first = configs[0]
    stores = {(c.store.path, c.cache_dir) for c in configs}
    if not first.sweep.progress or len(stores) > 1:
        return None
    jobs = [SweepJob(job_label(job, swept) or "the only job", config_hash(cfg)) for job, cfg in zip(expanded, configs)]
    store = open_store(first, cache_root(first.cache_dir))
    return SweepProgress(
        jobs,
        store,
        first.sweep.best,
        first.sweep.minimize,
        first.sweep.poll_s,
        resumed=first.sweep.resume and not first.eval.force,
    ).start()
