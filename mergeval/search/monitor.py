"""One line per finished trial: trials done / total, how this one ended, the best so far, time left.

    search: trial 5/50 (#4) pruned at stage 1: ... (2.3 s; lambda_=0.4, ...) · best so far #2 macro_gain +1.111 · 1m02s elapsed, about 9m10s left

Time left = (seconds per trial in this process so far) x (trials still to run);
trials of a resumed study that ran in an earlier process count as done but not
in the rate. (A sweep's progress, mergeval/run/progress.py, reads the store instead:
its jobs run in other processes; a search's trials run here.)
"""

from __future__ import annotations

import time

from mergeval.run.progress import duration


class Progress:
    def __init__(self, total: int, done_before: int):
        self.total, self.done_before, self.done_here = total, done_before, 0
        self.started = time.perf_counter()

    def line(self, number: int, outcome: str, best: str) -> str:
        """The progress line after trial ``number`` ended as ``outcome``; ``best``: the best trial so far."""
        self.done_here += 1
        elapsed = time.perf_counter() - self.started
        done = self.done_before + self.done_here
        left = elapsed / self.done_here * (self.total - done)
        return (
            f"search: trial {done}/{self.total} (#{number}) {outcome} · best so far {best} · "
            f"{duration(elapsed)} elapsed, about {duration(left)} left"
        )


def signed(value: float) -> str:
    """``+1.234``; float noise around zero prints as ``+0.000``, not ``-0.000``."""
    return f"{round(value, 3) + 0.0:+.3f}"
