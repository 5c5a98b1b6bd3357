"""Where mergeval keeps what it builds (converted models, experts, generated tasks)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from platformdirs import user_cache_dir


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir`` from the config, else $MERGEVAL_CACHE, else the user cache dir."""
    root = cache_dir or os.environ.get("MERGEVAL_CACHE") or user_cache_dir("mergeval")
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def atomic_dir(final: Path):
    """Yield a temporary sibling directory; rename it to ``final`` only if the block succeeds.

    An interrupted build leaves no half-written ``final`` (only a ``.tmp-*``
    sibling, which the next build ignores and which is removed on failure).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only; the result is an ordinary directory
    try:
        yield tmp
        if final.exists():  # built concurrently by another process: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def dir_size(path: Path) -> int:
    """Bytes of the files below ``path``, symlinks followed once (a Hugging Face cache snapshot links to blobs)."""
    return sum(p.resolve().stat().st_size for p in path.rglob("*") if p.resolve().is_file())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all, and durably: the data is fsynced before the rename and the directory
    after it, so a crash or power loss leaves the old file or the new one, never a torn or empty one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Persist a rename inside ``directory`` (POSIX needs the directory itself fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
