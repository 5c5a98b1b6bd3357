"""Promoted candidates' weights kept between a staged sweep's stages, where memory allows.

A candidate promoted to stage 2 is evaluated again there and maybe in stage 3.
Merging it again costs what its first merge cost (seconds for SmolLM2, minutes
for 8B models); loading its weights back into the live model costs one copy.
So stage 1 keeps the weights of the best candidates so far: at most
``stage1_keep`` of them (the ones stage 2 will take) and at most
``staged.keep_memory`` of the memory available when stage 1 starts. A
promoted candidate that did not fit is merged again when a later stage needs
it, as before.

What is kept is the live model's own tensors right after the merge was loaded
into it (cast once to the evaluation dtype, copied to host memory), so loading
them back gives the same model bit for bit as merging again: the merge is
deterministic for a config and seed, and the cast rounds the same way each time.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def available_memory() -> int:
    """Bytes of host memory available to a new allocation now: ``MemAvailable`` (Linux), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class KeptMerges:
    """The best candidates' weights by stage 1's key, within a count and a byte budget.

    ``offer`` is called once per candidate, in the sweep's order, with its
    stage-1 key (lower is better). The ranking is the one
    :func:`mergeval.staged.selection.promote` uses (the key, then the sweep's
    order), so what is kept at the end of stage 1 is a subset of stage 2's
    candidates; one that does not rank among the best that fit is never copied.
    """

    def __init__(self, capacity: int, budget_bytes: int):
        self.capacity, self.budget = capacity, budget_bytes
        self._kept: dict[str, tuple[tuple[float, int], int, dict]] = {}  # label -> (rank, bytes, weights)
        self._offered = 0
        self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(size for _, size, _ in self._kept.values())

    def offer(self, label: str, key: float, size: int, snapshot: Callable[[], dict]) -> None:
        """Keep ``snapshot()`` (``size`` bytes) for ``label`` if it ranks among the best that fit."""
        rank = (key, self._offered)
        self._offered += 1
        slots = min(self.capacity, self.budget // size if size > 0 else self.capacity)
        if slots < 1:
            return
        if len(self._kept) >= slots:
            worst = max(self._kept, key=lambda k: self._kept[k][0])
            if rank > self._kept[worst][0]:
                return
            del self._kept[worst]  # before the copy: never more than ``slots`` held at once
        self._kept[label] = (rank, size, snapshot())
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def get(self, label: str) -> dict | None:
        entry = self._kept.get(label)
        return None if entry is None else entry[2]

    def retain(self, labels) -> None:
        """Drop every kept candidate not in ``labels`` (those no later stage needs)."""
        keep = set(labels)
        for label in [k for k in self._kept if k not in keep]:
            del self._kept[label]

    def __contains__(self, label: str) -> bool:
        return label in self._kept

    def __len__(self) -> int:
        return len(self._kept)
