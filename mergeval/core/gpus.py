"""One job per GPU on one node: the GPUs this process may use, and which one a job claims.

``count`` is the number of CUDA devices torch sees (``CUDA_VISIBLE_DEVICES``
respected, as torch respects it). A job of a parallel sweep claims one of them
for its length (``claim``): a lock file per device and slot in a directory of
this machine (``claims_dir``; ``MERGEVAL_GPU_CLAIMS`` names another), held with
``flock``. The kernel drops such a lock when its holder's process ends however
it ends (an error, Ctrl-C, SIGKILL), so a dead job's device is free at once;
there is no stale claim to judge and none to clean up. The lock files stay (an
empty file per slot), since removing one races with a process about to lock it.

A job takes the device with the fewest jobs on it; on a tie its own (job number
mod the number of devices) if that is among them, else the lowest. So a sweep
that runs no more jobs at once than there are GPUs gives each job a device of
its own, whatever their lengths, and one that runs more shares them evenly (no
device holds more than ceil(jobs at once / GPUs)); nobody waits for a device.
The directory is per user and machine, not per sweep: two sweeps started on one
node at once share its GPUs evenly too, instead of both starting at device 0.

Testing aid: ``MERGEVAL_SIMULATED_GPUS=N`` makes this process (and the jobs it
starts, which inherit it) count N CUDA devices whatever torch sees, so the
assignment runs on a machine without a GPU. Tensors then stay on the CPU
(``compute_device``) while ``eval.device`` records the device assigned, and
result.json's ``hardware`` says ``simulated_gpus``: such a run proves which
device each job was given, not that anything ran on it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mergeval.core.errors import UserError

SIMULATED_ENV = "MERGEVAL_SIMULATED_GPUS"
CLAIMS_ENV = "MERGEVAL_GPU_CLAIMS"
RESOLVER = "mergeval_gpus"


def simulated() -> int | None:
    """The number of GPUs ``MERGEVAL_SIMULATED_GPUS`` simulates; None when it is unset or empty."""
    value = os.environ.get(SIMULATED_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise UserError(
            SIMULATED_ENV,
            f"'{value}' is not a number of GPUs",
            f"set it to a whole number (a testing aid), or unset it: unset {SIMULATED_ENV}",
        )
    return int(value)


def count() -> int:
    """How many CUDA devices this process may use: torch's count (0 without CUDA), or the simulated one."""
    fake = simulated()
    if fake is not None:
        return fake
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def names(n: int) -> list[str]:
    """A name for each of the ``n`` visible devices that is the same in every process of this machine: the
    entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID) where it is set, else the index; ``sim<i>`` when
    simulated, so simulated claims never meet real ones."""
    if simulated() is not None:
        return [f"sim{i}" for i in range(n)]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) >= n:
        return [re.sub(r"[^A-Za-z0-9_.-]", "_", v) for v in visible[:n]]
    return [str(i) for i in range(n)]


def kind(device: str) -> str:
    """``cuda:2`` -> ``cuda``: the kind of device, without which one of a node's (the results store's
    settings and a run's configuration hash keep this, so jobs on different GPUs share their evaluations)."""
    return device.split(":", 1)[0]


def compute_device(device: str) -> str:
    """The device tensors go to for ``device``: itself, or the CPU for a CUDA device that is only simulated."""
    return "cpu" if simulated() is not None and kind(device) == "cuda" else device


def select(device: str) -> str:
    """``compute_device(device)``; a CUDA device with an index also becomes torch's current device, so what
    uses the current device implicitly (memory statistics, a library's synchronize) is on this job's GPU,
    not on device 0 of every job."""
    target = compute_device(device)
    if kind(target) == "cuda" and ":" in target:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(target)
    return target


def on_gpus(several, otherwise):
    """``${mergeval_gpus:SEVERAL,OTHERWISE}``: SEVERAL where this machine has more than one GPU (``all``: their
    number), else OTHERWISE. The ``parallel`` preset's ``n_jobs`` is ``${mergeval_gpus:all,2}``, the ``ray``
    preset's ``gpus_per_job`` ``${mergeval_gpus:1,0}``: one GPU or none, and they are what they were."""
    n = count()
    if n > 1:
        return n if several == "all" else several
    return otherwise


def register_resolver() -> None:
    """``${mergeval_gpus:...}`` for the launcher presets (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, on_gpus)


def claims_dir() -> Path:
    """Where this machine's GPU claims are: ``MERGEVAL_GPU_CLAIMS``, else a directory of this user's in the
    temporary directory."""
    given = os.environ.get(CLAIMS_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / f"mergeval-gpu-claims-{os.getuid()}"


@dataclass
class Claim:
    """A device held until ``release`` (or the end of the process): its ``index`` among the visible ones and
    how many other jobs held it when it was claimed (``shared_with``)."""

    index: int
    shared_with: int
    path: Path
    _fd: int | None = field(default=None, repr=False)

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"

    def release(self) -> None:
        if self._fd is not None:
            try:  # unlocked, not only closed: a child forked meanwhile shares the lock, and would keep it
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


def _held_slots(directory: Path, name: str) -> set[int]:
    """The slots of device ``name`` that some process holds, found by trying each one's lock.
    Called with the directory's mutex held: nobody else claims meanwhile, and a probe that finds a slot
    free unlocks it at once."""
    held = set()
    for path in directory.glob(f"cuda-{name}.*.lock"):
        slot = path.name[len(f"cuda-{name}.") : -len(".lock")]
        if not slot.isdigit():
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if not _try_lock(fd):
                held.add(int(slot))
        finally:
            os.close(fd)  # also drops the probe's own lock
    return held


def claim(n: int, preferred: int = 0, directory: Path | None = None, holder: dict | None = None) -> Claim:
    """Claim one of ``n`` devices for this process until ``Claim.release``: the one with the fewest holders,
    ``preferred % n`` on a tie if it is among them, else the lowest index (module docstring). ``holder``
    (the job) is written into the lock file, for whoever looks."""
    directory = directory or claims_dir()
    directory.mkdir(parents=True, exist_ok=True)
    ids = names(n)
    mutex = _open(directory / "claims.mutex")
    try:
        fcntl.flock(mutex, fcntl.LOCK_EX)  # one claimant at a time on this machine; held for a moment
        busy = [_held_slots(directory, name) for name in ids]
        fewest = min(len(b) for b in busy)
        candidates = [i for i in range(n) if len(busy[i]) == fewest]
        index = preferred % n if preferred % n in candidates else candidates[0]
        slot = next(s for s in range(len(busy[index]) + 1) if s not in busy[index])
        path = directory / f"cuda-{ids[index]}.{slot}.lock"
        fd = _open(path)
        try:
            if not _try_lock(fd):  # every claimant holds the mutex, so a slot found free stays free
                raise RuntimeError(f"{path} was taken while the claims' mutex was held")
            _note(fd, holder)
        except BaseException:  # Ctrl-C included: a slot this process will never release must not stay locked
            os.close(fd)
            raise
        return Claim(index, len(busy[index]), path, fd)
    finally:
        os.close(mutex)


def _note(fd: int, holder: dict | None) -> None:
    """Who holds the slot, in its lock file, for whoever looks (the lock is what counts, not the note)."""
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **(holder or {})}).encode())
    except OSError:
        pass
