"""Which process owns a run, a claim or a temporary file, and whether it is still alive.

A process is named by (host, pid, start time). The start time (clock ticks
since boot, from /proc on Linux; 0 where unknown) guards against pid reuse: a
pid that now belongs to a younger process does not keep a dead run alive.
Only processes on this host can be proven gone; for another host the caller
decides (a time-to-live, or leave it alone).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first); OSError if unreadable."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    return stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and ')'


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T stopped, Z zombie, ...); None when there is no such process."""
    try:
        return _stat_fields(pid)[0]
    except FileNotFoundError:
        return None


def start_time(pid: int) -> int:
    """Clock ticks since boot at which ``pid`` started (field 22 of /proc/PID/stat); 0 where unknown;
    -1 if the process does not exist or has exited (a zombie its parent has not reaped yet runs nothing: a
    worker of a killed sweep can stay one for a while, and its job must not look alive)."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return -1 if os.path.isdir("/proc/self") else _exists_without_proc(pid)
    except OSError:
        return 0
    return -1 if fields[0] in ("Z", "X") else int(fields[19])


def _exists_without_proc(pid: int) -> int:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return -1
    except PermissionError:  # it exists, as another user's process
        return 0
    return 0


def me() -> tuple[str, int, int]:
    """(host, pid, start time) of this process."""
    return socket.gethostname(), os.getpid(), start_time(os.getpid())


def gone(host: str, pid: int | None, started: int | None = 0) -> bool:
    """True only when the process is provably gone: on this host, no such pid, or a pid that started at
    another time (reused). A process on another host, or one we cannot inspect, is not provably gone."""
    if pid is None or host != socket.gethostname():
        return False
    now = start_time(pid)
    return now == -1 or bool(started and now and now != started)


# Temporary files and directories carry their owner in the name, so a later process can prove them orphaned
# (its owner is gone) without reading them: .tmp-<name>-<host hash>.<pid>.<start>-<random>
_OWNED = re.compile(r"^\.tmp-.*-([0-9a-f]{8})\.(\d+)\.(\d+)-[A-Za-z0-9_]+$")


def _host_tag(host: str) -> str:
    return hashlib.sha256(host.encode()).hexdigest()[:8]


def tmp_prefix(name: str) -> str:
    """The prefix for a temporary sibling of ``name`` owned by this process (pass to mkstemp/mkdtemp)."""
    host, pid, started = me()
    return f".tmp-{name}-{_host_tag(host)}.{pid}.{started}-"


def orphaned(entry_name: str) -> bool:
    """Whether a directory entry is a temporary file of mergeval's whose owner (on this host) is gone."""
    m = _OWNED.match(entry_name)
    if not m or m.group(1) != _host_tag(socket.gethostname()):
        return False
    return gone(socket.gethostname(), int(m.group(2)), int(m.group(3)))
